"""AREA vs S-FedAvg, AS-FedAvg, FedBuff and MIFA on the paper's toy quadratic (Fig. 4).

Setup (spec `../shared/specs/area_async.md` 4.2 with the scale resolution 7.1):
f_i(x) = (1/2)(c i x - 1)^2, x in R, i = 1..50, c = 1; client clocks lambda_i ~ N(10, 3)
(sd, clipped at 0.1); the continuous-time model simulated exactly by its jump chain
(categorical mode, one event per iteration, Exp(Lambda) time steps); aggregation every
Delta = 4 deliveries (S-FedAvg: all 50 clients per round, round time = slowest client);
true gradients, one step per event; x_s0 = 0. For each method the step size is chosen on the
grid {1, 3} x 10^-6..10^-3 (plus 1e-3) by the smallest mean time-averaged log10 error;
repetitions = rate draws x event seeds, all vmapped (one compile per method and rate draw).

Writes `<out>/quadratic<tag>.png` (normalised error ||x_s(t) - x*||^2 / ||x*||^2 vs time:
median and 10-90% band over runs at each method's best step size; the paper shows
mean/min/max, which over 200 runs with different rate draws is dominated by single runs),
`<out>/quadratic<tag>.json` (aggregates) and `<out>/quadratic<tag>_runs.json` (per run at each
method's selected step size, runs in the order (draw, rep): log10 final error, time-averaged
log10 error, time to 1e-10 or null; the verdict table's unit).

    nice -n 10 python experiments/area_quadratic.py --out experiments/results/area  # ~400 s

Confirmation on fresh rate draws and event seeds at the step sizes selected above (203 s):

    nice -n 10 python experiments/area_quadratic.py --first-draw 5 --tag _fresh \
        --method-grid AREA=1e-3 S-FedAvg=1e-3 AS-FedAvg=1e-5 FedBuff=1e-4 MIFA=3e-5
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from fedjax_sim.algorithms import area, as_fedavg, fedbuff, mifa, s_fedavg  # noqa: E402
from fedjax_sim.algorithms.core import LocalSpec  # noqa: E402
from fedjax_sim.algorithms.events import Aggregation, Arrivals, Events, normal_rates  # noqa: E402
from fedjax_sim.data import toy_quadratic  # noqa: E402
from fedjax_sim.models import linear_regression  # noqa: E402

GRID = (1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3)
METHODS = ("AREA", "S-FedAvg", "AS-FedAvg", "FedBuff", "MIFA")
FULL = LocalSpec(steps=1, sampling="full")


def build(method: str, events: Events, alpha):
    loss = linear_regression(1).loss
    opt = optax.sgd(alpha)  # alpha may be a tracer: the whole grid is one vmapped program
    kw = dict(events=events, client_optimizer=opt, local=FULL)
    return {
        "AREA": lambda: area(loss, **kw),
        "S-FedAvg": lambda: s_fedavg(loss, **kw),  # cohort_size=None: Delta = n = 50
        "AS-FedAvg": lambda: as_fedavg(loss, **kw),
        "FedBuff": lambda: fedbuff(loss, **kw),
        "MIFA": lambda: mifa(loss, **kw),
    }[method]()


def simulate_method(method, rates, alphas, keys, data, x_star, steps, grid):
    """Normalised errors on the time grid, `[A, R, G]`, for step sizes `alphas [A]` and event
    keys `[R]` (one compiled program)."""
    events = Events(Arrivals.categorical(rates), Aggregation.every(4))
    err0 = 1.0  # x_s0 = 0

    def one(alpha, key):
        alg = build(method, events, alpha)
        state = alg.init({"w": jnp.zeros(1)}, key)

        def body(s, _):
            s, m = alg.step(s, data, key)
            return s, ((s.params["w"][0] - x_star) ** 2 / x_star**2, m["t"])

        _, (err, t) = jax.lax.scan(body, state, None, length=steps)
        idx = jnp.searchsorted(t, grid, side="right") - 1  # last event at or before g
        values = jnp.where(idx >= 0, err[jnp.maximum(idx, 0)], err0)
        return jnp.where(t[-1] >= grid, values, jnp.nan), t[-1]

    run = jax.jit(jax.vmap(jax.vmap(one, (None, 0)), (0, None)))
    return run(jnp.asarray(alphas), keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draws", type=int, default=5, help="independent draws of lambda_i")
    ap.add_argument("--reps", type=int, default=40, help="event seeds per rate draw")
    ap.add_argument("--horizon", type=float, default=8.0, help="simulated time")
    ap.add_argument("--points", type=int, default=400, help="time grid points")
    ap.add_argument(
        "--first-draw", type=int, default=0,
        help="rate draws (and their event keys) FIRST..FIRST+DRAWS-1: fresh draws for "
        "confirming the step sizes an earlier run selected",
    )  # fmt: skip
    ap.add_argument(
        "--method-grid", nargs="*", default=[], metavar="METHOD=a,b",
        help="per-method step-size grid (replaces the default grid for that method)",
    )  # fmt: skip
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--out", default="experiments/results/area")
    args = ap.parse_args()
    grids = {m: GRID for m in METHODS}
    for item in args.method_grid:
        name, values = item.split("=")
        if name not in grids:
            raise SystemExit(f"--method-grid: unknown method {name!r}, one of {METHODS}")
        grids[name] = tuple(float(v) for v in values.split(","))
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    problem = toy_quadratic(50, scale=1.0)
    x_star = float(problem.optimum()[0])
    grid = jnp.linspace(0.0, args.horizon, args.points)
    curves = {m: [] for m in METHODS}  # per draw: [A, R, G]
    extra = []  # AREA at 2e-3 (outside the grid, spec 8.13 observation)
    for d in range(args.first_draw, args.first_draw + args.draws):
        rates = normal_rates(50, 10.0, 3.0, minimum=0.1, seed=d)
        keys = jax.random.split(jax.random.key(1000 + d), args.reps)
        async_steps = int(1.5 * args.horizon * rates.sum()) + 200
        # S-FedAvg: rounds of E[max_i Exp(lambda_i)] time
        ts = np.linspace(0, 50, 50001)
        round_time = np.trapezoid(1 - np.prod(1 - np.exp(-np.outer(ts, rates)), 1), ts)
        sync_steps = int(1.6 * args.horizon / round_time) + 10
        for m in METHODS:
            steps = sync_steps if m == "S-FedAvg" else async_steps
            err, _ = simulate_method(m, rates, grids[m], keys, problem.data, x_star, steps, grid)
            curves[m].append(np.asarray(err))
        err, _ = simulate_method(
            "AREA", rates, (2e-3,), keys, problem.data, x_star, async_steps, grid
        )
        extra.append(np.asarray(err)[0])
        print(
            f"draw {d}: Lambda={rates.sum():.1f}, min lambda={rates.min():.2f} "
            f"({time.time() - t0:.0f}s)",
            flush=True,
        )

    g = np.asarray(grid)
    summary = {
        "x_star": x_star,
        "grid": {m: list(v) for m, v in grids.items()} if args.method_grid else list(GRID),
        "draws": args.draws,
        "first_draw": args.first_draw,
        "reps": args.reps,
        "horizon": args.horizon,
        "methods": {},
    }
    best = {}
    runs = {}  # per run at the selected step size
    for m in METHODS:
        err = np.concatenate(curves[m], axis=1)  # [A, D*R, G]
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log10(np.maximum(err, 1e-300))
        finite = np.isfinite(err).all(axis=2)  # diverged (overflow) runs -> inf
        score = np.where(finite, logs.mean(axis=2), np.inf).mean(axis=1)  # [A]
        a = int(np.argmin(score))
        best[m] = err[a]
        with np.errstate(divide="ignore", invalid="ignore"):
            run_logs = np.log10(np.maximum(best[m], 1e-300))  # [runs, G]
        half = err[:, :, g >= args.horizon / 2]
        time_avg = np.where(np.isfinite(half).all(2), half.mean(2), np.inf)  # [A, runs]
        hit = best[m] < 1e-10
        first = np.where(hit.any(1), g[np.argmax(hit, 1)], np.inf)
        runs[m] = {
            "alpha": grids[m][a],
            "final_log10_error": [round(float(v), 4) for v in run_logs[:, -1]],
            "mean_log10_error": [round(float(v), 4) for v in run_logs.mean(1)],
            "time_to_1e-10": [round(float(v), 4) if np.isfinite(v) else None for v in first],
        }
        summary["methods"][m] = {
            "best_alpha": grids[m][a],
            "score_per_alpha": [float(s) for s in score],
            "median_time_to_1e-10": float(np.median(first)),
            "fraction_reaching_1e-10": float(hit.any(1).mean()),
            "final_error_median": float(np.median(best[m][:, -1])),
            "min_over_alphas_of_median_time_avg_error_2nd_half": float(
                np.min(np.median(time_avg, axis=1))
            ),
            "min_over_runs_and_alphas_time_avg_error_2nd_half": float(time_avg.min()),
            "_first": first,
        }
    a_first = summary["methods"]["AREA"].pop("_first")
    for m in METHODS[1:]:
        other = summary["methods"][m].pop("_first")
        summary["methods"][m]["runs_where_AREA_reaches_1e-10_first"] = float(
            np.mean(a_first < other)
        )
    extra = np.concatenate(extra, 0)
    summary["AREA_alpha_2e-3"] = {
        "stable_runs": float(np.isfinite(extra).all(1).mean()),
        "median_time_to_1e-10": float(
            np.median(np.where((extra < 1e-10).any(1), g[np.argmax(extra < 1e-10, 1)], np.inf))
        ),
    }
    summary["seconds"] = time.time() - t0
    stem = os.path.join(args.out, f"quadratic{args.tag}")
    with open(stem + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    meta = {k: summary[k] for k in ("x_star", "draws", "first_draw", "reps", "horizon")}
    with open(stem + "_runs.json", "w") as f:
        json.dump({**meta, "runs": runs}, f)
    plot(g, best, summary, stem + ".png")
    print(json.dumps(summary, indent=1))


def plot(g, best, summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m, err in best.items():
        e = np.maximum(err, 1e-32)
        alpha = summary["methods"][m]["best_alpha"]
        (line,) = ax.semilogy(g, np.median(e, 0), label=f"{m} (alpha={alpha:g})")
        lo, hi = np.percentile(e, [10, 90], axis=0)
        ax.fill_between(g, lo, hi, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("simulated time")
    ax.set_ylabel("||x_s - x*||^2 / ||x*||^2")
    ax.set_ylim(1e-30, 1e3)
    runs = summary["draws"] * summary["reps"]
    ax.set_title(f"Toy quadratic, n=50, lambda_i~N(10,3), Delta=4: median, 10-90% of {runs} runs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
