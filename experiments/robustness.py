"""Byzantine robustness of FedAvg's aggregators on sklearn digits (issue 21, item 5.2).

FedAvg with the plain mean vs each robust aggregator (coordinate-wise median, trimmed mean,
Krum, Multi-Krum, geometric median (RFA), centered clipping) under each attack (sign flip,
scaling / model replacement, Gaussian noise, ALIE, label flipping) with 10 % and 20 %
Byzantine clients, plus the no-attack row of every aggregator; final test accuracy over 3
seeds.

Setting: the CLI's default digits split (Dirichlet(0.5) label skew, 20 % of each client held
out, the central test set is their union) over C = 50 clients, full participation (so the
Byzantine count per round is exactly 5 or 10), MLP 64-64-10, 10 local steps of batch 16 at
client lr 0.1, server lr 1, 100 rounds. The Byzantine clients are a fixed set drawn from
`--seed 0` (the same set for the three seeds: `fedjax-sim sweep` varies the run key, not the
data or the attack's set). Defender settings assume up to 20 % Byzantine clients whatever the
true fraction (f = 10 of 50): trimmed mean beta = 0.2, Krum f = 10, Multi-Krum f = 10 and m =
n - f = 40, geometric median 10 smoothed Weiszfeld iterations (nu = 1e-6), centered clipping
tau = 1 and 1 iteration (the library defaults). Attack parameters are the library defaults:
sign flip -1 x, scaling x10, Gaussian N(0, 1) per coordinate, ALIE z = 1.

Each (aggregator, attack, fraction) is one `fedjax_sim.run.sweep.sweep` over 3 seeds, i.e.

    fedjax-sim sweep --seeds 3 --num-clients 50 --cohort-size None --rounds 100 \
        --eval-every 25 --aggregator AGG --aggregator-args ... --attack ATTACK \
        --byzantine-fraction F --runs-per-group 3

    PYTHONPATH=$PWD nice -n 10 python experiments/robustness.py

Writes experiments/results/robustness/{runs.json,runs.csv,summary.csv,summary.md,
robustness.png}; a configuration already in runs.json is not run again (delete the file to
start over).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import time

import numpy as np

from fedjax_sim.app.config import algorithm_factory, algorithm_kwargs, build_run
from fedjax_sim.app.sweep_cli import SweepConfig
from fedjax_sim.run.simulate import EvalSpec
from fedjax_sim.run.sweep import mean_ci, sweep

AGGREGATORS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mean": ("mean", ()),
    "median": ("median", ()),
    "trimmed_mean": ("trimmed_mean", ("beta=0.2",)),
    "krum": ("krum", ("f=10",)),
    "multi_krum": ("multi_krum", ("f=10", "m=40")),
    "geometric_median": ("geometric_median", ("iters=10",)),
    "centered_clip": ("centered_clip", ("tau=1.0", "iters=1")),
}
ATTACKS = ("none", "sign_flip", "scale", "gaussian", "alie", "label_flip", "sign_flip_x10")
# the attack (--attack) and its --attack-args of each column; sign_flip_x10 is a supplement
# (a stronger sign flip, -10 x the honest update) beyond the list
ATTACK_SPECS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sign_flip": ("sign_flip", ()),
    "scale": ("scale", ()),
    "gaussian": ("gaussian", ()),
    "alie": ("alie", ()),
    "label_flip": ("label_flip", ()),
    "sign_flip_x10": ("sign_flip", ("scale=10.0",)),
}
FRACTIONS = (0.1, 0.2)


def grid(args) -> list[tuple[str, str, float]]:
    out = []
    for agg in args.aggregators.split(","):
        out.append((agg, "none", 0.0))
        for attack in args.attacks.split(","):
            for frac in FRACTIONS:
                out.append((agg, attack, frac))
    return out


def fields_of(args, agg: str, attack: str, frac: float) -> dict:
    name, agg_args = AGGREGATORS[agg]
    f = dict(
        num_clients=args.clients,
        cohort_size=None,
        rounds=args.rounds,
        eval_every=args.eval_every,
        seeds=args.seeds,
        runs_per_group=args.seeds,
        progress=False,
    )
    if name != "mean":
        f.update(aggregator=name, aggregator_args=agg_args)
    if attack != "none":
        kind, attack_args = ATTACK_SPECS[attack]
        f.update(attack=kind, byzantine_fraction=frac)
        if attack_args:
            f.update(attack_args=attack_args)
    return f


def cli_command(fields: dict) -> str:
    parts = ["fedjax-sim sweep"]
    for k, v in fields.items():
        if k == "progress":
            continue
        v = " ".join(v) if isinstance(v, tuple) else v
        parts.append(f"--{k.replace('_', '-')} {v}")
    return " ".join(parts)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="experiments/results/robustness")
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--aggregators", default=",".join(AGGREGATORS))
    p.add_argument("--attacks", default=",".join(ATTACKS[1:]))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    raw_path = os.path.join(args.out, "runs.json")
    done: dict = {"meta": {"args": vars(args)}, "runs": [], "configs": []}
    if os.path.exists(raw_path):
        done = json.load(open(raw_path))
    have = {(c["aggregator"], c["attack"], c["fraction"]) for c in done["configs"]}

    t_all = time.perf_counter()
    # the data, model and client map are those of every configuration (the same flags but
    # the aggregator / attack ones): loaded once, so the evaluator is compiled once
    base = fields_of(args, "mean", "none", 0.0)
    ds, model, _, cmap = build_run(SweepConfig(**base), None, set(base))
    factory = algorithm_factory("fedavg")
    for agg, attack, frac in grid(args):
        if (agg, attack, frac) in have:
            continue
        fields = fields_of(args, agg, attack, frac)
        cfg = SweepConfig(**fields)
        t0 = time.perf_counter()
        kwargs = algorithm_kwargs(cfg, set(fields), data=ds.train, client_map=cmap)

        def make_algorithm(hp, kwargs=kwargs):
            return factory(model.loss, **kwargs)

        res = sweep(
            make_algorithm,
            ds.train,
            seeds=range(cfg.seeds),
            model=model,
            num_rounds=cfg.rounds,
            test=ds.test,
            evaluation=EvalSpec(every=cfg.eval_every),
            client_map=cmap,
            runs_per_group=cfg.runs_per_group,
            progress=False,
        )
        wall = time.perf_counter() - t0
        finals = res.values("test_accuracy")
        for run, h, a in zip(res.runs, res.histories, finals, strict=True):
            done["runs"].append(
                {
                    "aggregator": agg,
                    "attack": attack,
                    "fraction": frac,
                    "seed": run.seed,
                    "final_test_accuracy": float(a),
                    "final_train_loss": float(np.asarray(h.metrics["train_loss"][-1])),
                    "curve": [[e["round"], e["test_accuracy"]] for e in h.evals],
                    "nonfinite_round": h.meta.get("nonfinite_round"),
                }
            )
        mean, half, std = mean_ci(finals)
        nonfinite = sum(h.meta.get("nonfinite_round") is not None for h in res.histories)
        done["configs"].append(
            {
                "aggregator": agg,
                "attack": attack,
                "fraction": frac,
                "mean": mean,
                "std": std,
                "ci95": half,
                "n": len(finals),
                "nonfinite_runs": nonfinite,
                "seconds": wall,
                "command": cli_command(fields),
            }
        )
        done["meta"]["data"] = ds.train.summary()
        print(
            f"{agg:>16} {attack:>10} {frac:.1f}: acc {mean:.4f} +- {std:.4f}"
            f"{f' NONFINITE x{nonfinite}' if nonfinite else ''}; {wall:.1f} s",
            flush=True,
        )
        with open(raw_path + ".tmp", "w") as f:
            json.dump(done, f, indent=1)
        os.replace(raw_path + ".tmp", raw_path)
    done["meta"].setdefault("seconds_total_runs", 0.0)
    done["meta"]["seconds_total_runs"] = sum(c["seconds"] for c in done["configs"])
    done["meta"]["seconds_this_invocation"] = time.perf_counter() - t_all
    with open(raw_path, "w") as f:
        json.dump(done, f, indent=1)
    report(done, args.out)


def report(done: dict, out: str) -> None:
    configs = done["configs"]
    cols = [k for k in done["runs"][0] if k != "curve"]
    with open(os.path.join(out, "runs.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(done["runs"])
    with open(os.path.join(out, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, list(configs[0]))
        w.writeheader()
        w.writerows(configs)
    aggs = list(dict.fromkeys(c["aggregator"] for c in configs))
    by = {(c["aggregator"], c["attack"], c["fraction"]): c for c in configs}
    lines = []
    for frac in FRACTIONS:
        lines.append(f"\nByzantine fraction {frac:g} (no-attack column: no Byzantine client)\n")
        lines.append("| aggregator | " + " | ".join(ATTACKS) + " |")
        lines.append("|---|" + "---:|" * len(ATTACKS))
        for agg in aggs:
            cells = []
            for attack in ATTACKS:
                c = by.get((agg, attack, 0.0 if attack == "none" else frac))
                cells.append("" if c is None else _cell(c))
            lines.append(f"| {agg} | " + " | ".join(cells) + " |")
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines).lstrip() + "\n")
    heatmap(aggs, by, os.path.join(out, "robustness.png"), done)


def _cell(c: dict) -> str:
    if c["nonfinite_runs"]:  # the accuracy of a NaN model is meaningless
        return f"diverged (NaN in {c['nonfinite_runs']}/{c['n']} runs)"
    return f"{c['mean']:.3f} ± {c['std']:.3f}"


def heatmap(aggs, by, path, done):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(FRACTIONS), figsize=(15, 0.6 * len(aggs) + 2.4), sharey=True, layout="constrained"
    )
    values = [c["mean"] for c in by.values() if not c["nonfinite_runs"]]
    # colour range over the informative cells (collapsed runs, < 0.5, get the bottom colour)
    vmin = np.floor(min([v for v in values if v >= 0.5] or [0.0]) * 20) / 20
    vmax = np.ceil(max(values) * 20) / 20
    for k, (ax, frac) in enumerate(zip(axes, FRACTIONS, strict=True)):
        m = np.full((len(aggs), len(ATTACKS)), np.nan)
        s = np.full_like(m, np.nan)
        for i, agg in enumerate(aggs):
            for j, attack in enumerate(ATTACKS):
                c = by.get((agg, attack, 0.0 if attack == "none" else frac))
                if c is not None and not c["nonfinite_runs"]:
                    m[i, j], s[i, j] = c["mean"], c["std"]
                elif c is not None:
                    ax.text(j, i, "NaN\n(diverged)", ha="center", va="center", fontsize=7)
        im = ax.imshow(m, vmin=vmin, vmax=vmax, cmap="RdYlGn", aspect="auto")
        for i in range(m.shape[0]):
            for j in range(m.shape[1]):
                if math.isfinite(m[i, j]):
                    ax.text(
                        j,
                        i,
                        f"{m[i, j]:.3f}\n±{s[i, j]:.3f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                    )
        ax.set_xticks(range(len(ATTACKS)), ATTACKS, rotation=30, ha="right", fontsize=8)
        if k == 0:
            ax.set_yticks(range(len(aggs)), aggs, fontsize=8)
        ax.set_title(f"{frac:.0%} Byzantine clients", fontsize=10)
    fig.colorbar(im, ax=axes, shrink=0.8, label="final test accuracy (mean of the seeds)")
    a = done["meta"]["args"]
    fig.suptitle(
        f"FedAvg on digits (Dirichlet 0.5, {a['clients']} clients, full participation, "
        f"{a['rounds']} rounds): final test accuracy, mean ± std over {a['seeds']} seeds",
        fontsize=10,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
