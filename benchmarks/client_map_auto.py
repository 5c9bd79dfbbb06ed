"""Does the measured `ClientMap("auto")` pick the fastest mode? (issue 20)

For each workload, one FedAvg round is compiled with every candidate mode (`map` with
chunks of 1, 2, 4, 8, 16 clients, `vmap`) and with `auto` (measuring on, a fresh cache
directory: the first compilation measures, and its cost is reported as `autotune_seconds`).
Rounds are then timed round-robin over the modes (`repeats` passes, random order per pass,
so the load of a shared machine hits all modes alike); the table gives median seconds per
round, the best mode, auto's choice and `auto / best`.

Workloads: W1 (1000 clients, MLP 784-200-200-10, 10 steps of 32, 100 examples/client), the
default digits job (`fedjax-sim run`: 100 Dirichlet(0.5) clients, cohort 10, MLP 64-64-10,
10 steps of 16), LR (1000 clients, logistic 60 -> 10, 10 steps of 10, 20 examples/client).

Usage: nice python benchmarks/client_map_auto.py [--workloads W1 digits LR] [--repeats 3]
Rows -> benchmarks/results/client_map_auto.jsonl (`--out` elsewhere); a re-run replaces the
rows of the workloads it measures and keeps the others.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

os.environ["FEDJAX_SIM_AUTOTUNE"] = "1"
os.environ.setdefault("FEDJAX_SIM_CACHE_DIR", tempfile.mkdtemp(prefix="fedjax_auto_"))

import jax  # noqa: E402

from fedjax_sim import data, models
from fedjax_sim.algorithms import CohortSpec, LocalSpec, fedavg  # noqa: E402
from fedjax_sim.app.bench import workloads  # noqa: E402
from fedjax_sim.app.bench.results import Recorder  # noqa: E402
from fedjax_sim.runtime import autotune  # noqa: E402
from fedjax_sim.runtime.parallel import ClientMap  # noqa: E402

MODES = [("map", 1), ("map", 2), ("map", 4), ("map", 8), ("map", 16), ("vmap", None)]


def setup(name: str):
    """`(make_algorithm(client_map), state, data)` of a workload."""
    key = jax.random.key(0)
    if name == "digits":
        ds = data.load_digits(num_clients=100)
        model = models.mlp(ds.feature_shape, ds.num_classes, hidden=(64,))
        local, cohort, train = LocalSpec(steps=10, batch_size=16), CohortSpec(size=10), ds.train
    else:
        w = workloads.preset(name)
        model, train = workloads.make_model(w), workloads.make_data(w)
        local, cohort = LocalSpec(steps=w.local_steps, batch_size=w.batch_size), CohortSpec()

    def make(cmap: ClientMap):
        return fedavg(
            model.loss, client_optimizer=0.05, local=local, cohort=cohort, client_map=cmap
        )

    state = make(ClientMap("map", 1)).init(model.init(key), key)
    return make, state, train, key


def _cache() -> dict:
    try:
        with open(autotune.cache_path()) as fh:
            return json.load(fh)
    except OSError:
        return {}


def bench(name: str, repeats: int) -> dict:
    make, state, train, key = setup(name)
    steps = {}
    for mode, bs in MODES:
        f = jax.jit(make(ClientMap(mode, bs)).step)
        jax.block_until_ready(f(state, train, key))
        steps["vmap" if mode == "vmap" else f"map({bs})"] = f
    autotune._MEMORY.clear()
    before = _cache()
    t0 = time.perf_counter()
    f = jax.jit(make(ClientMap("auto")).step)
    jax.block_until_ready(f(state, train, key))
    tune_seconds = time.perf_counter() - t0
    steps["auto"] = f
    new = [v for k, v in _cache().items() if k not in before]  # the round's single map_sum
    choice = new[0] if new else {}
    times: dict[str, list[float]] = {k: [] for k in steps}
    calls_per_timing = {"digits": 50, "LR": 10}.get(name, 1)
    for _ in range(repeats):
        names = list(steps)
        random.shuffle(names)
        for k in names:
            t0 = time.perf_counter()
            for _ in range(calls_per_timing):
                out = steps[k](state, train, key)
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / calls_per_timing)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min((k for k in med if k != "auto"), key=med.get)
    return {
        "workload": name,
        "median_seconds": med,
        "all_seconds": times,
        "best_mode": best,
        "auto_choice": choice,
        "auto_over_best": med["auto"] / med[best],
        "autotune_seconds": tune_seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workloads", nargs="*", default=["W1", "digits", "LR"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="JSON lines (default benchmarks/results/client_map_auto.jsonl)")
    args = p.parse_args()
    rec = Recorder("client_map_auto", args.out)
    for name in args.workloads:
        r = bench(name, args.repeats)
        rec.add(name, **r)
        rec.write()
        ch = r["auto_choice"]
        print(
            f"{name}: best {r['best_mode']} {r['median_seconds'][r['best_mode']]:.4f} s, auto -> "
            f"{ch.get('mode')}({ch.get('batch_size')}) {r['median_seconds']['auto']:.4f} s, "
            f"auto/best {r['auto_over_best']:.3f}, measuring took {r['autotune_seconds']:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
