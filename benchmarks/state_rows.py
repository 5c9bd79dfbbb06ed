"""Seconds per round of a streamed SCAFFOLD run with its per-client state rows on the device
vs on the host (`simulate_streamed(state_rows=...)`, issue 20), at a population where both fit.

Workload: W1's model (MLP 784-200-200-10, 199,210 parameters: a SCAFFOLD control variate
is 0.8 MB per client), 20 examples of 784 uint8 features per client in a host store,
`local` steps of batch 32, cohorts of `cohort` clients, chunks of `every` rounds. The two
modes alternate in one process (`--repeats` times each, after one compiling run each), so a
shared machine's load hits both alike. Round time = the median over the chunks after the
first of a run (`StreamStats.chunk_seconds`, wall time including any wait for data) divided
by the chunk length. Also reported for host rows: row bytes per round each way, the time the
main loop spent writing rows back (overlapping the next chunk's compute), the wait for the
prefetched rows and `StreamStats.overlap`. Histories of the two modes are checked equal.

Usage:
  nice python benchmarks/state_rows.py [--clients 2000] [--cohort 100] [--local 10]
      [--every 3] [--rounds 12] [--repeats 3]

One row per configuration (label `C=... cohort=... local=... every=...`; a re-run replaces
the row of its configuration) in
benchmarks/results/state_rows.jsonl (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import numpy as np

from fedjax_sim import EvalSpec
from fedjax_sim.algorithms import CohortSpec, LocalSpec, scaffold
from fedjax_sim.app.bench.results import Recorder
from fedjax_sim.data.store import ClientStore, Dequantize, HostStore
from fedjax_sim.models import mlp
from fedjax_sim.run.streaming import AlgorithmCohorts, simulate_streamed
from fedjax_sim.runtime.parallel import ClientMap

PER_CLIENT, DIM, CLASSES = 20, 784, 10


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=2000)
    p.add_argument("--cohort", type=int, default=100)
    p.add_argument("--local", type=int, default=10)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="JSON lines (default benchmarks/results/state_rows.jsonl)")
    a = p.parse_args()
    rec = Recorder("state_rows", a.out)

    rng = np.random.default_rng(0)
    x = np.frombuffer(rng.bytes(a.clients * PER_CLIENT * DIM), np.uint8)
    y = rng.integers(0, CLASSES, (a.clients, PER_CLIENT), dtype=np.int32)
    rows = HostStore({"x": x.reshape(a.clients, PER_CLIENT, DIM), "y": y})
    store = ClientStore(rows, np.full(a.clients, PER_CLIENT), CLASSES, Dequantize())
    model = mlp((DIM,), CLASSES, hidden=(200, 200))
    cohort = CohortSpec(size=a.cohort)
    alg = scaffold(
        model.loss,
        num_clients=a.clients,
        cohort=cohort,
        local=LocalSpec(steps=a.local, batch_size=32),
        client_map=ClientMap("map", 1),
    )
    plan = AlgorithmCohorts(cohort, store.counts)
    key = jax.random.key(0)

    def run(state_rows: str):
        h = simulate_streamed(
            alg,
            store,
            key,
            plan=plan,
            model=model,
            num_rounds=a.rounds,
            evaluation=EvalSpec(every=a.every, clients=False),
            progress=False,
            state_rows=state_rows,
        )
        s = h.meta["streaming"]
        per_round = statistics.median(s["chunk_seconds"][1:]) / a.every
        return h, per_round, s

    reference = {m: run(m)[0] for m in ("device", "host")}  # compiles
    for k in reference["device"].metrics:
        np.testing.assert_array_equal(
            np.asarray(reference["device"].metrics[k]), np.asarray(reference["host"].metrics[k])
        )
    times: dict[str, list[float]] = {"device": [], "host": []}
    stats: dict[str, list[dict]] = {"device": [], "host": []}
    for _ in range(a.repeats):
        for mode in ("device", "host"):
            _, t, s = run(mode)
            times[mode].append(t)
            stats[mode].append(s)
    host_stats = stats["host"]
    data_bytes = stats["device"][0]["bytes_sent"]  # ids and data rows, the same in both modes
    dev, host = statistics.median(times["device"]), statistics.median(times["host"])
    rounds = a.rounds
    result = {
        "args": vars(a),
        "device_s_per_round": times["device"],
        "host_s_per_round": times["host"],
        "median_device": dev,
        "median_host": host,
        "host_over_device": host / dev,
        "row_mb_sent_per_round": statistics.median(
            (s["bytes_sent"] - data_bytes) / rounds / 2**20 for s in host_stats
        ),
        "row_mb_returned_per_round": statistics.median(
            s["bytes_returned"] / rounds / 2**20 for s in host_stats
        ),
        "writeback_s_per_round": statistics.median(
            s["writeback_seconds"] / rounds for s in host_stats
        ),
        "stall_s_per_round": statistics.median(s["stall_seconds"] / rounds for s in host_stats),
        "prefetch_s_per_round": statistics.median(
            s["prefetch_seconds"] / rounds for s in host_stats
        ),
        "overlap": statistics.median(s["overlap"] for s in host_stats),
    }
    print(json.dumps(result, indent=1))
    rec.add(f"C={a.clients} cohort={a.cohort} local={a.local} every={a.every}", **result)
    rec.write()


if __name__ == "__main__":
    main()
