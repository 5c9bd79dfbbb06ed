"""Beikmohammadi et al. (2024) on Fashion-MNIST, scaled to CPU: step-size schedules x
{FedAvg, FedProx, EF-FedAvg, EF-FedProx} x {IID, Non-IID2, Non-IID1}.

Spec: ../shared/specs/stepsizes_no_similarity.md (sections 4-5). Paper setting: 10 clients,
the 431,080-parameter CNN, K = 400 rounds, T = 30 local SGD steps of lr s_k (not / T) on
batches of 64; FedProx: one prox per round, 30 inner GD steps on one batch, inner lr
min(0.1, s_k), mu = 1/s_k; EF: top-1% of the model delta with error feedback; schedules
fixed s = 0.1, diminishing 0.8/(k+1)^0.51, step-decay 0.8/2^floor(k/50). Here (defaults):
K = 24 rounds, T = J = 10, batch 16, step-decay phase P = K/8 = 3 (8 phases like the paper's
400/50), fixed s = 0.1 (the paper's value, i.e. c = 0.1 sqrt(K)), 1 seed; training loss and
test accuracy are evaluated every 6 rounds on the first 200 training / test examples of each
client (the paper uses every example). No random horizontal flip augmentation.

Usage (one schedule per invocation keeps each run short; `nice` on a shared machine):
    PYTHONPATH=. nice -n 10 python experiments/stepsizes_fmnist.py --schedule fixed
    PYTHONPATH=. python experiments/stepsizes_report.py   # curves + markdown table
Writes experiments/results/stepsizes/<schedule>.json.

With `--seeds N` every algorithm x split is one `fedjax_sim.run.sweep.sweep` over seeds 0..N-1
(one compiled program per algorithm; the seed drives the network init and the minibatches,
the partition stays the one of `--seed`), written to
`<out>/sweep_<schedule><tag>/<algorithm>_<split>/` (histories.json, runs.csv, summary.csv,
summary.md, sweep.png with the 95% CI band) plus `<out>/sweep_<schedule><tag>.json` (every
run's curve and the mean / std / CI of the final accuracy per cell), written atomically once
every cell is done (progress meanwhile: `<out>/sweep_<schedule><tag>.json.partial`).
With `--checkpoint-every K` a cell's sweep is checkpointed every K rounds (orbax, under
`<out>/sweep_<schedule><tag>.ckpt/`) and rerunning the same command skips the finished
cells and resumes the unfinished one bit for bit: a long run can span sessions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import jax
import numpy as np

from fedjax_sim.algorithms import schedules
from fedjax_sim.algorithms.compression import TopK
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.algorithms.fixed_point import ef_fedavg, ef_fedprox, fp_fedavg, fp_fedprox
from fedjax_sim.data import pack
from fedjax_sim.data.builtin import read_fashion_mnist
from fedjax_sim.data.federated import with_client_test
from fedjax_sim.data.partition import PARTITIONERS
from fedjax_sim.models import count_params, lenet
from fedjax_sim.run.simulate import EvalSpec, evaluate_clients
from fedjax_sim.run.sweep import mean_ci, sweep
from fedjax_sim.runtime.parallel import ClientMap

PARTITIONS = {"IID": "iid_shards", "Non-IID2": "class_halves", "Non-IID1": "one_class"}
ALGORITHMS = ("FedAvg", "FedProx", "EF-FedAvg", "EF-FedProx")
NUM_CLIENTS = 10
STATED_DECAY_POWER = 0.51  # nu of the paper's diminishing 0.8/(k+1)^nu


def make_schedule(name: str, rounds: int, decay_power: float = STATED_DECAY_POWER):
    if name == "fixed":
        return schedules.fixed(0.1 * rounds**0.5, rounds)  # s = 0.1 as in the paper
    if name == "diminishing":
        return schedules.diminishing(0.8, decay_power)
    if name == "step_decay":
        return schedules.step_decay(0.8, 2.0, max(1, rounds // 8))
    raise ValueError(f"unknown schedule {name!r}")


def make_algorithm(name, loss, schedule, args, client_map):
    common = dict(
        client_optimizer=schedule, cohort=CohortSpec(weighting="counts"), client_map=client_map
    )
    local = LocalSpec(steps=args.local_steps, batch_size=args.batch_size)
    prox = dict(
        inner_steps=args.inner_steps or args.local_steps,
        inner_lr=args.inner_lr,
        batch_size=args.batch_size,
        cap_inner_lr=not args.no_cap,
    )
    ef = dict(num_clients=NUM_CLIENTS, compressor=TopK(fraction=0.01))
    if name == "FedAvg":
        return fp_fedavg(loss, local=local, divide_by_T=False, **common)
    if name == "FedProx":
        return fp_fedprox(loss, **prox, **common)
    if name == "EF-FedAvg":
        return ef_fedavg(loss, local=local, divide_by_T=False, **ef, **common)
    return ef_fedprox(loss, **prox, **ef, **common)


def first_per_client(x, y, ids, n):
    """Keeps the first n examples of every client (evaluation subsample)."""
    order = np.argsort(ids, kind="stable")
    rank = np.empty(ids.size, np.int64)
    starts = np.searchsorted(ids[order], np.arange(NUM_CLIENTS))
    rank[order] = np.arange(ids.size) - starts[ids[order]]
    keep = rank < n
    return pack(x[keep], y[keep], ids[keep], NUM_CLIENTS, num_classes=10)


def federated(partition: str, seed: int, eval_n: int):
    x, y, xt, yt = read_fashion_mnist()
    part = PARTITIONERS[partition]
    ids, ids_t = part(y, NUM_CLIENTS, seed), part(yt, NUM_CLIENTS, seed + 1)
    train = with_client_test(
        pack(x, y, ids, NUM_CLIENTS, num_classes=10), pack(xt, yt, ids_t, NUM_CLIENTS)
    )
    evaluation = with_client_test(
        first_per_client(x, y, ids, eval_n), first_per_client(xt, yt, ids_t, eval_n)
    )
    return train, evaluation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", default="fixed", choices=["fixed", "diminishing", "step_decay"])
    ap.add_argument(
        "--decay-power",
        type=float,
        default=STATED_DECAY_POWER,
        help="nu of the diminishing 0.8/(k+1)^nu (the paper states 0.51; some of the authors' "
        "logs ran 0.9)",
    )
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=6)
    ap.add_argument("--eval-per-client", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="N seeds per cell with fedjax_sim.run.sweep",
    )
    ap.add_argument("--first-seed", type=int, default=0,
                    help="--seeds N runs seeds FIRST..FIRST+N-1 (same partitions)")  # fmt: skip
    ap.add_argument("--partitions", nargs="*", default=list(PARTITIONS), choices=list(PARTITIONS))
    ap.add_argument("--algorithms", nargs="*", default=list(ALGORITHMS))
    ap.add_argument("--inner-lr", type=float, default=0.1, help="FedProx inner GD lr")
    ap.add_argument("--inner-steps", type=int, default=None, help="J (default: local steps)")
    ap.add_argument("--no-cap", action="store_true", help="inner lr not capped at s_k")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    ap.add_argument("--out", default="experiments/results/stepsizes")
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="--seeds N: checkpoint each cell's sweep every K rounds in <out>/<name>.ckpt/ "
        "(and keep finished cells in <name>.json.partial); rerunning the same command "
        "resumes where it stopped",
    )
    args = ap.parse_args()

    model = lenet((28, 28, 1), 10)
    assert count_params(model.init(jax.random.key(0))) == 431_080
    schedule = make_schedule(args.schedule, args.rounds, args.decay_power)
    client_map = ClientMap("map", batch_size=1)
    data = {
        name: federated(PARTITIONS[name], args.seed, args.eval_per_client)
        for name in args.partitions
    }

    def evaluate(params, ev):
        tr = evaluate_clients(model, params, ev.x, ev.y, ev.counts, client_map, "train")
        te = evaluate_clients(model, params, ev.x_test, ev.y_test, ev.test_counts, client_map)
        return tr["train_loss_pooled"], te["client_accuracy_mean"]

    if args.seeds is not None:
        return run_sweeps(args, model, schedule, client_map, data, evaluate)
    evaluate = jax.jit(evaluate)
    results = {
        "config": {
            **vars(args),
            "schedule_values": [float(s) for s in schedules.values(schedule, args.rounds)],
        },
        "runs": {},
    }
    key = jax.random.key(args.seed)
    params0 = model.init(jax.random.fold_in(key, 7))
    for alg_name in args.algorithms:
        alg = make_algorithm(alg_name, model.loss, schedule, args, client_map)
        step = jax.jit(alg.step)  # compiled once, reused for the three partitions
        for part_name, (train, ev) in data.items():
            state = alg.init(params0, key)
            t0 = time.perf_counter()
            curve = {"round": [], "train_loss": [], "test_accuracy": [], "bytes_up": 0.0}
            for r in range(args.rounds + 1):
                if r % args.eval_every == 0 or r == args.rounds:
                    loss, acc = (float(v) for v in evaluate(state.params, ev))
                    curve["round"].append(r)
                    curve["train_loss"].append(loss)
                    curve["test_accuracy"].append(acc)
                if r < args.rounds:
                    state, metrics = step(state, train, key)
                    curve["bytes_up"] += float(metrics["bytes_up"])
            curve["seconds"] = time.perf_counter() - t0
            results["runs"][f"{alg_name}|{part_name}"] = curve
            print(
                f"{args.schedule:12s} {alg_name:10s} {part_name:8s} "
                f"loss {curve['train_loss'][-1]:.4f} acc {curve['test_accuracy'][-1]:.4f} "
                f"({curve['seconds']:.0f} s)",
                flush=True,
            )
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{args.schedule}{args.tag}.json"), "w") as f:
                json.dump(results, f, indent=1)


def run_sweeps(args, model, schedule, client_map, data, evaluate) -> None:
    """`--seeds N`: one seeds-only `sweep` per algorithm x split (see the module doc)."""
    name = f"sweep_{args.schedule}{args.tag}"
    results = {
        "config": {
            **vars(args),
            "schedule_values": [float(s) for s in schedules.values(schedule, args.rounds)],
        },
        "cells": {},
    }
    partial = os.path.join(args.out, f"{name}.json.partial")
    if args.checkpoint_every and os.path.exists(partial):
        with open(partial) as f:
            done = json.load(f)
        if same_run(done["config"], results["config"]):  # keep the cells it finished
            results["cells"] = done["cells"]
            print(f"resuming {name}: done {sorted(results['cells'])}", flush=True)
    for alg_name in args.algorithms:
        alg = make_algorithm(alg_name, model.loss, schedule, args, client_map)

        def make(hp, alg=alg):  # one object per algorithm: compiled once for all splits
            return alg

        for part_name, (train, ev) in data.items():

            def extra(params, data, test, ev=ev):
                loss, acc = evaluate(params, ev)
                return {"pooled_train_loss": loss, "test_accuracy": acc}

            if f"{alg_name}|{part_name}" in results["cells"]:
                continue
            spec = EvalSpec(every=args.eval_every, central=False, clients=False, extra=extra)
            checkpoints = {}
            if args.checkpoint_every:
                folder = os.path.join(args.out, f"{name}.ckpt", f"{alg_name}_{part_name}")
                checkpoints = dict(checkpoint_dir=os.path.abspath(folder), resume=True,
                                   checkpoint_every=args.checkpoint_every)  # fmt: skip
            t0 = time.perf_counter()
            res = sweep(
                make, train, seeds=range(args.first_seed, args.first_seed + args.seeds),
                model=model, num_rounds=args.rounds, evaluation=spec, client_map=client_map,
                progress=False,
                meta={"algorithm": alg_name, "split": part_name, "schedule": args.schedule},
                **checkpoints,
            )  # fmt: skip
            seconds = time.perf_counter() - t0
            res.save(os.path.join(args.out, name, f"{alg_name}_{part_name}"))
            acc = res.values("test_accuracy")
            mean, half, std = mean_ci(acc)
            loss = res.values("pooled_train_loss")
            results["cells"][f"{alg_name}|{part_name}"] = {
                "seconds": seconds,
                "n": int(acc.size),
                "final_accuracy": {"mean": mean, "std": std, "ci95_half": half},
                "final_train_loss": {"mean": float(loss.mean()), "std": float(loss.std(ddof=1))},
                "runs": [
                    {
                        "seed": r.seed,
                        "round": [e["round"] for e in h.evals],
                        "test_accuracy": [e["test_accuracy"] for e in h.evals],
                        "train_loss": [e["pooled_train_loss"] for e in h.evals],
                        "nonfinite_round": h.meta.get("nonfinite_round"),
                    }
                    for r, h in zip(res.runs, res.histories, strict=True)
                ],
            }
            print(
                f"{args.schedule:12s} {alg_name:10s} {part_name:8s} n={acc.size} "
                f"acc {100 * mean:.1f} +- {100 * std:.1f} loss {loss.mean():.4f} "
                f"({seconds:.0f} s)",
                flush=True,
            )
            # progress after every cell goes to `<name>.json.partial`; `<name>.json` appears
            # (atomically) only once every cell is done, so a reader never sees a half run
            write_atomic(os.path.join(args.out, f"{name}.json.partial"), results)
    final = os.path.join(args.out, f"{name}.json")
    write_atomic(final, results)
    os.remove(final + ".partial")
    if args.checkpoint_every:  # every cell is in the results: its checkpoints are spent
        shutil.rmtree(os.path.join(args.out, f"{name}.ckpt"), ignore_errors=True)


def same_run(a: dict, b: dict) -> bool:
    """Two runs' configs compute the same cells (output and checkpoint options aside)."""
    skip = {"out", "checkpoint_every"}
    return {k: v for k, v in a.items() if k not in skip} == {
        k: v for k, v in b.items() if k not in skip
    }


def write_atomic(path: str, results: dict) -> None:
    """Writes `results` as JSON to `path` via a temporary file and `os.replace`."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
