"""Table of the committed `fgdro_imbalanced_fmnist.py` results with the worst-class LOSS.

    PYTHONPATH=. python experiments/fgdro_report.py
Reads experiments/results/fgdro/fmnist_dir*.json and writes table_fmnist.md there: per
partition and method, the final worst-class accuracy, worst-class test loss (largest
per-class mean cross-entropy on the balanced 10k test set), mean per-class loss and test
accuracy, mean (std) over the seeds in the file. The worst-class accuracy is 0 for almost
every method at the committed scale (30 rounds x 4 local steps), so the worst-class loss is
the informative robustness metric there.

    PYTHONPATH=. python experiments/fgdro_report.py --seeds experiments/results/fgdro/FILE.json
reports one multi-seed step-size sweep of `fgdro_imbalanced_fmnist.py` (rows with an `lr`)
instead, into FILE_table.md and FILE.png. Several files of one setting (same hparams and
rounds, e.g. a grid's lower decades run later) are merged into one grid with `--seeds F1 F2
... --out STEM`; a (method, lr, seed) run present in two files must agree in every final
metric and curve (it is kept once). Selection rule (the paper tunes each method's
initial step size on a grid and reports its worst-case and average accuracy; it does not say
on which metric it selects): per method, the lr with the highest mean final worst-class
accuracy, ties broken by the lowest mean worst-class loss; a step size with a non-finite run
(diverged in any seed) is not selected. Differences are paired by seed
(same initial model, same partition), mean and 95% Student-t CI.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import numpy as np

from fedjax_sim.run.sweep import mean_ci

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


# the paper's Table 7 (imbalanced CIFAR-10): worst-class / average accuracy per Dirichlet alpha
PAPER_TABLE7 = {
    0.3: {
        "FedAvg": (0.3140, 0.6236), "SCAFFOLD": (0.3245, 0.6337), "FedProx": (0.3102, 0.6189),
        "FedAdam": (0.4860, 0.7147), "DRFA": (0.3215, 0.6381), "DR-DSGD": (0.3277, 0.6403),
        "FGDRO-CVaR": (0.4100, 0.6606), "FGDRO-KL": (0.3560, 0.6369),
        "FGDRO-KL-Adam": (0.5280, 0.7057),
    },
    10.0: {
        "FedAvg": (0.3620, 0.6742), "SCAFFOLD": (0.3821, 0.6816), "FedProx": (0.3757, 0.6925),
        "FedAdam": (0.4460, 0.7042), "DRFA": (0.3752, 0.6739), "DR-DSGD": (0.3700, 0.6792),
        "FGDRO-CVaR": (0.4010, 0.6882), "FGDRO-KL": (0.4110, 0.6951),
        "FGDRO-KL-Adam": (0.5110, 0.7286),
    },
}  # fmt: skip
METRICS = (  # (column, final key, higher is better)
    ("worst-class acc", "test_classes_accuracy_worst", True),
    ("worst-class loss", "test_classes_loss_worst", False),
    ("test acc", "test_accuracy", True),
)
ORDER = ("FGDRO-KL-Adam", "FedAdam", "FGDRO-CVaR", "FGDRO-KL")  # the paper's worst-acc order


def _ms(v: np.ndarray) -> str:
    mean, _, std = mean_ci(v)
    return f"{mean:.4f} +- {std:.4f}"


def _pair(d: np.ndarray, higher: bool) -> str:
    mean, half, _ = mean_ci(d)
    better = int((d > 0).sum() if higher else (d < 0).sum())
    return f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}] ({better}/{d.size})"


def config(r: dict, hparams: dict) -> tuple[float, float]:
    """A row's tuned hyper-parameters (lr, beta); `beta` is the file's default where the row
    did not sweep it."""
    return r["lr"], r.get("beta", hparams["beta"])


def lr_label(cfg: tuple[float, float], cfgs) -> str:
    """`cfg`'s step size, with its beta where the method's `cfgs` hold more than one."""
    lr, beta = cfg
    return f"{lr:g}" + (f" (beta {beta:g})" if len({b for _, b in cfgs}) > 1 else "")


def load_sweeps(paths: list[str]) -> tuple[dict, list[dict]]:
    """(hparams, rows) of one or more sweep files of the same setting, each (method, lr, beta,
    seed) run once; raises ValueError on differing settings or on a repeated run that
    differs."""
    hparams, runs = None, {}
    for path in paths:
        with open(path) as f:
            blob = json.load(f)
        if hparams is None:
            hparams = blob["hparams"]
        elif blob["hparams"] != hparams:
            diff = sorted(k for k in {*hparams, *blob["hparams"]}
                          if hparams.get(k) != blob["hparams"].get(k))  # fmt: skip
            raise ValueError(f"{path}: hparams {diff} differ from {paths[0]}'s")
        for r in blob["rows"]:
            key = (r["method"], *config(r, hparams), r["seed"])
            # wall time may differ; `beta` is in the key (a row may leave the default implicit)
            same = {k: v for k, v in r.items() if k not in ("seconds", "beta")}
            if key in runs and {k: v for k, v in runs[key].items()
                                if k not in ("seconds", "beta")} != same:  # fmt: skip
                raise ValueError(f"{path}: run {key} differs from the same run in an earlier file")
            runs.setdefault(key, r)
    rows = list(runs.values())
    if len({tuple(r["curve_rounds"]) for r in rows}) > 1:
        raise ValueError(f"{paths}: the files differ in their evaluation rounds")
    return hparams, rows


def selections(paths: list[str]) -> tuple[dict, list[dict], dict, dict]:
    """(hparams, rows, arrays, chosen) of one step-size sweep (one or more files of one
    setting): `arrays[method][(lr, beta)]` holds the per-seed final metrics (seed order),
    `chosen[method]` the (lr, beta) the module's selection rule picks."""
    hp, rows = load_sweeps(paths)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    arr: dict[str, dict[tuple, dict[str, np.ndarray]]] = {}
    for m in methods:
        for cfg in sorted({config(r, hp) for r in rows if r["method"] == m}):
            sel = sorted((r for r in rows if r["method"] == m and config(r, hp) == cfg),
                         key=lambda r: r["seed"])  # fmt: skip
            d = {key: np.array([r["final"][key] for r in sel]) for _, key, _ in METRICS}
            d["seed"] = np.array([r["seed"] for r in sel])
            d["initial_loss"] = np.array([r["curve_worst_loss"][0] for r in sel])  # round 0
            d["diverged"] = sum(r.get("nonfinite_round") is not None for r in sel)
            arr.setdefault(m, {})[cfg] = d
    acc, loss = METRICS[0][1], METRICS[1][1]
    chosen = {m: max(a, key=lambda c, a=a: (a[c]["diverged"] == 0, a[c][acc].mean(),
                                            -a[c][loss].mean()))
              for m, a in arr.items()}  # fmt: skip
    return hp, rows, arr, chosen


