"""One FedAvg round of workload W1, measured side by side in one run.

W1: 1000 clients x 10 local steps x batch 32, MLP 784-200-200-10, random data (100 examples
per client), full participation. Engine modes: `vmap`, `map(batch_size=k)`; baseline: a
per-client Python loop over a jitted client update (how sequential simulators work).
Reports compile time, seconds/round (median and min of `--repeats` rounds) and
client-steps/s as JSON lines (stdout and `--out`).

    python benchmarks/round_throughput.py --out benchmarks/results/round_throughput.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sim.algorithms import LocalSpec, fedavg
from fedjax_sim.algorithms.core import client_key, local_train
from fedjax_sim.data import FederatedData
from fedjax_sim.models import mlp
from fedjax_sim.parallel import ClientMap


def make_data(num_clients: int, per_client: int, seed: int = 0) -> FederatedData:
    rng = np.random.default_rng(seed)
    x = rng.random((num_clients, per_client, 784), dtype=np.float32)
    y = rng.integers(0, 10, (num_clients, per_client)).astype(np.int32)
    return FederatedData.create(x, y, np.full(num_clients, per_client, np.int32), num_classes=10)


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return compile_s, times


def engine_round(model, data, params, key, local, cmap):
    alg = fedavg(model.loss, client_optimizer=0.05, local=local, client_map=cmap)
    state = alg.init(params, key)
    step = jax.jit(alg.step)
    return lambda: step(state, data, key)[0].params


def loop_round(model, data, params, key, local):
    """Sequential baseline: jitted per-client update, Python loop, running weighted sum."""

    @jax.jit
    def client_update(params, x, y, count, k):
        res = local_train(params, data.client(0)._replace(x=x, y=y, count=count), k,
                          loss_fn=model.loss, optimizer=optax.sgd(0.05),
                          max_steps=local.steps, batch_size=local.batch_size)
        return jax.tree.map(lambda a, b: (a - b) * count, res.params, params)

    def run():
        total = jax.tree.map(jnp.zeros_like, params)
        for i in range(data.num_clients):
            delta = client_update(params, data.x[i], data.y[i], data.counts[i],
                                  client_key(key, i))
            total = jax.tree.map(jnp.add, total, delta)
        n = jnp.sum(data.counts)
        return jax.tree.map(lambda p, t: p + t / n, params, total)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--per-client", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--map-batch", type=int, nargs="+", default=[1, 5, 10, 25])
    parser.add_argument("--skip-vmap", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    data = make_data(args.clients, args.per_client)
    model = mlp((784,), 10, hidden=(200, 200))
    key = jax.random.key(0)
    params = model.init(key)
    local = LocalSpec(steps=args.steps, batch_size=args.batch)
    flops = 6 * args.clients * args.steps * args.batch * (784 * 200 + 200 * 200 + 200 * 10)
    modes = [] if args.skip_vmap else [("vmap", engine_round(model, data, params, key, local,
                                                               ClientMap("vmap")))]
    modes += [(f"map(batch_size={b})", engine_round(model, data, params, key, local,
                                                   ClientMap("map", b))) for b in args.map_batch]
    modes.append(("per-client python loop", loop_round(model, data, params, key, local)))
    info = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "jax": jax.__version__, "cpu_count": __import__("os").cpu_count(),
            "machine": platform.machine()}
    rows = []
    for name, fn in modes:
        compile_s, times = timed(fn, args.repeats)
        med = statistics.median(times)
        row = {"workload": "W1", "mode": name, "clients": args.clients, "steps": args.steps,
               "batch": args.batch, "compile_s": round(compile_s, 3),
               "round_s_median": round(med, 4), "round_s_min": round(min(times), 4),
               "client_steps_per_s": round(args.clients * args.steps / med, 1),
               "gflop_per_s": round(flops / med / 1e9, 1), **info}
        rows.append(row)
        print(json.dumps(row), flush=True)
    loop = next(r for r in rows if r["mode"] == "per-client python loop")
    best = min((r for r in rows if r is not loop), key=lambda r: r["round_s_median"])
    summary = {"summary": True, "best_mode": best["mode"],
               "speedup_vs_loop": round(loop["round_s_median"] / best["round_s_median"], 2)}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            for row in [*rows, summary]:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
