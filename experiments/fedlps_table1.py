"""FedLPS vs FedAvg (and FedProx) at CPU scale: the comparisons of the paper's Table 1.

Buttaci & Calafiore (spec ../shared/specs/fedlps_local_perturbation.md, section 5). For one
dataset and model, both data settings (balanced a = 0, b = 0; imbalanced a > 0, b = 1) are
built as in the paper (pool split 80:20, per-pixel standardisation, train and test set each
partitioned into C clients by the Hsu et al. procedure, test clients unseen), the one-off
similarity graph is computed from the training clients, and every algorithm runs from the
same initial model (PyTorch's default Linear init, U(+-1/sqrt(fan_in))). The pooled accuracy
on the unseen test clients is recorded after every round.

    nice -n 10 python experiments/fedlps_table1.py --dataset fashion_mnist --model logistic

writes experiments/results/fedlps/<dataset>_<model>.json after every finished cell (one
algorithm in one setting); fedlps_report.py turns the JSON files into the README table and
curves. If the JSON file exists and was made with the same configuration (everything but the
settings, betas and FedProx alphas), its cells are kept and only the missing ones are run
(`--fresh` starts over).

With `--seeds N` (N >= 2) each setting is instead ONE `fedjax_sim.run.sweep.sweep` over
beta in {1 (= FedAvg with the graph weights), --betas} x seeds 0..N-1: the seed drives the
model init (PyTorch-like, as above) and the minibatch order, the partition and graph stay
those of `--seed`. Written to `sweep_<dataset>_<model>_<setting>/` beside the JSON (per-run
histories.json / runs.csv, summary, sweep.png with 95% CI bands) and
`results/fedlps/sweep_<dataset>_<model>.json` (rounds to the target per run, the paired
speed-up FedAvg rounds / FedLPS rounds per seed, mean / std over seeds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms import fedavg, fedlps, fedprox
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.algorithms.similarity import graph_from_data
from fedjax_sim.data.builtin import read_fashion_mnist
from fedjax_sim.data.unseen import federate_unseen, split_pool
from fedjax_sim.models import logistic_regression, mlp
from fedjax_sim.run.convergence import rounds_to_target
from fedjax_sim.run.simulate import EvalSpec, simulate
from fedjax_sim.run.sweep import mean_ci, sweep

RESULTS = os.path.join(os.path.dirname(__file__), "results", "fedlps")

# CPU-scale defaults per (dataset, model); paper: C=100, E=10, B=256, gamma=1e-3, T=200,
# the full pool, target c = 0.75 (FEMNIST). Targets here were fixed from short pilot runs
# (about 0.93x of FedAvg's final balanced accuracy), before the reported runs.
_FMNIST = dict(pool=20000, clients=50, epochs=2, batch=32, lr=5e-3, a=10.0)
_DIGITS = dict(pool=None, clients=20, epochs=5, batch=16, lr=5e-3, a=10.0, rounds=200)
DEFAULTS = {
    ("fashion_mnist", "logistic"): dict(_FMNIST, rounds=60, target=0.78),
    ("fashion_mnist", "mlp"): dict(_FMNIST, pool=10000, lr=1e-2, rounds=40, target=0.75),
    ("digits", "logistic"): dict(_DIGITS, target=0.90),
    ("digits", "mlp"): dict(_DIGITS, target=0.90),
}


def load_pool(name: str, pool: int | None, seed: int):
    """`(x_train, y_train, x_test, y_test)`: a fixed 80:20 split of the (sub-sampled) pool."""
    if name == "fashion_mnist":
        xa, ya, xb, yb = read_fashion_mnist()
        x, y = np.concatenate([xa, xb]), np.concatenate([ya, yb])
    else:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        x, y = bunch.data.astype(np.float32) / 16.0, bunch.target.astype(np.int32)
    x = x.reshape(len(x), -1)
    return split_pool(x, y, test_fraction=0.2, max_examples=pool, seed=seed)


def torch_like_init(params, key):
    """PyTorch's default nn.Linear init: kernel and bias ~ U(+-1/sqrt(fan_in)) per layer."""
    out = {}
    for i, (name, layer) in enumerate(sorted(params.items())):  # loop over layers
        bound = 1.0 / np.sqrt(layer["kernel"].shape[0])
        keys = jax.random.split(jax.random.fold_in(key, i))
        out[name] = {
            leaf: jax.random.uniform(k, layer[leaf].shape, layer[leaf].dtype, -bound, bound)
            for leaf, k in zip(("kernel", "bias"), keys, strict=True)
        }
    return out


