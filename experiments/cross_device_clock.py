"""Cross-device clock: FedAvg (plain, over-selection, deadline, both), FedBuff and AREA on one
device trace, test accuracy against virtual hours (issue 38, item 4).

Setting (fixed before the full run; experiments/README.md, "Cross-device clock"): the AREA
experiments' problem (`area_logistic.load`): full 60,000-image Fashion-MNIST (Debian
`dataset-fashion-mnist`), Dirichlet(0.1) label skew over n = 128 clients (partition seed 0),
multinomial logistic regression (7,850 parameters, l2 1e-3), K = 50 local SGD steps of
minibatch 32. Devices: the bundled 64-row trace (`device_model.bundled_trace()`), client i on
row i mod 64, availability windows off (every client always online; the trace's speeds,
bandwidths and 2 % mid-round dropout apply), the model's 31.4 kB sent down and up.
- FedAvg: cohort M = 32 (the event model keeps all 128 clients busy; sized for the CPU
  budget), example-weighted mean, server lr 1; over-selection 1.3 draws 42 and keeps the
  first 32 to finish;
  the deadline is the 70th percentile of the 128 clients' round times under the trace (late
  clients dropped). Client lr from `--fedavg-grid`, chosen on `--select-seeds` (other seeds
  than the runs) by the mean test accuracy over the `--select-rounds` evaluations of plain
  FedAvg.
- FedBuff and AREA: `device_model.event_model` (every client trains continuously, Poisson
  deliveries at (1 - dropout_i) / time_i), server step every 4 deliveries, gradients scaled
  by s_i / S, step sizes the AREA Fig. 2 runs selected for K = 50 on seeds 0-9
  (`area/logistic_K50_seeds10_full60k_h10grid_*`: AREA 10, FedBuff 1), for `--async-hours`;
  m + 2 sqrt(m) + 2 slots per iteration (m: expected due clients; the rest wait one).
- Equal concurrency (`--concurrency K`, asynchronous runs only): at most K clients train at
  once (`event_model(concurrency=K)`; K = 32, FedAvg's cohort); m is then the steady-state
  number of due clients under the cap (`capped_due`). The synchronous runs are reused from
  `clock_sync.json`. Everything else as above, except the horizon: the cap cuts the
  deliveries per second 6.4x (13.3 -> 2.1 per 1.97 s iteration, bundled trace), so the
  runs go 0.5 virtual hours (FedAvg's 10 rounds: 0.49 h) with 200 evaluations (every 5
  iterations, the spacing of the uncapped runs).

    nice -n 10 python experiments/cross_device_clock.py --tag _sync
    nice -n 10 python experiments/cross_device_clock.py --methods FedBuff AREA --tag _async
    nice -n 10 python experiments/cross_device_clock.py --methods FedBuff AREA \
        --concurrency 32 --async-hours 0.5 --async-evals 200 --tag _async_conc32

Writes `experiments/results/cross_device/clock<tag>.json` (`.json.partial` until complete):
config, the selection and per run (method, seed) the evaluated virtual hours and test
accuracies, and the synchronous runs' per-round round times and counts of late / dropped
clients; capped runs also their cap and mean number of clients training.
`cross_device_report.py` makes the tables and the plot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))  # area_logistic: the shared problem
from area_logistic import NU, build, load  # noqa: E402
from compact_histories import shorten  # noqa: E402

from fedjax_sim.algorithms import fedavg, sample_size_scale  # noqa: E402
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec  # noqa: E402
from fedjax_sim.algorithms.device_model import (  # noqa: E402
    DeviceModel,
    bundled_trace,
    client_times,
    event_model,
    load_trace,
)
from fedjax_sim.algorithms.events import Aggregation  # noqa: E402
from fedjax_sim.data.federated import tree_size_bytes  # noqa: E402
from fedjax_sim.models import logistic_regression  # noqa: E402
from fedjax_sim.run.simulate import EvalSpec  # noqa: E402
from fedjax_sim.run.sweep import sweep  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "results", "cross_device")
SYNC = ("FedAvg", "FedAvg+OS", "FedAvg+DL", "FedAvg+OS+DL")
ASYNC = {"FedBuff": 1.0, "AREA": 10.0}  # AREA Fig. 2 (K = 50) selections, seeds 0-9
METHODS = (*SYNC, *ASYNC)
OVER_SELECTION = 1.3
DEADLINE_PERCENTILE = 70


def accuracy_fn(model, test):
    xt, yt = jnp.asarray(test[0]), jnp.asarray(test[1])

    def extra(params, data, _test):
        return {"test_accuracy": jnp.mean(jnp.argmax(model.apply(params, xt), -1) == yt)}

    return extra


def device_model(profiles, method: str, deadline: float) -> DeviceModel:
    return DeviceModel(
        profiles,
        deadline=deadline if "DL" in method else None,
        over_selection=OVER_SELECTION if "OS" in method else 1.0,
        availability=False,
    )


def run_sync(method, lr_grid, seeds, ctx, rounds=None) -> list[dict]:
    """FedAvg under `method`'s device model: one sweep over lr x seeds; per run its compact
    history (`compact`)."""
    dm = device_model(ctx["profiles"], method, ctx["deadline"])

    def make(hp):
        return fedavg(
            ctx["model"].loss, client_optimizer=optax.sgd(hp["lr"]), local=ctx["local"],
            cohort=CohortSpec(size=ctx["cohort"]), device_model=dm,
        )  # fmt: skip

    res = sweep(
        make, ctx["data"], seeds=[int(s) for s in seeds], grid={"lr": list(lr_grid)},
        model=ctx["model"], num_rounds=rounds or ctx["rounds"], params=ctx["params0"],
        progress=False,
        evaluation=EvalSpec(every=ctx["eval_every"], central=False, clients=False,
                            extra=ctx["extra"]),
        runs_per_group=len(lr_grid) * len(seeds),
    )  # fmt: skip
    out = []
    for r, h in zip(res.runs, res.histories, strict=True):
        hours, acc = h.eval_series("test_accuracy", x="virtual_hours")
        out.append({
            "method": method, "seed": int(r.seed), "lr": float(r.hparams["lr"]),
            "hours": hours.tolist(), "test_accuracy": acc.tolist(),
            "round_time": np.asarray(h.metric("round_time")).tolist(),
            **{k: int(np.sum(h.metric(k))) for k in ("late", "dropouts", "unavailable")},
        })  # fmt: skip
    return out


def run_async(method, seeds, horizon, ctx) -> list[dict]:
    """FedBuff / AREA on `event_model` of the same profiles for `horizon` virtual seconds."""
    kw = dict(
        steps=ctx["local"].steps, bytes_down=ctx["bytes"], bytes_up=ctx["bytes"],
        aggregation=Aggregation.every(4), availability=False,
        max_probability=ctx["max_probability"],
    )  # fmt: skip
    p = np.asarray(event_model(ctx["profiles"], ctx["clients"], **kw).arrivals.values)
    k = ctx["concurrency"]
    m = float(p.sum()) if k is None else capped_due(p, k)
    # slots: m + 2 sqrt(m) + 2 (the default m + 6 sqrt(m) + 8 trains ~3x the due clients);
    # a due client that does not fit is deferred one iteration (the `overflow` metric)
    capacity = math.ceil(m + 2.0 * math.sqrt(m) + 2.0)
    if k is not None:
        kw["concurrency"] = k
    events = event_model(ctx["profiles"], ctx["clients"], capacity=capacity, **kw)
    dt = float(events.arrivals.dt)
    evals = ctx["async_evals"]
    every = max(1, -(-int(np.ceil(horizon / dt)) // evals))
    alpha = ASYNC[method]

    def make(_hp):
        return build(method, ctx["model"], events, alpha, ctx["local"], ctx["scale"])

    res = sweep(
        make, ctx["data"], seeds=[int(s) for s in seeds], model=ctx["model"],
        num_rounds=every * evals, params=ctx["params0"], progress=False,
        evaluation=EvalSpec(every=every, central=False, clients=False, extra=ctx["extra"]),
        runs_per_group=len(seeds),
    )  # fmt: skip
    out = []
    for r, h in zip(res.runs, res.histories, strict=True):
        rounds, acc = h.eval_series("test_accuracy")
        t = np.asarray(h.metrics["t"], np.float64)
        clock = dict(zip(h.rounds, t.tolist(), strict=True)) | {0: 0.0}
        out.append({
            "method": method, "seed": int(r.seed), "lr": alpha, "dt": dt, "slots": capacity,
            "overflow": int(np.sum(h.metric("overflow"))),
            **({} if k is None else {"concurrency": k,
                                     "training": float(np.mean(h.metric("training")))}),
            "hours": [clock[int(k)] / 3600.0 for k in rounds], "test_accuracy": acc.tolist(),
        })  # fmt: skip
    return out


def capped_due(p: np.ndarray, k: int) -> float:
    """Expected due clients per iteration when at most `k` of the clients (per-iteration
    firing probabilities `p`) train and idle ones start uniformly at random: in the steady
    state client i trains with probability pi_i = r / (r + p_i), r the per-idle-client start
    rate with sum_i pi_i = k (bisection); due: sum_i pi_i p_i. Slow clients hold their slot
    longer, so this is below k mean(p) (bundled trace, k = 32 of 128: 2.03 vs 3.34; a
    replay of the engine gives 2.08)."""
    p = np.asarray(p, np.float64)
    lo, hi = 0.0, 1e6 * float(p.max())
    for _ in range(200):
        r = 0.5 * (lo + hi)
        lo, hi = (lo, r) if np.sum(r / (r + p)) > k else (r, hi)
    pi = r / (r + p)
    return float(np.sum(pi * p))


def selection(runs: list[dict]) -> float:
    """The lr with the highest mean (over seeds) of the mean test accuracy over evaluations
    (round 0 excluded)."""
    lrs = sorted({r["lr"] for r in runs})
    score = [np.mean([np.mean(r["test_accuracy"][1:]) for r in runs if r["lr"] == a]) for a in lrs]
    return lrs[int(np.argmax(score))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=100)
    ap.add_argument("--select-seeds", type=int, nargs="+", default=[200, 201])
    ap.add_argument("--fedavg-grid", type=float, nargs="+", default=[0.03, 0.1, 0.3, 1, 3])
    ap.add_argument("--fedavg-lr", type=float, default=None, help="skip the selection")
    ap.add_argument("--select-rounds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=1)
    ap.add_argument("--async-evals", type=int, default=40)
    ap.add_argument("--async-hours", type=float, default=0.1, help="FedBuff / AREA horizon")
    ap.add_argument("--max-probability", type=float, default=0.5)
    ap.add_argument("--train", type=int, default=60000)
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--cohort", type=int, default=32)
    ap.add_argument("--local-steps", type=int, default=50)
    ap.add_argument(
        "--methods", nargs="+", default=list(SYNC), choices=METHODS,
        help="default: the FedAvg variants (clock_sync.json); FedBuff AREA: clock_async.json",
    )  # fmt: skip
    ap.add_argument(
        "--concurrency", type=int, default=None, metavar="K",
        help="FedBuff / AREA: at most K clients training at once (event_model(concurrency=K)); "
        "default: every client trains all the time (clock_async.json)",
    )  # fmt: skip
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.concurrency is not None and any(m in SYNC for m in args.methods):
        ap.error("--concurrency caps the asynchronous runs only: use --methods FedBuff AREA")
    t0 = time.time()
    os.makedirs(OUT, exist_ok=True)
    data, _, test = load(args.train, args.clients, seed=0)
    model = logistic_regression((784,), 10, l2=NU)
    params0 = jax.tree.map(jnp.zeros_like, model.init(jax.random.key(0)))
    profiles = load_trace(bundled_trace())
    nbytes = float(tree_size_bytes(params0))
    local = LocalSpec(steps=args.local_steps, batch_size=32)
    p = profiles(np.arange(args.clients))
    times = np.asarray(client_times(p, float(local.steps), nbytes, nbytes), np.float64)
    deadline = float(np.percentile(times, DEADLINE_PERCENTILE))
    ctx = dict(
        data=data, model=model, params0=params0, profiles=profiles, bytes=nbytes, local=local,
        cohort=args.cohort, deadline=deadline, rounds=args.rounds, eval_every=args.eval_every,
        extra=accuracy_fn(model, test), clients=args.clients, async_evals=args.async_evals,
        scale=sample_size_scale(np.asarray(data.counts)), max_probability=args.max_probability,
        concurrency=args.concurrency,
    )  # fmt: skip
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    blob = {
        "config": {**vars(args), "deadline_s": deadline, "model_bytes": nbytes,
                   "client_time_s": {"median": float(np.median(times)),
                                     "p90": float(np.percentile(times, 90)),
                                     "max": float(times.max())},
                   "trace": "bundled (device_traces/small.csv), row i mod 64, availability off",
                   "async_step_sizes": ASYNC, "over_selection": OVER_SELECTION,
                   "deadline_percentile": DEADLINE_PERCENTILE, "seeds_list": seeds},
        "selection": {}, "runs": [], "seconds": {},
    }  # fmt: skip
    path = os.path.join(OUT, f"clock{args.tag}.json")
    print(f"data {data.summary()}; client time median {np.median(times):.1f} s, deadline "
          f"{deadline:.1f} s ({time.time() - t0:.0f} s)", flush=True)  # fmt: skip

    def save(final: bool = False) -> None:
        blob["seconds"]["total"] = time.time() - t0
        with open(path + ".partial", "w") as f:
            json.dump(shorten(blob), f, separators=(",", ":"))  # float32s: shortest repr
        if final:
            os.replace(path + ".partial", path)

    lr = args.fedavg_lr
    if lr is None and any(m in SYNC for m in args.methods):
        t1 = time.time()
        sel = run_sync("FedAvg", args.fedavg_grid, args.select_seeds, ctx, args.select_rounds)
        lr = selection(sel)
        blob["selection"] = {"seeds": args.select_seeds, "grid": args.fedavg_grid, "lr": lr,
                             "runs": sel}  # fmt: skip
        blob["seconds"]["selection"] = time.time() - t1
        print(f"FedAvg lr {lr} (selection {time.time() - t1:.0f} s)", flush=True)
    blob["config"]["fedavg_lr"] = lr
    for m in (m for m in SYNC if m in args.methods):
        t1 = time.time()
        blob["runs"] += run_sync(m, [lr], seeds, ctx)
        blob["seconds"][m] = time.time() - t1
        save()
        rs = [r for r in blob["runs"] if r["method"] == m]
        print(f"{m}: final acc {np.mean([r['test_accuracy'][-1] for r in rs]):.3f}, "
              f"{np.mean([r['hours'][-1] for r in rs]):.2f} h, mean round "
              f"{np.mean([np.mean(r['round_time']) for r in rs]):.1f} s "
              f"({time.time() - t1:.0f} s)", flush=True)  # fmt: skip
    horizon = 3600.0 * args.async_hours
    for m in (m for m in ASYNC if m in args.methods):
        t1 = time.time()
        blob["runs"] += run_async(m, seeds, horizon, ctx)
        blob["seconds"][m] = time.time() - t1
        save()
        rs = [r for r in blob["runs"] if r["method"] == m]
        print(f"{m}: final acc {np.mean([r['test_accuracy'][-1] for r in rs]):.3f}, "
              f"{np.mean([r['hours'][-1] for r in rs]):.2f} h ({time.time() - t1:.0f} s)",
              flush=True)  # fmt: skip
    usage = resource.getrusage(resource.RUSAGE_SELF)
    blob["seconds"]["cpu"] = usage.ru_utime + usage.ru_stime
    save(final=True)
    print(f"wrote {path} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
