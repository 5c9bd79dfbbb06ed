"""One FedAvg round of workload W1, measured side by side in one run.

W1: 1000 clients x 10 local steps x batch 32, MLP 784-200-200-10, random data (100 examples
per client), full participation. Engine modes: `vmap`, `map(batch_size=k)`; baseline: a
per-client Python loop over a jitted client update (how sequential simulators work).
Reports compile time, seconds/round (median and min of `--repeats` rounds), client-steps/s
and the roofline ratio as rows in benchmarks/results/round_throughput.jsonl (`--out`
elsewhere), in one process (for isolated
measurements with peak memory per configuration use `fedjax-sim bench --suite modes
baselines`, which runs the same measurements through `fedjax_sim.app.bench`).

    python benchmarks/round_throughput.py --skip-vmap --map-batch 1 5
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from fedjax_sim.app.bench import measure, runner
from fedjax_sim.app.bench.results import Recorder, now
from fedjax_sim.app.bench.workloads import PRESETS
from fedjax_sim.data import FederatedData


def make_data(num_clients: int, per_client: int, seed: int = 0) -> FederatedData:
    rng = np.random.default_rng(seed)
    x = rng.random((num_clients, per_client, 784), dtype=np.float32)
    y = rng.integers(0, 10, (num_clients, per_client)).astype(np.int32)
    return FederatedData.create(x, y, np.full(num_clients, per_client, np.int32), num_classes=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--per-client", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--map-batch", type=int, nargs="+", default=[1, 5, 10, 25])
    parser.add_argument("--skip-vmap", action="store_true")
    parser.add_argument("--out", help="default benchmarks/results/round_throughput.jsonl")
    args = parser.parse_args()
    rec = Recorder("round_throughput", args.out)

    w = PRESETS["W1"].replace(
        clients=args.clients,
        local_steps=args.steps,
        batch_size=args.batch,
        per_client=args.per_client,
    )
    peak = measure.matmul_peak()
    modes = [] if args.skip_vmap else [w.replace(mode="vmap", map_batch=None)]
    modes += [w.replace(mode="map", map_batch=b) for b in args.map_batch]
    rows = []
    for v in modes:
        rows.append(
            runner.measure_engine(
                v, repeats=args.repeats, suite="W1", label=v.mode_label, peak=peak
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    loop = runner.measure_loop(w, repeats=args.repeats, suite="W1", peak=peak)
    print(json.dumps(loop), flush=True)
    best = min(rows, key=lambda r: r["round_s_median"]) if rows else loop
    summary = {
        "kind": "summary",
        "label": "summary",
        "time": now(),
        "best_mode": best["label"],
        "speedup_vs_loop": loop["round_s_median"] / best["round_s_median"],
    }
    print(json.dumps(summary))
    for row in [*rows, loop, summary]:
        rec.add_row(row)
    rec.write()


if __name__ == "__main__":
    main()
