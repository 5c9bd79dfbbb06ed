"""Table of the committed `fgdro_imbalanced_fmnist.py` results with the worst-class LOSS.

    PYTHONPATH=. python experiments/fgdro_report.py
Reads experiments/results/fgdro/fmnist_dir*.json and writes table_fmnist.md there: per
partition and method, the final worst-class accuracy, worst-class test loss (largest
per-class mean cross-entropy on the balanced 10k test set), mean per-class loss and test
accuracy, mean (std) over the seeds in the file. The worst-class accuracy is 0 for almost
every method at the committed scale (30 rounds x 4 local steps), so the worst-class loss is
the informative robustness metric there.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

DIR = os.path.join(os.path.dirname(__file__), "results", "fgdro")
COLUMNS = (
    ("worst-class acc", "test_classes_accuracy_worst"),
    ("worst-class loss", "test_classes_loss_worst"),
    ("mean class loss", "test_classes_loss_mean"),
    ("test acc", "test_accuracy"),
)


def cell(values: list[float]) -> str:
    v = np.asarray(values, np.float64)
    return f"{v.mean():.4f}" + (f" ({v.std(ddof=1):.4f})" if v.size > 1 else "")


def main() -> None:
    head = "| partition | method | n | " + " | ".join(c for c, _ in COLUMNS) + " |"
    lines = [head, "|---|---|---:|" + "---:|" * len(COLUMNS)]
    for path in sorted(glob.glob(os.path.join(DIR, "fmnist_dir*.json"))):
        with open(path) as f:
            blob = json.load(f)
        alpha = blob["hparams"]["alpha"]
        methods = list(dict.fromkeys(r["method"] for r in blob["rows"]))
        for name in methods:
            rows = [r for r in blob["rows"] if r["method"] == name]
            cells = [cell([r["final"][key] for r in rows]) for _, key in COLUMNS]
            lines.append(f"| Dir({alpha:g}) | {name} | {len(rows)} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(DIR, "table_fmnist.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
