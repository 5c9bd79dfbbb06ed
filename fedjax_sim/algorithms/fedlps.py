"""FedLPS: local perturbation toward similar clients (paper Algorithm 1).

Buttaci & Calafiore, "Aiding Global Convergence in Federated Learning via Local Perturbation
and Mutual Similarity Information" (the paper names the method "Ours"; FedLPS is the
project's name). Spec: docs/specs/fedlps_local_perturbation.md.

Round t (all clients of the cohort S_t in parallel, per-client state stacked `[C, ...]`):

    u_i      = sum_n (p_in / p_i) last_w[n]            # fixed during the round
    w        = w_bar_t;  for k < K:  w <- w - gamma * grad f_i(beta w + (1 - beta) u_i; xi_k)
    last_w[i] = w_i^K                                   for i in S_t
    w_bar_{t+1} = sum_{i in S_t} p_i w_i^K / sum_{i in S_t} p_i

with `p_in`, `p_i` the similarity graph of `similarity.py` (also the aggregation weights) and
`last_w[n] = w_bar_0` initially, so `u_0^i = w_bar_0`. The gradient is taken at the perturbed
point and the step is applied to the local iterate: the `perturbation` local-step hook of
the composable layer (`compose`), whose server-side state is `last_w`. `beta = 1` is FedAvg
with the graph weights. Any L2 penalty belongs to the loss (`Model.l2`), so its gradient is
taken at the perturbed point (A6); gradient clipping (the paper's appendix) is
`client_optimizer=optax.chain(optax.clip_by_global_norm(G), optax.sgd(gamma))`.

Computing `U` at the start of round t from `last_w` equals the paper's server computing
`u_{t+1}` at the end of round t. Resolutions of the spec (section 7):
- A1: local work is a `LocalSpec` (E epochs of `ceil(N_i / B)` steps, or K steps).
- A2: partial participation normalises by `sum_{i in S_t} p_i` (identical under full
  participation, the paper's setting).
- A3: `stale="keep"` (default): clients outside the cohort keep their stale `last_w`;
  `stale="global"`: they are filled with the new global model, which keeps
  `sum_i p_i u_i = w_bar` (Lemma 1) exact under partial participation.
- A5: clients without data have `p_i = 0`, contribute nothing and use `u_i = w_bar_t`.
- A client that does not contribute (weight 0: no data, `p_i = 0`, a dropped
  straggler) keeps its `last_w` (or gets the global model with `stale="global"`).
Deviation: the server step is any server optimizer and aggregator on the updates (default
`1.0`, the paper's plain averaging), as in `fedavg`. The downlink carries two models
(`w_bar`, `u_i`).
Storage of `last_w` is `O(C |w|)` and the graph `O(C^2)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms.compose import Options, preset, synchronous
from fedjax_sim.algorithms.core import (
    Algorithm,
    CohortSpec,
    LossFn,
    float_dtype,
    tree_norm,
    tree_sub,
)
from fedjax_sim.algorithms.distributors import Distributor, cohort_distributor
from fedjax_sim.algorithms.local_hook import LocalHook, RoundSummary
from fedjax_sim.algorithms.similarity import MessageMethod, SimilarityGraph, graph_from_data
from fedjax_sim.core.checks import check_number
from fedjax_sim.core.rows import scatter_rows
from fedjax_sim.data.federated import FederatedData

Params = Any


def perturbation_anchors(last_w: Params, params: Params, row_weights: jax.Array) -> Params:
    """`u = row_weights @ last_w`, `[M, ...]` for `row_weights` `[M, C]` (rows of `p_in / p_i`)
    and `last_w` `[C, ...]`; rows without neighbours (all zero, `p_i = 0`) get the global
    model `params`."""
    has = jnp.sum(row_weights, axis=1) > 0  # [M]

    def one(stacked, glob):
        u = jnp.tensordot(row_weights.astype(stacked.dtype), stacked, axes=1)  # [M, ...]
        return jnp.where(has.reshape(-1, *(1,) * glob.ndim), u, glob[None])

    return jax.tree.map(one, last_w, params)


def perturbation(
    beta: Any, graph: SimilarityGraph, stale: Literal["keep", "global"] = "keep"
) -> LocalHook:
    """FedLPS' local perturbation (Buttaci & Calafiore, Algorithm 1): the gradient at
    `beta w + (1 - beta) u_i`, applied to the local iterate w, with the anchor
    `u_i = sum_n (p_in / p_i) last_w[n]` (`perturbation_anchors`, a `client_input` fixed
    during the round). Server: `last_w [C, ...]`, every client's last final model (the global
    model at init); `finalize` writes the contributing clients' final models (`stale="keep"`)
    and fills every other client with the new global model (`stale="global"`). Summand
    `||u_i - x_t||` (metric `anchor_gap`); the anchor travels down with the model."""
    check_number("FedLPS beta", beta, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
    if stale not in ("keep", "global"):
        raise ValueError(f"stale must be 'keep' or 'global', got {stale!r}")
    num_clients = graph.num_clients
    row_normalised = np.asarray(graph.row_normalised)  # [C, C] float64, rows sum to 1 or 0

    def prepare(last_w, cohort, params, key):
        rows = jnp.asarray(row_normalised, float_dtype())[cohort.ids]  # [M, C]
        return None, perturbation_anchors(last_w, params, rows)

    def direction(value_and_grad, params, batch, carry, ctx):
        anchor = ctx.client_input
        point = jax.tree.map(lambda w, u: beta * w + (1.0 - beta) * u, params, anchor)
        loss, grads = value_and_grad(point, batch)
        return loss, grads, carry

    def finish(ctx, outcome):
        gap = tree_norm(tree_sub(ctx.client_input, ctx.anchor))
        return None, gap, outcome.params, outcome.update

    def finalize(last_w, s: RoundSummary, server_step):
        params = server_step(s.update)
        reported = s.cohort.weights > 0
        last_w = scatter_rows(last_w, s.cohort.ids, reported, s.outputs)
        if stale == "global":
            fill = jnp.zeros(num_clients, bool).at[s.cohort.ids].set(reported)
            last_w = jax.tree.map(
                lambda w, g: jnp.where(fill.reshape(-1, *(1,) * g.ndim), w, g[None]),
                last_w,
                params,
            )
        return last_w, params, {"anchor_gap": s.mean}  # p-weighted mean ||u_i - w_bar_t||

    return LocalHook(
        "perturbation",
        direction,
        init_server=lambda params: jax.tree.map(
            lambda x: jnp.broadcast_to(x, (num_clients, *x.shape)), params
        ),
        prepare=prepare,
        finish=finish,
        finalize=finalize,
        # the server has x_i = x_t + Delta_i; ||u_i - x_t|| is a diagnostic
        not_sent=("summand", "output"),
    )


def degree_cohort(cohort: CohortSpec, graph: SimilarityGraph) -> Distributor:
    """`cohort` (uniform sampling) aggregated with the graph degrees `p_i`."""
    if cohort.sampling != "uniform":
        raise ValueError("fedlps samples cohorts uniformly without replacement")
    if cohort.client_weights is not None or cohort.weighting != "auto":
        raise ValueError(
            "fedlps aggregates with the graph degrees; leave client_weights and weighting unset"
        )
    num_clients = graph.num_clients
    spec = dataclasses.replace(cohort, client_weights=tuple(graph.degrees))
    spec.check(num_clients)
    base = cohort_distributor(spec)

    def sample(state, key, counts, round_):
        if counts.shape[0] != num_clients:
            raise ValueError(f"data has {counts.shape[0]} clients, the graph {num_clients}")
        return base.sample(state, key, counts, round_)

    return base._replace(sample=sample)


@preset()
def fedlps(
    loss_fn: LossFn,
    *,
    beta: float = 0.5,
    graph: SimilarityGraph | None = None,
    data: FederatedData | None = None,
    message_method: MessageMethod = "auto",
    stale: Literal["keep", "global"] = "keep",
    options: Options,
) -> Algorithm:
    """FedLPS (Buttaci & Calafiore): local steps with gradients at `beta w + (1-beta) u_i`.

    `beta` the perturbation weight in (0, 1] (1: FedAvg with the graph weights); `graph` the
    one-off similarity graph (`similarity.graph_from_data(train)`), or None to compute it from
    `data` with `message_method`; `stale` "keep" or "global" (module docstring, A3). The
    paper's local work is `LocalSpec(epochs=10, batch_size=256, sampling="epoch")` and its
    server step the plain average (`server_optimizer=1.0`); `cohort` (uniform, `size`) is
    aggregated with the graph degrees `p_i`."""
    if graph is None:
        if data is None:
            raise ValueError("fedlps needs the similarity graph: pass graph= or data=")
        graph = graph_from_data(data, method=message_method)
    hook = perturbation(beta, graph, stale)
    if not isinstance(options.cohort, CohortSpec):
        raise ValueError("fedlps samples its cohort from a CohortSpec (graph-degree weights)")
    cohort = degree_cohort(options.cohort, graph)
    return synchronous(loss_fn, dataclasses.replace(options, cohort=cohort), hook)
