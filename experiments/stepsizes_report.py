"""Curves and the markdown table of `stepsizes_fmnist.py` results.

    PYTHONPATH=. python experiments/stepsizes_report.py [--dir experiments/results/stepsizes]

Writes `curves.png` (test accuracy and training loss per schedule x partition) and `table.md`
(final test accuracy / training loss / uploaded MB per run) into the results folder.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PARTITIONS = ("IID", "Non-IID2", "Non-IID1")
ALGORITHMS = ("FedAvg", "FedProx", "EF-FedAvg", "EF-FedProx")
SCHEDULES = ("fixed", "diminishing", "step_decay")


def load(directory: str) -> dict[str, dict]:
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        with open(path) as f:
            out[os.path.basename(path)[:-5]] = json.load(f)
    return out


def table(results: dict[str, dict]) -> str:
    lines = [
        "| schedule | split | " + " | ".join(ALGORITHMS) + " |",
        "|---|---|" + "---|" * len(ALGORITHMS),
    ]
    for name, res in results.items():
        for part in PARTITIONS:
            cells = []
            for alg in ALGORITHMS:
                run = res["runs"].get(f"{alg}|{part}")
                cells.append(
                    "-"
                    if run is None
                    else f"{100 * run['test_accuracy'][-1]:.1f} / {run['train_loss'][-1]:.3f}"
                )
            lines.append(f"| {name} | {part} | " + " | ".join(cells) + " |")
    up = []
    for name, res in results.items():
        for key, run in res["runs"].items():
            if key.endswith("|IID"):
                up.append(f"{name}/{key.split('|')[0]}: {run['bytes_up'] / 1e6:.1f} MB")
    return "\n".join(lines) + "\n\nUploaded in total (IID runs): " + "; ".join(up) + "\n"


def plot(results: dict[str, dict], path: str) -> None:
    names = [s for s in SCHEDULES if s in results]
    fig, axes = plt.subplots(
        2 * len(names), 3, figsize=(11, 3.2 * len(names)), squeeze=False, sharex=True
    )
    for r, name in enumerate(names):
        for c, part in enumerate(PARTITIONS):
            for alg in ALGORITHMS:
                run = results[name]["runs"].get(f"{alg}|{part}")
                if run is None:
                    continue
                axes[2 * r, c].plot(run["round"], run["test_accuracy"], marker=".", label=alg)
                axes[2 * r + 1, c].plot(run["round"], run["train_loss"], marker=".", label=alg)
            axes[2 * r, c].set_title(f"{name}, {part}", fontsize=9)
            axes[2 * r, c].set_ylabel("test acc", fontsize=8)
            axes[2 * r + 1, c].set_ylabel("train loss", fontsize=8)
    axes[0, 0].legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("round")
    fig.tight_layout()
    fig.savefig(path, dpi=70)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="experiments/results/stepsizes")
    args = ap.parse_args()
    results = load(args.dir)
    if not results:
        raise SystemExit(f"no results in {args.dir}; run experiments/stepsizes_fmnist.py first")
    md = table(results)
    with open(os.path.join(args.dir, "table.md"), "w") as f:
        f.write(md)
    plot(results, os.path.join(args.dir, "curves.png"))
    print(md)


if __name__ == "__main__":
    main()
