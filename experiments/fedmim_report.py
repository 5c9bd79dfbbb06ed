"""Table (markdown) and curves (PNG) of `fedmim_fmnist.py`'s results.

    PYTHONPATH=. python experiments/fedmim_report.py
Reads experiments/results/fedmim/dir*.json, writes table.md and curves.png there.

C_t / A^2: FedMIM's and FedCM's local gradient step is damped by A = 1 - sum(alpha) = 0.1
(FedMIM alpha = (0.6, 0.3)) and a = 1 - momentum = 0.1 (FedCM), while the inertia /
momentum term is common to all clients and cancels in x_i - x_{t+1}; the client drift, and
so C_t, then scales like A^2 (spec 8 item 5). Dividing by A^2 compares the drift per unit of
gradient step with FedAvg's (A = 1). The ratio column is that normalised C_t over FedAvg's.
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
# gradient-step damping of fedmim_fmnist.py's configurations (1 for the undamped methods)
DAMPING = {"FedMIM": 1.0 - (0.6 + 0.3), "FedCM": 1.0 - 0.9}


def main() -> None:
    files = sorted(glob.glob(os.path.join(DIR, "dir*.json")))
    results = {os.path.basename(f)[3:-5]: json.load(open(f)) for f in files}
    lines = [
        "| partition | method | final acc (%) | best acc (%) | mean C_t, last 20 rounds "
        "| A | C_t / A^2 | C_t / A^2 over FedAvg's | s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 7), squeeze=False)
    for col, (tag, res) in enumerate(results.items()):
        ref = res["runs"].get("FedAvg") or results.get(tag.split("_")[0], res)["runs"]["FedAvg"]
        ref_c = float(np.mean(np.asarray(ref["consistency"], np.float64)[-20:]))
        for name, run in res["runs"].items():
            c = np.asarray(run["consistency"], np.float64)
            a = DAMPING.get(name, 1.0)
            norm = float(np.mean(c[-20:])) / a**2
            lines.append(
                f"| Dir({tag}) | {name} | {100 * run['accuracy'][-1]:.2f} | "
                f"{100 * max(run['accuracy']):.2f} | {np.mean(c[-20:]):.4g} | {a:.2g} | "
                f"{norm:.4g} | {norm / ref_c:.3g}x | {run['seconds']} |"
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
