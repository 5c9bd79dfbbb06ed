"""Table and curves from the JSON files of fedlps_table1.py (and fedlps_graph.py).

    python experiments/fedlps_report.py

prints the markdown table of experiments/README.md (final pooled accuracy on the unseen test
clients / rounds to the target accuracy (speed-up vs FedAvg)) and writes
experiments/results/fedlps/curves_<dataset>.png. The multi-seed sweeps
(`fedlps_table1.py --seeds N`, files `sweep_<dataset>_<model>.json`) go to
`results/fedlps/table_seeds.md`: rounds to the target, paired speed-up vs FedAvg (beta = 1,
same seed), final accuracy and loss, mean +- std over seeds (n). Sweeps of one setting run on
several data partitions (`fedlps_table1.py --seed P --tag _partP`: the pool split, the client
partition and the similarity graph of seed P) go to `results/fedlps/table_partitions.md`: the
paired speed-up's and final-accuracy change's mean per partition, then mean +- std and 95%
CI over the partitions.
"""

from __future__ import annotations

import glob
import json
import os

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fedjax_sim.run.convergence import rounds_to_target, speedup  # noqa: E402
from fedjax_sim.run.sweep import mean_ci  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "fedlps")


def load() -> dict:
    out = {}
    for path in sorted(glob.glob(os.path.join(RESULTS, "*_*.json"))):
        name = os.path.basename(path)[:-5]
        if name.startswith(("graph", "sweep_")):
            continue
        with open(path) as f:
            out[name] = json.load(f)
    return out


def cell(run: dict, ref: dict, target: float) -> str:
    r = rounds_to_target(run["rounds"], run["accuracy"], target)
    r_ref = rounds_to_target(ref["rounds"], ref["accuracy"], target)
    s = speedup(r_ref, r)
    rounds = "-" if r is None else str(r)
    sp = "" if s is None else f" ({s:.1f}x)"
    return f"{100 * run['final_accuracy']:.2f} / {rounds}{sp}"


def algo_order(name: str) -> tuple:
    """FedAvg, then FedProx by alpha, then FedLPS by decreasing beta."""
    kind, _, value = name.partition(" ")
    rank = {"FedAvg": 0, "FedProx": 1, "FedLPS": 2}[kind]
    x = float(value.split("=")[1]) if value else 0.0
    return (rank, -x if kind == "FedLPS" else x)


def table(results: dict) -> str:
    lines = []
    for name, res in results.items():
        cfg = res["config"]
        settings = sorted(res["settings"])  # balanced, imbalanced
        lines.append(
            f"\n**{cfg['dataset']}, {cfg['model']}** (C={cfg['clients']}, E={cfg['epochs']}, "
            f"B={cfg['batch']}, gamma={cfg['lr']:g}, T={cfg['rounds']}, target "
            f"c={cfg['target']:g}, imbalanced a={cfg['a']:g}, b=1, graph from "
            f"{cfg.get('graph_features', 'standardised')} features)\n"
        )
        lines.append("| Algo | " + " | ".join(settings) + " |")
        lines.append("|---" * (len(settings) + 1) + "|")
        algos = sorted({a for s in settings for a in res["settings"][s]["runs"]}, key=algo_order)
        for algo in algos:
            cells = []
            for s in settings:
                runs = res["settings"][s]["runs"]
                done = algo in runs and "FedAvg" in runs
                cells.append(cell(runs[algo], runs["FedAvg"], cfg["target"]) if done else "-")
            lines.append(f"| {algo} | " + " | ".join(cells) + " |")
        del name
    return "\n".join(lines)


