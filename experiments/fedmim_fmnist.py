"""FedMIM (Liu et al.) vs its baselines, the paper's CIFAR-10 comparison scaled to CPU on
Fashion-MNIST. Spec: ../shared/specs/fedmim.md (sections 3-5, 7 items 7-9).

Paper (Table I, CIFAR-10): 100 clients of 500 examples, balanced Dirichlet(alpha) labels,
10% participation, E = 5 epochs of B = 50, lr 0.1 * 0.998^t, weight decay 1e-3, ResNet-18-GN,
1000 rounds. Here (defaults, chosen to fit a shared 2-core CPU): Fashion-MNIST, 100 clients
of `--per-client` (100) examples each drawn by the spec's balanced Dirichlet procedure
(section 4) with alpha in {0.1, 0.6}, 10% participation (S = 10 uniform without
replacement), one local epoch of B = 20 (K = 5 steps, epoch sampling), the same lr schedule
and weight decay (in the loss, spec 7 item 5), a small CNN (conv 3x3x8, conv 3x3x16, dense
64), `--rounds` (150) rounds, no augmentation, no gradient clipping. Test accuracy on the
first `--test` (2000) test images every `--eval-every` rounds (final and best reported,
spec 7 item 9) and the paper's local consistency C_t every round.

Hyper-parameters (spec 2.4, 3): FedAvg; FedAdam without bias correction (eta_g = 0.1,
b1 = 0.9, b2 = 0.99, tau = 0.01); SCAFFOLD (option II); FedCM (a = 0.1); FedDyn (a = 0.1);
FedSAM (rho = 0.05); FedMIM alpha = (0.6, 0.3), beta = (0.9, 0.1) (Table III's best).

Usage (one partition per invocation; `nice` on a shared machine):
    PYTHONPATH=. nice -n 10 python experiments/fedmim_fmnist.py --dirichlet 0.1
    PYTHONPATH=. nice -n 10 python experiments/fedmim_fmnist.py --dirichlet 0.6
    PYTHONPATH=. python experiments/fedmim_report.py      # curves + markdown table
Writes experiments/results/fedmim/dir<alpha>.json.

With `--seeds N` every method is one `fedjax_sim.run.sweep.sweep` over its client-lr grid
(`--grid`, per method `--method-grid NAME=a,b,c`) x seeds 0..N-1 (one compiled program; a
seed changes the initial model and the cohort / minibatch draws, the partition is seed
0's). Writes `results/fedmim/sweep_dir<alpha><tag>.json` (every run's accuracy and C_t
curves) and the sweep engine's output per method under `results/fedmim/sweep_dir<alpha><tag>/`;
`fedmim_report.py` selects each method's lr and writes the paired tables. With several
devices (`XLA_FLAGS=--xla_force_host_platform_device_count=2`: one per CPU core) the runs are
sharded over them (`sweep.runs_mesh`).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from fedjax_sim.algorithms import (
    fedadam_reddi,
    fedavg,
    fedcm,
    feddyn,
    fedmim,
    fedsam,
    scaffold,
)
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.algorithms.schedules import round_decay
from fedjax_sim.data import pack
from fedjax_sim.data.federated import ArrayData
from fedjax_sim.data.idx import read_fashion_mnist
from fedjax_sim.models import cnn
from fedjax_sim.run.simulate import EvalSpec, evaluate_central
from fedjax_sim.run.sweep import runs_mesh, sweep

ALGORITHMS = ("FedAvg", "FedAdam", "SCAFFOLD", "FedCM", "FedDyn", "FedSAM", "FedMIM")
OUT_DIR = os.path.join(os.path.dirname(__file__), "results", "fedmim")


def balanced_dirichlet(labels, num_clients, per_client, alpha, seed):
    """Spec section 4 (FedDyn-style): client i draws a class prior q_i ~ Dir(alpha 1_K) and is
    filled to `per_client` examples by drawing a class from q_i and popping an unused example
    of that class (a class whose pool is exhausted is refilled with a fresh permutation).
    Returns example indices `[num_clients, per_client]`."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    pools = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    heads = np.zeros(classes.size, np.int64)
    priors = rng.dirichlet(np.full(classes.size, alpha), size=num_clients)  # [C, K]
    out = np.empty((num_clients, per_client), np.int64)
    for i in range(num_clients):  # data preparation (NumPy), not the simulator
        draws = rng.choice(classes.size, size=per_client, p=priors[i])
        for j, c in enumerate(draws):
            if heads[c] == pools[c].size:
                pools[c], heads[c] = rng.permutation(pools[c]), 0
            out[i, j] = pools[c][heads[c]]
            heads[c] += 1
    return out


