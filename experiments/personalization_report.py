"""Tables and a plot of `personalization.py`'s results, and the loaders the verdict rows use.

    PYTHONPATH=. python experiments/personalization_report.py   # markdown tables + plot
    PYTHONPATH=. python experiments/personalization_report.py --partial   # also unfinished

Reads `results/personalization/<dataset>_<partition>.json` (complete files only; with
`--partial` also the methods done so far of a `.partial`, labelled; the verdicts never read
those); every
number is over the confirming seeds at each method's selected lr (selected on the
selection seeds). Writes `results/personalization/personalization.png` and prints the
markdown tables of experiments/README.md's section.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from fedjax_sim.run.sweep import mean_ci

RESULTS = os.path.join(os.path.dirname(__file__), "results", "personalization")
SETTINGS = (("fashion_mnist", "dir0.1"), ("fashion_mnist", "shards2"), ("digits", "dir0.1"),
            ("digits", "shards2"))  # fmt: skip
LABELS = {"fashion_mnist": "Fashion-MNIST", "digits": "digits", "dir0.1": "Dir(0.1)",
          "shards2": "2-class shards"}  # fmt: skip
PERSONALIZED = ("FedAvg-FT", "FedPer", "LG-FedAvg", "FedRep", "FedBABU", "Ditto", "APFL",
                "pFedMe", "Per-FedAvg FO", "Per-FedAvg HF")  # fmt: skip

# PFLlib's benchmark (docs/benchmark.html of github.com/TsingZ0/PFLlib, commit 8afdf11,
# 2025-03-23; pfllib.com/benchmark.html): test accuracy (%), FMNIST, 4-layer CNN, 20
# clients, all joining, batch 10, 1 local epoch, 2000 rounds, best mean personal accuracy
# over rounds (FedAvg: the global model), 3 trials. Per-FedAvg: their implementation's
# first-order update. LG-FedAvg and FedAvg-FT are not in the table.
PFLLIB_FMNIST = {
    "shards2": {"FedAvg": 80.41, "Per-FedAvg FO": 99.18, "pFedMe": 99.35, "Ditto": 99.44,
                "APFL": 99.41, "FedPer": 99.47, "FedRep": 99.56, "FedBABU": 99.41},
    "dir0.1": {"FedAvg": 85.85, "Per-FedAvg FO": 95.10, "pFedMe": 97.25, "Ditto": 97.47,
               "APFL": 97.25, "FedPer": 97.44, "FedRep": 97.56, "FedBABU": 97.46},
}  # fmt: skip


def path(dataset: str, partition: str) -> str:
    return os.path.join(RESULTS, f"{dataset}_{partition}.json")


def load(dataset: str, partition: str, partial: bool = False) -> dict:
    """The complete result file (FileNotFoundError while it is missing or `.partial`;
    `partial`: the `.partial` when the complete file is missing)."""
    name = path(dataset, partition)
    if partial and not os.path.exists(name):
        name += ".partial"
    with open(name) as f:
        return json.load(f)


def confirmed(blob: dict, method: str, key: str = "personal_mean") -> dict[int, float]:
    """`{seed: key}` of `method`'s confirming runs at its selected lr."""
    m = blob["methods"][method]
    return {r["seed"]: r[key] for r in m["runs"]
            if r["phase"] == "confirm" and r["lr"] == m["selected_lr"]}  # fmt: skip


def points(blob: dict, method: str, key: str = "personal_mean") -> dict[int, float]:
    return {s: 100.0 * v for s, v in confirmed(blob, method, key).items()}


def paired(a: dict, b: dict) -> np.ndarray:
    seeds = sorted(set(a) & set(b))
    assert seeds, "no common seeds"
    return np.array([a[s] - b[s] for s in seeds], np.float64)


def vs_fedavg(dataset: str, partition: str, method: str) -> np.ndarray:
    """`method` minus FedAvg, mean personal test accuracy in points, paired by seed."""
    blob = load(dataset, partition)
    return paired(points(blob, method), points(blob, "FedAvg"))


def fedavg_vs_each(dataset: str, partition: str) -> dict[str, np.ndarray]:
    """FedAvg minus each personalized method (points), paired by seed."""
    blob = load(dataset, partition)
    fa = points(blob, "FedAvg")
    return {m: paired(fa, points(blob, m)) for m in PERSONALIZED}