def curves(results: dict) -> list[str]:
    paths = []
    datasets = sorted({r["config"]["dataset"] for r in results.values()})
    for ds in datasets:
        items = [r for r in results.values() if r["config"]["dataset"] == ds]
        ncols = max(len(r["settings"]) for r in items)
        fig, axes = plt.subplots(len(items), ncols, figsize=(4.2 * ncols, 3.0 * len(items)))
        axes = [[axes]] if len(items) * ncols == 1 else axes
        axes = [axes] if len(items) == 1 else axes
        for row, res in zip(axes, items, strict=True):
            for ax in row[len(res["settings"]) :]:  # a run with fewer settings than columns
                ax.axis("off")
            for ax, setting in zip(row, sorted(res["settings"]), strict=False):
                rec = res["settings"][setting]
                for algo in sorted(rec["runs"], key=algo_order):
                    run = rec["runs"][algo]
                    ax.plot(run["rounds"][1:], run["accuracy"][1:], label=algo, lw=1)
                ax.axhline(res["config"]["target"], color="gray", ls=":", lw=0.8)
                finals = [run["final_accuracy"] for run in rec["runs"].values()]
                ax.set_ylim(max(0.0, min(finals) - 0.15), min(1.0, max(finals) + 0.02))
                raw = " (graph: raw pixels)" if res["config"].get("graph_features") == "raw" else ""
                ax.set_title(f"{res['config']['model']}, {setting}{raw}", fontsize=9)
                ax.set_xlabel("round", fontsize=8)
                ax.set_ylabel("pooled test acc (unseen)", fontsize=8)
                ax.tick_params(labelsize=7)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"FedLPS vs FedAvg, {ds}", fontsize=10)
        fig.tight_layout()
        path = os.path.join(RESULTS, f"curves_{ds}.png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def load_sweeps() -> list[dict]:
    """Every multi-seed sweep file (`sweep_*.json`), in file-name order."""
    out = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "sweep_*.json"))):
        with open(path) as f:
            out.append(json.load(f))
    return out


