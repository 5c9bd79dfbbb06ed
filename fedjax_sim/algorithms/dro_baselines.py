"""The federated DRO baselines of the FGDRO paper, DRFA and (federated) DR-DSGD, as presets
of the composable layer (`compose`).

Spec: `docs/specs/fgdro.md` section 2.5 (the FGDRO paper gives no baseline details; the
spec fixes them).

DRFA: Deng, Kamani, Mahdavi, "Distributionally Robust Federated Averaging" (NeurIPS 2020).
Minimax `min_w max_{lam in simplex} sum_i lam_i l_i(w)` (CVaR with K = 1). The client weights
`lam [C]` are the state of a distributor (`lambda_ascent`: who trains, with which weight, and
the projected ascent on lam from the losses at the snapshot model); the snapshot model
`w_i(t')`, t' ~ Uniform{1..I} (authors' code: 1..I-1), is a local-step hook (`snapshot`).
`cohort.size=None` is the spec's full-participation variant, `size=m` the paper's sampled
one. The model update goes through any aggregator and server optimizer (default: the
lam-weighted mean, the paper's). The KL-regularised variant (DRFA-Prox) is not implemented.

DR-DSGD: Issaid, Elgabli, Bennis, "DR-DSGD: A Distributionally Robust Decentralized Learning
Algorithm over Graphs" (TMLR 2022). Minimises `sum_i exp(l_i(w)/t)` (t = `temperature`, the
paper's mu) with the plug-in minibatch estimate `w_i -= eta (1/t) exp(l/t) grad l` (l =
minibatch loss at w_i; biased for small batches; the `tilted` hook). Federated adaptation
(spec): gossip mixing replaced by exact uniform averaging every I local steps. The
exponential is not clipped (as in the paper): a large `l/t` overflows, so choose t > max loss.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms import cohorts
from fedjax_sim.algorithms.compose import Options, preset, synchronous
from fedjax_sim.algorithms.core import (
    EXTRA,
    Algorithm,
    CohortSpec,
    LocalSpec,
    LossFn,
    client_key,
    float_dtype,
    minibatch,
    round_key,
    tree_sub,
)
from fedjax_sim.algorithms.distributors import Distributor, DistributorSummary
from fedjax_sim.algorithms.hooks import tilted
from fedjax_sim.algorithms.local_hook import LocalHook
from fedjax_sim.core.checks import check_number, is_concrete
from fedjax_sim.data.federated import FederatedData, tree_size_bytes


# ------------------------------------------------------------------------------ DRFA
def project_simplex(v: jax.Array) -> jax.Array:
    """Euclidean projection of `v [N]` onto the probability simplex (sort-based, exact)."""
    n = v.shape[0]
    srt = jnp.sort(v)[::-1]
    css = jnp.cumsum(srt) - 1.0
    rho = jnp.sum(srt - css / jnp.arange(1, n + 1, dtype=v.dtype) > 0)
    theta = css[rho - 1] / rho.astype(v.dtype)
    return jnp.maximum(v - theta, 0.0)


def snapshot_step(key: jax.Array, round_: jax.Array, steps: int) -> jax.Array:
    """DRFA's snapshot step `t'` of a round, uniform in `{1..steps}` (from the step's key)."""
    return _draw_snapshot(round_key(key, round_, EXTRA), steps)


def _draw_snapshot(extra: jax.Array, steps: int) -> jax.Array:
    return jax.random.randint(jax.random.fold_in(extra, 0), (), 1, steps + 1)


def snapshot(steps: int) -> LocalHook:
    """DRFA's snapshot (Deng et al. 2020, Alg. 1): the local model `w_i(t')` after the
    round's snapshot step `t'` (`snapshot_step`, the same for every client, a `client_input`)
    of I = `steps`; carry `(snapshot, k)` (the hook sees the pre-step model of step k, i.e.
    w(k)); summand `w_i(t') - x_t`, whose weighted mean the distributor turns into `w_snap`.
    The snapshot travels up with the update."""

    def direction(value_and_grad, params, batch, carry, ctx):
        snap, k = carry
        snap = jax.tree.map(lambda p, s: jnp.where(k == ctx.client_input, p, s), params, snap)
        loss, grads = value_and_grad(params, batch)
        return loss, grads, (snap, k + 1)

    def finish(ctx, outcome):
        last = ctx.client_input >= outcome.steps  # t' = I (or beyond a straggler's work)
        snap = jax.tree.map(lambda f, s: jnp.where(last, f, s), outcome.params, outcome.carry[0])
        return None, tree_sub(snap, ctx.anchor), None, outcome.update

    def prepare(server, cohort, params, key):
        return server, jnp.broadcast_to(_draw_snapshot(key, steps), cohort.ids.shape)

    return LocalHook(
        "snapshot",
        direction,
        prepare=prepare,
        start=lambda ctx: (ctx.anchor, jnp.int32(0)),
        finish=finish,
        not_sent=("client_input",),  # t' is drawn from the round's key, known to all
    )


def lambda_ascent(
    loss_fn: LossFn,
    options: Options,
    *,
    num_clients: int,
    initial_weights: jax.Array | None,
    dual_lr: Any,
    dual_lr_decay: Any,
    weight_floor: Any,
    client_metrics: bool,
) -> Distributor:
    """DRFA's client weights `lam [N]` (Deng et al. 2020, Alg. 1) as a stateful distributor.

    `sample`: all N clients with weights lam (`size=None`), or `size` = m clients drawn
    i.i.d. ~ lam with weights 1. `finalize`: `w_snap = x_t + mean snapshot delta` (the
    `snapshot` hook's mean), one minibatch loss `v_i` at `w_snap` from every client (or from
    m uniform loss clients, scaled by N/m), `lam = Proj_simplex(lam + gamma I v)` with
    `gamma = dual_lr * dual_lr_decay^round`, floored at `weight_floor` and renormalised. Loss
    clients receive `w_snap` (d down) and send one loss (1 up). `options`: the cohort size m
    (None: all N, the full-participation variant), I = `local.steps`, minibatches, client map."""
    size, local = options.cohort.size, options.local
    if initial_weights is None:
        lam0 = jnp.full((num_clients,), 1.0 / num_clients, float_dtype())
    else:
        lam0 = jnp.asarray(initial_weights, float_dtype())
        if lam0.shape != (num_clients,) or (
            is_concrete(lam0) and not bool(jnp.all(lam0 >= 0) & (jnp.sum(lam0) > 0))
        ):
            raise ValueError(f"initial_weights must be [{num_clients}] non-negative, sum > 0")
        lam0 = lam0 / jnp.sum(lam0)

    def sample(lam, key, counts, round_):
        if counts.shape[0] != num_clients:
            raise ValueError(
                f"drfa was built for num_clients={num_clients}, data has {counts.shape[0]}"
            )
        if size is None:
            return jnp.arange(num_clients, dtype=jnp.int32), lam
        ids = cohorts.weighted(key, lam, size)
        return ids, jnp.ones((size,), lam.dtype)

    def finalize(lam, s: DistributorSummary, data: FederatedData, key: jax.Array):
        w_snap = jax.tree.map(
            lambda p, d: (p + d).astype(p.dtype), s.params, s.hook_means["snapshot"]
        )
        extra = round_key(key, s.round, EXTRA)
        if size is None:
            loss_ids, scale = jnp.arange(num_clients, dtype=jnp.int32), 1.0
        else:
            loss_ids = cohorts.uniform(jax.random.fold_in(extra, 1), num_clients, size)
            scale = num_clients / size
        loss_key = jax.random.fold_in(extra, 2)

        def snapshot_loss(cid):
            batch = minibatch(
                data.client(cid), client_key(loss_key, cid), 0, local.batch_size, local.sampling
            )
            return loss_fn(w_snap, batch)

        losses = options.client_map.map(snapshot_loss, loss_ids)
        v = jnp.zeros((num_clients,), lam.dtype).at[loss_ids].add(scale * losses)
        gamma = dual_lr * dual_lr_decay ** s.round.astype(lam.dtype)
        new = project_simplex(lam + gamma * local.steps * v)
        if not is_concrete(weight_floor) or weight_floor > 0:
            new = jnp.maximum(new, weight_floor)
            new = new / jnp.sum(new)
        n_loss = jnp.float32(loss_ids.shape[0])
        metrics = {
            "snapshot_step": snapshot_step(key, s.round, local.steps),
            "snapshot_loss_max": jnp.max(losses),
            "weights_max": jnp.max(new),
            "bytes_up": n_loss * losses.dtype.itemsize,
            "bytes_down": n_loss * float(tree_size_bytes(s.params)),
        }
        if client_metrics:
            metrics["client_weights"] = new
        return new, metrics

    return Distributor(
        init=lambda n: lam0,
        sample=sample,
        downloads=lambda ids, weights: jnp.int32(ids.shape[0]),
        finalize=finalize,
        distinct=size is None,
        uploads=lambda ids, weights: jnp.int32(ids.shape[0]),
    )


@preset(client_optimizer=0.01, local=LocalSpec(steps=32, batch_size=32))
def drfa(
    loss_fn: LossFn,
    *,
    num_clients: int,
    dual_lr: float = 0.01,
    dual_lr_decay: float = 1.0,
    weight_floor: float = 0.0,
    initial_weights: jax.Array | None = None,
    client_metrics: bool = True,
    options: Options,
) -> Algorithm:
    """DRFA (Deng et al. 2020): I = `local.steps` local steps of `client_optimizer` for w,
    projected ascent on the client weights lam (`lambda_ascent`, `snapshot`). `num_clients`
    N; `dual_lr` gamma >= 0; `dual_lr_decay` in (0, 1] (authors' code: 0.9); `weight_floor`
    in [0, 1/N) (authors' code: 1e-3); `initial_weights` `[N]` initial lam (normalised;
    default uniform; the authors use `n_i / n`); `cohort` a `CohortSpec` of which only `size`
    is used. Metrics: `client_weights` lam (if `client_metrics`), `snapshot_step`,
    `snapshot_loss_max`, `weights_max`; payload: training clients 2d up, d down."""
    o = options
    check_number("dual_lr", dual_lr, lambda v: 0 <= v < math.inf, ">= 0 (finite)")
    check_number("dual_lr_decay", dual_lr_decay, lambda v: 0 < v <= 1, "in (0, 1]")
    check_number("weight_floor", weight_floor, lambda v: 0 <= v * num_clients < 1, "in [0, 1/N)")
    if o.local.epochs is not None:
        raise ValueError("DRFA runs a fixed number I of local steps: use LocalSpec(steps=I)")
    if not isinstance(o.cohort, CohortSpec):
        raise ValueError("DRFA samples its cohort from lam: give cohort=CohortSpec(size=m)")
    if o.cohort.sampling != "uniform" or o.cohort.weighting != "auto":
        raise ValueError(
            "DRFA draws its cohort from lam and weights it by lam: only the cohort size is "
            "used (leave sampling and weighting unset)"
        )
    o.cohort.check(num_clients)
    cohort = lambda_ascent(
        loss_fn,
        o,
        num_clients=num_clients,
        initial_weights=initial_weights,
        dual_lr=dual_lr,
        dual_lr_decay=dual_lr_decay,
        weight_floor=weight_floor,
        client_metrics=client_metrics,
    )
    return synchronous(loss_fn, dataclasses.replace(o, cohort=cohort), snapshot(o.local.steps))


# ------------------------------------------------------------------------------ DR-DSGD
@preset(
    client_optimizer=0.01,
    local=LocalSpec(steps=32, batch_size=32),
    cohort=CohortSpec(weighting="uniform"),
)
def dr_dsgd(loss_fn: LossFn, *, temperature: float = 2.0, options: Options) -> Algorithm:
    """DR-DSGD (Issaid et al. 2022), federated: local steps `w -= eta (1/t) exp(l/t) grad l`
    with t = `temperature` (> 0; the paper's mu, its theory assumes > 1), uniform averaging
    every I = `local.steps` steps (payload d per client, up and down)."""
    cohort = options.cohort
    if isinstance(cohort, CohortSpec):
        if cohort.weighting == "counts":
            raise ValueError("DR-DSGD averages clients uniformly: use weighting='uniform'")
        cohort = dataclasses.replace(cohort, weighting="uniform")
    return synchronous(loss_fn, dataclasses.replace(options, cohort=cohort), tilted(temperature))
