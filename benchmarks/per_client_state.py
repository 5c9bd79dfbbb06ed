"""Round time of algorithms with per-client state at C = 10^3 vs C = 10^5 clients.

A round touches only the M cohort rows of the `[C, d]` per-client state (gather `state[idx]`,
write back `.at[idx].set`), so with a fixed cohort (M = 100) the round time must not grow
like C. Every algorithm here (including the FedAvg reference) also draws its cohort with an
O(C) uniform top-k, which is the only O(C) work left.

Workload: synthetic classification, 8 examples of 32 features per client, 10 classes,
logistic regression (d = 330 parameters), 10 local steps of batch 8, cohort 100.
Three ways of running rounds are timed:
  scan    `lax.scan` over R rounds in one jit (how `simulate` runs), state donated;
  donate  one `jit(step, donate_argnums=0)` call per round;
  copy    one `jit(step)` call per round without donation: XLA must copy the [C, d] state
          every round (shows why the library runs rounds under scan).
All cases are compiled first, then timed round-robin in a random order per repeat, so the
noise of a shared machine hits every case alike; medians and minima are reported.

Usage:
  nice python benchmarks/per_client_state.py [--clients 1000 100000] [--cohort 100]
      [--rounds 10] [--repeats 15] [--algorithms fedavg scaffold feddyn fedmim]
Rows (one per algorithm, mode and C) go to benchmarks/results/per_client_state.jsonl
(`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim import algorithms
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.app.bench.results import Recorder
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models import logistic_regression
from fedjax_sim.runtime.parallel import ClientMap

FEATURES, CLASSES, PER_CLIENT = 32, 10, 8


def make_data(num_clients: int, seed: int = 0) -> FederatedData:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_clients, PER_CLIENT, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(num_clients, PER_CLIENT)).astype(np.int32)
    counts = np.full(num_clients, PER_CLIENT, np.int32)
    return FederatedData.create(x, y, counts, num_classes=CLASSES)


def build_cases(name: str, data: FederatedData, args) -> list[dict]:
    """Compiled callables `state, data -> state` for the three modes, each with its state."""
    num_clients = data.num_clients
    model = logistic_regression((FEATURES,), CLASSES)
    alg = algorithms.build(
        name,
        model.loss,
        num_clients=num_clients,
        client_optimizer=0.05,
        local=LocalSpec(steps=10, batch_size=8),
        cohort=CohortSpec(size=args.cohort),
        client_map=ClientMap(args.client_map),
    )
    key = jax.random.key(0)
    params = model.init(jax.random.key(1))

    def scan(state, data):
        return jax.lax.scan(lambda s, _: alg.step(s, data, key), state, length=args.rounds)[0]

    def step(state, data):
        return alg.step(state, data, key)[0]

    cases = []
    for mode, fn, rounds in (
        ("scan", jax.jit(scan, donate_argnums=0), args.rounds),
        ("donate", jax.jit(step, donate_argnums=0), 1),
        ("copy", jax.jit(step), 1),
    ):
        state = alg.init(jax.tree.map(jnp.copy, params), key)  # donation deletes inputs
        state = jax.block_until_ready(fn(state, data))  # compile and warm up
        cases.append(
            dict(
                name=name,
                clients=num_clients,
                mode=mode,
                fn=fn,
                rounds=rounds,
                state=state,
                data=data,
                times=[],
            )
        )
    return cases


def measure(cases: list[dict], repeats: int, seed: int = 0) -> None:
    """Round-robin over all cases in a random order per repeat (spreads machine noise)."""
    rng = np.random.default_rng(seed)
    for _ in range(repeats):
        for i in rng.permutation(len(cases)):
            case = cases[i]
            t0 = time.perf_counter()
            case["state"] = jax.block_until_ready(case["fn"](case["state"], case["data"]))
            case["times"].append((time.perf_counter() - t0) / case["rounds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1000, 100000])
    parser.add_argument("--cohort", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--algorithms", nargs="+", default=["fedavg", "scaffold", "feddyn", "fedmim"]
    )
    parser.add_argument("--client-map", default="auto", choices=["auto", "vmap", "map"])
    parser.add_argument("--out", help="default benchmarks/results/per_client_state.jsonl")
    args = parser.parse_args()
    rec = Recorder("per_client_state", args.out)

    datasets = {num: make_data(num) for num in args.clients}
    cases = [
        c
        for name in args.algorithms
        for num in args.clients
        for c in build_cases(name, datasets[num], args)
    ]
    measure(cases, args.repeats)
    results: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for c in cases:
        stats = {"median": statistics.median(c["times"]), "min": min(c["times"])}
        results.setdefault(c["name"], {}).setdefault(str(c["clients"]), {})[c["mode"]] = stats
        rec.add(
            f"{c['name']} {c['mode']} C={c['clients']}",
            algorithm=c["name"], mode=c["mode"], clients=c["clients"], cohort=args.cohort,
            rounds=args.rounds, repeats=args.repeats, client_map=args.client_map,
            median_s=stats["median"], min_s=stats["min"],
        )  # fmt: skip
    rec.write()

    small, large = str(min(args.clients)), str(max(args.clients))
    print(f"\nms per round (median / min of {args.repeats}), cohort {args.cohort}")
    print(f"| algorithm | mode | C={small} | C={large} | ratio of medians | ratio of mins |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.algorithms:
        for mode in ("scan", "donate", "copy"):
            a, b = results[name][small][mode], results[name][large][mode]
            print(
                f"| {name} | {mode} | {a['median'] * 1e3:.2f} / {a['min'] * 1e3:.2f} "
                f"| {b['median'] * 1e3:.2f} / {b['min'] * 1e3:.2f} "
                f"| {b['median'] / a['median']:.2f}x | {b['min'] / a['min']:.2f}x |"
            )


if __name__ == "__main__":
    jnp.zeros(())  # initialise the backend before timing
    main()