def seeds_table(sweeps: list[dict]) -> str:
    lines = [
        "| dataset | pool | model | setting | partition | beta | n | reached "
        "| rounds to target (mean +- std) | speed-up vs FedAvg (paired, mean +- std [95% CI]) "
        "| final acc % | final loss | final loss - FedAvg's (paired) | s (sweep) |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in sweeps:
        cfg = res["config"]
        for setting, rec in res["settings"].items():
            ref = {r["seed"]: r["final_loss"] for r in rec["runs"] if r["beta"] == 1.0}
            for beta, st in rec["summary"].items():
                sel = [r for r in rec["runs"] if f"{r['beta']:g}" == beta]
                d = np.array([r["final_loss"] - ref[r["seed"]] for r in sel])
                rtt, sp = st["rounds_to_target"], st["speedup_vs_fedavg"]
                acc, loss = st["final_accuracy"], st["final_loss"]
                name = "FedAvg (beta = 1)" if beta == "1" else beta
                lines.append(
                    f"| {cfg['dataset']} | {cfg['pool'] or 'all'} | {cfg['model']} | {setting} | "
                    f"{cfg['seed']} | {name} | {st['n']} | "
                    f"{st['reached']} | "
                    + (f"{rtt['mean']:.1f} +- {rtt['std']:.1f}" if rtt else "-")
                    + " | "
                    + (
                        f"{sp['mean']:.2f} +- {sp['std']:.2f} [{sp['mean'] - sp['ci95_half']:.2f}, "
                        f"{sp['mean'] + sp['ci95_half']:.2f}]"
                        if sp
                        else "-"
                    )
                    + f" | {100 * acc['mean']:.2f} +- {100 * acc['std']:.2f} | "
                    f"{loss['mean']:.4f} +- {loss['std']:.4f} | "
                    f"{d.mean():+.4f} +- {d.std(ddof=1):.4f} | {rec['seconds']:.0f} |"
                )
    return "\n".join(lines) + "\n"


# config keys that may differ between sweep files of one setting
PER_FILE = ("seed", "betas", "settings", "tag", "out", "fresh", "prox")


def paired_changes(runs: list[dict], beta: float) -> dict[str, np.ndarray]:
    """beta vs FedAvg (beta = 1), paired by seed: `speedup` (only seeds where both runs reach
    the target, as in fedlps_table1.py), `acc` (final accuracy change, points) and `loss`."""
    ref = {r["seed"]: r for r in runs if r["beta"] == 1.0}
    sel = [r for r in runs if r["beta"] == beta]
    sp = [speedup(ref[r["seed"]]["rounds_to_target"], r["rounds_to_target"]) for r in sel]
    return {
        "speedup": np.array([v for v in sp if v is not None], np.float64),
        "acc": np.array(
            [100 * (r["final_accuracy"] - ref[r["seed"]]["final_accuracy"]) for r in sel]
        ),
        "loss": np.array([r["final_loss"] - ref[r["seed"]]["final_loss"] for r in sel]),
    }


def _over(values: list[float]) -> str:
    mean, half, std = mean_ci(np.asarray(values, np.float64))
    return f"{mean:.2f} +- {std:.2f} [{mean - half:.2f}, {mean + half:.2f}]"


def partitions_table(sweeps: list[dict]) -> str | None:
    """Between-partition spread of the paired speed-up and final-accuracy change, for settings
    swept on >= 2 partitions. A partition where some seed's FedAvg or FedLPS run misses the
    target (within the fixed rounds) has fewer speed-up pairs than seeds (shown as k/n) and is
    left out of the speed-up's over-partition statistics; the accuracy change has every pair."""
    groups: dict[tuple, dict[int, list[dict]]] = {}
    for res in sweeps:
        cfg = res["config"]
        same = tuple(sorted((k, str(v)) for k, v in cfg.items() if k not in PER_FILE))
        for setting, rec in res["settings"].items():
            part = groups.setdefault((cfg["dataset"], cfg["model"], setting, same), {})
            part.setdefault(cfg["seed"], []).extend(rec["runs"])
    lines = [
        "| dataset | model | setting | beta | partitions | speed-up per partition (mean over "
        "seeds with both runs at the target, k/n) | speed-up over complete partitions: mean +- "
        "std [95% CI] (partitions) | final acc - FedAvg's per partition (points) | final acc "
        "change over partitions | final loss - FedAvg's per partition |",
        "|---|---|---|---:|---:|---|---:|---|---:|---|",
    ]
    for (dataset, model, setting, _), parts in groups.items():
        if len(parts) < 2:
            continue
        betas = sorted({r["beta"] for runs in parts.values() for r in runs} - {1.0}, reverse=True)
        for beta in betas:
            have = {p: paired_changes(runs, beta) for p, runs in sorted(parts.items())
                    if any(r["beta"] == beta for r in runs)}  # fmt: skip
            if len(have) < 2:
                continue
            per = ", ".join(
                f"{p}: {c['speedup'].mean():.2f} ({c['speedup'].size}/{c['acc'].size})"
                if c["speedup"].size
                else f"{p}: - (0/{c['acc'].size})"
                for p, c in have.items()
            )
            full = [
                c["speedup"].mean() for c in have.values() if c["speedup"].size == c["acc"].size
            ]
            over = f"{_over(full)} ({len(full)})" if len(full) >= 2 else f"- ({len(full)})"
            acc = ", ".join(f"{c['acc'].mean():+.2f}" for c in have.values())
            loss = ", ".join(f"{c['loss'].mean():+.4f}" for c in have.values())
            lines.append(
                f"| {dataset} | {model} | {setting} | {beta:g} | {len(have)} | {per} | {over} | "
                f"{acc} | {_over([c['acc'].mean() for c in have.values()])} | {loss} |"
            )
    return "\n".join(lines) + "\n" if len(lines) > 2 else None


def main() -> None:
    sweeps = load_sweeps()
    if sweeps:
        text = seeds_table(sweeps)
        with open(os.path.join(RESULTS, "table_seeds.md"), "w") as f:
            f.write(text)
        print(text)
        parts = partitions_table(sweeps)
        if parts:
            with open(os.path.join(RESULTS, "table_partitions.md"), "w") as f:
                f.write(parts)
            print(parts)
    results = load()
    print(table(results))
    for path in curves(results):
        print(f"wrote {path}")
    graph_path = os.path.join(RESULTS, "graph_analysis.json")
    if os.path.exists(graph_path):
        with open(graph_path) as f:
            rows = json.load(f)
        print(
            "\n| dataset | features | a | b | median mis | pairs m_i.m_n<0 | Laplacian l2 / l_max |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            feats = "standardised" if r["standardised"] else "raw [0,1]"
            print(
                f"| {r['dataset']} | {feats} | {r['a']:g} | {r['b']:g} | {r['mis_median']:.3f} | "
                f"{r['opposite_fraction']:.2f} | {r['lap_l2']:.3g} / {r['lap_max']:.3g} |"
            )


if __name__ == "__main__":
    main()
