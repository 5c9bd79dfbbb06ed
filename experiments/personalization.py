"""Personalized FL presets vs FedAvg and FedAvg-FT on label-skewed digits and Fashion-MNIST
(issue 37 item 5): mean personal test accuracy over clients, per-method lr selected on
selection seeds, verdicts on fresh confirming seeds.

Setting (defaults, sized for a shared 2-core CPU; the anchors' settings are in
experiments/README.md): 100 clients; partitions Dirichlet(0.1) label skew
(`partition.dirichlet`) and 2-class shards (`partition.shards`, McMahan et al.'s
pathological split), partition seed 0 for every run; each client holds out 25 % of its
examples as its own test split (PFLlib's 75/25). Fashion-MNIST: the 60k training images
are partitioned, the official 10k are the central test set (FedAvg's global accuracy);
digits: all 1797 images are partitioned, the central test set is the union of the client
splits. Model: MLP with one hidden layer of `--hidden` (64) ReLU units (digits 64-64-10,
4,810 parameters; Fashion-MNIST 784-64-10, 50,890); its head is the last dense layer.
Training: `--rounds` rounds, cohort 10 of 100 clients (uniform without replacement),
`--local-steps` (20) SGD steps of batch `--batch-size` (20, with replacement) per round,
server lr 1.

Methods (client lr eta from the grid, traced in one sweep program):
FedAvg; FedAvg-FT (5 fine-tuning steps at eta); FedPer; LG-FedAvg; FedRep (the preset's
default head:body ratio: 18:2 of 20 steps, 9:1 of 10); FedBABU (head frozen, 5 fine-tuning steps at
eta); Ditto (lam 0.1, personal lr eta); APFL (alpha 0.25 fixed, personal lr eta); pFedMe
(lam 15, K = 5 inner steps of personal lr 0.05, beta 1; eta grid smaller: eta*lam < 1);
Per-FedAvg FO / HF (alpha = eta, one adaptation step of size alpha; D, D', D'' the
halves / thirds of each minibatch).

Protocol: for each (dataset, partition, method) one `sweep` (one compiled program) over the
lr grid x (selection seeds `--select-seeds`, default 0-2, + confirming seeds
`--confirm-seeds`, default 100-104); a seed changes the initial model, cohorts and
minibatches, not the partition. The lr is selected on the selection seeds' runs only
(highest mean personal accuracy); the verdicts use the confirming seeds' runs at that lr
(the confirming seeds' runs at the other lrs are kept in the file and used by nothing; one
program instead of a second compilation). Every run's final model is evaluated per client:
each client's own model (`Algorithm.personalize`; FedAvg: the global model) on its own test
split (`evaluation.evaluate_personal`: mean, worst, 10th percentile; the pooled accuracy
too), and the global model on the same splits and on the central test set.

    PYTHONPATH=. nice -n 10 python experiments/personalization.py            # everything
    PYTHONPATH=. nice -n 10 python experiments/personalization.py --datasets digits
    PYTHONPATH=. python experiments/personalization_report.py                 # tables, plot

Writes `results/personalization/<dataset>_<partition><tag>.json` (`.json.partial` until
every method of that setting is done): per method the grid, the selected lr, the sweep's
seconds, and per run (lr, seed, phase) the final metrics; the confirming runs at the
selected lr also keep every client's personal accuracy (null: no test examples). A setting
already complete is skipped; a `.partial` of the same setting is resumed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms import (
    CohortSpec,
    LocalSpec,
    apfl,
    ditto,
    fedavg,
    fedavg_ft,
    fedbabu,
    fedper,
    fedrep,
    lg_fedavg,
    per_fedavg,
    pfedme,
)
from fedjax_sim.data import load_digits, load_fashion_mnist
from fedjax_sim.models import mlp
from fedjax_sim.run.evaluation import evaluate_personal
from fedjax_sim.run.simulate import EvalSpec
from fedjax_sim.run.sweep import sweep

OUT_DIR = os.path.join(os.path.dirname(__file__), "results", "personalization")
METHODS = ("FedAvg", "FedAvg-FT", "FedPer", "LG-FedAvg", "FedRep", "FedBABU", "Ditto", "APFL",
           "pFedMe", "Per-FedAvg FO", "Per-FedAvg HF")  # fmt: skip
GRID = (0.03, 0.1, 0.3)
PFEDME_GRID = (0.01, 0.02, 0.05)  # eta * lam (15) < 1: w moves toward theta, not past it
PARTITIONS = {"dir0.1": ("dirichlet", {"alpha": 0.1}), "shards2": ("shards", {"per_client": 2})}
DATASETS = ("digits", "fashion_mnist")
FINAL_KEYS = ("test_accuracy", "client_accuracy_mean", "train_loss")


def make_factory(name: str, loss, num_clients: int, args):
    """`hp -> Algorithm` of `name` with the traced client lr `hp["lr"]`."""

    def make(hp):
        lr = hp["lr"]
        common = dict(
            client_optimizer=lr,
            local=LocalSpec(steps=args.local_steps, batch_size=args.batch_size),
            cohort=CohortSpec(size=args.cohort, weighting="uniform"),
            num_clients=num_clients,
        )
        if name == "FedAvg":
            return fedavg(loss, **common)
        if name == "FedAvg-FT":
            return fedavg_ft(loss, finetune_steps=args.finetune_steps, **common)
        if name == "FedPer":
            return fedper(loss, **common)
        if name == "LG-FedAvg":
            return lg_fedavg(loss, **common)
        if name == "FedRep":
            return fedrep(loss, **common)
        if name == "FedBABU":
            return fedbabu(loss, finetune_steps=args.finetune_steps, **common)
        if name == "Ditto":
            return ditto(loss, lam=0.1, **common)
        if name == "APFL":
            return apfl(loss, mixing=0.25, **common)
        if name == "pFedMe":
            return pfedme(loss, lam=15.0, personal_lr=0.05, inner_steps=5, **common)
        variant = name.split()[-1].lower()
        return per_fedavg(loss, inner_lr=lr, variant=variant, adapt_steps=1, **common)

    return make


def load(dataset: str, partition: str, num_clients: int):
    partitioner, kwargs = PARTITIONS[partition]
    if dataset == "digits":
        return load_digits(num_clients, partitioner, 0, client_test_fraction=0.25, **kwargs)
    return load_fashion_mnist(num_clients, partitioner, 0, client_test_fraction=0.25, **kwargs)


def personal_eval(make, model, data, result):
    """Each run's final state evaluated per client (`evaluate_personal`), vmapped over runs:
    `{metric: [R]}` plus `personal_accuracy` `[R, C]`."""
    states = result.states
    hps = {"lr": jnp.asarray([r.hparams["lr"] for r in result.runs], jnp.float32)}
    keys = jax.vmap(jax.random.key)(jnp.asarray([r.seed for r in result.runs]))

    @jax.jit
    def run(states, hps, keys, data):
        def one(state, hp, key):
            return evaluate_personal(model, make(hp).personalize, state, data, key)

        return jax.vmap(one)(states, hps, keys)

    out = jax.device_get(run(states, hps, keys, data))
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def run_method(name, make, model, data, test, args, lrs):
    """One sweep over `lrs` x (selection + confirming seeds) plus the per-client evaluation
    of every run's final state; per-run records and seconds."""
    seeds = [*args.select_seeds, *args.confirm_seeds]
    t0 = time.perf_counter()
    res = sweep(
        make, data, seeds=seeds, grid={"lr": list(lrs)}, model=model, num_rounds=args.rounds,
        test=test, progress=False, meta={"algorithm": name},
        evaluation=EvalSpec(every=args.rounds), runs_per_group=len(lrs) * len(seeds),
    )  # fmt: skip
    per = personal_eval(make, model, data, res)
    counts = np.asarray(data.test_counts, np.float64)
    has = counts > 0
    runs = []
    for i, (r, h) in enumerate(zip(res.runs, res.histories, strict=True)):
        final = h.evals[-1]
        acc = per["personal_accuracy"][i]
        runs.append({
            "lr": float(r.hparams["lr"]),
            "seed": int(r.seed),
            "phase": "select" if r.seed in args.select_seeds else "confirm",
            **{k: float(per[f"personal_accuracy_{s}"][i]) for k, s in
               (("personal_mean", "mean"), ("personal_worst", "worst"), ("personal_p10", "p10"))},
            "personal_pooled": float(np.sum(acc[has] * counts[has]) / np.sum(counts[has])),
            "global_test_accuracy": float(final["test_accuracy"]),
            "global_client_mean": float(final["client_accuracy_mean"]),
            "train_loss": float(np.asarray(h.metrics["train_loss"][-1])),
            "nonfinite_round": h.meta.get("nonfinite_round"),
            "personal_accuracy": [None if np.isnan(a) else round(float(a), 4) for a in acc],
        })  # fmt: skip
    return runs, time.perf_counter() - t0


