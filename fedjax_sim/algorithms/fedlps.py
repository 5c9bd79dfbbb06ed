"""FedLPS: local perturbation toward similar clients (paper Algorithm 1).

Buttaci & Calafiore, "Aiding Global Convergence in Federated Learning via Local Perturbation
and Mutual Similarity Information" (the paper names the method "Ours"; FedLPS is the
project's name). Spec: ../shared/specs/fedlps_local_perturbation.md.

Round t (all clients of the cohort S_t in parallel, per-client state stacked `[C, ...]`):

    u_i      = sum_n (p_in / p_i) last_w[n]            # fixed during the round
    w        = w_bar_t;  for k < K:  w <- w - gamma * grad f_i(beta w + (1 - beta) u_i; xi_k)
    last_w[i] = w_i^K                                   for i in S_t
    w_bar_{t+1} = sum_{i in S_t} p_i w_i^K / sum_{i in S_t} p_i

with `p_in`, `p_i` the similarity graph of `similarity.py` (also the aggregation weights) and
`last_w[n] = w_bar_0` initially, so `u_0^i = w_bar_0`. The gradient is taken at the perturbed
point and the step is applied to the local iterate, through `local_train`'s `grad_fn` hook
(`perturbed_grad_fn`). `beta = 1` is FedAvg with the graph weights. Any L2 penalty belongs to
the loss (`Model.l2`), so its gradient is taken at the perturbed point (A6); gradient clipping
(the paper's appendix) is `client_optimizer=optax.chain(optax.clip_by_global_norm(G),
optax.sgd(gamma))`.

Computing `U` at the start of round t from `last_w` equals the paper's server computing
`u_{t+1}` at the end of round t. Resolutions of the spec (section 7):
- A1: local work is a `LocalSpec` (E epochs of `ceil(N_i / B)` steps, or K steps).
- A2: partial participation normalises by `sum_{i in S_t} p_i` (identical under full
  participation, the paper's setting).
- A3: `stale="keep"` (default): clients outside the cohort keep their stale `last_w`;
  `stale="global"`: they are filled with the new global model, which keeps
  `sum_i p_i u_i = w_bar` (Lemma 1) exact under partial participation.
- A5: clients without data have `p_i = 0`, contribute nothing and use `u_i = w_bar_t`.
Deviation: the server step is an optax optimizer on the averaged delta (default `sgd(1.0)`,
the paper's plain averaging), as in `fedavg`. The downlink carries two models (`w_bar`, `u_i`).
Storage of `last_w` is `O(C |w|)` and the graph `O(C^2)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from fedjax_sim.algorithms.core import (
    COHORT,
    LOCAL,
    Algorithm,
    ClientOptimizer,
    CohortSpec,
    GradFn,
    LocalSpec,
    LossFn,
    Params,
    client_key,
    client_optimizer_for_round,
    float_dtype,
    local_train,
    map_cohort,
    payload_metrics,
    round_key,
    server_optimizer_from,
    server_update,
    tree_norm,
    tree_sub,
)
from fedjax_sim.algorithms.similarity import MessageMethod, SimilarityGraph, graph_from_data
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.parallel import ClientMap


@struct.dataclass
class FedLPSState:
    """Global model, server optimizer state, every client's last local model, round."""

    params: Params
    opt_state: Any
    last_w: Params  # [C, ...] last reported final local model of each client
    round: jax.Array  # [] int32


def perturbed_grad_fn(anchor: Params, beta: float) -> GradFn:
    """Local-step hook: the gradient at `beta * w + (1 - beta) * anchor`, applied to `w`."""

    def grad_fn(value_and_grad, params, batch, aux):
        point = jax.tree.map(lambda w, u: beta * w + (1.0 - beta) * u, params, anchor)
        loss, grads = value_and_grad(point, batch)
        return loss, grads, aux

    return grad_fn


def perturbation_anchors(last_w: Params, params: Params, row_weights: jax.Array) -> Params:
    """`u = row_weights @ last_w`, `[M, ...]` for `row_weights` `[M, C]` (rows of `p_in / p_i`);
    rows without neighbours (all zero, `p_i = 0`) get the global model `params`."""
    has = jnp.sum(row_weights, axis=1) > 0  # [M]

    def one(stacked, glob):
        u = jnp.tensordot(row_weights.astype(stacked.dtype), stacked, axes=1)  # [M, ...]
        return jnp.where(has.reshape(-1, *(1,) * glob.ndim), u, glob[None])

    return jax.tree.map(one, last_w, params)


def _check_beta(beta: float) -> float:
    beta = float(beta)
    if not (np.isfinite(beta) and 0.0 < beta <= 1.0):
        raise ValueError(f"FedLPS beta must be in (0, 1], got {beta}")
    return beta


