"""Table (markdown) and curves (PNG) of `fedmim_fmnist.py`'s results.

    PYTHONPATH=. python experiments/fedmim_report.py
Reads experiments/results/fedmim/dir*.json, writes table.md and curves.png there.
"""

from __future__ import annotations

import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

DIR = os.path.join(os.path.dirname(__file__), "results", "fedmim")


def main() -> None:
    files = sorted(glob.glob(os.path.join(DIR, "dir*.json")))
    results = {os.path.basename(f)[3:-5]: json.load(open(f)) for f in files}
    lines = [
        "| partition | method | final acc (%) | best acc (%) | mean C_t, last 20 rounds | s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 7), squeeze=False)
    for col, (tag, res) in enumerate(results.items()):
        for name, run in res["runs"].items():
            c = np.asarray(run["consistency"], np.float64)
            lines.append(
                f"| Dir({tag}) | {name} | {100 * run['accuracy'][-1]:.2f} | "
                f"{100 * max(run['accuracy']):.2f} | {np.mean(c[-20:]):.4g} | {run['seconds']} |"
            )
            axes[0, col].plot(run["rounds"], run["accuracy"], marker="o", label=name)
            axes[1, col].semilogy(np.arange(1, c.size + 1), c, label=name)
        axes[0, col].set_title(f"Dir({tag}): test accuracy")
        axes[1, col].set_title(f"Dir({tag}): consistency C_t")
        axes[1, col].set_xlabel("round")
        axes[0, col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(DIR, "curves.png"), dpi=70)
    with open(os.path.join(DIR, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
