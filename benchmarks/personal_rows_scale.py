"""Ditto (a full personal model per client) at 10^3 vs 10^5 clients with host state rows in a
memory-mapped store: peak RSS and seconds per round at the same cohort (issue 37 item 6).

Workload: MLP 64-32-10 (2,410 parameters: a personal model is 9.6 kB per client), 20
examples of 64 uint8 features per client in an on-disk `ClientStore` (read with `pread`,
so data pages do not count in the resident set), Ditto (lam 0.1) with cohorts of `--cohort`
clients, `--local` local steps of batch 10, chunks of `--every` rounds,
`simulate_streamed(state_rows="host", rows_dir=<temp dir>)`: the C personal models live in a
memory-mapped file, written block by block at init (`streaming.init_blocks`), and each chunk
gets the rows of the clients it touches.

Every population size runs in its own process (`run`); peak RSS is that process's
`ru_maxrss` (`resource.getrusage`), also sampled after imports and after building the data
store. Round time = the median chunk time after the first chunk (wall, incl. any wait for
data) / rounds per chunk. `all` runs the sizes alternately `--repeats` times and records per
size the median round time and the largest peak RSS of its runs. `rows_bytes` is the rows'
files' size, `rows_bytes_allocated` their blocks on disk. The machine's 1-minute load
average is in each row (`load`).

Usage:
  nice python benchmarks/personal_rows_scale.py all [--clients 1000 100000] [--rounds 60]
      [--repeats 2]
  nice python benchmarks/personal_rows_scale.py run --clients 100000   # one size, JSON out

One row per population size (label `ditto C=... cohort=... local=... every=...`) in
benchmarks/results/personal_rows_scale.jsonl (`--out` elsewhere), and a `summary` row with
the ratios of the largest to the smallest population.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from fedjax_sim.app.bench.results import Recorder

PER_CLIENT, DIM, CLASSES, HIDDEN = 20, 64, 10, 32


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _disk(path: str) -> tuple[int, int]:
    """(apparent, allocated) bytes of the files under `path`."""
    size = alloc = 0
    for root, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(root, f))
            size, alloc = size + st.st_size, alloc + st.st_blocks * 512
    return size, alloc


def run(a) -> dict:
    import jax

    from fedjax_sim import EvalSpec
    from fedjax_sim.algorithms import CohortSpec, LocalSpec, ditto
    from fedjax_sim.data.store import write_client_store
    from fedjax_sim.models import mlp
    from fedjax_sim.run.streaming import AlgorithmCohorts, simulate_streamed

    rss_imports = _rss_mib()
    c = a.clients
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:

        def fill(ids):
            rng = np.random.default_rng(int(ids[0]))
            x = np.frombuffer(rng.bytes(ids.size * PER_CLIENT * DIM), np.uint8)
            y = rng.integers(0, CLASSES, (ids.size, PER_CLIENT), dtype=np.int32)
            return x.reshape(ids.size, PER_CLIENT, DIM), y, np.full(ids.size, PER_CLIENT)

        t0 = time.perf_counter()
        store = write_client_store(
            os.path.join(tmp, "data"),
            c,
            PER_CLIENT,
            (DIM,),
            fill,
            num_classes=CLASSES,
            dequantize=1 / 255,
            block=4096,
            progress=False,
        )
        data_seconds = time.perf_counter() - t0
        rss_data = _rss_mib()
        model = mlp((DIM,), CLASSES, hidden=(HIDDEN,))
        cohort = CohortSpec(size=a.cohort)
        alg = ditto(
            model.loss,
            num_clients=c,
            cohort=cohort,
            local=LocalSpec(steps=a.local, batch_size=10),
        )
        rows_dir = os.path.join(tmp, "rows")
        t0 = time.perf_counter()
        h = simulate_streamed(
            alg,
            store,
            jax.random.key(0),
            plan=AlgorithmCohorts(cohort, store.counts),
            model=model,
            num_rounds=a.rounds,
            evaluation=EvalSpec(every=a.every, clients=False),
            progress=False,
            state_rows="host",
            rows_dir=rows_dir,
        )
        run_seconds = time.perf_counter() - t0
        rows_bytes, rows_alloc = _disk(rows_dir)
        data_bytes = _disk(os.path.join(tmp, "data"))[0]
    s = h.meta["streaming"]
    chunks = s.pop("chunk_seconds")
    loss = [float(v) for v in np.asarray(h.metrics["train_loss"]).reshape(-1)]
    out = {
        "clients": c,
        "cohort": a.cohort,
        "local": a.local,
        "every": a.every,
        "rounds": a.rounds,
        "params": int(sum(np.size(p) for p in jax.tree.leaves(model.init(jax.random.key(0))))),
        "s_per_round": statistics.median(chunks[1:]) / a.every,
        "first_chunk_s": chunks[0],
        "chunk_s": chunks,
        "run_s": run_seconds,
        "data_write_s": data_seconds,
        "rows_bytes": rows_bytes,
        "rows_bytes_allocated": rows_alloc,
        "data_bytes": data_bytes,
        "rss_after_imports_mib": rss_imports,
        "rss_after_data_mib": rss_data,
        "peak_rss_mib": _rss_mib(),
        "train_loss_first_last": [loss[0], loss[-1]],
        "streaming": s,
    }
    print(json.dumps(out), flush=True)
    return out


def all_(a) -> None:
    rec = Recorder("personal_rows_scale", a.out)
    runs: dict[int, list[dict]] = {c: [] for c in a.clients}
    for _ in range(a.repeats):  # the sizes alternate: a shared machine's load hits both
        for c in a.clients:
            cmd = [sys.executable, __file__, "run", "--clients", str(c)]
            for k in ("cohort", "local", "every", "rounds"):
                cmd += [f"--{k}", str(getattr(a, k))]
            if a.tmp:
                cmd += ["--tmp", a.tmp]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                sys.exit(f"{cmd} failed:\n{done.stderr[-4000:]}")
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps({k: v for k, v in r.items() if k not in ("chunk_s", "streaming")}))
            runs[c].append(r)
    rows = {}
    for c, rs in runs.items():
        rows[c] = {
            **rs[-1],
            "repeats": len(rs),
            "s_per_round": statistics.median(r["s_per_round"] for r in rs),
            "s_per_round_runs": [r["s_per_round"] for r in rs],
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
            "peak_rss_mib_runs": [r["peak_rss_mib"] for r in rs],
            "first_chunk_s": statistics.median(r["first_chunk_s"] for r in rs),
        }
        rec.add(f"ditto C={c} cohort={a.cohort} local={a.local} every={a.every}", **rows[c])
    lo, hi = rows[min(rows)], rows[max(rows)]
    summary = {
        "clients": [min(rows), max(rows)],
        "peak_rss_ratio": hi["peak_rss_mib"] / lo["peak_rss_mib"],
        "s_per_round_ratio": hi["s_per_round"] / lo["s_per_round"],
        "rows_bytes_ratio": hi["rows_bytes"] / lo["rows_bytes"],
    }
    print(json.dumps(summary))
    rec.add(f"ditto summary C={min(rows)} vs {max(rows)}", kind="summary", **summary)
    rec.write()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["run", "all"])
    p.add_argument("--clients", type=int, nargs="+", default=[1000, 100_000])
    p.add_argument("--cohort", type=int, default=50)
    p.add_argument("--local", type=int, default=5)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2, help="runs per size (all)")
    p.add_argument("--tmp", help="directory for the data and rows stores (default: system tmp)")
    p.add_argument(
        "--out", help="JSON lines (default benchmarks/results/personal_rows_scale.jsonl)"
    )
    a = p.parse_args()
    if a.what == "run":
        a.clients = a.clients[0]
        run(a)
    else:
        all_(a)


if __name__ == "__main__":
    main()