def make_algorithm(name, loss, num_clients, args):
    lr = round_decay(args.lr, args.lr_decay)
    common = dict(
        local=LocalSpec(steps=args.local_steps, batch_size=args.batch_size, sampling="epoch"),
        cohort=CohortSpec(size=args.cohort, weighting="uniform"),
    )
    if name == "FedAvg":  # a schedule is optax.sgd(lr(t)), as client_sgd(lr) (traceable lr)
        return fedavg(loss, client_optimizer=lr, **common)
    if name == "FedAdam":
        return fedadam_reddi(loss, server_optimizer=0.1, client_optimizer=lr, **common)
    if name == "SCAFFOLD":
        return scaffold(loss, num_clients=num_clients, client_optimizer=lr, **common)
    if name == "FedCM":
        return fedcm(loss, momentum=0.9, client_optimizer=lr, **common)
    if name == "FedDyn":
        return feddyn(
            loss, num_clients=num_clients, regularization=0.1, client_optimizer=lr, **common
        )
    if name == "FedSAM":
        return fedsam(loss, rho=args.rho, client_optimizer=lr, **common)
    return fedmim(loss, momentum=(0.6, 0.3), lookahead=(0.9, 0.1), client_optimizer=lr, **common)


def run_one(alg, model, data, test, args):
    """`rounds` rounds in scanned chunks of `eval_every`; returns accuracy and C_t curves."""
    t0 = time.perf_counter()
    key = jax.random.key(args.seed)
    state = alg.init(model.init(key), key)
    # data and test are arguments, not closed-over constants (XLA would constant-fold them)
    chunk = jax.jit(
        lambda s, d: jax.lax.scan(lambda s, _: alg.step(s, d, key), s, length=args.eval_every)
    )
    accuracy = jax.jit(lambda p, t: evaluate_central(model, p, t)["test_accuracy"])
    rounds, acc, consistency, loss = [], [], [], []
    for r in range(args.eval_every, args.rounds + 1, args.eval_every):
        state, metrics = chunk(state, data)
        rounds.append(r)
        print(f"  round {r}: {time.perf_counter() - t0:.1f} s", flush=True)
        acc.append(float(accuracy(state.params, test)))
        consistency.extend(np.asarray(metrics["consistency"], np.float64).tolist())
        loss.extend(np.asarray(metrics["train_loss"], np.float64).tolist())
        if not np.isfinite(loss[-1]):
            break
    return dict(rounds=rounds, accuracy=acc, consistency=consistency, train_loss=loss)


def method_grids(args) -> dict[str, list[float]]:
    """Client-lr grid per method: `--grid` (default: `--lr`), replaced by `--method-grid`."""
    grids = {m: list(args.grid or [args.lr]) for m in args.algorithms}
    for item in args.method_grid:
        name, _, values = item.partition("=")
        if name not in grids:
            raise SystemExit(f"--method-grid: unknown method {name!r}, one of {args.algorithms}")
        grids[name] = [float(v) for v in values.split(",")]
    return grids


