"""Aggregator kernel throughput: mean, DP (`dp_mean`), median, trimmed mean, Krum and the
geometric median on a random `[M, d]` float32 stack of client updates.

One measurement = one jitted call of the whole server-side aggregation from the stack:
`encode` of every row (DP's clipping; identity otherwise), the weighted sum `w @ stack` (XLA
CPU's `jnp.sum(stack, axis=0)` is ~30x slower), and `reduce` (with the stack for the robust
aggregators). Updates/s = M / (median seconds over `--repeats` calls
after a warm-up call). Each configuration runs in its own subprocess, whose peak RSS
(`resource.getrusage`) is its memory; a stack over `--max-stack-gb` is skipped, and a
configuration whose timed call exceeds `--cap-s` is timed once (or killed at 3 x cap) and
marked. The same run measures a 2048^2 float32 matmul as the machine-speed reference.

    PYTHONPATH=$PWD nice -n 10 python benchmarks/aggregators.py

Rows (stamped with commit, machine, load and command) go to
`benchmarks/results/aggregators.jsonl` (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.aggregators import mean
from fedjax_sim.algorithms.core import Cohort
from fedjax_sim.algorithms.privacy import dp_mean
from fedjax_sim.algorithms.robust import geometric_median, krum, median, trimmed_mean
from fedjax_sim.app.bench.results import Recorder

AGGREGATORS = {
    "mean": lambda m: mean(),
    "dp_mean": lambda m: dp_mean(1.0, 1.0, float(m)),
    "median": lambda m: median(),
    "trimmed_mean": lambda m: trimmed_mean(0.1),
    "krum": lambda m: krum(max(1, m // 10)),
    "geometric_median": lambda m: geometric_median(10),
}


def timed(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def matmul_gflops(n: int = 2048, repeats: int = 10) -> float:
    """GFLOP/s of an n x n float32 matmul (median of `repeats` after a warm-up)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    timed(f, a, a)
    return 2 * n**3 / statistics.median(timed(f, a, a) for _ in range(repeats)) / 1e9


def measure(name: str, m: int, d: int, repeats: int, cap_s: float) -> dict:
    """One configuration, in this process."""
    agg = AGGREGATORS[name](m)
    stack = {"w": jax.random.normal(jax.random.key(1), (m, d), jnp.float32) * 0.01}
    params = jax.tree.map(lambda x: x[0], stack)
    server, rows = agg.init(params, m)
    weights = jnp.ones((m,), jnp.float32)
    key = jax.random.key(2)

    @jax.jit
    def aggregate(stack):
        sent, _ = jax.vmap(lambda u: agg.encode(u, rows, key, server))(stack)
        total = jax.tree.map(lambda x: jnp.tensordot(weights, x, axes=1), sent)
        cohort = Cohort(jnp.arange(m), weights, jnp.int32(0), m)
        update, _, _ = agg.reduce(server, total, jnp.float32(m), stack, cohort, key)
        return update

    first = timed(aggregate, stack)
    times = [timed(aggregate, stack)]
    capped = times[0] > cap_s
    while not capped and len(times) < repeats and sum(times) < cap_s:
        times.append(timed(aggregate, stack))
    s = statistics.median(times)
    return {
        "first_call_s": round(first, 3),
        "seconds": s,
        "repeats": len(times),
        "updates_per_s": m / s,
        "capped": capped,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--M", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--d", type=int, nargs="+", default=[10**4, 10**6])
    ap.add_argument("--aggregators", nargs="+", default=list(AGGREGATORS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cap-s", type=float, default=60.0)
    ap.add_argument("--max-stack-gb", type=float, default=4.0)
    ap.add_argument("--out", help="JSON lines (default benchmarks/results/aggregators.jsonl)")
    ap.add_argument("--one", nargs=3, metavar=("NAME", "M", "D"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        name, m, d = args.one[0], int(args.one[1]), int(args.one[2])
        print(json.dumps(measure(name, m, d, args.repeats, args.cap_s)))
        return
    rec = Recorder("aggregators", args.out)
    run = {"matmul_gflops": matmul_gflops(), "backend": jax.default_backend()}
    print(f"2048^2 f32 matmul: {run['matmul_gflops']:.1f} GFLOP/s", flush=True)
    for d in args.d:
        for m in args.M:
            for name in args.aggregators:
                row = {"aggregator": name, "M": m, "d": d, "stack_gb": 4 * m * d / 1e9}
                if row["stack_gb"] > args.max_stack_gb:
                    row["skipped"] = f"stack over {args.max_stack_gb} GB"
                else:
                    cmd = [sys.executable, __file__, "--one", name, str(m), str(d)]
                    cmd += ["--repeats", str(args.repeats), "--cap-s", str(args.cap_s)]
                    try:
                        out = subprocess.run(
                            cmd, capture_output=True, text=True, check=True,
                            timeout=3 * args.cap_s,
                        )  # fmt: skip
                        row.update(json.loads(out.stdout.strip().splitlines()[-1]))
                    except subprocess.TimeoutExpired:
                        row["skipped"] = f"killed after {3 * args.cap_s:.0f} s"
                    except subprocess.CalledProcessError as e:
                        row["skipped"] = e.stderr.strip().splitlines()[-1]
                rec.add(f"{name} M={m} d={d}", **run, **row)
                rec.write()
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