def seeds_report(paths: list[str], stem: str) -> str:
    """Grid table, selected step size per method, paired differences vs FedAvg and along the
    paper's worst-class order, and the mean +- 95% CI curves of one step-size sweep (one or
    more files of one setting), written to STEM_table.md and STEM.png."""
    hp, rows, arr, chosen = selections(paths)
    methods = list(arr)
    loss = METRICS[1][1]
    papers = PAPER_TABLE7.get(float(hp["alpha"]), {})  # {} for an alpha the paper did not run
    n_seeds = len(arr[methods[0]][chosen[methods[0]]]["seed"])
    cols = " | ".join(c for c, _, _ in METRICS)
    lines = [
        f"# FGDRO Table 7 at CPU scale: imbalanced Fashion-MNIST, Dir({hp['alpha']:g}), "
        f"{n_seeds} seeds x per-method step-size grid",
        "",
        f"I = {hp['I']} local steps of B = {hp['B']}, final model; mean +- std (ddof 1) over "
        "seeds. Selected lr: highest mean worst-class accuracy, ties by lowest worst-class loss, "
        "step sizes with a diverged (non-finite) run excluded"
        + (
            " (lr and beta jointly where beta was swept)."
            if any(len({b for _, b in a}) > 1 for a in arr.values())
            else "."
        ),
        "",
        "## Every grid point (selected lr marked *)",
        "",
        f"| method | lr | n | {cols} | diverged runs |",
        "|---|---:|---:|" + "---:|" * len(METRICS) + "---:|",
    ]
    for m, a in arr.items():
        for cfg, d in a.items():
            cells = " | ".join(_ms(d[key]) for _, key, _ in METRICS)
            mark = "*" if cfg == chosen[m] else ""
            lines.append(
                f"| {m} | {lr_label(cfg, a)}{mark} | {d['seed'].size} | {cells} | {d['diverged']} |"
            )
    lines += [
        "",
        f"## Selected lr per method, with the paper's Dir({hp['alpha']:g}) worst / average "
        "(CIFAR-10)",
        "",
        "Worst-class loss minus the initial model's (round 0, same seed), paired: below 0 when "
        "training lowered the worst class's loss at all.",
        "",
        f"| method | lr | n | {cols} | worst-class loss - initial (seeds below) "
        "| paper worst / avg |",
        "|---|---:|---:|" + "---:|" * len(METRICS) + "---:|---:|",
    ]
    for m, a in arr.items():
        d = a[chosen[m]]
        cells = " | ".join(_ms(d[key]) for _, key, _ in METRICS)
        gain = _pair(d[loss] - d["initial_loss"], higher=False)
        paper = "{:.4f} / {:.4f}".format(*papers[m]) if m in papers else "-"
        lines.append(
            f"| {m} | {lr_label(chosen[m], a)} | {d['seed'].size} | {cells} | {gain} | {paper} |"
        )

    def paired(x: str, y: str) -> str:
        dx, dy = arr[x][chosen[x]], arr[y][chosen[y]]
        assert np.array_equal(dx["seed"], dy["seed"]), (x, y)
        return " | ".join(_pair(dx[k] - dy[k], hi) for _, k, hi in METRICS)

    head = " | ".join(f"{c} (seeds better)" for c, _, _ in METRICS)
    lines += [
        "",
        "## Each method minus FedAvg, paired by seed: mean [95% CI]",
        "",
        f"| method | {head} |",
        "|---|" + "---:|" * len(METRICS),
    ]
    lines += [f"| {m} | {paired(m, 'FedAvg')} |" for m in methods if m != "FedAvg"]
    pairs = [*zip(ORDER, ORDER[1:], strict=False), ("FGDRO-KL-Adam", "FGDRO-KL"),
             ("FGDRO-KL-Adam", "DRFA")]  # fmt: skip
    pairs = [(x, y) for x, y in pairs if x in arr and y in arr]
    if pairs:  # a file without the paper's ordered methods (e.g. SCAFFOLD / FedProx only)
        lines += [
            "",
            "## The paper's worst-class order (KL-Adam > FedAdam > CVaR > KL > DRFA), adjacent "
            "pairs, and KL-Adam minus KL / DRFA",
            "",
            f"| pair | {head} |",
            "|---|" + "---:|" * len(METRICS),
        ]
        lines += [f"| {x} minus {y} | {paired(x, y)} |" for x, y in pairs]
    text = "\n".join(lines) + "\n"
    with open(stem + "_table.md", "w") as f:
        f.write(text)
    plot_seeds(rows, hp, {m: (c, lr_label(c, arr[m])) for m, c in chosen.items()}, stem + ".png",
               f"Dir({hp['alpha']:g})")  # fmt: skip
    return text


