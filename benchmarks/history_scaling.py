"""Run-length scaling of `fedjax-sim run` (issue 19): wall time of the default job at several
round counts, and a long soak with the process's memory (VmRSS) and progress (rows of the
append-only history.csv) sampled every `--sample-s` seconds.

    PYTHONPATH=$PWD nice -n 5 python benchmarks/history_scaling.py --rounds 2000 20000
    PYTHONPATH=$PWD nice -n 5 python benchmarks/history_scaling.py --rounds 100000 --sample-s 10

Rows (one per round count; a re-run replaces the rows of the counts it measures) go to
benchmarks/results/history_scaling.jsonl (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from fedjax_sim.app.bench.results import Recorder
from fedjax_sim.app.bench.suites import rss_of


def run(rounds: int, sample_s: float, extra: list[str]) -> dict:
    """One `fedjax-sim run --rounds N` in a fresh folder; samples (t, rss, rows written)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "fedjax_sim", "run", "--rounds", str(rounds)]
        cmd += ["--no-progress", "--out", out, *extra]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        samples = []
        csv_path = os.path.join(out, "history.csv")
        while proc.poll() is None:
            time.sleep(sample_s)
            rows = 0
            if os.path.exists(csv_path):
                with open(csv_path, "rb") as f:
                    rows = max(0, sum(1 for _ in f) - 2)  # header and round 0
            samples.append((round(time.perf_counter() - t0, 1), rss_of(proc.pid), rows))
        wall = time.perf_counter() - t0
        stdout, stderr = proc.communicate()
        with open(os.path.join(out, "history.json")) as f:
            seconds = json.load(f)["meta"]["seconds"]
    if proc.returncode:
        raise RuntimeError(f"rounds={rounds}: exit {proc.returncode}: {stderr[-2000:]}")
    return {
        "rounds": rounds,
        "wall_s": wall,
        "simulate_s": seconds,
        "final_line": stdout.strip().splitlines()[-1],
        "samples": samples,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, nargs="+", default=[2000, 20000])
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--out", help="JSON lines (default benchmarks/results/history_scaling.jsonl)")
    p.add_argument("extra", nargs="*", help="more fedjax-sim run flags (after --)")
    args = p.parse_args()
    rec = Recorder("history_scaling", args.out, machine=False)
    for rounds in args.rounds:
        row = run(rounds, args.sample_s, args.extra)
        print(json.dumps({k: v for k, v in row.items() if k != "samples"}), flush=True)
        rec.add(f"{rounds} rounds", **row, sample_s=args.sample_s)
        rec.write()


if __name__ == "__main__":
    main()
