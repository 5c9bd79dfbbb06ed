"""Asynchronous event iterations: cost follows the firing clients, not C (issue 4).

AREA on multinomial logistic regression (random data: `--dim` features, 10 classes,
`--per-client` examples per client), Bernoulli arrivals with p_i = p * U(0.5, 1.5) (mean p),
aggregation every 4 deliveries, one local SGD step (batch 8), capacity "auto" (the firing
clients are compacted into ~E + 6 sqrt(E) + 8 slots, E = sum_i p_i). For each C and p:
compile time, iterations/s, client updates/s (delivered results per second), overflow, and
the bytes of the per-client state (AREA's r_i and y_i plus the engine's [C] bookkeeping).
`--full` also times the reference step that trains all C clients and masks (capacity=None).

    nice -n 10 python benchmarks/async_throughput.py  # -> benchmarks/results/async_throughput.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms import area
from fedjax_sim.algorithms.core import LocalSpec
from fedjax_sim.algorithms.events import Aggregation, Arrivals, Events
from fedjax_sim.app.bench.results import Recorder
from fedjax_sim.data import FederatedData, tree_size_bytes
from fedjax_sim.models import logistic_regression
from fedjax_sim.runtime.parallel import ClientMap


def make_data(num_clients: int, per_client: int, dim: int, seed: int = 0) -> FederatedData:
    rng = np.random.default_rng(seed)
    x = rng.random((num_clients, per_client, dim), dtype=np.float32)
    y = rng.integers(0, 10, (num_clients, per_client)).astype(np.int32)
    return FederatedData.create(x, y, np.full(num_clients, per_client, np.int32), num_classes=10)


def per_client_bytes(state, num_clients: int) -> int:
    """Bytes of the state arrays with a leading [C] axis (per-client state)."""
    leaves = jax.tree.leaves(state)
    return sum(tree_size_bytes(a) for a in leaves if a.ndim >= 1 and a.shape[0] == num_clients)


def measure(data, model, p_mean, *, capacity, chunk, seconds, cmap, seed=0):
    c = data.num_clients
    rng = np.random.default_rng(seed)
    p = np.clip(p_mean * rng.uniform(0.5, 1.5, c), 1e-9, 1.0)
    events = Events(Arrivals.bernoulli(p), Aggregation.every(4), capacity=capacity)
    alg = area(
        model.loss,
        events=events,
        client_optimizer=0.05,
        local=LocalSpec(steps=1, batch_size=8),
        client_map=cmap,
    )
    key = jax.random.key(seed)
    state = alg.init(jax.tree.map(jnp.zeros_like, model.init(key)), key)

    # donated: without it every call copies the whole [C, ...] state (520 MB at C = 1e5),
    # which dominated the per-iteration time at C = 1e5 (measured 15x instead of ~1x)
    @functools.partial(jax.jit, donate_argnums=0)
    def run(state):
        def body(s, _):
            s, m = alg.step(s, data, key)
            return s, (m["fired"], m["overflow"])

        return jax.lax.scan(body, state, None, length=chunk)

    t0 = time.perf_counter()
    state, _ = jax.block_until_ready(run(state))
    compile_s = time.perf_counter() - t0
    times, fired, overflow = [], 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 2:
        t0 = time.perf_counter()
        state, (f, o) = jax.block_until_ready(run(state))
        times.append(time.perf_counter() - t0)
        fired += int(f.sum())
        overflow += int(o.sum())
    total = sum(times)
    iters = chunk * len(times)
    return {
        "clients": c,
        "p_mean": p_mean,
        "expected_firings": float(p.sum()),
        "slots": events.slots,
        "capacity": "full" if capacity is None else capacity,
        "compile_s": round(compile_s, 3),
        "s_per_iteration_median": float(np.median(times)) / chunk,
        "iterations_per_s": iters / total,
        "client_updates_per_s": fired / total,
        "fired_per_iteration": fired / iters,
        "overflow_per_iteration": overflow / iters,
        "per_client_state_bytes": per_client_bytes(state, c),
        "data_bytes": tree_size_bytes((data.x, data.y)),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--probs", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--per-client", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per config")
    ap.add_argument("--map", default="vmap", choices=["vmap", "map", "auto"])
    ap.add_argument("--full", action="store_true", help="also time the all-C masked step")
    ap.add_argument("--out", help="JSON lines (default benchmarks/results/async_throughput.jsonl)")
    args = ap.parse_args()
    model = logistic_regression((args.dim,), 10)
    cmap = ClientMap(args.map)
    rec = Recorder("async_throughput", args.out)
    rows = []
    for c in args.clients:
        data = make_data(c, args.per_client, args.dim)
        for p in args.probs:
            e = c * p
            chunk = int(np.clip(5000 / max(e, 1.0), 20, 500))
            configs = [("auto", chunk)]
            if args.full and c <= 10000:
                configs.append((None, max(2, chunk // 20)))
            for capacity, n in configs:
                row = {
                    **measure(
                        data, model, p, capacity=capacity, chunk=n, seconds=args.seconds, cmap=cmap
                    ),
                    "map": args.map,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                rec.add(f"C={c} p={p:g} capacity={capacity}", **row)
                rec.write()
        del data
    # the ratio asked for: per-iteration time at C = 1e5 vs C = 1e3, equal expected firings
    by = {(r["clients"], r["p_mean"]): r for r in rows if r["capacity"] == "auto"}
    for (c1, p1), (c2, p2) in [
        ((1000, 1e-1), (100000, 1e-3)),
        ((1000, 1e-2), (10000, 1e-3)),
        ((1000, 1e-1), (10000, 1e-2)),
    ]:
        if (c1, p1) in by and (c2, p2) in by:
            ratio = by[(c2, p2)]["s_per_iteration_median"] / by[(c1, p1)]["s_per_iteration_median"]
            print(
                f"per-iteration time C={c2} p={p2} / C={c1} p={p1} "
                f"(E={c1 * p1:g} firings): {ratio:.2f}x"
            )


if __name__ == "__main__":
    main()