def plot_seeds(rows: list[dict], hp: dict, chosen: dict, path: str, title: str) -> None:
    """Worst-class accuracy, worst-class loss and test accuracy over rounds per method at its
    selected `chosen[method] = (config, label)`: mean and 95% CI band over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (("curve_worst", "worst-class acc"), ("curve_worst_loss", "worst-class loss"),
            ("curve_mean", "test acc"))  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for m, (cfg, name) in chosen.items():
        sel = [r for r in rows if r["method"] == m and config(r, hp) == cfg]
        x = sel[0]["curve_rounds"]
        for ax, (key, label) in zip(axes, keys, strict=True):
            v = np.asarray([r[key] for r in sel], np.float64)
            stats = np.array([mean_ci(v[:, t]) for t in range(v.shape[1])])
            mean, half = stats[:, 0], np.nan_to_num(stats[:, 1])
            (line,) = ax.plot(x, mean, lw=1.5, label=f"{m} (lr {name})")
            ax.fill_between(x, mean - half, mean + half, color=line.get_color(), alpha=0.2)
            ax.set(xlabel="round", ylabel=label, title=f"{title}: {label}, mean and 95% CI")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", nargs="+", default=None, metavar="FILE",
                    help="a step-size sweep's JSON (several: merged into one grid)")  # fmt: skip
    ap.add_argument("--out", default=None, metavar="STEM",
                    help="output stem (default: the --seeds file without .json)")  # fmt: skip
    args = ap.parse_args()
    if args.seeds:
        if args.out is None and len(args.seeds) > 1:
            ap.error("--out STEM is required with several --seeds files")
        stem = args.out or args.seeds[0].removesuffix(".json")
        try:
            print(seeds_report(args.seeds, stem))
        except ValueError as e:
            ap.exit(2, f"fgdro_report.py: error: {e}\n")
        return
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
