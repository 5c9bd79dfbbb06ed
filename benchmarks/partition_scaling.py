"""Partitioning at scale: JAX device partitioners over 10^6 clients x 10^7 examples.

For each partitioner (iid, dirichlet, shards, quantity_skew) reports the first call (compile +
run) and the warm time, the client sizes, the padding waste `sum_i (N_max - n_i)` of one padded
array, and the waste after bucketing clients by size (`size_buckets`, optimal contiguous
buckets). Also times the NumPy reference partitioners at the same scale and Fashion-MNIST loads
(first = parse + partition + write the cache; later = read the cache).

    PYTHONPATH=. nice -n 10 python benchmarks/partition_scaling.py

Rows (`device <partitioner>`, `numpy <partitioner>`, `fashion_mnist`) go to
benchmarks/results/partition_scaling.jsonl (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np

from fedjax_sim.app.bench.results import Recorder
from fedjax_sim.data import buckets, jax_partition, load_fashion_mnist

numpy_partition = importlib.import_module("fedjax_sim.data.partition")  # module, not function

SETTINGS = {
    "iid": {},
    "dirichlet": {"alpha": 0.5, "num_classes": 10},
    "shards": {"per_client": 2, "num_classes": 10},
    "quantity_skew": {"sigma": 1.0, "min_size": 1},
}


def timed(fn):
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def bench_device(n: int, c: int, repeats: int, num_buckets: tuple[int, ...]) -> dict:
    labels = jax.random.randint(jax.random.key(123), (n,), 0, 10, dtype=np.int32)
    rows = {}
    for name, kw in SETTINGS.items():
        run = lambda seed: jax_partition.partition(name, jax.random.key(seed), labels, c, **kw)
        ids, first = timed(lambda: run(0))
        warm = [timed(lambda s=s: run(s))[1] for s in range(1, repeats + 1)]
        counts, t_counts = timed(lambda: jax_partition.client_counts(ids, c))
        counts = np.asarray(counts)
        row = {
            "first_call_s": round(first, 2),
            "warm_s_median": round(statistics.median(warm), 2),
            "warm_s_all": [round(w, 2) for w in warm],
            "counts_s": round(t_counts, 3),
            "examples": int(counts.sum()),
            "n_max": int(counts.max()),
            "n_min": int(counts.min()),
            "empty_clients": int((counts == 0).sum()),
            "padding_waste": jax_partition.padding_waste(counts),
        }
        for b in num_buckets:
            start = time.perf_counter()
            bk = buckets.size_buckets(counts, b)
            row[f"waste_{b}_buckets"] = bk.waste
            row[f"bucket_max_{b}"] = bk.max_counts.tolist()
            row[f"size_buckets_{b}_s"] = round(time.perf_counter() - start, 3)
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    return rows


def bench_numpy(n: int, c: int) -> dict:
    labels = np.random.default_rng(0).integers(0, 10, n).astype(np.int32)
    rows = {}
    for name, kw in SETTINGS.items():
        kw = {k: v for k, v in kw.items() if k != "num_classes"}
        start = time.perf_counter()
        numpy_partition.partition(name, labels, c, 0, **kw)
        rows[name] = {"seconds": round(time.perf_counter() - start, 2)}
        print("numpy", name, rows[name], flush=True)
    return rows


def bench_fashion_mnist(repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as cache_dir:
        start = time.perf_counter()
        jax.block_until_ready(load_fashion_mnist(cache_dir=cache_dir))
        first = time.perf_counter() - start
        later, later_cpu = [], []
        for _ in range(repeats):
            start, cpu = time.perf_counter(), time.process_time()
            ds = jax.block_until_ready(load_fashion_mnist(cache_dir=cache_dir))
            later.append(time.perf_counter() - start)
            later_cpu.append(time.process_time() - cpu)
        size = sum(
            os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(cache_dir) for f in fs
        )
    row = {
        "first_load_s": round(first, 2),
        "cached_load_s": [round(t, 3) for t in later],
        "cached_load_cpu_s": [round(t, 3) for t in later_cpu],  # all threads of this process
        "cache_mb": round(size / 2**20, 1),
        "train_shape": list(ds.train.x.shape),
    }
    print("fashion_mnist", row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=float, default=1e7)
    parser.add_argument("--clients", type=float, default=1e6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--buckets", type=int, nargs="*", default=[4, 8, 16])
    parser.add_argument("--skip-numpy", action="store_true")
    parser.add_argument("--skip-fashion-mnist", action="store_true")
    parser.add_argument("--out", help="default benchmarks/results/partition_scaling.jsonl")
    args = parser.parse_args()
    n, c = int(args.examples), int(args.clients)
    rec = Recorder("partition_scaling", args.out)
    scale = {"examples": n, "clients": c}
    for name, row in bench_device(n, c, args.repeats, tuple(args.buckets)).items():
        rec.add(f"device {name}", source="device", partitioner=name, **scale, **row)
    rec.write()
    if not args.skip_numpy:
        for name, row in bench_numpy(n, c).items():
            rec.add(f"numpy {name}", source="numpy", partitioner=name, **scale, **row)
        rec.write()
    if not args.skip_fashion_mnist and os.path.isdir("/usr/share/datasets/fashion-mnist"):
        rec.add("fashion_mnist", source="fashion_mnist", **bench_fashion_mnist(args.repeats + 1))
        rec.write()


if __name__ == "__main__":
    main()
