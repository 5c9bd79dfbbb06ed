"""Tables of the multi-seed `area_logistic.py` runs (`logistic_K<K>_<tag>_<setting>.json`).

    PYTHONPATH=. python experiments/area_report.py [--tag seeds10_full60k] [--local-steps 50]
Writes experiments/results/area/logistic_<tag>.md (K = 1) or logistic_K<K>_<tag>.md: per clock
setting and method, the step size chosen by each selection rule, the normalised loss
(f - f*) / (f(0) - f*) and the test accuracy at 10 / 25 / 50 / 100 % of the horizon (mean +- std
over seeds at the step size of the time-averaged rule), and AREA minus each baseline, paired by
seed (mean, 95% CI, and how many seeds AREA is better) in the loss and in the test accuracy at
each of those times ("fastest in accuracy").
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from fedjax_sim.run.sweep import mean_ci

DIR = os.path.join(os.path.dirname(__file__), "results", "area")
METHODS = ("AREA", "S-FedAvg", "AS-FedAvg", "FedBuff", "MIFA")


def fmt(v, digits: int = 3) -> str:
    v = np.asarray(v, np.float64)
    return f"{v.mean():.{digits}f} +- {v.std(ddof=1):.{digits}f}"


def paired(area: dict, other: dict, field: str, lower_is_better: bool) -> str:
    """AREA minus baseline of `field` paired by seed: mean [95% CI] (seeds where AREA is better)."""
    d = np.subtract(area[field], other[field])
    mean, half, _ = mean_ci(d)
    better = int(np.sum(d < 0 if lower_is_better else d > 0))
    return f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}] ({better}/{d.size})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="seeds10_full60k")
    ap.add_argument("--local-steps", type=int, default=1, help="K of the runs to tabulate")
    args = ap.parse_args()
    out = []
    for setting in ("uniform", "non-uniform"):
        path = os.path.join(DIR, f"logistic_K{args.local_steps}_{args.tag}_{setting}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            res = json.load(f)
        runs = {m: res["runs"].get(f"{setting}/{m}") for m in METHODS}
        if runs["AREA"] is None:
            continue
        times = list(runs["AREA"]["at_time"])
        n = runs["AREA"]["n_seeds"]
        out.append(f"\n#### {setting} clocks, {n} seeds (`{os.path.basename(path)}`)\n")
        out.append(
            "| method | alpha (time-avg rule) | alpha (final-loss rule) | "
            + " | ".join(f"loss / acc at t = {t}" for t in times)
            + " |"
        )
        out.append("|---|---:|---:|" + "---:|" * len(times))
        for m, r in runs.items():
            cells = [
                f"{fmt(r['at_time'][t]['normalised_loss_per_seed'])} / "
                f"{fmt(r['at_time'][t]['test_accuracy_per_seed'])}"
                for t in times
            ]
            out.append(
                f"| {m} | {r['best_alpha']:g} | {r['best_alpha_by_final_loss']:g} | "
                + " | ".join(cells)
                + " |"
            )
        for rule, key in (("time-avg", "at_time"), ("final-loss", "at_time_final_loss_rule")):
            area = runs["AREA"][key]
            out.append(
                f"\nAREA minus baseline, normalised loss paired by seed ({rule} rule), "
                "mean [95% CI] (seeds where AREA is lower)\n"
            )
            out.append("| baseline | " + " | ".join(f"loss diff. t = {t}" for t in times) + " |")
            out.append("|---|" + "---:|" * len(times))
            for m in METHODS[1:]:
                cells = [
                    paired(area[t], runs[m][key][t], "normalised_loss_per_seed", True)
                    for t in times
                ]
                out.append(f"| {m} | " + " | ".join(cells) + " |")
            out.append(
                f"\nAREA minus baseline, test accuracy paired by seed ({rule} rule), mean [95% CI] "
                "(seeds where AREA is higher)\n"
            )
            out.append("| baseline | " + " | ".join(f"acc. diff. t = {t}" for t in times) + " |")
            out.append("|---|" + "---:|" * len(times))
            for m in METHODS[1:]:
                cells = [
                    paired(area[t], runs[m][key][t], "test_accuracy_per_seed", False) for t in times
                ]
                out.append(f"| {m} | " + " | ".join(cells) + " |")
    text = "\n".join(out) + "\n"
    prefix = "" if args.local_steps == 1 else f"K{args.local_steps}_"
    with open(os.path.join(DIR, f"logistic_{prefix}{args.tag}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
