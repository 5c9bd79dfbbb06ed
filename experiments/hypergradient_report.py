"""The tables and the verdicts of `hypergradient_tuner.py` (issue 36), generated from its
committed result files.

    PYTHONPATH=. python experiments/hypergradient_report.py            # print the block
    PYTHONPATH=. python experiments/hypergradient_report.py --write    # put it into README.md

The claim (stated in experiments/README.md before the runs; applied by `holds`): started from
a client learning rate 10x too small or 10x too large relative to the grid's best point, the
tuner's mean test accuracy over the seeds is at most `MARGIN_POINTS` below the grid best
point's mean test accuracy (same seeds; best point by mean validation accuracy, recomputed
here from the raw per-seed accuracies), and its client-steps (local SGD steps of its runs
from that start) are less than `MAX_STEPS_RATIO` of the grid's. Also given, not part of the
rule: the paired per-seed difference's 95% Student-t CI, and the client-step ratio counting
the tuner's backward pass through the rounds as two more forward passes.

Files are grouped by run: (first seed, window, step size, tolerance of the accept / reject
rule). Per run the verdict is over the (cell, start) pairs of `CELLS` x both starts: it holds
if it holds in every pair, fails if in none, else it holds in the pairs counted; a run that
lacks cells of `CELLS` says which (its verdict covers the cells present). Seeds 0-4 selected
the tuner's settings (window 10, step 0.3); the confirming run is that tuner with the
accept / reject rule's tolerance 0.01 on fresh seeds 5-9 (`CONFIRMING`). Every number is
computed from the raw per-seed values and rounded once.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections.abc import Iterable

import numpy as np
import readme_block

from fedjax_sim.run.sweep import mean_ci

RESULTS = os.path.join(os.path.dirname(__file__), "results", "hypergradient")
README = os.path.join(os.path.dirname(__file__), "README.md")
BEGIN, END = "<!-- hypergradient:begin -->", "<!-- hypergradient:end -->"
MARGIN_POINTS, MAX_STEPS_RATIO = 1.0, 1 / 3
DATASETS = {"digits": "digits", "fashion_mnist": "Fashion-MNIST"}
ALGORITHMS = {"fedavg": "FedAvg", "fedprox": "FedProx"}
CELLS = [(d, a, m) for d in DATASETS for a in (0.1, 1.0) for m in ALGORITHMS]
# the confirming run: the tuner fixed on seeds 0-4 (window 10, step 0.3, the accept / reject
# rule's default tolerance 0.01) on fresh seeds 5-9; other runs on seeds >= 5 are diagnostics
CONFIRMING = (5, 10, 0.3, 0.01)
COMMAND = (
    "PYTHONPATH=. nice -n 10 python experiments/hypergradient_tuner.py --window 10 "
    "--step-size 0.3 --first-seed 5 --dataset {dataset}"
)
# result files written before the accept / reject rule had the earlier safeguard only
# (non-finite windows or a 10x rise): `hypergradient_tuner.py`'s docstring, `tolerance=9`
EARLIER_SAFEGUARD = 9.0


def load(results: str = RESULTS) -> list[dict]:
    """Every result file under `results`, sorted by name."""
    blobs = []
    for path in sorted(glob.glob(os.path.join(results, "*.json"))):
        with open(path) as f:
            blobs.append(json.load(f) | {"file": os.path.basename(path)})
    return blobs


def run_of(blob: dict) -> tuple[int, int, float, float]:
    """(first seed, window, step size, tolerance) of a result file."""
    spec = blob.get("tuner_spec") or {"window": 1, "step_size": 0.1}
    tolerance = spec.get("tolerance", EARLIER_SAFEGUARD)
    return min(blob["seeds"]), spec["window"], spec["step_size"], tolerance


def cell(blob: dict) -> dict:
    """One cell's numbers from its raw per-seed accuracies: the grid's best point (by mean
    validation accuracy), and per tuner start its test accuracies, the gap to the grid's best
    in points and whether the claim holds there."""
    val = np.asarray(blob["grid_val_accuracy"])  # [grid point, seed]
    test = np.asarray(blob["grid_test_accuracy"])
    best = int(np.argmax(val.mean(axis=1)))
    grid = blob["grid"]
    if grid[best] != blob["best_lr"]:
        raise ValueError(f"{blob['file']}: best lr {blob['best_lr']} != recomputed {grid[best]}")
    steps_ratio = blob["client_steps_tuner_per_start"] / blob["client_steps_grid"]
    out = {
        "cell": (blob["dataset"], float(blob["alpha"]), blob["algorithm"]),
        "best_lr": grid[best],
        "grid_test": 100 * test[best],
        "steps_ratio": steps_ratio,
        "steps_ratio_backward": 3 * steps_ratio,
        "starts": [],
    }
    tuner = 100 * np.asarray(blob["tuner_test_accuracy"])  # [start, seed]
    effective = np.asarray(blob["tuner_final_effective_lr"])
    rejected = blob.get("tuner_rejected_windows")  # not recorded by the first runs
    if blob["tuner_starts"] != [grid[best] / 10, grid[best] * 10]:
        raise ValueError(f"{blob['file']}: starts {blob['tuner_starts']} are not lr / 10, x 10")
    for i, start in enumerate(blob["tuner_starts"]):
        gap = tuner[i] - out["grid_test"]  # paired by seed
        out["starts"].append({
            "start": start,
            "test": tuner[i],
            "gap": float(gap.mean()),
            "gap_ci": mean_ci(gap)[1],
            "holds": holds(float(gap.mean()), steps_ratio),
            "effective_lr": effective[i],
            "rejected": None if rejected is None else np.asarray(rejected[i]),
            # the same start held fixed: the grid's point at that lr (None if off the grid)
            "fixed": 100 * test[grid.index(start)] if start in grid else None,
        })  # fmt: skip
    return out


def holds(gap_points: float, steps_ratio: float) -> bool:
    """The claim in one (cell, start): mean gap >= -1 point with < 1/3 of the client-steps."""
    return gap_points >= -MARGIN_POINTS and steps_ratio < MAX_STEPS_RATIO


def verdict(cells: Iterable[dict]) -> str:
    """One run's verdict over its (cell, start) pairs (see the module docstring)."""
    cells = list(cells)
    pairs = [(c["cell"], s) for c in cells for s in c["starts"]]
    n_hold = sum(s["holds"] for _, s in pairs)
    present = {c["cell"] for c in cells}
    missing = [c for c in CELLS if c not in present]
    if n_hold == len(pairs):
        text = "holds"
    elif n_hold == 0:
        text = "fails"
    else:
        text = f"holds in {n_hold} of {len(pairs)} (cell, start) pairs"
    by_start = []
    for k, name in ((0, "lr / 10"), (1, "lr x 10")):
        n = sum(c["starts"][k]["holds"] for c in cells)
        by_start.append(f"from {name}: {n} of {len(cells)} cells")
    text = f"**{text}** ({'; '.join(by_start)})"
    if missing:
        text += f"; {len(missing)} of {len(CELLS)} cells not run: " + ", ".join(
            f"{DATASETS[d]} Dir {a:g} {ALGORITHMS[m]}" for d, a, m in missing
        )
    return text


