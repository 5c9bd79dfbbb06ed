"""Where a sweep's round spends its time: XLA:CPU op times of the default digits job from a
`jax.profiler` (perfetto) trace, summed per HLO op over `--rounds` rounds of R runs.

    PYTHONPATH=$PWD python benchmarks/sweep_profile.py --runs 1 16

Nested events (a `while` contains its body's ops) are listed as they are, so the rows do not
sum to the total; the dots and fusions inside the local steps are the leaves to read. The
HLO names are those of `XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text` dumps. Rows (one
per R: the top ops) go to benchmarks/results/sweep_profile.jsonl (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile

os.environ.setdefault("FEDJAX_SIM_AUTOTUNE", "0")  # the static client map: reproducible


def profile(runs: int, rounds: int, top: int) -> list[tuple[str, float, int]]:
    """`(HLO op, total ms, calls)` of one sweep of `runs` runs x `rounds` rounds."""
    import jax

    from fedjax_sim.app.config import RunConfig, build_run
    from fedjax_sim.run.simulate import EvalSpec
    from fedjax_sim.run.sweep import sweep

    dataset, model, alg, _ = build_run(RunConfig())

    def make(hp):
        return alg

    kw = dict(
        seeds=range(runs),
        model=model,
        num_rounds=rounds,
        evaluation=EvalSpec(every=10**6, clients=False),
        progress=False,
        runs_per_group=runs,
    )
    jax.block_until_ready(sweep(make, dataset.train, **kw).states)  # compile
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(sweep(make, dataset.train, **kw).states)
        (path,) = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    total, calls = collections.Counter(), collections.Counter()
    host = ("$", "Thunk", "np.", "Slinky", "PjitFunction")
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(host):
            total[e["name"]] += e.get("dur", 0) / 1000
            calls[e["name"]] += 1
    return [(n, t, calls[n]) for n, t in total.most_common(top)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", help="JSON lines (default benchmarks/results/sweep_profile.jsonl)")
    args = ap.parse_args(argv)
    from fedjax_sim.app.bench.results import Recorder

    argv = sys.argv if argv is None else [sys.argv[0], *argv]
    rec = Recorder("sweep_profile", args.out, argv=argv)
    for r in args.runs:
        print(f"R = {r}: {args.rounds} rounds, top ops (ms total, calls)")
        ops = profile(r, args.rounds, args.top)
        for name, ms, n in ops:
            print(f"  {ms:9.1f} ms {n:6d}  {name}")
        top = [{"op": name, "ms": ms, "calls": n} for name, ms, n in ops]
        rec.add(f"R={r}", runs=r, rounds=args.rounds, top_ops=top)
        rec.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