# config keys that may differ between runs merged into one JSON file
_MERGEABLE = ("settings", "betas", "prox", "out", "fresh")


def load_previous(path: str, config: dict) -> dict | None:
    """The JSON of an earlier run with the same configuration (None if absent or different)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        prev = json.load(f)
    old = {"graph_features": "standardised", **prev["config"]}  # files from before the option
    old = {k: v for k, v in old.items() if k not in _MERGEABLE}
    new = {k: v for k, v in config.items() if k not in _MERGEABLE}
    if old != new:
        diff = {k: (old.get(k), new.get(k)) for k in old.keys() | new.keys()}
        diff = {k: v for k, v in diff.items() if v[0] != v[1]}
        raise ValueError(f"{path} was made with another configuration {diff}; use --fresh")
    return prev


def _union(a: list, b: list) -> list:
    return list(a) + [v for v in b if v not in a]


def run(args, path: str) -> dict:
    cfg = {**DEFAULTS[(args.dataset, args.model)]}
    for k in cfg:
        if getattr(args, k, None) is not None:
            cfg[k] = getattr(args, k)
    config = {**vars(args), **cfg}
    prev = None if args.fresh else load_previous(path, config)
    out = {"config": config, "settings": {}}
    if prev is not None:
        for k in ("settings", "betas", "prox"):
            config[k] = _union(prev["config"][k], config[k])
        out["settings"] = prev["settings"]

    def save() -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f)

    xtr, ytr, xte, yte = load_pool(args.dataset, cfg["pool"], args.seed)
    make_model = {
        "logistic": lambda shape: logistic_regression(shape, 10, l2=args.l2),
        "mlp": lambda shape: mlp(shape, 10, hidden=(128,), l2=args.l2),
    }[args.model]
    settings = {"balanced": (0.0, 0.0), "imbalanced": (cfg["a"], 1.0)}
    for setting in args.settings:
        a, b = settings[setting]
        ds = federate_unseen(
            xtr, ytr, xte, yte, num_clients=cfg["clients"], partitioner="hsu", seed=args.seed,
            num_classes=10, name=args.dataset, class_imbalance=a, data_imbalance=b,
        )  # fmt: skip
        t0 = time.perf_counter()
        if args.graph_features == "raw":  # same clients (the partition depends on labels only)
            raw = federate_unseen(
                xtr, ytr, xte, yte, num_clients=cfg["clients"], partitioner="hsu",
                seed=args.seed, standardise=False, class_imbalance=a, data_imbalance=b,
            )  # fmt: skip
            graph = graph_from_data(raw.train)
        else:
            graph = graph_from_data(ds.train)
        graph_s = time.perf_counter() - t0
        model = make_model(ds.feature_shape)
        key = jax.random.key(args.seed)
        params = torch_like_init(model.init(key), jax.random.fold_in(key, 1))
        local = LocalSpec(epochs=cfg["epochs"], batch_size=cfg["batch"], sampling="epoch")
        common = dict(client_optimizer=cfg["lr"], local=local)
        weights = CohortSpec(client_weights=graph.degrees)
        algos = {"FedAvg": fedavg(model.loss, cohort=weights, **common)}
        for alpha in args.prox:
            algos[f"FedProx a={alpha:g}"] = fedprox(model.loss, mu=alpha, cohort=weights, **common)
        for beta in args.betas:
            algos[f"FedLPS b={beta:g}"] = fedlps(model.loss, beta=beta, graph=graph, **common)
        done = out["settings"].get(setting, {}).get("runs", {})
        algos = {k: v for k, v in algos.items() if k not in done}
        if not algos:
            continue
        counts = np.asarray(ds.train.counts)
        rec = {
            "a": a,
            "b": b,
            "graph_seconds": graph_s,
            "train_sizes": [int(counts.min()), int(counts.max())],
            "degrees": [float(graph.degrees.min()), float(graph.degrees.max())],
            "misalignment_median": float(
                np.median(graph.misalignment[~np.eye(len(counts), dtype=bool)])
            ),
            "runs": done,
        }
        out["settings"][setting] = rec
        for name, alg in algos.items():
            t0 = time.perf_counter()
            hist = simulate(
                alg, ds.train, key, model=model, num_rounds=cfg["rounds"], test=ds.test,
                params=params, evaluation=EvalSpec(every=1, clients=False), progress=False,
            )  # fmt: skip
            seconds = time.perf_counter() - t0
            rounds, acc = hist.eval_series("test_accuracy")
            _, loss = hist.eval_series("test_loss")
            rec["runs"][name] = {
                "rounds": rounds.tolist(),
                "accuracy": acc.tolist(),
                "loss": loss.tolist(),
                "final_accuracy": float(acc[-1]),
                "rounds_to_target": rounds_to_target(rounds, acc, cfg["target"]),
                "seconds": seconds,
            }
            print(
                f"{args.dataset} {args.model} {setting:10s} {name:14s} final {acc[-1]:.4f} "
                f"rounds->{cfg['target']}: {rec['runs'][name]['rounds_to_target']} "
                f"({seconds:.0f} s)",
                flush=True,
            )
            save()
    return out


def stats(values) -> dict:
    """`{mean, ci95_half, std}` over seeds (Student t, ddof 1)."""
    mean, half, std = mean_ci(np.asarray(values, np.float64))
    return {"mean": mean, "ci95_half": half, "std": std}


def run_sweep(args, path: str) -> dict:
    """`--seeds N`: one sweep over beta x seeds per setting (see the module doc)."""
    cfg = {**DEFAULTS[(args.dataset, args.model)]}
    for k in cfg:
        if getattr(args, k, None) is not None:
            cfg[k] = getattr(args, k)
    out = {"config": {**vars(args), **cfg}, "settings": {}}
    xtr, ytr, xte, yte = load_pool(args.dataset, cfg["pool"], args.seed)
    make_model = {
        "logistic": lambda shape: logistic_regression(shape, 10, l2=args.l2),
        "mlp": lambda shape: mlp(shape, 10, hidden=(128,), l2=args.l2),
    }[args.model]
    settings = {"balanced": (0.0, 0.0), "imbalanced": (cfg["a"], 1.0)}
    betas = [1.0] + [b for b in args.betas if b != 1.0]
    for setting in args.settings:
        a, b = settings[setting]
        ds = federate_unseen(
            xtr, ytr, xte, yte, num_clients=cfg["clients"], partitioner="hsu", seed=args.seed,
            num_classes=10, name=args.dataset, class_imbalance=a, data_imbalance=b,
        )  # fmt: skip
        graph = graph_from_data(ds.train)
        base = make_model(ds.feature_shape)
        model = dataclasses.replace(
            base, init=lambda key, f=base.init: torch_like_init(f(key), jax.random.fold_in(key, 1))
        )
        local = LocalSpec(epochs=cfg["epochs"], batch_size=cfg["batch"], sampling="epoch")

        def make(hp, model=model, graph=graph, local=local):
            return fedlps(
                model.loss, beta=hp["beta"], graph=graph, client_optimizer=cfg["lr"], local=local
            )

        t0 = time.perf_counter()
        res = sweep(
            make, ds.train, seeds=args.seeds, grid={"beta": betas}, model=model,
            num_rounds=cfg["rounds"], test=ds.test, evaluation=EvalSpec(every=1, clients=False),
            progress=False, meta={"dataset": args.dataset, "model": args.model, "setting": setting},
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        name = f"sweep_{args.dataset}_{args.model}{args.tag}_{setting}"
        res.save(os.path.join(os.path.dirname(path), name))
        runs = []
        for r, h in zip(res.runs, res.histories, strict=True):
            rounds, acc = h.eval_series("test_accuracy")
            runs.append(
                {
                    "beta": r.hparams["beta"],
                    "seed": r.seed,
                    "final_accuracy": float(acc[-1]),
                    "final_loss": float(h.eval_series("test_loss")[1][-1]),
                    "rounds_to_target": rounds_to_target(rounds, acc, cfg["target"]),
                }
            )
        ref = {r["seed"]: r["rounds_to_target"] for r in runs if r["beta"] == 1.0}
        summary = {}
        for beta in betas:
            sel = [r for r in runs if r["beta"] == beta]
            rtt = [r["rounds_to_target"] for r in sel]
            reached = [v for v in rtt if v is not None]
            sp = [
                ref[r["seed"]] / r["rounds_to_target"]
                for r in sel
                if r["rounds_to_target"] and ref[r["seed"]]
            ]
            acc = np.array([r["final_accuracy"] for r in sel])
            summary[f"{beta:g}"] = {
                "n": len(sel),
                "reached": len(reached),
                "rounds_to_target": stats(reached) if reached else None,
                "speedup_vs_fedavg": stats(sp) if sp else None,
                "final_accuracy": stats(acc),
                "final_loss": stats([r["final_loss"] for r in sel]),
            }
            print(
                f"{args.dataset} {args.model} {setting:10s} beta {beta:g}: rounds->"
                f"{cfg['target']} {np.mean(reached) if reached else float('nan'):.1f} +- "
                f"{np.std(reached, ddof=1) if len(reached) > 1 else float('nan'):.1f} "
                f"({len(reached)}/{len(sel)}), speed-up {np.mean(sp) if sp else float('nan'):.2f}"
                f" +- {np.std(sp, ddof=1) if len(sp) > 1 else float('nan'):.2f}, final acc "
                f"{acc.mean():.4f} +- {acc.std(ddof=1):.4f}",
                flush=True,
            )
        out["settings"][setting] = {"seconds": seconds, "summary": summary, "runs": runs}
        print(f"{setting}: {seconds:.0f} s", flush=True)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", choices=["digits", "fashion_mnist"], default="digits")
    ap.add_argument("--model", choices=["logistic", "mlp"], default="logistic")
    ap.add_argument("--settings", nargs="+", default=["balanced", "imbalanced"])
    ap.add_argument("--betas", nargs="*", type=float, default=[0.9, 0.5, 0.1])
    ap.add_argument("--prox", nargs="*", type=float, default=[], help="FedProx alphas")
    ap.add_argument(
        "--graph-features",
        choices=["standardised", "raw"],
        default="standardised",
        help="features the messages are computed from (training uses standardised ones)",
    )
    ap.add_argument("--l2", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    for k in ("pool", "clients", "epochs", "batch", "rounds"):
        ap.add_argument(f"--{k}", type=int)
    for k in ("lr", "a", "target"):
        ap.add_argument(f"--{k}", type=float)
    ap.add_argument("--out", default=None, help="JSON path (default results/fedlps/...)")
    ap.add_argument("--fresh", action="store_true", help="ignore cells of an existing JSON")
    ap.add_argument("--seeds", type=int, default=None, help="N seeds with fedjax_sim.run.sweep")
    ap.add_argument("--tag", default="", help="suffix of the --seeds output names")
    args = ap.parse_args()
    if args.seeds is not None:
        name = f"sweep_{args.dataset}_{args.model}{args.tag}.json"
        path = args.out or os.path.join(RESULTS, name)
        run_sweep(args, path)
        print(f"wrote {path}")
        return
    suffix = "_rawgraph" if args.graph_features == "raw" else ""
    path = args.out or os.path.join(RESULTS, f"{args.dataset}_{args.model}{suffix}.json")
    run(args, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    jnp.zeros(())  # initialise the backend before timing
    main()
