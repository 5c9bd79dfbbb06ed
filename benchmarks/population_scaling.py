"""Seconds per round and peak RSS vs population size at a fixed cohort (issue 20).

W1's model and local work (FedAvg, MLP 784-200-200-10, 10 local steps of batch 32,
`ClientMap("map", 1)`), a cohort of M = 1000 clients per round, 20 examples per client.
Three ways of holding the population:

  device      the whole population on device, float32 `[C, 20, 784]` (`simulate`'s path:
              `_compiled_chunk`, one round per chunk)
  disk        a memory-mapped uint8 store on disk (15.7 kB per client; prefixes of one
              written file give the smaller populations), cohorts drawn by the algorithm
              (`AlgorithmCohorts`, bitwise the device run's cohorts), rows gathered by the
              prefetch thread and decoded on device (`simulate_streamed`)
  procedural  rows generated on device from `(seed, client id)` (`UniformClassification`),
              cohorts drawn on the host in O(M) (`UniformCohorts`)

Every measurement runs in its own process (peak RSS = that process's `ru_maxrss`, which
includes the memory-mapped pages it touched). Round time = median wall time of the rounds
after the first (the first includes compilation).

Usage:
  nice python benchmarks/population_scaling.py write --store /work/popstore --clients 2000000
  nice python benchmarks/population_scaling.py run --source disk --store /work/popstore \\
      --clients 100000 --rounds 4
  nice python benchmarks/population_scaling.py all --store /work/popstore \\
      --out benchmarks/results/population_scaling.json
  nice python benchmarks/population_scaling.py pair --store /work/popstore \\
      --out benchmarks/results/population_pairs.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

from fedjax_sim.app.bench.results import Recorder

COHORT = 1000
PER_CLIENT = 20
DIM = 784
CLASSES = 10


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def write(args) -> None:
    from fedjax_sim.data.store import write_client_store

    def fill(ids):
        rng = np.random.default_rng(int(ids[0]))
        x = np.frombuffer(rng.bytes(ids.size * PER_CLIENT * DIM), np.uint8)
        y = rng.integers(0, CLASSES, (ids.size, PER_CLIENT), dtype=np.int32)
        return x.reshape(ids.size, PER_CLIENT, DIM), y, np.full(ids.size, PER_CLIENT)

    t0 = time.perf_counter()
    write_client_store(
        args.store,
        args.clients,
        PER_CLIENT,
        (DIM,),
        fill,
        num_classes=CLASSES,
        dequantize=1 / 255,
        block=16384,
    )
    print(json.dumps({"wrote": args.clients, "seconds": time.perf_counter() - t0}))


def run(args) -> dict:
    import jax

    from fedjax_sim.algorithms import CohortSpec, LocalSpec, fedavg
    from fedjax_sim.data.procedural import Population, UniformClassification
    from fedjax_sim.data.store import ClientStore
    from fedjax_sim.models import mlp
    from fedjax_sim.run.simulate import EvalSpec, _compiled_chunk
    from fedjax_sim.run.streaming import AlgorithmCohorts, UniformCohorts, simulate_streamed
    from fedjax_sim.runtime.parallel import ClientMap

    rss0 = _rss_gib()
    key = jax.random.key(0)
    model = mlp((DIM,), CLASSES, hidden=(200, 200))
    local = LocalSpec(steps=10, batch_size=32)
    cmap = ClientMap("map", 1)
    c = args.clients
    out = {"source": args.source, "clients": c, "cohort": COHORT, "rounds": args.rounds}
    if args.source == "device":
        from fedjax_sim.app.bench import workloads

        w = workloads.preset("W1").replace(clients=c, per_client=PER_CLIENT)
        data = workloads.make_data(w)
        alg = fedavg(
            model.loss,
            client_optimizer=0.05,
            local=local,
            cohort=CohortSpec(size=COHORT),
            client_map=cmap,
        )
        state = alg.init(model.init(key), key)
        run_chunk = _compiled_chunk(alg, 1)
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            state, m = run_chunk(state, data, key, 1)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t0)
        out["data_bytes_on_device"] = int(data.x.nbytes + data.y.nbytes)
    else:
        if args.source == "disk":
            source = ClientStore.open(args.store, num_clients=c)
            if args.cold:  # drop this file's cached pages: cohort rows come from the disk
                for name in ("x", "y"):
                    fd = os.open(os.path.join(args.store, f"{name}.bin"), os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
            cohort = CohortSpec(size=COHORT)
            plan = AlgorithmCohorts(cohort, source.counts)
            out["store_bytes"] = int(c * source.row_bytes)
        else:
            source = Population(UniformClassification(DIM, CLASSES, PER_CLIENT), c)
            cohort = CohortSpec()  # the algorithm sees the cohort as its population
            plan = UniformCohorts(c, COHORT)
        alg = fedavg(model.loss, client_optimizer=0.05, local=local, cohort=cohort, client_map=cmap)
        h = simulate_streamed(
            alg,
            source,
            key,
            plan=plan,
            model=model,
            num_rounds=args.rounds,
            evaluation=EvalSpec(every=1, clients=False),
            progress=False,
        )
        st = h.meta["streaming"]
        times = st.pop("chunk_seconds")
        out["streaming"] = st
        steady = max(1, st["chunks"] - 1)
        out["prefetch_seconds_per_round"] = (
            st["prefetch_seconds"] - st["first_chunk_seconds"]
        ) / steady
        out["stall_seconds_per_round"] = st["stall_seconds"] / steady
    out["first_round_seconds"] = times[0]
    out["seconds_per_round"] = statistics.median(times[1:]) if len(times) > 1 else times[0]
    out["round_seconds"] = times
    out["rss_after_imports_gib"] = rss0
    out["peak_rss_gib"] = _rss_gib()
    print(json.dumps(out), flush=True)
    return out


def pair(args) -> None:
    """Device vs disk in ONE process, alternating blocks of rounds (same load for both):
    per population size, `reps` x (3 device rounds, 4 streamed rounds of which the last 3
    are timed: the first waits for its data, which nothing can hide)."""
    import jax

    from fedjax_sim.algorithms import CohortSpec, LocalSpec, fedavg
    from fedjax_sim.app.bench import workloads
    from fedjax_sim.data.store import ClientStore
    from fedjax_sim.models import mlp
    from fedjax_sim.run.simulate import EvalSpec, _compiled_chunk
    from fedjax_sim.run.streaming import AlgorithmCohorts, simulate_streamed
    from fedjax_sim.runtime.parallel import ClientMap

    key = jax.random.key(0)
    model = mlp((DIM,), CLASSES, hidden=(200, 200))
    cohort = CohortSpec(size=COHORT)
    alg = fedavg(
        model.loss,
        client_optimizer=0.05,
        local=LocalSpec(steps=10, batch_size=32),
        cohort=cohort,
        client_map=ClientMap("map", 1),
    )
    rec = Recorder("population_pairs", args.out)
    for c in args.clients:
        data = workloads.make_data(workloads.preset("W1").replace(clients=c, per_client=PER_CLIENT))
        store = ClientStore.open(args.store, num_clients=c)
        plan = AlgorithmCohorts(cohort, store.counts)
        run_chunk = _compiled_chunk(alg, 1)
        state = alg.init(model.init(key), key)
        kw = dict(
            plan=plan, model=model, evaluation=EvalSpec(every=1, clients=False), progress=False
        )
        state, _ = jax.block_until_ready(run_chunk(state, data, key, 1))  # donates state
        simulate_streamed(alg, store, key, num_rounds=1, **kw)
        dev, stream, prefetch, stall = [], [], [], []
        for _ in range(args.reps):
            for _ in range(3):
                t0 = time.perf_counter()
                state, m = run_chunk(state, data, key, 1)
                jax.block_until_ready(m)
                dev.append(time.perf_counter() - t0)
            st = simulate_streamed(alg, store, key, num_rounds=4, **kw).meta["streaming"]
            stream += st["chunk_seconds"][1:]
            prefetch.append((st["prefetch_seconds"] - st["first_chunk_seconds"]) / 3)
            stall.append(st["stall_seconds"] / 3)
        row = {
            "clients": c,
            "device_seconds_per_round": statistics.median(dev),
            "disk_seconds_per_round": statistics.median(stream),
            "ratio": statistics.median(stream) / statistics.median(dev),
            "prefetch_seconds_per_round": statistics.median(prefetch),
            "stall_seconds_per_round": statistics.median(stall),
            "device_rounds": dev,
            "disk_rounds": stream,
            "reps": args.reps,
        }
        print(json.dumps(row), flush=True)
        del data
        rec.add(f"C={c}", **row)
        rec.write()


CASES = [
    ("device", 1000),
    ("device", 10_000),
    ("device", 100_000),
    ("disk", 1000),
    ("disk", 10_000),
    ("disk", 100_000),
    ("disk", 1_000_000),
    ("disk", 2_000_000),
    ("procedural", 1000),
    ("procedural", 1_000_000),
    ("procedural", 1_000_000_000),
]


def run_all(args) -> None:
    """Every case in its own process, `passes` times (forward then reverse order, so the
    load of a shared machine hits every case alike); the summary takes the median."""
    rec = Recorder("population_scaling", args.out, machine=False)
    results = []
    order = []
    for p in range(args.passes):
        order += CASES if p % 2 == 0 else CASES[::-1]
    for source, c in order:
        if args.only and source not in args.only:
            continue
        cmd = [
            sys.executable,
            __file__,
            "run",
            "--source",
            source,
            "--clients",
            str(c),
            "--rounds",
            str(args.rounds),
            "--store",
            args.store,
        ]
        if source == "disk" and c == max(n for s, n in CASES if s == "disk"):
            cmd.append("--cold")
        print(" ".join(cmd), file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            print(proc.stderr[-3000:], file=sys.stderr)
            results.append({"source": source, "clients": c, "error": proc.stderr[-500:]})
            continue
        results.append(json.loads(lines[-1]))
        r = results[-1]
        print(
            f"{source:>10} C={c:>13,}  {r['seconds_per_round']:.2f} s/round  "
            f"peak RSS {r['peak_rss_gib']:.2f} GiB",
            file=sys.stderr,
            flush=True,
        )
    for row in summarize(results):
        print(json.dumps(row), file=sys.stderr)
        case = (row["source"], row["clients"])
        cases = [r for r in results if (r["source"], r["clients"]) == case]
        rec.add(f"{row['source']} C={row['clients']}", **row, rounds=args.rounds, cases=cases)
    rec.write()


def summarize(results: list[dict]) -> list[dict]:
    """Per (source, clients): median s/round over passes, max peak RSS, median overlap."""
    rows = []
    for source, c in CASES:
        rs = [r for r in results if (r["source"], r["clients"]) == (source, c) and "error" not in r]
        if not rs:
            continue
        row = {
            "source": source,
            "clients": c,
            "passes": len(rs),
            "seconds_per_round": statistics.median(r["seconds_per_round"] for r in rs),
            "all_round_seconds": [r["round_seconds"][1:] for r in rs],
            "peak_rss_gib": max(r["peak_rss_gib"] for r in rs),
        }
        if source != "device":
            row["prefetch_seconds_per_round"] = statistics.median(
                r["prefetch_seconds_per_round"] for r in rs
            )
            row["stall_seconds_per_round"] = statistics.median(
                r["stall_seconds_per_round"] for r in rs
            )
            row["overlap"] = statistics.median(r["streaming"]["overlap"] for r in rs)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--store", required=True)
    w.add_argument("--clients", type=int, default=2_000_000)
    r = sub.add_parser("run")
    r.add_argument("--source", choices=("device", "disk", "procedural"), required=True)
    r.add_argument("--clients", type=int, required=True)
    r.add_argument("--rounds", type=int, default=4)
    r.add_argument("--store", default="/work/popstore")
    r.add_argument("--cold", action="store_true")
    a = sub.add_parser("all")
    a.add_argument("--store", default="/work/popstore")
    a.add_argument("--rounds", type=int, default=4)
    a.add_argument("--only", nargs="*")
    a.add_argument("--passes", type=int, default=2)
    a.add_argument("--out")
    q = sub.add_parser("pair")
    q.add_argument("--store", default="/work/popstore")
    q.add_argument("--clients", type=int, nargs="*", default=[1000, 10_000, 100_000])
    q.add_argument("--reps", type=int, default=3)
    q.add_argument("--out")
    args = p.parse_args()
    {"write": write, "run": run, "all": run_all, "pair": pair}[args.cmd](args)


if __name__ == "__main__":
    main()