def select(runs: list[dict]) -> float:
    """The lr with the highest mean personal accuracy over the selection seeds' runs
    (non-finite runs count as 0)."""
    runs = [r for r in runs if r["phase"] == "select"]
    lrs = sorted({r["lr"] for r in runs})

    def score(lr):
        v = [0.0 if r["nonfinite_round"] is not None else r["personal_mean"]
             for r in runs if r["lr"] == lr]  # fmt: skip
        return float(np.mean(v))

    return max(lrs, key=score)


SKIP = ("force", "out_dir", "methods", "datasets", "partitions")  # not part of a setting


def setting_config(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in SKIP}


def saved_methods(partial: str, config: dict) -> dict:
    """The methods already in `partial` when it is a run of the same setting (else {})."""
    if not os.path.exists(partial):
        return {}
    with open(partial) as f:
        old = json.load(f)
    return old["methods"] if setting_config(old["config"]) == config else {}


def save(partial: str, out: str, blob: dict) -> None:
    """Writes `blob` with the methods other processes of the same setting saved meanwhile
    (`--methods` subsets run in parallel); renamed to `out` once every method is there."""
    if os.path.exists(out):  # completed by another process
        return
    blob["methods"] = {**saved_methods(partial, blob["config"]), **blob["methods"]}
    blob["complete"] = set(blob["methods"]) == set(METHODS)
    with open(partial + ".tmp", "w") as f:
        json.dump(blob, f, separators=(",", ":"))
    os.replace(partial + ".tmp", partial)
    if blob["complete"]:
        os.replace(partial, out)


