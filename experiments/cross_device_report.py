"""Tables and plot of `cross_device_clock.py` (`results/cross_device/clock_sync<tag>.json`:
the FedAvg variants; `clock_async<tag>.json`: FedBuff and AREA, if there;
`clock_async_conc32<tag>.json`: FedBuff and AREA with at most 32 clients training, FedAvg's
cohort, if there: methods `FedBuff@32` and `AREA@32`).

    PYTHONPATH=. python experiments/cross_device_report.py [--tag TAG]

Writes `clock<tag>.md` (per method: final accuracy, virtual hours, mean round time, late and
dropped clients, time to target; speed-ups paired by seed) and `clock<tag>.png` (test
accuracy against virtual hours, mean over seeds with the 95% CI band).

The target (fixed before the runs): TARGET_FRACTION x plain FedAvg's final test accuracy,
averaged over the seeds. A run's time to target is the virtual time of its first evaluation
at or above the target; a run that never reaches it is censored at its last evaluation (a
lower bound, counted in the tables). `experiments/verdicts.py` reads the same functions.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from fedjax_sim.run.sweep import mean_ci

DIR = os.path.join(os.path.dirname(__file__), "results", "cross_device")
CAP = 32  # the equal-concurrency runs' cap on clients training: FedAvg's cohort
CAPPED = {m: f"{m}@{CAP}" for m in ("FedBuff", "AREA")}  # their methods' names here
METHODS = ("FedAvg", "FedAvg+OS", "FedAvg+DL", "FedAvg+OS+DL", "FedBuff", "AREA", *CAPPED.values())
SYNC = METHODS[:4]
TARGET_FRACTION = 0.9


class Incomplete(Exception):
    """A result file without every method x seed run its config asks for."""


def load(path: str) -> dict:
    """`{method: {seed: run}}` of a complete result file (`Incomplete` otherwise)."""
    with open(path) as f:
        blob = json.load(f)
    cfg = blob["config"]
    runs: dict[str, dict[int, dict]] = {}
    for r in blob["runs"]:
        runs.setdefault(r["method"], {})[r["seed"]] = r
    for m in cfg["methods"]:
        have = runs.get(m, {})
        if sorted(have) != sorted(cfg["seeds_list"]):
            raise Incomplete(f"`{os.path.basename(path)}`: {m} has seeds {sorted(have)}")
        if m in SYNC and any(len(r["round_time"]) != cfg["rounds"] for r in have.values()):
            raise Incomplete(f"`{os.path.basename(path)}`: {m} stops before {cfg['rounds']}")
    return runs


def load_capped(path: str) -> dict:
    """`load` of a `cross_device_clock.py --concurrency CAP` file, its methods renamed
    `<method>@CAP` (`CAPPED`); `Incomplete` if its cap is not CAP."""
    with open(path) as f:
        k = json.load(f)["config"].get("concurrency")
    if k != CAP:
        raise Incomplete(f"`{os.path.basename(path)}`: concurrency {k}, not {CAP}")
    return {CAPPED[m]: r for m, r in load(path).items()}


def load_all(tag: str = "") -> tuple[dict, dict]:
    """`(runs, config)` of `clock_sync<tag>.json` merged with `clock_async<tag>.json` and
    `clock_async_conc<CAP><tag>.json` when they exist (the same seeds); the config is the
    synchronous file's."""
    sync = os.path.join(DIR, f"clock_sync{tag}.json")
    with open(sync) as f:
        cfg = json.load(f)["config"]
    runs = load(sync)
    path = os.path.join(DIR, f"clock_async{tag}.json")
    if os.path.exists(path):
        runs |= load(path)
    path = os.path.join(DIR, f"clock_async_conc{CAP}{tag}.json")
    if os.path.exists(path):
        runs |= load_capped(path)
    return runs, cfg


def target(runs: dict) -> float:
    finals = [r["test_accuracy"][-1] for r in runs["FedAvg"].values()]
    return TARGET_FRACTION * float(np.mean(finals))


def time_to_target(run: dict, level: float) -> tuple[float, bool]:
    """(virtual hours of the first evaluation at or above `level`, reached?); not reached:
    the last evaluation's hours (a lower bound)."""
    acc = np.asarray(run["test_accuracy"])
    hit = np.flatnonzero(acc >= level)
    return (float(run["hours"][hit[0]]), True) if hit.size else (float(run["hours"][-1]), False)


def hours_to_target(runs: dict, method: str) -> dict[int, float]:
    level = target(runs)
    return {s: time_to_target(r, level)[0] for s, r in runs[method].items()}


def missed_target(runs: dict, method: str) -> int:
    """How many of `method`'s runs never reach the target."""
    level = target(runs)
    return sum(not time_to_target(r, level)[1] for r in runs[method].values())