def run_sweeps(args, model, data, test, results) -> None:
    """`--seeds N`: one lr-grid x seeds `sweep` per method (see the module doc)."""
    grids = method_grids(args)
    stem = f"sweep_dir{args.dirichlet:g}{args.tag}"
    out = args.out or os.path.join(OUT_DIR, f"{stem}.json")
    results.update(grids=grids, methods={})
    os.makedirs(os.path.dirname(out), exist_ok=True)
    for name in args.algorithms:

        def make(hp, name=name):  # the lr is traced: one program for the grid and the seeds
            return make_algorithm(name, model.loss, args.clients, argparse.Namespace(
                **{**vars(args), "lr": hp["lr"]}))  # fmt: skip

        t0 = time.perf_counter()
        res = sweep(
            make, data, seeds=range(args.first_seed, args.first_seed + args.seeds),
            grid={"lr": grids[name]}, model=model,
            num_rounds=args.rounds, test=test, progress=False, meta={"algorithm": name},
            mesh=runs_mesh() if jax.device_count() > 1 else None,
            evaluation=EvalSpec(every=args.eval_every, clients=False),
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        res.save(os.path.join(os.path.dirname(out), stem, name))
        results["methods"][name] = {
            "seconds": round(seconds, 1),
            "runs": [
                {
                    "lr": r.hparams["lr"],
                    "seed": r.seed,
                    "rounds": h.eval_series("test_accuracy")[0].tolist(),
                    "accuracy": h.eval_series("test_accuracy")[1].tolist(),
                    "consistency": np.asarray(h.metrics["consistency"], np.float64).tolist(),
                    "train_loss": np.asarray(h.metrics["train_loss"], np.float64).tolist(),
                    "nonfinite_round": h.meta.get("nonfinite_round"),
                }
                for r, h in zip(res.runs, res.histories, strict=True)
            ],
        }
        for row in res.summary("test_accuracy"):
            acc = f"{100 * row['mean']:.2f} +- {100 * row['std']:.2f} (n = {row['n']})"
            print(
                f"Dir({args.dirichlet:g}) {name:8s} lr {row['lr']:g}: final acc {acc}", flush=True
            )
        print(f"Dir({args.dirichlet:g}) {name}: {seconds:.0f} s", flush=True)
        with open(out, "w") as f:  # after every method: partial results survive
            json.dump(results, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dirichlet", type=float, default=0.1)
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--per-client", type=int, default=100)
    p.add_argument("--cohort", type=int, default=10)
    p.add_argument("--local-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--lr-decay", type=float, default=0.998)
    p.add_argument("--weight-decay", type=float, default=1e-3)
    p.add_argument("--rho", type=float, default=0.05)
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--test", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--seeds", type=int, default=None, help="N seeds with fedjax_sim.run.sweep")
    p.add_argument("--first-seed", type=int, default=0,
                   help="--seeds N runs seeds FIRST..FIRST+N-1 (same partition)")  # fmt: skip
    p.add_argument("--grid", type=float, nargs="+", default=None, help="client lrs (--seeds)")
    p.add_argument("--method-grid", nargs="*", default=[], metavar="METHOD=a,b,c")
    p.add_argument("--tag", default="", help="suffix of the --seeds output names")
    args = p.parse_args()

    x, y, x_test, y_test = read_fashion_mnist()
    idx = balanced_dirichlet(y, args.clients, args.per_client, args.dirichlet, args.seed)
    ids = np.repeat(np.arange(args.clients), args.per_client)
    data = pack(x[idx.ravel()], y[idx.ravel()], ids, args.clients, num_classes=10)
    test = ArrayData(x_test[: args.test], y_test[: args.test])
    model = cnn((28, 28, 1), 10, channels=(8, 16), dense=64, conv="slices", l2=args.weight_decay)
    classes_per_client = np.mean([np.unique(y[row]).size for row in idx])
    results = dict(
        config=vars(args),
        classes_per_client=float(classes_per_client),
        jax=jax.__version__,
        runs={},
    )
    if args.seeds is not None:
        return run_sweeps(args, model, data, test, results)
    out = args.out or os.path.join(OUT_DIR, f"dir{args.dirichlet}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    for name in args.algorithms:
        t0 = time.perf_counter()
        alg = make_algorithm(name, model.loss, args.clients, args)
        curves = run_one(alg, model, data, test, args)
        curves["seconds"] = round(time.perf_counter() - t0, 1)
        results["runs"][name] = curves
        print(
            f"Dir({args.dirichlet}) {name}: final acc {curves['accuracy'][-1]:.4f}, best "
            f"{max(curves['accuracy']):.4f}, mean C_t (last 50) "
            f"{np.mean(curves['consistency'][-50:]):.4g}, {curves['seconds']} s",
            flush=True,
        )
        with open(out, "w") as f:  # after every algorithm: partial results survive
            json.dump(results, f)


if __name__ == "__main__":
    main()
