"""Privacy-utility of user-level DP-FedAvg on sklearn digits (issue 21, item 5.1).

Test accuracy vs epsilon in {1, 2, 4, 8, inf} at delta = 1e-5, fixed vs adaptive clipping
(Andrew et al. 2021, target quantile 0.5), with Poisson (Bernoulli) cohorts so that
amplification by sampling applies; plus the non-private FedAvg baseline (no clipping, no
noise). For each finite epsilon the noise multiplier z is calibrated for the planned rounds by
the library (`--target-epsilon`: `accounting.calibrate_noise`, dp_accounting's RDP
accountant); epsilon = inf is clipping without noise (z = 0).

Population: digits' 1797 examples, a stratified 20 % (360) held out as the central test set,
the other 1437 split iid over C = 1000 clients (1-2 examples each: user-level DP is close to
example-level here); q = 0.1, so the expected cohort is m = qC = 100 (the fixed denominator).

Every configuration is one `fedjax_sim.run.sweep.sweep` over 3 seeds (one compiled program; the
seeds change the model init, the cohorts, the local batches and the DP noise; the data split
is fixed). Each configuration equals

    fedjax-sim sweep --num-clients 1000 --cohort-sampling bernoulli --cohort-probability 0.1 \
        --cohort-size None --dp-clip 1.0 --target-epsilon EPS [--dp-quantile 0.5] ...

except for the data (the CLI's digits holds out 20 % *per client*, which leaves ~30 test
examples at 1000 clients of 1-2 examples; here the held-out 20 % is drawn centrally).

    PYTHONPATH=$PWD nice -n 10 python experiments/privacy_utility.py

Supplement (`--supplement-clips 0.2`, the default): fixed clipping at C = 0.2, a value read
off the adaptive runs' final clip norms, i.e. tuned after the fact (it would cost privacy in
practice); it tells whether adaptive clipping's gain is more than picking a smaller C.
Configurations already in runs.json are not run again (delete it to start over).

Writes experiments/results/privacy_utility/{runs.json,runs.csv,summary.csv,summary.md,
privacy_utility.png} and one folder per configuration with the sweep's own outputs.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import time

import numpy as np

from fedjax_sim import models
from fedjax_sim.app.config import (
    RunConfig,
    algorithm_factory,
    algorithm_kwargs,
    make_client_map,
    privacy_accounting,
)
from fedjax_sim.data.dataset import ArrayData, federate
from fedjax_sim.run.simulate import EvalSpec
from fedjax_sim.run.sweep import mean_ci, sweep

EPSILONS = (1.0, 2.0, 4.0, 8.0, math.inf)


def load_data(num_clients: int, seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    return federate(
        x_tr,
        y_tr,
        num_clients=num_clients,
        partitioner="iid",
        seed=seed,
        client_test_fraction=0.0,
        central_test=ArrayData(x=x_te, y=y_te),
        num_classes=10,
        name="digits",
    )


def configs(args) -> list[tuple[str, str, float, dict]]:
    """`(label, clipping, target epsilon, RunConfig fields)`: the baseline, then fixed and
    adaptive clipping at each epsilon."""
    common = dict(
        num_clients=args.clients,
        rounds=args.rounds,
        cohort_sampling="bernoulli",
        cohort_probability=args.q,
        cohort_size=None,
        local_steps=args.local_steps,
        batch_size=args.batch_size,
        client_lr=args.client_lr,
        eval_every=args.eval_every,
        client_map=args.client_map,
        map_batch_size=args.map_batch_size,
        progress=False,
    )
    out = [("nonprivate", "none", math.inf, dict(common, weighting="uniform"))]
    groups = [("fixed", args.clip), ("adaptive", args.clip)]
    groups += [(f"fixed C={c:g}", c) for c in args.supplement_clips]
    for clipping, clip in groups:
        for eps in EPSILONS:
            dp = dict(common, dp_clip=clip, dp_delta=args.delta)
            if math.isfinite(eps):
                dp["target_epsilon"] = eps
            if clipping == "adaptive":
                dp["dp_quantile"] = args.quantile
            prefix = clipping if clipping in ("fixed", "adaptive") else f"fixedC{clip:g}"
            out.append((f"{prefix}_eps{eps:g}", clipping, eps, dp))
    return out


def cli_command(fields: dict) -> str:
    flags = []
    for k, v in fields.items():
        if k == "progress":
            continue
        flags.append(f"--{k.replace('_', '-')} {v}")
    return "fedjax-sim sweep --seeds 3 " + " ".join(flags)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="experiments/results/privacy_utility")
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--q", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--local-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--client-lr", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--quantile", type=float, default=0.5)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--client-map", default="map", help="auto | vmap | map")
    p.add_argument("--map-batch-size", type=int, default=100)
    p.add_argument(
        "--supplement-clips",
        type=float,
        nargs="*",
        default=[0.2],
        help="extra fixed clip norms (a supplement: C picked after the fact, see README)",
    )
    p.add_argument("--only", default=None, help="comma-separated labels (a quick check)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    t_all = time.perf_counter()
    ds = load_data(args.clients)
    summary = ds.train.summary()
    print(f"data: {summary}; central test {len(ds.test.y)} examples", flush=True)
    model = models.build("mlp", ds.feature_shape, ds.num_classes, hidden=(64,), l2=0.0)
    factory = algorithm_factory("fedavg")
    rows, summaries = [], []
    raw_path = os.path.join(args.out, "runs.json")
    if os.path.exists(raw_path):  # configurations already run are kept, not run again
        old = json.load(open(raw_path))
        rows, summaries = old["runs"], old["summary"]
    have = {s["config"] for s in summaries}
    todo = [c for c in configs(args) if c[0] not in have]
    if args.only:
        keep = set(args.only.split(","))
        todo = [c for c in todo if c[0] in keep]
    for label, clipping, eps, fields in todo:
        cfg = RunConfig(**fields)
        explicit = set(fields)
        cmap = make_client_map(cfg)
        kwargs = algorithm_kwargs(cfg, explicit, data=ds.train, client_map=cmap)
        acc = privacy_accounting(cfg, ds.train.num_clients)

        def make_algorithm(hp, kwargs=kwargs):
            return factory(model.loss, **kwargs)

        t0 = time.perf_counter()
        res = sweep(
            make_algorithm,
            ds.train,
            seeds=args.seeds,
            model=model,
            num_rounds=cfg.rounds,
            test=ds.test,
            evaluation=EvalSpec(every=cfg.eval_every, clients=False),
            client_map=cmap,
            progress=False,
            privacy=None if acc is None else acc.epsilon,
            meta={"config": dataclasses.asdict(cfg), "label": label},
        )
        wall = time.perf_counter() - t0
        res.save(os.path.join(args.out, label), plot=False)
        z = None if acc is None else acc.noise_multiplier
        finals = res.values("test_accuracy")
        for run, h, a in zip(res.runs, res.histories, finals, strict=True):
            reached = h.evals[-1].get("epsilon", math.inf)
            clip = h.metrics.get("dp_clip_norm")
            rows.append(
                {
                    "config": label,
                    "clipping": clipping,
                    "target_epsilon": eps,
                    "reached_epsilon": reached,
                    "delta": args.delta,
                    "noise_multiplier": z,
                    "seed": run.seed,
                    "final_test_accuracy": float(a),
                    "final_clip_norm": None if clip is None else float(np.asarray(clip[-1])),
                    "mean_participants": float(np.mean(h.metrics["participants"])),
                    "curve": [[e["round"], e["test_accuracy"]] for e in h.evals],
                    "nonfinite_round": h.meta.get("nonfinite_round"),
                }
            )
        mean, half, std = mean_ci(finals)
        summaries.append(
            {
                "config": label,
                "clipping": clipping,
                "target_epsilon": eps,
                "reached_epsilon": rows[-1]["reached_epsilon"],
                "noise_multiplier": z,
                "mean": mean,
                "std": std,
                "ci95": half,
                "n": len(finals),
                "seconds": wall,
                "command": cli_command(fields),
            }
        )
        print(
            f"{label:>18}: acc {mean:.4f} +- {std:.4f} (95% CI +-{half:.4f}); target eps "
            f"{eps:g}, reached {rows[-1]['reached_epsilon']:.4g}, z "
            f"{'-' if z is None else f'{z:.4g}'}; {wall:.1f} s",
            flush=True,
        )
    total = time.perf_counter() - t_all
    meta = {"args": vars(args), "data": summary, "test_examples": int(len(ds.test.y))}
    meta["seconds_this_invocation"] = total
    meta["seconds_total_configs"] = sum(s["seconds"] for s in summaries)
    with open(os.path.join(args.out, "runs.json"), "w") as f:
        json.dump({"meta": meta, "runs": rows, "summary": summaries}, f, indent=1)
    cols = [k for k in rows[0] if k != "curve"]
    with open(os.path.join(args.out, "runs.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(args.out, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, list(summaries[0]))
        w.writeheader()
        w.writerows(summaries)
    write_table(summaries, os.path.join(args.out, "summary.md"))
    plot(summaries, os.path.join(args.out, "privacy_utility.png"), args)
    print(f"total {total:.1f} s; results in {args.out}/")


def write_table(summaries, path):
    lines = [
        "| clipping | target eps | reached eps | z | test accuracy mean ± std | 95% CI | s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        z = "-" if s["noise_multiplier"] is None else f"{s['noise_multiplier']:.3f}"
        lines.append(
            f"| {s['clipping']} | {s['target_epsilon']:g} | {s['reached_epsilon']:.8g} | {z} | "
            f"{s['mean']:.4f} ± {s['std']:.4f} | ±{s['ci95']:.4f} | {s['seconds']:.0f} |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(summaries, path, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [e for e in EPSILONS if math.isfinite(e)]
    inf_x = 2 * max(finite)  # where epsilon = inf is drawn on the log axis
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    groups = list(dict.fromkeys(s["clipping"] for s in summaries if s["clipping"] != "none"))
    styles = ["o-", "s-", "^:", "v:", "d:"]
    for k, clipping in enumerate(groups):
        pts = [s for s in summaries if s["clipping"] == clipping]
        dx = 1 + 0.03 * (k - (len(groups) - 1) / 2)
        x = [min(s["target_epsilon"], inf_x) * dx for s in pts]
        if clipping == "fixed":
            label = f"fixed clipping (C={args.clip:g})"
        elif clipping == "adaptive":
            label = f"adaptive clipping (quantile {args.quantile:g}, C_0={args.clip:g})"
        else:
            label = f"{clipping}, picked after the fact (supplement)"
        ax.errorbar(
            x,
            [s["mean"] for s in pts],
            yerr=[s["ci95"] for s in pts],
            fmt=styles[k % len(styles)],
            capsize=3,
            label=label,
        )
    base = [s for s in summaries if s["clipping"] == "none"]
    if base:
        b = base[0]
        ax.axhline(b["mean"], color="k", ls="--", lw=1, label="non-private FedAvg")
        ax.axhspan(b["mean"] - b["ci95"], b["mean"] + b["ci95"], color="k", alpha=0.08)
    ax.set_xscale("log")
    ax.set_xticks([*finite, inf_x])
    ax.set_xticklabels([f"{e:g}" for e in finite] + ["∞"])
    ax.set(
        xlabel=f"ε (δ = {args.delta:g}, RDP, Poisson q = {args.q:g})",
        ylabel="final test accuracy",
        title=(
            f"DP-FedAvg on digits, C = {args.clients}, m = {args.q * args.clients:g}, "
            f"{args.rounds} rounds; mean, 95% CI ({args.seeds} seeds)"
        ),
    )
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