def speedup(runs: dict, base: str, method: str) -> np.ndarray:
    """Per seed: `base`'s time to target / `method`'s (> 1: `method` is faster)."""
    a, b = hours_to_target(runs, base), hours_to_target(runs, method)
    return np.array([a[s] / b[s] for s in sorted(set(a) & set(b))], np.float64)


def mean_round_time(runs: dict, method: str) -> dict[int, float]:
    return {s: float(np.mean(r["round_time"])) for s, r in runs[method].items()}


def round_time_ratio(runs: dict, base: str, method: str) -> np.ndarray:
    """Per seed: `base`'s mean round time / `method`'s."""
    a, b = mean_round_time(runs, base), mean_round_time(runs, method)
    return np.array([a[s] / b[s] for s in sorted(set(a) & set(b))], np.float64)


def ci(v) -> str:
    v = np.asarray(v, np.float64)
    mean, half, std = mean_ci(v)
    return f"{mean:.3f} +- {std:.3f} [{mean - half:.3f}, {mean + half:.3f}]"


def tables(runs: dict, cfg: dict) -> str:
    level = target(runs)
    out = [
        f"Target: {TARGET_FRACTION} x plain FedAvg's mean final test accuracy = {level:.4f}; "
        f"n = {len(cfg['seeds_list'])} seeds ({cfg['seeds_list'][0]}-{cfg['seeds_list'][-1]}), "
        "mean +- std [95% CI].",
        "",
        "| method | final test acc | virtual hours run | mean round time (s) | late / dropped "
        "clients per round | hours to target | reached |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in (m for m in METHODS if m in runs):
        rs = [runs[m][s] for s in sorted(runs[m])]
        ttt = [time_to_target(r, level) for r in rs]
        rt = late = "-"
        if m in SYNC:
            rt = ci([np.mean(r["round_time"]) for r in rs])
            n = cfg["rounds"]
            late = (f"{np.mean([r['late'] for r in rs]) / n:.1f} / "
                    f"{np.mean([r['dropouts'] for r in rs]) / n:.2f}")  # fmt: skip
        out.append(
            f"| {m} | {ci([r['test_accuracy'][-1] for r in rs])} | "
            f"{np.mean([r['hours'][-1] for r in rs]):.3f} | {rt} | {late} | "
            f"{ci([t for t, _ in ttt])} | {sum(ok for _, ok in ttt)}/{len(ttt)} |"
        )
    if any(m in runs for m in CAPPED.values()):
        out += ["", f"`@{CAP}`: at most {CAP} clients training at once (`--concurrency {CAP}`, "
                "FedAvg's cohort); the others keep all "
                f"{cfg['clients']} clients training."]  # fmt: skip
    out += ["", "Speed-up to the target, paired by seed (FedAvg's hours / the method's):", ""]
    out += ["| method | vs FedAvg | vs FedAvg+OS+DL |", "|---|---|---|"]
    for m in (m for m in METHODS[1:] if m in runs):
        vs = ci(speedup(runs, "FedAvg+OS+DL", m)) if m not in SYNC else "-"
        out.append(f"| {m} | {ci(speedup(runs, 'FedAvg', m))} | {vs} |")
    return "\n".join(out) + "\n"


def plot(runs: dict, cfg: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colour = {}
    for m in (m for m in METHODS if m in runs):
        rs = list(runs[m].values())
        end = min(r["hours"][-1] for r in rs)
        grid = np.linspace(0, end, 200)
        v = np.array([np.interp(grid, r["hours"], r["test_accuracy"]) for r in rs])
        st = np.array([mean_ci(c) for c in v.T])
        base = m.split("@")[0]  # a capped run: its uncapped method's colour, dashed
        style = dict(color=colour[base], ls="--") if base in colour and base != m else {}
        (line,) = ax.plot(grid, st[:, 0], label=m, **style)
        colour.setdefault(m, line.get_color())
        ax.fill_between(grid, st[:, 0] - st[:, 1], st[:, 0] + st[:, 1], color=line.get_color(),
                        alpha=0.15)  # fmt: skip
    ax.axhline(target(runs), color="grey", ls=":", lw=1, label="target")
    title = f"Fashion-MNIST logistic, bundled trace, {len(cfg['seeds_list'])} seeds (95% CI)"
    ax.set(xlabel="virtual hours (linear below 0.05, log above)", ylabel="test accuracy",
           ylim=(0.3, 0.85), title=title)  # fmt: skip
    ax.set_xscale("symlog", linthresh=0.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    runs, cfg = load_all(args.tag)
    text = tables(runs, cfg)
    with open(os.path.join(DIR, f"clock{args.tag}.md"), "w") as f:
        f.write(text)
    plot(runs, cfg, os.path.join(DIR, f"clock{args.tag}.png"))
    print(text)


if __name__ == "__main__":
    main()
