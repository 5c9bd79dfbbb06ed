"""Curves and the markdown table of `stepsizes_fmnist.py` results.

    PYTHONPATH=. python experiments/stepsizes_report.py [--dir experiments/results/stepsizes]

Writes `curves.png` (test accuracy and training loss per schedule x partition) and `table.md`
(test accuracy / training loss at the last round K of every run and at the last round evaluated
in every run, uploaded MB per run) into the results folder. The multi-seed sweeps
(`stepsizes_fmnist.py --seeds N`, files `sweep_*.json`) go to `table_seeds.md` (final test
accuracy / training loss, mean +- std and 95% CI over seeds, n), `paired_seeds.md` (paired
differences of the final test accuracy by seed: EF-X minus X with the same solver, and FedProx
/ EF-FedProx minus FedAvg, for every schedule, K and split run with both) and
`curves_seeds.png` (mean test accuracy with its 95% CI band per split; one row per schedule
and local steps T / batch size).
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from stepsizes_fmnist import STATED_DECAY_POWER  # noqa: E402  (files without decay_power ran it)

from fedjax_sim.run.sweep import mean_ci  # noqa: E402

PARTITIONS = ("IID", "Non-IID2", "Non-IID1")
ALGORITHMS = ("FedAvg", "FedProx", "EF-FedAvg", "EF-FedProx")
SCHEDULES = ("fixed", "diminishing", "step_decay")


def load(directory: str) -> dict[str, dict]:
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        if os.path.basename(path).startswith(("diagnose_", "sweep_")):  # other formats
            continue
        with open(path) as f:
            out[os.path.basename(path)[:-5]] = json.load(f)
    return out


def cell(run: dict | None, round_: int | None = None) -> str:
    """`accuracy % / training loss` at `round_` (default: the last evaluation)."""
    if run is None or (round_ is not None and round_ not in run["round"]):
        return "-"
    i = -1 if round_ is None else run["round"].index(round_)
    return f"{100 * run['test_accuracy'][i]:.1f} / {run['train_loss'][i]:.3f}"


def table(results: dict[str, dict], round_: int | None = None) -> str:
    """One row per schedule x split: the last evaluation (round K) or the one at `round_`."""
    lines = [
        "| schedule | K | split | " + " | ".join(ALGORITHMS) + " |",
        "|---|---|---|" + "---|" * len(ALGORITHMS),
    ]
    for name, res in results.items():
        k = res["config"]["rounds"] if round_ is None else round_
        for part in PARTITIONS:
            cells = [cell(res["runs"].get(f"{alg}|{part}"), round_) for alg in ALGORITHMS]
            lines.append(f"| {name} | {k} | {part} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def common_round(results: dict[str, dict]) -> int:
    """The last round evaluated in every run (to compare schedules run for different K)."""
    rounds = [set(run["round"]) for res in results.values() for run in res["runs"].values()]
    return max(set.intersection(*rounds))


def uploads(results: dict[str, dict]) -> str:
    up = []
    for name, res in results.items():
        for key, run in res["runs"].items():
            if key.endswith("|IID"):
                up.append(f"{name}/{key.split('|')[0]}: {run['bytes_up'] / 1e6:.1f} MB")
    return "Uploaded in total (IID runs): " + "; ".join(up) + "\n"


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


def load_sweeps(directory: str) -> dict[str, dict]:
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "sweep_*.json"))):
        with open(path) as f:
            out[os.path.basename(path)[len("sweep_") : -5]] = json.load(f)
    return out


def seeds_table(sweeps: dict[str, dict]) -> str:
    lines = [
        "| run | K | T | batch | split | algorithm | n | final test acc % (mean +- std) "
        "| 95% CI | final train loss (mean +- std) | runs at chance (acc < 11%) | s |",
        "|---|---:|---:|---:|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for name, res in sweeps.items():
        cfg = res["config"]
        for key, c in res["cells"].items():
            alg, part = key.split("|")
            acc = np.array([r["test_accuracy"][-1] for r in c["runs"]])
            loss = np.array([r["train_loss"][-1] for r in c["runs"]])
            mean, half, std = mean_ci(acc)
            lines.append(
                f"| {name} | {cfg['rounds']} | {cfg['local_steps']} | {cfg['batch_size']} | "
                f"{part} | {alg} | {acc.size} | "
                f"{100 * mean:.1f} +- {100 * std:.1f} | [{100 * (mean - half):.1f}, "
                f"{100 * (mean + half):.1f}] | {loss.mean():.3f} +- {loss.std(ddof=1):.3f} | "
                f"{int(np.sum(acc < 0.11))} | {c['seconds']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def _solver(cfg: dict, alg: str) -> str:
    """The FedProx inner solver of a sweep (`-` for the FedAvg family)."""
    if not alg.endswith("FedProx"):
        return "-"
    j = cfg["inner_steps"] or cfg["local_steps"]
    return f"J = {j}, {'uncapped' if cfg['no_cap'] else 'capped'}, inner lr {cfg['inner_lr']:g}"


def schedule_label(cfg: dict) -> str:
    """The schedule's name, with its power where a diminishing run did not use the stated 0.51
    (older files have no `decay_power`: they ran 0.51)."""
    nu = cfg.get("decay_power", STATED_DECAY_POWER)
    if cfg["schedule"] == "diminishing" and nu != STATED_DECAY_POWER:
        return f"diminishing (nu {nu:g})"
    return cfg["schedule"]


def paired_table(sweeps: dict[str, dict]) -> str:
    """Final test accuracy differences paired by seed (same init and minibatches)."""
    cells = []
    for name, res in sweeps.items():
        cfg = res["config"]
        setting = (schedule_label(cfg), cfg["rounds"], cfg["local_steps"], cfg["batch_size"])
        for key, c in res["cells"].items():
            alg, part = key.split("|")
            acc = {r["seed"]: r["test_accuracy"][-1] for r in c["runs"]}
            cells.append((setting, part, alg, _solver(cfg, alg), name, acc))
    pairs = []
    for a in cells:
        for b in cells:
            if a[:2] != b[:2]:
                continue
            ef = a[2] == "EF-" + b[2] and a[3] == b[3]
            prox = a[2].endswith("FedProx") and b[2] == "FedAvg"
            if ef or prox:
                pairs.append((a, b))
    lines = [
        "| schedule | K | T | batch | split | A | B | A's solver | n "
        "| A - B, points (mean +- std) | 95% CI | seeds with A < B | A / B runs |",
        "|---|---:|---:|---:|---|---|---|---|---:|---:|---|---:|---|",
    ]
    order = {p: i for i, p in enumerate(PARTITIONS)}
    pairs.sort(key=lambda ab: (ab[0][0], order[ab[0][1]], ab[0][2], ab[1][2], ab[0][3]))
    for a, b in pairs:
        seeds = sorted(set(a[5]) & set(b[5]))
        if not seeds:  # e.g. fresh seeds 5-9 against a run of seeds 0-4: nothing to pair
            continue
        d = 100 * np.array([a[5][s] - b[5][s] for s in seeds])
        mean, half, std = mean_ci(d)
        sched, k, t, batch = a[0]
        lines.append(
            f"| {sched} | {k} | {t} | {batch} | {a[1]} | {a[2]} | {b[2]} | {a[3]} | {d.size} | "
            f"{mean:+.1f} +- {std:.1f} | [{mean - half:+.1f}, {mean + half:+.1f}] | "
            f"{int(np.sum(d < 0))} of {d.size} | {a[4]} / {b[4]} |"
        )
    return "\n".join(lines) + "\n"


def plot_seeds(sweeps: dict[str, dict], path: str) -> None:
    """One row per schedule and (T, batch), one panel per split; one colour per (run,
    algorithm) everywhere."""

    def row_of(cfg: dict) -> tuple:
        return (SCHEDULES.index(cfg["schedule"]), schedule_label(cfg), cfg["local_steps"],
                cfg["batch_size"])  # fmt: skip

    rows = sorted({row_of(r["config"]) for r in sweeps.values()})
    fig, axes = plt.subplots(len(rows), 3, figsize=(13, 3.6 * len(rows)), squeeze=False)
    labels = sorted({(name, key.split("|")[0]) for name, r in sweeps.items() for key in r["cells"]})
    cmap = plt.get_cmap("tab20")
    colors = {lab: cmap(i % 20) for i, lab in enumerate(labels)}
    for name, res in sweeps.items():
        cfg = res["config"]
        row = rows.index(row_of(cfg))
        for key, c in res["cells"].items():
            alg, part = key.split("|")
            ax = axes[row, PARTITIONS.index(part)]
            rounds = np.asarray(c["runs"][0]["round"])
            v = np.array([r["test_accuracy"] for r in c["runs"]])  # [S, T]
            stats = np.array([mean_ci(v[:, t]) for t in range(v.shape[1])])
            mean, half = stats[:, 0], np.nan_to_num(stats[:, 1])
            color = colors[(name, alg)]
            label = f"{alg} [{name}], n={len(v)}"
            ax.plot(rounds, mean, marker=".", color=color, label=label)
            ax.fill_between(rounds, mean - half, mean + half, color=color, alpha=0.2)
            ax.set_title(
                f"{schedule_label(cfg)}, T = {cfg['local_steps']}, batch {cfg['batch_size']}, "
                f"{part}: test acc. (mean, 95% CI)",
                fontsize=9,
            )
            ax.set_xlabel("round")
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
        else:
            ax.set_axis_off()  # a split not run at this row's setting
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="experiments/results/stepsizes")
    args = ap.parse_args()
    results = load(args.dir)
    sweeps = load_sweeps(args.dir)
    if sweeps:
        text = seeds_table(sweeps)
        with open(os.path.join(args.dir, "table_seeds.md"), "w") as f:
            f.write(text)
        paired = paired_table(sweeps)
        with open(os.path.join(args.dir, "paired_seeds.md"), "w") as f:
            f.write(paired)
        plot_seeds(sweeps, os.path.join(args.dir, "curves_seeds.png"))
        print(text)
        print(paired)
    if not results:
        raise SystemExit(f"no results in {args.dir}; run experiments/stepsizes_fmnist.py first")
    at = common_round(results)
    md = (
        "At the last round K of each run (test accuracy % / training loss):\n\n"
        + table(results)
        + f"\nAt round {at}, evaluated in every run:\n\n"
        + table(results, at)
        + "\n"
        + uploads(results)
    )
    with open(os.path.join(args.dir, "table.md"), "w") as f:
        f.write(md)
    plot(results, os.path.join(args.dir, "curves.png"))
    print(md)


if __name__ == "__main__":
    main()
