"""Before vs after a change, side by side in one sitting: the default job, W1 and a 16-run
sweep, each run alternately on the two checkouts (A B, B A, A B, ...), ratio after/before per pair.

    python benchmarks/no_slower.py --before 1ba5437 --pairs 5

`--before` is a git ref, checked out into a temporary worktree (removed at the end); "after"
is this checkout. Every measurement runs in a fresh process with the checkout on
`PYTHONPATH`, after one untimed warm-up per checkout (which also fills the client-map
autotune cache both share):

- `default`: `python -m fedjax_sim run` on the built-in default job (FedAvg, digits, 200
  rounds), the whole process's wall time (import, compile, run, files);
- `W1`: one FedAvg round of 1000 clients x 10 local steps x batch 32, MLP 784-200-200-10, map
  one client at a time: the median of `--repeats` compiled rounds inside the process;
- `sweep16`: `python -m fedjax_sim sweep --seeds 16 --rounds 50` on the default job, the whole
  process's wall time.

Rows (suite `no_slower`, label `<workload>`) carry both checkouts' times per pair, the ratios
and their median; the target is a median ratio <= 1.02 (within 2 % or faster). The W1 row
also says whether both checkouts compile W1's round to the same optimized program (XLA's
text without source locations, hashed): then any time difference is the machine's noise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fedjax_sim.app.bench.results import Recorder  # noqa: E402

# W1 inside one process, importable from both layouts (the benchmark harness moved to
# fedjax_sim.app.bench with the layered packages); prints seconds per round.
W1 = """
try:
    from fedjax_sim.app.bench import measure, workloads
except ImportError:
    from fedjax_sim.bench import measure, workloads
import statistics
b = workloads.build(workloads.PRESETS["W1"])
t = measure.time_round(b.algorithm.step, b.state, b.data, b.key, {repeats})
print("SECONDS", statistics.median(t["times"]))
"""


# W1's compiled round (8 clients: the same program structure) as text without source
# locations, hashed: equal hashes mean both checkouts run the same optimized program.
W1_HLO = """
import hashlib, re
try:
    from fedjax_sim.app.bench import workloads
except ImportError:
    from fedjax_sim.bench import workloads
import jax
b = workloads.build(workloads.PRESETS["W1"].replace(clients=8))
text = jax.jit(b.algorithm.step).lower(b.state, b.data, b.key).compile().as_text()
lines = [re.sub(r", metadata=\\{[^}]*\\}|stack_frame_id=[0-9]+", "", line)
         for line in text.splitlines() if not re.match(r'^[0-9]+ [{"]', line)]
print("HLO", hashlib.sha256("\\n".join(lines).encode()).hexdigest())
"""


def w1_program(tree: str) -> str:
    """Hash of W1's optimized program on the checkout `tree` (source locations removed)."""
    env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.run([sys.executable, "-c", W1_HLO], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"W1 program on {tree} failed:\n{proc.stderr[-2000:]}")
    return next(x.split()[1] for x in proc.stdout.splitlines() if x.startswith("HLO "))


def command(workload: str, out: str, repeats: int) -> list[str]:
    py = [sys.executable]
    if workload == "default":
        return py + ["-m", "fedjax_sim", "run", "--out", out, "--no-progress"]
    if workload == "sweep16":
        return (
            py
            + ["-m", "fedjax_sim", "sweep", "--seeds", "16", "--rounds", "50"]
            + [
                "--out",
                out,
                "--no-progress",
            ]
        )
    return py + ["-c", W1.format(repeats=repeats)]


def measure_once(tree: str, workload: str, repeats: int) -> float:
    """Seconds of one measurement of `workload` on the checkout `tree`."""
    out = tempfile.mkdtemp(prefix="no_slower_")
    env = {**os.environ, "PYTHONPATH": tree}
    try:
        t0 = time.perf_counter()
        proc = subprocess.run(
            command(workload, out, repeats), env=env, cwd=out, capture_output=True, text=True
        )
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{workload} on {tree} failed:\n{proc.stderr[-2000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("SECONDS "):
            return float(line.split()[1])
    return wall


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="git ref of the 'before' checkout")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="W1 rounds timed per process")
    p.add_argument("--workloads", nargs="+", default=["default", "W1", "sweep16"])
    p.add_argument("--out", default=None, help="rows file (default: the suite's file)")
    args = p.parse_args(argv)
    unknown = set(args.workloads) - {"default", "W1", "sweep16"}
    if unknown or args.pairs < 1 or args.repeats < 1:
        p.error(f"unknown workloads {sorted(unknown)}" if unknown else "--pairs/--repeats >= 1")

    before_ref = subprocess.run(
        ["git", "rev-parse", "--short", args.before], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    if not before_ref:
        p.error(f"--before {args.before}: not a git ref of this repository")
    before = tempfile.mkdtemp(prefix="no_slower_before_")
    subprocess.run(
        ["git", "worktree", "add", "--detach", before, args.before],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    rec = Recorder("no_slower", args.out)
    trees = {"before": before, "after": ROOT}
    try:
        for workload in args.workloads:
            for tree in trees.values():  # warm-up: compile caches, autotune cache
                measure_once(tree, workload, args.repeats)
            times: dict[str, list[float]] = {"before": [], "after": []}
            for pair in range(args.pairs):  # A B, B A, A B, ...: no checkout always runs first
                order = list(trees.items()) if pair % 2 == 0 else list(trees.items())[::-1]
                for name, tree in order:
                    times[name].append(measure_once(tree, workload, args.repeats))
            ratios = [a / b for a, b in zip(times["after"], times["before"], strict=True)]
            ratio = statistics.median(ratios)
            same = None
            if workload == "W1":
                same = w1_program(trees["before"]) == w1_program(trees["after"])
            rec.add(
                workload,
                before_commit=before_ref,
                seconds_before=times["before"],
                seconds_after=times["after"],
                ratios=ratios,
                ratio_median=ratio,
                within_2_percent=ratio <= 1.02,
                same_compiled_program=same,
                what="in-process s/round" if workload == "W1" else "whole-process wall s",
            )
            rec.write()
            print(f"{workload}: after/before median {ratio:.3f} (pairs {ratios})", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", before], cwd=ROOT)


if __name__ == "__main__":
    main()
