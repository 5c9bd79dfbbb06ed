"""FGDRO vs the paper's baselines on class-imbalanced Fashion-MNIST (the paper's App. G CIFAR-10
protocol, Table 7, applied offline to Fashion-MNIST and scaled to CPU).

Protocol (spec `../shared/specs/fgdro.md` sections 4 and 7.13): classes 5-9 keep 20% of their
training images (`partition.imbalanced_dirichlet`), the rest is split over 100 clients by
Dirichlet(alpha) with alpha in {0.3, 10}; evaluation on the balanced official test set:
worst = min per-class accuracy, average = overall accuracy. Full participation, uniform
averaging, constant step sizes.

CPU scaling (what differs from the paper): images average-pooled to 14x14; the two-layer CNN
is conv5x5(8)-pool-conv5x5(16)-pool-fc64 (paper: 32/64 channels, fc512, 32x32x3 images;
`cnn(conv="slices")`, the same function as lax.conv but faster in local loops on CPU);
I = 4 local steps of batch 8 (paper I = 32, B = 32) and R = 30 rounds (paper 625); one
seed (paper 3); step sizes not tuned (one value per family, see README); SCAFFOLD, FedProx
and LocalAdam are skipped by default (pass --methods to run them).

Usage:
    PYTHONPATH=. nice -n 10 python experiments/fgdro_imbalanced_fmnist.py --alpha 0.3
    PYTHONPATH=. nice -n 10 python experiments/fgdro_imbalanced_fmnist.py --alpha 10
Writes experiments/results/fgdro/fmnist_dir{alpha}.{json,png}.

Per-method step-size grids (the paper tunes the initial step size per method in
{1e-4, 1e-3, 1e-2, 1e-1}): `--grid` for the SGD-step methods, `--adam-grid` for FGDRO-KL-Adam
and LocalAdam, `--method-grid NAME=a,b,c` per method; each method is then one sweep over its
grid x `--seeds` (rows carry their `lr`); `fgdro_report.py --seeds FILE` selects per method.
`--beta-grid` crosses the rates beta1 = beta2 = beta3 of FGDRO-KL / FGDRO-KL-Adam (the paper
tunes beta in {0.01, 0.1, 0.2, 0.5}) with those methods' step-size grids (rows carry `beta`).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from fgdro_common import ADAM_LR, BETA_METHODS, METHODS, plot_rows, run_all, table

from fedjax_sim.data.builtin import read_fashion_mnist
from fedjax_sim.data.dataset import federate
from fedjax_sim.data.federated import ArrayData
from fedjax_sim.models import cnn
from fedjax_sim.run.dro import dro_evaluator

SKIPPED = ("SCAFFOLD", "FedProx", "LocalAdam")  # CPU budget; all three run via --methods
OUT = os.path.join(os.path.dirname(__file__), "results", "fgdro")


def pool2(x: np.ndarray) -> np.ndarray:
    """`[N, 28, 28, 1] -> [N, 14, 14, 1]` by 2x2 averaging."""
    n, h, w, c = x.shape
    return x.reshape(n, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--alpha", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--methods", nargs="*", default=[m for m in METHODS if m not in SKIPPED])
    p.add_argument("--local-steps", type=int, default=4, help="I")
    p.add_argument("--batch-size", type=int, default=8, help="B")
    p.add_argument("--every", type=int, default=10, help="rounds between evaluations")
    p.add_argument("--grid", type=float, nargs="*", default=None, help="lrs of the SGD methods")
    p.add_argument(
        "--adam-grid", type=float, nargs="*", default=None, help="lrs of " + str(ADAM_LR)
    )
    p.add_argument("--method-grid", nargs="*", default=[], metavar="METHOD=a,b,c")
    p.add_argument(
        "--beta-grid", type=float, nargs="*", default=None,
        help="rates beta1 = beta2 = beta3 of " + str(BETA_METHODS) + ", crossed with their lrs",
    )  # fmt: skip
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = args.out or os.path.join(OUT, f"fmnist_dir{args.alpha:g}.json")
    grids = {m: args.adam_grid if m in ADAM_LR else args.grid for m in args.methods}
    grids.update({k: [float(v) for v in vs.split(",")] for k, _, vs in
                  (item.partition("=") for item in args.method_grid)})  # fmt: skip
    if args.beta_grid and not all(0.0 < b <= 1.0 for b in args.beta_grid):
        p.error(f"--beta-grid: every rate must be in (0, 1], got {args.beta_grid}")
    betas = [m for m in args.methods if m in BETA_METHODS]
    if args.beta_grid and not betas:
        p.error(f"--beta-grid: none of --methods uses beta ({', '.join(BETA_METHODS)})")
    if args.beta_grid and not all(grids.get(m) for m in betas):
        p.error("--beta-grid needs a step-size grid for " + ", ".join(betas))
    grids = {
        m: {"lr": g, **({"beta": args.beta_grid} if args.beta_grid and m in betas else {})}
        for m, g in grids.items() if g
    } or None  # fmt: skip
    hp = dict(
        I=args.local_steps, B=args.batch_size, lr=0.05, adam_lr=0.001, prox_mu=0.01,
        fedadam_server_lr=0.01, drfa_gamma=0.002, dr_dsgd_temperature=2.0, K=20,
        kl_temperature=1.0, beta=0.1, alpha=args.alpha,
    )  # fmt: skip
    x, y, xt, yt = read_fashion_mnist()
    ds = federate(
        pool2(x),
        y,
        num_clients=100,
        partitioner="imbalanced_dirichlet",
        seed=0,
        client_test_fraction=0.0,
        central_test=ArrayData(pool2(xt), yt),
        num_classes=10,
        name="fmnist_imbalanced",
        alpha=args.alpha,
    )
    counts = np.asarray(ds.train.counts)
    print(f"clients: {counts.size}, examples {counts.sum()}, per client min {counts.min()} "
          f"max {counts.max()}")  # fmt: skip
    model = cnn((14, 14, 1), 10, channels=(8, 16), dense=64, kernel_size=5, conv="slices")
    extra = dro_evaluator(model, groups="classes")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    rows = run_all(
        args.methods,
        range(args.seeds),
        data=ds.train,
        test=ds.test,
        model=model,
        rounds=args.rounds,
        every=args.every,
        extra=extra,
        hp=hp,
        out_path=out,
        worst="test_classes_accuracy_worst",
        mean="test_accuracy",
        grids=grids,
        worst_loss="test_classes_loss_worst",
    )
    print(table(rows, args.methods, worst_loss="test_classes_loss_worst"))
    if grids is None:  # with step-size grids: fgdro_report.py --seeds plots the selected lrs
        plot_rows(
            rows, out.replace(".json", ".png"),
            title=f"imbalanced Fashion-MNIST, Dir({args.alpha:g}), 100 clients: "
            "worst-class / test acc",
        )  # fmt: skip
    with open(out) as f:
        blob = json.load(f)
    blob["table"] = table(rows, args.methods, worst_loss="test_classes_loss_worst")
    with open(out, "w") as f:
        json.dump(blob, f, indent=1)


if __name__ == "__main__":
    main()
