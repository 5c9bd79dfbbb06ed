"""Diagnoses the chance-level runs of `stepsizes_fmnist.py` (Beikmohammadi et al. 2024 on
Fashion-MNIST): per-round curvature, inner-solver growth and dead ReLUs.

Two questions (spec ../shared/specs/stepsizes_no_similarity.md, 2.2 and 7.2):
- `prox`: does FedProx's inexact solver (J GD steps with lr = min(inner_lr, s_k) on
  `F_i(y; xi) + ||y - x||^2 / (2 s_k)`) diverge? With lr = s_k (the fixed schedule s = 0.1,
  inner lr 0.1) every inner step is `y <- x - s grad F_i(y; xi)`, a contraction only while
  `s * lambda_max(hess F_i(.; xi)) < 1`; the spec's condition `lr (L + 1/s) < 2` is the same
  thing. Per round this logs lambda_max of one client's minibatch Hessian at x^k (power
  iteration on Hessian-vector products) and the inner solver's growth ratio
  `||y_J - y_{J-1}|| / ||y_1 - y_0||` (> 1: the J steps diverge) for the variants given.
- `fedavg`: does FedAvg with a large first step (diminishing / step-decay, s_0 = 0.8, local lr
  s_k not divided by T) kill the network? Per round this logs the fraction of dead ReLUs
  (dense-500 units and conv channels that are <= 0 on every evaluation example) and the
  spread of the logits.

    PYTHONPATH=. nice -n 10 python experiments/stepsizes_diagnose.py prox
    PYTHONPATH=. nice -n 10 python experiments/stepsizes_diagnose.py fedavg

Writes experiments/results/stepsizes/diagnose_<what>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stepsizes_fmnist import PARTITIONS, federated, make_algorithm, make_schedule  # noqa: E402

from fedjax_sim.data.federated import Batch  # noqa: E402
from fedjax_sim.models import lenet  # noqa: E402
from fedjax_sim.models.lenet import _LeNet  # noqa: E402
from fedjax_sim.run.simulate import evaluate_clients  # noqa: E402
from fedjax_sim.runtime.parallel import ClientMap  # noqa: E402


def client_batch(train, client: int, key, batch_size: int) -> Batch:
    n = int(train.counts[client])
    idx = jax.random.choice(key, n, (batch_size,), replace=False)
    return Batch(train.x[client][idx], train.y[client][idx], jnp.ones(batch_size, jnp.float32))


def top_eigenvalue(loss, params, batch, key, iters: int = 30) -> float:
    """Largest-magnitude eigenvalue of the Hessian of `loss(., batch)` at `params`."""
    hvp = _hvp(loss)
    v = jax.tree.map(lambda p: jax.random.normal(key, p.shape), params)
    lam = 0.0  # Rayleigh quotient of the normalised iterate
    for _ in range(iters):
        v = jax.tree.map(lambda a: a / float(ravel_norm(v)), v)
        w = hvp(params, batch, v)
        lam = float(jnp.vdot(ravel_pytree(w)[0], ravel_pytree(v)[0]))
        v = w
    return lam


def ravel_norm(tree) -> jax.Array:
    return jnp.linalg.norm(ravel_pytree(tree)[0])


_CACHE: dict = {}


def _hvp(loss):
    if ("hvp", loss) not in _CACHE:
        grad = jax.grad(loss)
        _CACHE["hvp", loss] = jax.jit(lambda p, b, v: jax.jvp(lambda q: grad(q, b), (p,), (v,))[1])
    return _CACHE["hvp", loss]


def _prox_step(loss):
    if ("prox", loss) not in _CACHE:
        grad = jax.grad(loss)

        def step(y, x, b, s, lr):
            g = grad(y, b)
            return jax.tree.map(lambda yi, gi, xi: yi - lr * (gi + (yi - xi) / s), y, g, x)

        _CACHE["prox", loss] = jax.jit(step)
    return _CACHE["prox", loss]


def inner_growth(loss, params, batch, s: float, lr: float, steps: int) -> float:
    """`||y_J - y_{J-1}|| / ||y_1 - y_0||` of J GD steps on `F(y) + ||y - x||^2 / (2 s)`."""
    step = _prox_step(loss)
    y, first, last = params, None, None
    for _ in range(steps):
        y_new = step(y, params, batch, s, lr)
        last = float(ravel_norm(jax.tree.map(jnp.subtract, y_new, y)))
        first = last if first is None else first
        y = y_new
    return last / max(first, 1e-30)


@jax.jit
def relu_stats(params, x) -> dict[str, jax.Array]:
    """Dead fractions (<= 0 on every example of x) of the dense-500 units and of the conv
    channels after max-pool, and the std of the logits over examples (0: constant output)."""
    module = _LeNet((28, 28, 1), (20, 50), 500, 10)
    logits, inter = module.apply(
        {"params": params}, x, capture_intermediates=True, mutable=["intermediates"]
    )
    inter = inter["intermediates"]
    dense = inter["Dense_0"]["__call__"][0]  # [B, 500] pre-activation
    out = {"dead_dense": jnp.mean(jnp.all(dense <= 0, axis=0))}
    for i in (0, 1):
        conv = inter[f"Conv_{i}"]["__call__"][0]  # [B, H, W, C]; max-pool commutes with ReLU
        out[f"dead_conv{i}"] = jnp.mean(jnp.all(conv <= 0, axis=(0, 1, 2)))
    out["logit_std"] = jnp.mean(jnp.std(logits, axis=0))
    return out


def run(alg_name, schedule_name, partition, args, variant) -> dict:
    model = lenet((28, 28, 1), 10)
    ns = argparse.Namespace(**{**vars(args), **variant})
    schedule = make_schedule(schedule_name, args.rounds_nominal)
    client_map = ClientMap("map", batch_size=1)
    train, ev = federated(PARTITIONS[partition], args.seed, 200)
    alg = make_algorithm(alg_name, model.loss, schedule, ns, client_map)
    step = jax.jit(alg.step)
    key = jax.random.key(args.seed)
    state = alg.init(model.init(jax.random.fold_in(key, 7)), key)
    evaluate = jax.jit(
        lambda p: (
            evaluate_clients(model, p, ev.x, ev.y, ev.counts, client_map, "train")[
                "train_loss_pooled"
            ],
            evaluate_clients(model, p, ev.x_test, ev.y_test, ev.test_counts, client_map)[
                "client_accuracy_mean"
            ],
        )
    )
    x_eval = ev.x[:, :40].reshape(-1, 28, 28, 1)  # 40 examples of every client
    rows = []
    for r in range(args.rounds + 1):
        loss, acc = (float(v) for v in evaluate(state.params))
        row = {"round": r, "s": float(schedule(r)), "train_loss": loss, "test_accuracy": acc}
        row.update({k: float(v) for k, v in relu_stats(state.params, x_eval).items()})
        if alg_name in ("FedProx", "EF-FedProx"):
            bkey = jax.random.fold_in(key, 1000 + r)
            batch = client_batch(train, 0, bkey, ns.batch_size)
            row["lambda_max"] = top_eigenvalue(model.loss, state.params, batch, bkey)
            lr = ns.inner_lr if ns.no_cap else min(ns.inner_lr, row["s"])
            row["inner_lr"] = lr
            row["inner_growth"] = inner_growth(
                model.loss, state.params, batch, row["s"], lr, ns.inner_steps or ns.local_steps
            )
        if r < args.rounds:
            new, _ = step(state, train, key)
            d = ravel_pytree(new.params)[0] - ravel_pytree(state.params)[0]
            row["update_norm"] = float(jnp.linalg.norm(d))
            state = new
        rows.append(row)
        print(variant, {k: round(v, 4) for k, v in row.items()}, flush=True)
    return {
        "algorithm": alg_name,
        "schedule": schedule_name,
        "partition": partition,
        "variant": variant,
        "rows": rows,
    }


VARIANTS = {
    "prox": [
        # the experiment's setting: J = 10, batch 16, inner lr min(0.1, s) = 0.1
        ("FedProx", "fixed", "IID", {"batch_size": 16, "inner_steps": 10}),
        # the paper's batch size
        ("FedProx", "fixed", "IID", {"batch_size": 64, "inner_steps": 10}),
        # the effective update of the authors' released runs: J = 1, lr 0.1 (spec 7.2)
        ("FedProx", "fixed", "IID", {"batch_size": 16, "inner_steps": 1}),
        # a smaller inner lr: GD on the prox objective is stable while 0.05 (L + 10) < 2 and
        # contracts by |1 - 0.05 * 10| = 1/2 per step in the flat directions
        ("FedProx", "fixed", "IID", {"batch_size": 16, "inner_steps": 10, "inner_lr": 0.05}),
    ],
    "fedavg": [
        ("FedAvg", "diminishing", "Non-IID2", {"batch_size": 16}),
        ("FedAvg", "diminishing", "Non-IID2", {"batch_size": 64}),
        ("FedAvg", "diminishing", "IID", {"batch_size": 16}),
        ("FedAvg", "step_decay", "IID", {"batch_size": 16}),
    ],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=sorted(VARIANTS))
    ap.add_argument("--rounds", type=int, default=24, help="rounds run")
    ap.add_argument("--rounds-nominal", type=int, default=24, help="K of the schedules")
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--inner-lr", type=float, default=0.1)
    ap.add_argument("--inner-steps", type=int, default=None)
    ap.add_argument("--no-cap", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", type=int, nargs="*", help="indices of the variants to run")
    ap.add_argument("--out", default="experiments/results/stepsizes")
    args = ap.parse_args()
    todo = VARIANTS[args.what]
    out = []
    for i, (alg, sched, part, variant) in enumerate(todo):
        if args.only and i not in args.only:
            continue
        t0 = time.perf_counter()
        res = run(alg, sched, part, args, variant)
        res["seconds"] = time.perf_counter() - t0
        out.append(res)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"diagnose_{args.what}.json"), "w") as f:
            json.dump({"config": vars(args), "runs": out}, f, indent=0)
    print(json.dumps([np.round(r["rows"][-1]["test_accuracy"], 3) for r in out]))


if __name__ == "__main__":
    main()