def _acc(values: np.ndarray) -> str:
    return f"{values.mean():.1f} +- {values.std(ddof=1):.1f}"


def _start(s: dict) -> list[str]:
    return [
        _acc(s["test"]),
        f"{s['gap']:+.1f} [{s['gap'] - s['gap_ci']:+.1f}, {s['gap'] + s['gap_ci']:+.1f}]",
        "**yes**" if s["holds"] else "no",
    ]


def _run_title(run: tuple[int, int, float, float], seeds: list[int]) -> str:
    first, window, step, tolerance = run
    rule = (
        "earlier safeguard only" if tolerance == EARLIER_SAFEGUARD
        else f"accept / reject tolerance {tolerance:g}"
    )  # fmt: skip
    role = (
        "fresh seeds, confirming run" if run == CONFIRMING
        else "fresh seeds, diagnostic" if first >= CONFIRMING[0]
        else "selection seeds"
    )  # fmt: skip
    return (f"seeds {seeds[0]}-{seeds[-1]} ({role}); tuner window {window}, step {step:g}, "
            f"{rule}")  # fmt: skip


def render(blobs: list[dict]) -> str:
    """The README block: per run a verdict line and a table, then the tuners' end points."""
    runs: dict[tuple, list[dict]] = {}
    for b in sorted(blobs, key=lambda b: CELLS.index(cell(b)["cell"])):
        runs.setdefault(run_of(b), []).append(b)
    order = sorted(runs, key=lambda r: (r != CONFIRMING, r[0] < CONFIRMING[0], r[1:]))
    lines = []
    for run in order:
        group = runs[run]
        cells = [cell(b) for b in group]
        lines += [
            f"**{_run_title(run, group[0]['seeds'])}.** Verdict: {verdict(cells)}.",
            "",
            "| dataset | Dir | algorithm | grid best lr | grid best: test acc % | from lr / 10: "
            "test acc % | gap, points [95% CI] | claim | from lr x 10: test acc % | gap, "
            "points [95% CI] | claim | client-steps / grid's (with backward) |",
            "|---|---:|---|---:|---:|---:|---:|---|---:|---:|---|---:|",
        ]
        for c in cells:
            d, a, m = c["cell"]
            lines.append("| " + " | ".join([
                DATASETS[d], f"{a:g}", ALGORITHMS[m], f"{c['best_lr']:g}", _acc(c["grid_test"]),
                *_start(c["starts"][0]), *_start(c["starts"][1]),
                f"{c['steps_ratio']:.3f} ({c['steps_ratio_backward']:.3f})",
            ]) + " |")  # fmt: skip
        lines.append("")
    lines += [
        "Where the tuners end: the start held fixed (the grid's point at that lr: mean test "
        "acc %, - if off the grid), client lr x server lr after the last round (median over "
        "seeds [min, max]) and windows rejected by the accept / reject rule or the safeguard "
        "(mean per run; - where not recorded).",
        "",
        "| seeds, window | dataset | Dir | algorithm | grid best lr | lr / 10 fixed: test acc % "
        "| from lr / 10: final lr | rejected | lr x 10 fixed: test acc % | from lr x 10: final "
        "lr | rejected |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in order:
        for b in runs[run]:
            c = cell(b)
            d, a, m = c["cell"]
            ends = []
            for s in c["starts"]:
                e = s["effective_lr"]
                ends += [
                    "-" if s["fixed"] is None else f"{s['fixed'].mean():.1f}",
                    f"{np.median(e):.3g} [{e.min():.3g}, {e.max():.3g}]",
                    "-" if s["rejected"] is None else f"{s['rejected'].mean():.1f}",
                ]
            lines.append("| " + " | ".join([
                f"{b['seeds'][0]}-{b['seeds'][-1]}, {run[1]}", DATASETS[d], f"{a:g}",
                ALGORITHMS[m], f"{c['best_lr']:g}", *ends,
            ]) + " |")  # fmt: skip
    if CONFIRMING not in runs:
        lines += ["", "Confirming run on fresh seeds: **not run**: "
                  + "; ".join(f"`{COMMAND.format(dataset=d)}`" for d in DATASETS)]  # fmt: skip
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    return readme_block.replace_block(text, BEGIN, END, block)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help="write the block into README.md")
    p.add_argument("--results", default=RESULTS)
    args = p.parse_args()
    readme_block.print_or_write(render(load(args.results)), BEGIN, END, args.write, README)


if __name__ == "__main__":
    main()
