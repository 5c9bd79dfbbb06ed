"""AREA vs S-FedAvg, AS-FedAvg, FedBuff and MIFA: multinomial logistic regression (Fig. 1/2).

Setup (spec `../shared/specs/area_async.md` 4.1, reduced for CPU): Fashion-MNIST (the
paper uses MNIST, which no offline package ships) subsampled to `--train` examples, pixels in
[0, 1], 784 features + bias, softmax cross-entropy + nu/2 ||w||^2 with nu = 1e-3, zero
initial model; n = 128 clients with Dirichlet(0.1) label skew (per class, proportions over
clients); spec 7.2's weighting f_i = (s_i/S) fhat_i (gradients scaled by s_i/S, uniform 1/n
server averaging, so sum_i f_i is the example-weighted objective); K local SGD steps with
minibatch b = 32; client clocks lambda_i = 10 (uniform) or N(10, 5) clipped at 0.1
(non-uniform), simulated exactly in continuous time (categorical mode); Delta = 4 for all
methods (S-FedAvg samples 4 clients per round and waits for the slowest). Each method's step
size is chosen from the grid by the smallest mean time-averaged log10 normalised loss.

Metric: (f(x_s(t)) - f*) / (f(0) - f*) on all training data (f* from L-BFGS on the pooled
objective) and the test accuracy of x_s(t) on the 10k test set, against simulated time.

Recorded run (experiments/README.md, ~10 min on 2 CPU cores):

    nice -n 10 python experiments/area_logistic.py --train 12000 \
        --grid 0.01 0.1 1 10 100 1000 --seeds 2 --horizon 20 --evals 40 \
        --out experiments/results/area
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.optimize
from jax.flatten_util import ravel_pytree

from fedjax_sim.algorithms import (
    area,
    as_fedavg,
    fedbuff,
    mifa,
    s_fedavg,
    sample_size_scale,
)
from fedjax_sim.algorithms.core import LocalSpec
from fedjax_sim.algorithms.events import Aggregation, Arrivals, Events, normal_rates
from fedjax_sim.data import pack
from fedjax_sim.data.builtin import read_fashion_mnist
from fedjax_sim.data.partition import partition
from fedjax_sim.models import logistic_regression
from fedjax_sim.run.simulate import EvalSpec
from fedjax_sim.run.sweep import mean_ci, sweep

METHODS = ("AREA", "S-FedAvg", "AS-FedAvg", "FedBuff", "MIFA")
NU = 1e-3


def load(num_train: int, num_clients: int, seed: int):
    x, y, x_test, y_test = read_fashion_mnist()
    rng = np.random.default_rng(seed)
    idx = np.sort(rng.choice(x.shape[0], num_train, replace=False))
    x, y = x[idx].reshape(num_train, -1), y[idx]
    ids = partition("dirichlet", y, num_clients, seed, alpha=0.1)
    data = pack(x, y, ids, num_clients, num_classes=10)
    return data, (x, y), (x_test.reshape(x_test.shape[0], -1), y_test)


def objective_fn(model, x, y):
    """f(w) = mean_j CE_j + nu/2 ||w||^2 on the pooled training data (= sum_i (s_i/S) fhat_i)."""
    x, y = jnp.asarray(x), jnp.asarray(y)

    def f(params):
        logits = model.apply(params, x)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce + 0.5 * NU * sum(jnp.sum(p**2) for p in jax.tree.leaves(params))

    return f


def optimum(f, params0):
    """f* by L-BFGS in float64 on the flattened parameters."""
    flat, unravel = ravel_pytree(params0)
    with jax.enable_x64(True):
        fg = jax.jit(
            jax.value_and_grad(
                lambda v: f(jax.tree.map(lambda a: a.astype(jnp.float64), unravel(v)))
            )
        )
        res = scipy.optimize.minimize(
            lambda v: tuple(np.asarray(a, np.float64) for a in fg(jnp.asarray(v))),
            np.zeros(flat.size),
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": 1000, "gtol": 1e-8},
        )
    return float(res.fun)


def build(method, model, events, alpha, local, scale):
    kw = dict(events=events, client_optimizer=optax.sgd(alpha), local=local, client_scale=scale)
    if method == "S-FedAvg":
        return s_fedavg(model.loss, cohort_size=4, **kw)
    factory = {"AREA": area, "AS-FedAvg": as_fedavg, "FedBuff": fedbuff, "MIFA": mifa}[method]
    return factory(model.loss, **kw)


def simulate_method(method, model, rates, alphas, seeds, data, pooled, test, local, steps, evals):
    """Normalised-loss inputs: f(x_s), test accuracy and time at `evals` points, `[A, S, E]`,
    and the `SweepResult`. One `fedjax_sim.run.sweep.sweep` over alpha x seeds (one compiled
    program; one round of the sweep = one event of the continuous-time model)."""
    events = Events(Arrivals.categorical(rates), Aggregation.every(4))
    scale = sample_size_scale(np.asarray(data.counts))
    f = objective_fn(model, *pooled)
    xt, yt = jnp.asarray(test[0]), jnp.asarray(test[1])
    params0 = jax.tree.map(jnp.zeros_like, model.init(jax.random.key(0)))
    every = -(-steps // evals)  # evals * every >= steps

    def make(hp):
        return build(method, model, events, hp["alpha"], local, scale)

    def extra(params, data, test):
        acc = jnp.mean(jnp.argmax(model.apply(params, xt), -1) == yt)
        return {"objective": f(params), "test_accuracy": acc}

    res = sweep(
        make, data, seeds=[int(s) for s in seeds], grid={"alpha": list(alphas)}, model=model,
        num_rounds=every * evals, params=params0, progress=False,
        evaluation=EvalSpec(every=every, central=False, clients=False, extra=extra),
        # all runs in one vmap, as the former driver did: the planned groups would go through
        # lax.map(batch_size=...), which fails on the zero-size leaves of these states
        runs_per_group=len(alphas) * len(seeds),
    )  # fmt: skip
    shape = (len(alphas), len(seeds), evals)
    loss, acc, t = (np.empty(shape) for _ in range(3))
    for r, h in zip(res.runs, res.histories, strict=True):
        rows = [e for e in h.evals if e["round"] > 0]  # after each chunk, as in the paper's plots
        a, s_ = divmod(r.index, len(seeds))
        loss[a, s_] = [e["objective"] for e in rows]
        acc[a, s_] = [e["test_accuracy"] for e in rows]
        t[a, s_] = np.asarray(h.metrics["t"])[[e["round"] - 1 for e in rows]]
    return (loss, acc, t), res


def expected_max_time(rates, size):
    """E[max of `size` Exp(lambda_i)] averaged over uniform cohorts (Monte Carlo)."""
    rng = np.random.default_rng(0)
    draws = [rng.exponential(1 / rng.choice(rates, size, replace=False)).max() for _ in range(4000)]
    return float(np.mean(draws))


def at_times(t, err, acc, horizon):
    """Median normalised loss and mean test accuracy over seeds at fixed simulated times
    (last evaluation at or before the time; `[S, E]` inputs)."""
    out = {}
    for frac in (0.1, 0.25, 0.5, 1.0):
        time_ = frac * horizon
        idx = [max(int(np.searchsorted(ts, time_ * (1 + 1e-9), side="right")) - 1, 0) for ts in t]
        e = [float(ei[i]) for ei, i in zip(err, idx, strict=True)]
        a = [float(ai[i]) for ai, i in zip(acc, idx, strict=True)]
        lm, lh, ls = mean_ci(np.log10(np.maximum(e, 1e-300)))
        am, ah, as_ = mean_ci(np.asarray(a))
        out[f"{time_:g}"] = {
            "normalised_loss": float(np.median(e)),
            "test_accuracy": float(np.mean(a)),
            "n": len(e),
            "normalised_loss_per_seed": e,
            "test_accuracy_per_seed": a,
            "log10_loss_mean_std_ci95half": [lm, ls, lh],
            "test_accuracy_mean_std_ci95half": [am, as_, ah],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--train", type=int, default=12000, help="training examples used")
    ap.add_argument("--local-steps", type=int, default=1)
    ap.add_argument("--grid", type=float, nargs="+", default=[1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument(
        "--first-seed", type=int, default=0,
        help="seeds FIRST..FIRST+N-1 (same data, partition and clocks): confirmation runs on "
        "seeds disjoint from the runs that selected the step sizes",
    )  # fmt: skip
    ap.add_argument("--horizon", type=float, default=10.0, help="simulated time")
    ap.add_argument("--evals", type=int, default=40)
    ap.add_argument("--out", default="experiments/results/area")
    ap.add_argument(
        "--settings", nargs="+", default=["uniform", "non-uniform"],
        choices=["uniform", "non-uniform"], help="clock settings to run",
    )  # fmt: skip
    ap.add_argument(
        "--methods", nargs="+", default=list(METHODS), choices=METHODS,
        help="methods to run (e.g. to extend some methods' grids, see --extend)",
    )  # fmt: skip
    ap.add_argument(
        "--extend", default=None, metavar="TAG",
        help="merge with the earlier run logistic_K<K><TAG>.json (same data, seeds, horizon): "
        "its step sizes are added to this run's per method and each method's step size is "
        "chosen over the union",
    )  # fmt: skip
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from the JSONs")
    ap.add_argument(
        "--method-grid", nargs="*", default=[], metavar="METHOD=a,b,c",
        help="per-method step-size grid (replaces --grid for that method)",
    )  # fmt: skip
    args = ap.parse_args()
    grids = {m: list(args.grid) for m in METHODS}
    for item in args.method_grid:
        name, values = item.split("=")
        if name not in grids:
            raise SystemExit(f"--method-grid: unknown method {name!r}, one of {METHODS}")
        grids[name] = [float(v) for v in values.split(",")]
    if args.replot:
        return replot(args)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    data, pooled, test = load(args.train, args.clients, seed=0)
    model = logistic_regression((784,), 10, l2=NU)
    params0 = jax.tree.map(jnp.zeros_like, model.init(jax.random.key(0)))
    f = objective_fn(model, *pooled)
    f_star, f_0 = optimum(f, params0), float(f(params0))
    print(f"data: {data.summary()}, f(0)={f_0:.4f}, f*={f_star:.4f} ({time.time() - t0:.0f}s)")
    local = LocalSpec(steps=args.local_steps, batch_size=32)
    seeds = np.arange(args.first_seed, args.first_seed + args.seeds)
    settings = {
        "uniform": np.full(args.clients, 10.0),
        "non-uniform": normal_rates(args.clients, 10.0, 5.0, minimum=0.1, seed=1),
    }
    settings = {k: v for k, v in settings.items() if k in args.settings}
    tag = f"K{args.local_steps}{args.tag}"
    earlier = load_earlier(args, f_star) if args.extend is not None else {"runs": {}}
    raw = {"grid": {}, "seeds": seeds.tolist(), "runs": {}}
    summary = {"f_star": f_star, "f_0": f_0, "grid": raw["grid"], "args": vars(args), "runs": {}}
    curves = {}
    for setting, rates in settings.items():
        async_steps = int(args.horizon * rates.sum())
        sync_steps = int(1.2 * args.horizon / expected_max_time(rates, 4))
        for m in METHODS:
            parts = []  # (grid, normalised loss, accuracy, time, seconds) per source
            if m in args.methods:
                steps = max(sync_steps if m == "S-FedAvg" else async_steps, args.evals)
                (loss, acc, t), res = simulate_method(
                    m, model, rates, grids[m], seeds, data, pooled, test, local, steps, args.evals
                )
                err = (loss - f_star) / (f_0 - f_star)  # [A, S, E]
                parts.append((grids[m], err, acc, t, res.meta["seconds"]))
            old = earlier["runs"].get(f"{setting}/{m}")
            if old is not None:
                arrays = (np.asarray(old[k]) for k in ("normalised_loss", "test_accuracy", "time"))
                parts.append((earlier["grid"][m], *arrays, old["sweep_seconds"]))
            if not parts:
                continue
            grid, err, acc, t, seconds = merge_grids(m, parts)
            raw["grid"][m] = grid
            with np.errstate(invalid="ignore", divide="ignore"):
                logs = np.log10(np.where(np.isfinite(err) & (err > 0), err, np.inf))
            score = np.where(np.isfinite(logs).all(2), logs.mean(2), np.inf).mean(1)
            a = int(np.argmin(score))
            # alternative reading of "fastest converging": the smallest median final loss
            final = np.where(np.isfinite(err[:, :, -1]), err[:, :, -1], np.inf)
            a_final = int(np.argmin(np.median(final, 1)))
            raw["runs"][f"{setting}/{m}"] = {
                "normalised_loss": err.tolist(),  # [alpha, seed, eval]
                "test_accuracy": acc.tolist(),
                "time": t.tolist(),
                "sweep_seconds": seconds,
            }
            curves[(setting, m)] = (t[a], err[a], acc[a], grid[a])
            summary["runs"][f"{setting}/{m}"] = {
                "best_alpha": grid[a],
                "score_per_alpha": [float(s) for s in score],
                "final_normalised_loss": float(np.median(err[a][:, -1])),
                "final_test_accuracy": float(np.mean(acc[a][:, -1])),
                "best_test_accuracy": float(np.mean(acc[a].max(1))),
                "time_reached": float(t[a][:, -1].min()),
                "at_time": at_times(t[a], err[a], acc[a], args.horizon),
                "n_seeds": int(len(seeds)),
                "best_alpha_by_final_loss": grid[a_final],
                "median_final_loss_per_alpha": [float(v) for v in np.median(final, 1)],
                "at_time_final_loss_rule": at_times(
                    t[a_final], err[a_final], acc[a_final], args.horizon
                ),
            }
            print(
                f"{setting:11s} {m:9s} alpha={grid[a]:g} "
                f"loss={summary['runs'][f'{setting}/{m}']['final_normalised_loss']:.4f} "
                f"acc={summary['runs'][f'{setting}/{m}']['final_test_accuracy']:.4f} "
                f"({time.time() - t0:.0f}s)",
                flush=True,
            )
    summary["seconds"] = time.time() - t0
    with open(os.path.join(args.out, f"logistic_{tag}.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    with open(os.path.join(args.out, f"logistic_{tag}_runs.json"), "w") as fh:
        json.dump(raw, fh)
    plot(curves, args, os.path.join(args.out, f"logistic_{tag}.png"))


def load_earlier(args, f_star: float) -> dict:
    """The `_runs.json` of the run named by `--extend`, after checking that it ran the same
    problem (data, seeds, K, horizon, evaluations; f* equal to 1e-9)."""
    path = os.path.join(args.out, f"logistic_K{args.local_steps}{args.extend}")
    with open(path + ".json") as fh:
        summary = json.load(fh)
    with open(path + "_runs.json") as fh:
        raw = json.load(fh)
    keys = ("train", "clients", "local_steps", "seeds", "horizon", "evals")
    differ = [k for k in keys if summary["args"][k] != getattr(args, k)]
    differ += ["first_seed"] * (summary["args"].get("first_seed", 0) != args.first_seed)
    if differ or abs(summary["f_star"] - f_star) > 1e-9 * abs(f_star):
        raise SystemExit(f"--extend {args.extend}: different run ({differ or 'f*'})")
    return raw


def merge_grids(method: str, parts: list) -> tuple:
    """Step sizes of several sources in increasing order: `(grid, err, acc, t, seconds)`,
    arrays `[A, S, E]` concatenated on the step-size axis; seconds summed."""
    grid = [a for p in parts for a in p[0]]
    if len(set(grid)) != len(grid):
        raise SystemExit(f"--extend: {method} runs a step size twice ({sorted(grid)})")
    order = np.argsort(grid)
    arrays = (np.concatenate([p[i] for p in parts])[order] for i in (1, 2, 3))
    return ([grid[i] for i in order], *arrays, sum(p[4] for p in parts))


def replot(args) -> None:
    """The PNG of an earlier run, from its `logistic_<tag>.json` and `_runs.json`."""
    tag = f"K{args.local_steps}{args.tag}"
    with open(os.path.join(args.out, f"logistic_{tag}.json")) as fh:
        summary = json.load(fh)
    with open(os.path.join(args.out, f"logistic_{tag}_runs.json")) as fh:
        raw = json.load(fh)
    curves = {}
    for key, run in raw["runs"].items():
        setting, m = key.split("/")
        alpha = summary["runs"][key]["best_alpha"]
        a = raw["grid"][m].index(alpha)
        t, err, acc = (np.asarray(run[k])[a] for k in ("time", "normalised_loss", "test_accuracy"))
        curves[(setting, m)] = (t, err, acc, alpha)
    plot(curves, args, os.path.join(args.out, f"logistic_{tag}.png"))


def plot(curves, args, path):
    """Mean over seeds with the 95% CI band (Student t; for the loss: of log10) when there are
    >= 3 seeds, else the min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [s for s in ("uniform", "non-uniform") if s in args.settings]
    fig, axes = plt.subplots(len(settings), 2, figsize=(10, 3.5 * len(settings)), squeeze=False)
    band = "95% CI" if args.seeds >= 3 else "min-max"
    for row, setting in enumerate(settings):
        grid = np.linspace(0, args.horizon, 200)
        for m in (m for m in METHODS if (setting, m) in curves):
            t, err, acc, alpha = curves[(setting, m)]
            for col, values in enumerate((err, acc)):
                # before a run's first evaluation its model is x_s0 = 0: normalised loss 1
                left = 1.0 if col == 0 else np.nan
                v = np.array(
                    [np.interp(grid, ti, vi, left=left) for ti, vi in zip(t, values, strict=True)]
                )
                ax = axes[row, col]
                if col == 0:
                    v = np.log10(np.maximum(v, 1e-300))
                if args.seeds >= 3:  # accuracy: over the runs evaluated by then
                    st = np.array(
                        [
                            mean_ci(c[np.isfinite(c)]) if np.isfinite(c).any() else (np.nan,) * 3
                            for c in v.T
                        ]
                    )
                    mid, lo, hi = st[:, 0], st[:, 0] - st[:, 1], st[:, 0] + st[:, 1]
                else:
                    mid, lo, hi = v.mean(0), v.min(0), v.max(0)
                if col == 0:
                    mid, lo, hi = 10.0**mid, 10.0**lo, 10.0**hi
                draw = ax.semilogy if col == 0 else ax.plot
                (line,) = draw(grid, mid, label=f"{m} ({alpha:g})")
                ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.15)
        axes[row, 0].set_ylabel(f"{setting}: (f - f*) / (f(0) - f*)")
        axes[row, 1].set_ylabel(f"{setting}: test accuracy")
        axes[row, 1].legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("simulated time")
    fig.suptitle(
        f"Logistic regression, Fashion-MNIST ({args.train} ex.), n={args.clients}, "
        f"Dirichlet(0.1), K={args.local_steps}, Delta=4, {args.seeds} seed(s), band: {band}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