def rank_agreement(partition: str, fedavg: bool = True) -> np.ndarray:
    """Per confirming seed, Spearman's rho between our mean personal accuracies of the
    methods in PFLlib's table (without FedAvg: its pFL methods only) and PFLlib's (FMNIST)."""
    from scipy.stats import spearmanr

    blob = load("fashion_mnist", partition)
    ref = PFLLIB_FMNIST[partition]
    methods = sorted(m for m in ref if fedavg or m != "FedAvg")
    ours = {m: points(blob, m) for m in methods}
    seeds = sorted(set.intersection(*(set(v) for v in ours.values())))
    return np.array([spearmanr([ours[m][s] for m in methods], [ref[m] for m in methods])[0]
                     for s in seeds], np.float64)  # fmt: skip


def fmt(v: np.ndarray, d: int = 1) -> str:
    mean, half, std = mean_ci(v)
    return f"{mean:.{d}f} ± {std:.{d}f}"


def table(dataset: str, partition: str, partial: bool = False) -> str:
    blob = load(dataset, partition, partial)
    done = (
        ""
        if blob.get("complete")
        else (f"PARTIAL ({len(blob['methods'])} of 11 methods done; no verdict reads it), ")
    )
    head = (
        f"{LABELS[dataset]}, {LABELS[partition]}, {done}{blob['config']['rounds']} rounds of "
        f"{blob['config']['local_steps']} local steps "
        f"(mean over the clients with test examples; "
        f"mean ± std over {len(blob['config']['confirm_seeds'])} confirming seeds, points)\n\n"
        "| method | lr (grid) | personal mean | worst | 10th pct | pooled | minus FedAvg "
        "[95% CI] | global model: central test | global model: clients' mean | PFLlib |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    ref = PFLLIB_FMNIST[partition] if dataset == "fashion_mnist" else {}
    rows = []
    for m in ("FedAvg", *PERSONALIZED):
        if m not in blob["methods"]:
            continue
        meta = blob["methods"][m]
        grid = ", ".join(f"{g:g}" for g in meta["grid"])
        cols = [fmt(np.array(list(points(blob, m, k).values())))
                for k in ("personal_mean", "personal_worst", "personal_p10", "personal_pooled",
                          "global_test_accuracy", "global_client_mean")]  # fmt: skip
        if m == "FedAvg":
            diff = "-"
        else:
            d = paired(points(blob, m), points(blob, "FedAvg"))
            mean, half, _ = mean_ci(d)
            diff = f"{mean:+.1f} [{mean - half:+.1f}, {mean + half:+.1f}]"
        anchor = f"{ref[m]:.2f}" if m in ref else "-"
        lr = f"{meta['selected_lr']:g} ({grid})"
        rows.append(f"| {m} | {lr} | {' | '.join(cols[:4])} | {diff} | {cols[4]} | {cols[5]} | "
                    f"{anchor} |")  # fmt: skip
    stats = blob["partition_stats"]
    secs = sum(m["seconds"] for m in blob["methods"].values())
    tail = (
        f"\n{stats['train_examples']} training / {stats['test_examples']} client-test "
        f"examples, {stats['classes_per_client_mean']:.1f} classes per client on average, "
        f"{stats['clients_without_test']} clients without test examples; "
        f"{secs / 60:.1f} min of sweeps.\n"
    )
    return head + "\n".join(rows) + "\n" + tail


def exists(dataset: str, partition: str, partial: bool) -> bool:
    name = path(dataset, partition)
    return os.path.exists(name) or (partial and os.path.exists(name + ".partial"))


def plot(out: str, partial: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [s for s in SETTINGS if exists(*s, partial)]
    fig, axes = plt.subplots(1, len(done), figsize=(4.2 * len(done), 4.2), squeeze=False)
    for ax, (ds, part) in zip(axes[0], done, strict=True):
        blob = load(ds, part, partial)
        methods = [m for m in ("FedAvg", *PERSONALIZED) if m in blob["methods"]]
        stats = [mean_ci(np.array(list(points(blob, m).values()))) for m in methods]
        ax.barh(range(len(methods)), [s[0] for s in stats], xerr=[s[1] for s in stats],
                color=["0.6" if m == "FedAvg" else "C0" for m in methods])  # fmt: skip
        ax.set_yticks(range(len(methods)), methods, fontsize=8)
        ax.invert_yaxis()
        lo = min(s[0] for s in stats)
        mark = "" if blob.get("complete") else " (partial)"
        ax.set(xlim=(max(0, lo - 10), 100), xlabel="mean personal test accuracy (%)",
               title=f"{LABELS[ds]}, {LABELS[part]}{mark}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    partial = "--partial" in sys.argv[1:]
    for s in SETTINGS:
        if exists(*s, partial):
            print(table(*s, partial))
    plot(os.path.join(RESULTS, "personalization.png"), partial)


if __name__ == "__main__":
    main()