def fedlps(
    loss_fn: LossFn,
    *,
    beta: float = 0.5,
    graph: SimilarityGraph | None = None,
    data: FederatedData | None = None,
    message_method: MessageMethod = "auto",
    client_optimizer: ClientOptimizer = 0.1,
    server_optimizer: float | optax.GradientTransformation = 1.0,
    local: LocalSpec = LocalSpec(),
    cohort: CohortSpec = CohortSpec(),
    stale: Literal["keep", "global"] = "keep",
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """FedLPS (Buttaci & Calafiore): local SGD with gradients at `beta w + (1-beta) u_i`.

    Args:
      loss_fn: `loss_fn(params, batch)` (e.g. `model.loss`, L2 penalty included).
      beta: perturbation weight in (0, 1]; 1 is FedAvg with the graph weights.
      graph: the one-off similarity graph (`similarity.graph_from_data(train)`); if None it
        is computed from `data` with `message_method`.
      data: the training data, used only to build the graph when `graph` is None.
      client_optimizer: local optimizer (float = SGD learning rate gamma).
      server_optimizer: applied to `-mean(Delta_i)`; 1.0 = the paper's averaging.
      local: local work (paper: `LocalSpec(epochs=10, batch_size=256, sampling="epoch")`).
      cohort: participation (`size`, uniform sampling); aggregation weights are always the
        graph degrees `p_i`.
      stale: "keep" (non-participants keep their last model) or "global" (filled with the
        new global model; see the module docstring, A3).
      client_map: how the cohort is mapped (vmap / lax.map).
    """
    beta = _check_beta(beta)
    if stale not in ("keep", "global"):
        raise ValueError(f"stale must be 'keep' or 'global', got {stale!r}")
    if graph is None:
        if data is None:
            raise ValueError("fedlps needs the similarity graph: pass graph= or data=")
        graph = graph_from_data(data, method=message_method)
    if cohort.sampling != "uniform":
        raise ValueError("fedlps samples cohorts uniformly without replacement")
    if cohort.client_weights is not None:
        raise ValueError("fedlps aggregates with the graph degrees; leave client_weights unset")
    num_clients = graph.num_clients
    cohort = dataclasses.replace(cohort, client_weights=tuple(graph.degrees))
    cohort.check(num_clients)
    row_normalised = np.asarray(graph.row_normalised)  # [C, C] float64, rows sum to 1 or 0
    server_opt = server_optimizer_from(server_optimizer)
    client_optimizer_for_round(client_optimizer, jnp.int32(0))  # validate eagerly

    def init(params: Params, key: jax.Array) -> FedLPSState:
        del key
        last_w = jax.tree.map(lambda x: jnp.broadcast_to(x, (num_clients, *x.shape)), params)
        return FedLPSState(
            params=params, opt_state=server_opt.init(params), last_w=last_w, round=jnp.int32(0)
        )

    def step(state: FedLPSState, data: FederatedData, key: jax.Array):
        if data.num_clients != num_clients:
            raise ValueError(f"data has {data.num_clients} clients, the graph {num_clients}")
        idx, weights = cohort.sample(round_key(key, state.round, COHORT), data.counts)
        counts = data.counts[idx]
        num_steps = local.num_steps(counts)
        rows = jnp.asarray(row_normalised, float_dtype())[idx]  # [M, C]
        anchors = perturbation_anchors(state.last_w, state.params, rows)  # [M, ...]
        optimizer = client_optimizer_for_round(client_optimizer, state.round)
        local_key = round_key(key, state.round, LOCAL)

        def client_fn(cid, steps, anchor):
            result = local_train(
                state.params,
                data.client(cid),
                client_key(local_key, cid),
                loss_fn=loss_fn,
                optimizer=optimizer,
                max_steps=local.max_steps(data.max_count),
                num_steps=None if local.epochs is None else steps,
                batch_size=local.batch_size,
                sampling=local.sampling,
                grad_fn=perturbed_grad_fn(anchor, beta),
            )
            gap = tree_norm(tree_sub(anchor, state.params))
            delta = tree_sub(result.params, state.params)
            return (delta, result.loss, gap), (result.params, result.steps)

        out = map_cohort(client_fn, idx, weights, num_steps, anchors, client_map=client_map)
        mean_delta, train_loss, anchor_gap = out.mean
        final, steps = out.outputs
        params, opt_state = server_update(
            state.params, mean_delta, server_opt, state.opt_state, apply=out.total_weight > 0
        )
        has_data = counts > 0

        def write(stacked, new, glob_new):
            keep = has_data.reshape(-1, *(1,) * (new.ndim - 1))
            stacked = stacked.at[idx].set(jnp.where(keep, new, stacked[idx]))
            if stale == "global":
                reported = jnp.zeros(num_clients, bool).at[idx].set(has_data)
                fill = reported.reshape(-1, *(1,) * glob_new.ndim)
                stacked = jnp.where(fill, stacked, glob_new[None])
            return stacked

        last_w = jax.tree.map(write, state.last_w, final, params)
        participants = jnp.sum(weights > 0)
        metrics = {
            "train_loss": train_loss,
            "participants": participants,
            "local_steps": jnp.sum(jnp.where(weights > 0, steps, 0)) / jnp.maximum(participants, 1),
            "update_norm": tree_norm(mean_delta),
            "anchor_gap": anchor_gap,  # p-weighted mean ||u_i - w_bar_t||
            **payload_metrics(state.params, participants, jnp.int32(idx.shape[0]), 1.0, 2.0),
        }
        new_state = FedLPSState(
            params=params, opt_state=opt_state, last_w=last_w, round=state.round + 1
        )
        return new_state, metrics

    return Algorithm(init, step)