def run_setting(dataset: str, partition: str, args) -> None:
    out = os.path.join(args.out_dir, f"{dataset}_{partition}{args.tag}.json")
    if os.path.exists(out) and not args.force:
        print(f"{out} exists: skipped", flush=True)
        return
    partial = out + ".partial"
    config = {**setting_config(vars(args)), "dataset": dataset, "partition": partition}
    blob = {"config": config, "methods": {} if args.force else saved_methods(partial, config)}
    ds = load(dataset, partition, args.clients)
    data, test = ds.train, ds.test
    model = mlp(ds.feature_shape, ds.num_classes, hidden=(args.hidden,))
    counts = np.asarray(data.counts)
    y = np.asarray(data.y)
    blob["partition_stats"] = {
        "train_examples": int(counts.sum()),
        "test_examples": int(np.asarray(data.test_counts).sum()),
        "clients_without_test": int(np.sum(np.asarray(data.test_counts) == 0)),
        "classes_per_client_mean": float(
            np.mean([np.unique(y[i, : counts[i]]).size for i in range(args.clients)])
        ),
    }
    os.makedirs(args.out_dir, exist_ok=True)
    for name in args.methods:
        if name in blob["methods"] or name in saved_methods(partial, config):
            continue
        make = make_factory(name, model.loss, args.clients, args)
        grid = PFEDME_GRID if name == "pFedMe" else GRID
        runs, seconds = run_method(name, make, model, data, test, args, grid)
        lr = select(runs)
        for r in runs:  # per-client accuracies: the confirming runs at the selected lr only
            if r["phase"] == "select" or r["lr"] != lr:
                del r["personal_accuracy"]
        blob["methods"][name] = {
            "grid": list(grid),
            "selected_lr": lr,
            "seconds": round(seconds, 1),
            "runs": runs,
        }
        conf = [r for r in runs if r["phase"] == "confirm" and r["lr"] == lr]
        pm = np.mean([r["personal_mean"] for r in conf])
        print(f"{dataset} {partition} {name:14s} lr {lr:g}: personal mean {pm:.4f}, "
              f"global {np.mean([r['global_client_mean'] for r in conf]):.4f} "
              f"({seconds:.0f} s)", flush=True)  # fmt: skip
        save(partial, out, blob)
        if blob["complete"]:
            return
    save(partial, out, blob)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    p.add_argument("--partitions", nargs="+", default=list(PARTITIONS), choices=list(PARTITIONS))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--cohort", type=int, default=10)
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--finetune-steps", type=int, default=5)
    p.add_argument("--select-seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--confirm-seeds", type=int, nargs="+", default=[100, 101, 102, 103, 104])
    p.add_argument("--tag", default="")
    p.add_argument("--out-dir", default=OUT_DIR)
    p.add_argument("--force", action="store_true", help="re-run a complete setting")
    args = p.parse_args()
    for dataset in args.datasets:
        for partition in args.partitions:
            run_setting(dataset, partition, args)


if __name__ == "__main__":
    main()
