"""FedDyn: Acar et al., "Federated Learning Based on Dynamic Regularization" (ICLR 2021).
Baseline of the FedMIM paper (its "prox-weight" a = 0.1); update rules of
`../shared/specs/fedmim.md` section 2.4.

State: global model x, server state h, and per-client gradient states h_i for ALL C clients
stacked on axis 0 (`[C, ...]`), all zero at init. Round t, cohort S_t:

    local (K steps from theta = x_t):  theta <- theta - eta_l (g_i(theta) - h_i + a (theta - x_t))
    h_i <- h_i - a (theta_K - x_t)                                    (i in S_t only)
    server:  h <- h - a (1/C) sum_{i in S_t} (theta_{i,K} - x_t)
             x_{t+1} = mean_{i in S_t} theta_{i,K} - h / a

The mean over the cohort uses `CohortSpec.weighting` (the paper's 1/S is
`weighting="uniform"`, identical to count weighting for equal-size clients). Only cohort rows
of h_i are read and written (`.at[idx].set`): O(M d) per round. An empty round (Bernoulli
cohort with nobody selected) keeps x, h and every h_i. The server model is not a server-
optimizer step (FedDyn has no global learning rate).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from fedjax_sim.algorithms.core import (
    Algorithm,
    CohortSpec,
    LocalSpec,
    LossFn,
    Params,
    tree_add,
    tree_norm,
    tree_scale,
    tree_sub,
)
from fedjax_sim.algorithms.stateful import check_cohort, client_state_round
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.parallel import ClientMap
from fedjax_sim.schedules import LearningRate, client_sgd


@struct.dataclass
class FedDynState:
    params: Params  # x_t
    h: Params  # server state h
    client_h: Params  # h_i, leaves [C, ...]
    round: jax.Array  # [] int32


def dynamic_regularizer_grad_fn(h_i: Params, anchor: Params, alpha: float):
    """Local-step hook: direction `g - h_i + alpha (theta - anchor)`."""

    def grad_fn(value_and_grad, params, batch, aux):
        loss, g = value_and_grad(params, batch)
        direction = jax.tree.map(
            lambda g_, hi, p, a: g_ - hi + alpha * (p - a), g, h_i, params, anchor
        )
        return loss, direction, aux

    return grad_fn


def feddyn(
    loss_fn: LossFn,
    *,
    num_clients: int,
    alpha: float = 0.1,
    client_lr: LearningRate = 0.1,
    weight_decay: float = 0.0,
    local: LocalSpec = LocalSpec(),
    cohort: CohortSpec = CohortSpec(),
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """FedDyn with regularisation coefficient `alpha` (> 0) and per-client states h_i.

    Args:
      loss_fn: `loss_fn(params, batch)`, e.g. `model.loss`.
      num_clients: C, the number of clients of the data (rows of the `[C, ...]` state).
      alpha: FedDyn's alpha (the FedMIM paper's "prox-weight", 0.1).
      client_lr: local SGD learning rate, a float or a per-round schedule.
      weight_decay: decay added to the local direction (`optax.add_decayed_weights`).
      local, cohort, client_map: local work, participation (uniform or Bernoulli), mapping.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"FedDyn alpha must be a finite number > 0, got {alpha}")
    check_cohort(cohort)
    client_optimizer = client_sgd(client_lr, weight_decay)

    def init(params: Params, key: jax.Array) -> FedDynState:
        del key
        return FedDynState(
            params=params,
            h=jax.tree.map(jnp.zeros_like, params),
            client_h=jax.tree.map(lambda p: jnp.zeros((num_clients, *p.shape), p.dtype), params),
            round=jnp.int32(0),
        )

    def step(state: FedDynState, data: FederatedData, key: jax.Array):
        x = state.params
        out = client_state_round(
            x,
            state.client_h,
            data,
            key,
            state.round,
            loss_fn=loss_fn,
            client_optimizer=client_optimizer,
            local=local,
            cohort=cohort,
            client_map=client_map,
            make_grad_fn=lambda h_i: dynamic_regularizer_grad_fn(h_i, x, alpha),
            update_client=lambda h_i, delta, steps: tree_sub(h_i, tree_scale(delta, alpha)),
        )
        # sum_i (h_i+ - h_i) = -alpha sum_i Delta_i, so h <- h + (1/C) sum_i (h_i+ - h_i)
        h = tree_add(state.h, tree_scale(out.state_change_sum, 1.0 / data.num_clients))
        candidate = tree_sub(tree_add(x, out.mean_delta), tree_scale(h, 1.0 / alpha))
        params = jax.tree.map(lambda n, o: jnp.where(out.contributed, n, o), candidate, x)
        new = FedDynState(params, h, out.client_state, state.round + 1)
        return new, {**out.metrics, "h_norm": tree_norm(h)}

    return Algorithm(init, step)
