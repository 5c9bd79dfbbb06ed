"""Table (markdown) and curves (PNG) of `fedmim_fmnist.py`'s results.

    PYTHONPATH=. python experiments/fedmim_report.py
Reads experiments/results/fedmim/dir*.json, writes table.md and curves.png there.

C_t / A^2: FedMIM's and FedCM's local gradient step is damped by A = 1 - sum(alpha) = 0.1
(FedMIM alpha = (0.6, 0.3)) and a = 1 - momentum = 0.1 (FedCM), while the inertia /
momentum term is common to all clients and cancels in x_i - x_{t+1}; the client drift, and
so C_t, then scales like A^2 (spec 8 item 5). Dividing by A^2 compares the drift per unit of
gradient step with FedAvg's (A = 1). The ratio column is that normalised C_t over FedAvg's.

    PYTHONPATH=. python experiments/fedmim_report.py --seeds
reads the multi-seed sweeps `sweep_dir*.json` of `fedmim_fmnist.py --seeds N` instead and
writes `table_seeds_<name>.md` and `curves_seeds_<name>.png` per file. Selection rule (the
paper's "search for their best performance", with the client lr as the tuned knob): per
method, the lr of its grid with the highest mean (over seeds) final test accuracy; the paper's
literal protocol (one common lr 0.1 for every method) is reported beside it. Differences are
FedMIM minus each baseline paired by seed (same initial model and partition), mean and 95%
Student-t CI.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from fedjax_sim.run.sweep import mean_ci  # noqa: E402

DIR = os.path.join(os.path.dirname(__file__), "results", "fedmim")
# gradient-step damping of fedmim_fmnist.py's configurations (1 for the undamped methods)
DAMPING = {"FedMIM": 1.0 - (0.6 + 0.3), "FedCM": 1.0 - 0.9}


WINDOW = 20  # C_t: mean over the last WINDOW rounds of each run
COMMON_LR = 0.1  # the paper's common local lr (Table I: the same for every method)


def _fmt(v: np.ndarray, scale: float = 100.0, digits: int = 2) -> str:
    mean, _, std = mean_ci(v)
    return f"{scale * mean:.{digits}f} +- {scale * std:.{digits}f}"


def _ci(d: np.ndarray, scale: float = 100.0, digits: int = 2) -> str:
    mean, half, _ = mean_ci(d)
    lo, hi = scale * (mean - half), scale * (mean + half)
    return f"{scale * mean:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def seed_arrays(runs: list[dict]) -> dict[float, dict[str, np.ndarray]]:
    """`{lr: {seed, final, best, ct}}` (arrays over seeds, in seed order)."""
    out: dict[float, dict[str, list]] = {}
    for r in sorted(runs, key=lambda r: (r["lr"], r["seed"])):
        d = out.setdefault(r["lr"], {"seed": [], "final": [], "best": [], "ct": []})
        d["seed"].append(r["seed"])
        d["final"].append(r["accuracy"][-1])
        d["best"].append(max(r["accuracy"]))
        d["ct"].append(float(np.mean(np.asarray(r["consistency"], np.float64)[-WINDOW:])))
    return {lr: {k: np.asarray(v, np.float64) for k, v in d.items()} for lr, d in out.items()}


def merged(paths: list[str]) -> dict:
    """The sweeps of one partition (`sweep_dir<alpha>.json` and grid extensions
    `sweep_dir<alpha>_<tag>.json`, same setting, other lrs) as one: runs and grids joined per
    method, seconds summed."""
    blob = json.load(open(paths[0]))
    for path in paths[1:]:
        more = json.load(open(path))
        keep = ("dirichlet", "rounds", "local_steps", "cohort", "clients", "per_client", "test")
        assert all(more["config"][k] == blob["config"][k] for k in keep), path
        for m, v in more["methods"].items():
            if m not in blob["methods"]:
                blob["methods"][m] = {"seconds": 0.0, "runs": []}
                blob["grids"][m] = []
            blob["methods"][m]["runs"] += v["runs"]
            blob["methods"][m]["seconds"] += v["seconds"]
            blob["grids"][m] = sorted(set(blob["grids"][m]) | set(more["grids"][m]))
    blob["files"] = [os.path.basename(p) for p in paths]
    return blob


def selections(paths: list[str]) -> tuple[dict, dict, dict]:
    """(merged sweep, `{method: seed_arrays}`, `{method: selected lr}`) of one partition's
    files; the selection rule: the lr with the highest mean final accuracy."""
    blob = merged(paths)
    arr = {m: seed_arrays(v["runs"]) for m, v in blob["methods"].items()}
    chosen = {m: max(a, key=lambda lr, a=a: a[lr]["final"].mean()) for m, a in arr.items()}
    return blob, arr, chosen


def seeds_report(paths: list[str]) -> str:
    """Tables (lr grid; selected lr per method; FedMIM minus each baseline, paired) and the
    mean +- 95% CI curves of the `sweep_dir<alpha>*.json` files of one partition."""
    blob, arr, chosen = selections(paths)
    path = paths[0]
    name = os.path.basename(path)[len("sweep_") : -len(".json")]
    cfg = blob["config"]
    n = {m: a[chosen[m]]["final"].size for m, a in arr.items()}
    lines = [
        f"# FedMIM Table I at CPU scale, {name}: {cfg['seeds']} seeds x per-method lr grid",
        "",
        f"Fashion-MNIST, balanced Dirichlet({cfg['dirichlet']:g}) over {cfg['clients']} clients "
        f"x {cfg['per_client']} examples, S = {cfg['cohort']}, K = {cfg['local_steps']} steps "
        f"of B = {cfg['batch_size']}, lr x {cfg['lr_decay']}^t, {cfg['rounds']} rounds, test "
        f"accuracy on {cfg['test']} test images. Final = last evaluation (round "
        f"{cfg['rounds']}), best = max over the evaluations every {cfg['eval_every']} rounds; "
        f"C_t = mean over the last {WINDOW} rounds. Mean +- std (ddof 1) over seeds. "
        f"Files: {', '.join(blob['files'])}.",
        "",
        "## Every grid point (selected lr marked *)",
        "",
        "| method | lr | n | final acc (%) | best acc (%) | C_t | C_t / A^2 | runs at chance "
        "(non-finite) | s (method) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m, a in arr.items():
        for lr, d in a.items():
            runs = [r for r in blob["methods"][m]["runs"] if r["lr"] == lr]
            bad = sum(r["nonfinite_round"] is not None for r in runs)
            chance = sum(r["accuracy"][-1] < 0.15 for r in runs)  # 10 classes: 0.10
            mark = "*" if lr == chosen[m] else ""
            lines.append(
                f"| {m} | {lr:g}{mark} | {d['final'].size} | {_fmt(d['final'])} | "
                f"{_fmt(d['best'])} | {_fmt(d['ct'], 1, 4)} | "
                f"{_fmt(d['ct'] / DAMPING.get(m, 1.0) ** 2, 1, 4)} | {chance} ({bad}) | "
                f"{blob['methods'][m]['seconds']:.0f} |"
            )
    ref = arr["FedAvg"][chosen["FedAvg"]]["ct"] if "FedAvg" in arr else None
    lines += [
        "",
        "## Selected lr per method (highest mean final accuracy); C_t raw and over A^2",
        "",
        "| method | lr | n | final acc (%) | best acc (%) | C_t | A | C_t / A^2 | over FedAvg's |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m, a in arr.items():
        d, amp = a[chosen[m]], DAMPING.get(m, 1.0)
        norm = d["ct"] / amp**2
        ratio = f"{norm.mean() / ref.mean():.3g}x" if ref is not None else "-"
        lines.append(
            f"| {m} | {chosen[m]:g} | {n[m]} | {_fmt(d['final'])} | {_fmt(d['best'])} | "
            f"{_fmt(d['ct'], 1, 4)} | {amp:.2g} | {_fmt(norm, 1, 4)} | {ratio} |"
        )
    if "FedMIM" in arr:
        mim = arr["FedMIM"]
        lines += [
            "",
            "## FedMIM minus each baseline, paired by seed: mean [95% CI] (seeds FedMIM ahead)",
            "",
            "| baseline | final acc, selected lrs | best acc, selected lrs | final acc, common "
            f"lr {COMMON_LR:g} | C_t, selected lrs | C_t / A^2, selected lrs | C_t / A^2, "
            f"common lr {COMMON_LR:g} |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for m, a in arr.items():
            if m == "FedMIM":
                continue
            x, y = mim[chosen["FedMIM"]], a[chosen[m]]
            assert np.array_equal(x["seed"], y["seed"]), (m, x["seed"], y["seed"])
            cells = []
            for key in ("final", "best"):
                dd = x[key] - y[key]
                cells.append(f"{_ci(dd)} ({int((dd > 0).sum())}/{dd.size})")
            if COMMON_LR in mim and COMMON_LR in a:
                dd = mim[COMMON_LR]["final"] - a[COMMON_LR]["final"]
                cells.append(f"{_ci(dd)} ({int((dd > 0).sum())}/{dd.size})")
            else:
                cells.append("-")
            amp_x, amp_y = DAMPING["FedMIM"], DAMPING.get(m, 1.0)
            dc = x["ct"] - y["ct"]
            dn = x["ct"] / amp_x**2 - y["ct"] / amp_y**2
            cells.append(_ci(dc, 1.0, 4) + f" ({int((dc < 0).sum())}/{dc.size} lower)")
            cells.append(_ci(dn, 1.0, 4) + f" ({int((dn < 0).sum())}/{dn.size} lower)")
            if COMMON_LR in mim and COMMON_LR in a:
                dn = mim[COMMON_LR]["ct"] / amp_x**2 - a[COMMON_LR]["ct"] / amp_y**2
                cells.append(_ci(dn, 1.0, 4) + f" ({int((dn < 0).sum())}/{dn.size} lower)")
            else:
                cells.append("-")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    out = os.path.dirname(path)
    with open(os.path.join(out, f"table_seeds_{name}.md"), "w") as f:
        f.write(text)
    plot_seeds(blob, chosen, os.path.join(out, f"curves_seeds_{name}.png"), name)
    return text


def plot_seeds(blob: dict, chosen: dict, path: str, name: str) -> None:
    """Test accuracy and C_t per method at its selected lr: mean and 95% CI band over seeds."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for m, v in blob["methods"].items():
        runs = [r for r in v["runs"] if r["lr"] == chosen[m]]
        for ax, key in zip(axes, ("accuracy", "consistency"), strict=True):
            vals = np.asarray([r[key] for r in runs], np.float64)  # [S, T]
            x = runs[0]["rounds"] if key == "accuracy" else np.arange(1, vals.shape[1] + 1)
            stats = np.array([mean_ci(vals[:, t]) for t in range(vals.shape[1])])
            mean, half = stats[:, 0], np.nan_to_num(stats[:, 1])
            scale = 100.0 if key == "accuracy" else 1.0
            (line,) = ax.plot(x, scale * mean, lw=1.5, label=f"{m} (lr {chosen[m]:g})")
            ax.fill_between(x, scale * (mean - half), scale * (mean + half),
                            color=line.get_color(), alpha=0.2)  # fmt: skip
    n = len(blob["methods"]["FedMIM"]["runs"]) // len(blob["grids"]["FedMIM"])
    axes[0].set(xlabel="round", ylabel="test accuracy (%)",
                title=f"{name}: test accuracy, mean and 95% CI over {n} seeds")  # fmt: skip
    axes[1].set(xlabel="round", ylabel="C_t", yscale="log", title=f"{name}: consistency C_t")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def partition_groups() -> dict[str, list[str]]:
    """`{partition: [sweep_dir<alpha>.json, its grid extensions...]}`, the main sweep first.
    Confirmation runs on fresh seeds (`sweep_dir<alpha>_fresh*.json`) are not part of the
    selection grid and are left out."""
    groups: dict[str, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(DIR, "sweep_dir*.json"))):
        if "_fresh" not in os.path.basename(path):
            groups.setdefault(os.path.basename(path)[6:-5].split("_")[0], []).append(path)
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", action="store_true", help="report the sweep_dir*.json files")
    if ap.parse_args().seeds:
        for paths in partition_groups().values():
            print(seeds_report(paths))
        return
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
