"""FedCM: Xu et al., "FedCM: Federated Learning with Client-level Momentum" (2021).
Baseline of the FedMIM paper (its "client-level momentum weight" a = 0.1); update rules of
`../shared/specs/fedmim.md` section 2.4.

Server state D (0 at init) is broadcast with x_t. Round t, cohort S_t:

    local (K steps from x_t):  x <- x - eta_l(t) (a g_i(x) + (1 - a) D_t)
    server:  x_{t+1} = x_t + eta_g Delta_t,   Delta_t = weighted mean of (x_{i,K} - x_t)
             D_{t+1} = -Delta_t / (eta_l(t) K)    (the lr used in round t)

K is the static local-step count (`LocalSpec.steps`, or the longest client's step count with
`LocalSpec(epochs=...)`: use equal-size clients then). An empty round (Bernoulli cohort with
nobody selected) keeps x_t and sets D_{t+1} = 0 (Delta_t = 0), exactly as FedMIM's history
records a zero displacement in that case (spec 2.3); with J = 1, alpha = (1 - a,), beta = 0
and a constant lr, FedMIM is this algorithm. The round is the FedAvg-type
`local_update_round` with a momentum hook; D is recovered from the server step as
`(x_t - x_{t+1}) / (eta_g eta_l K)` (the server optimizer is SGD with lr eta_g).
MoFedSAM (`fedsam.mofedsam`) is this round with SAM gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from fedjax_sim.algorithms.core import (
    Algorithm,
    CohortSpec,
    GradFn,
    LocalSpec,
    LossFn,
    Params,
    Stragglers,
    server_optimizer_from,
    tree_norm,
    tree_scale,
    tree_sub,
)
from fedjax_sim.algorithms.fedavg import ServerState, local_update_round
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.parallel import ClientMap
from fedjax_sim.schedules import LearningRate, client_sgd, lr_at


@struct.dataclass
class FedCMState:
    params: Params  # x_t
    opt_state: Any  # server optimizer (SGD with eta_g) state
    momentum: Params  # D_t
    round: jax.Array  # [] int32


def client_momentum_grad_fn(momentum: Params, alpha: float) -> GradFn:
    """Local-step hook: direction `alpha g + (1 - alpha) D`."""

    def grad_fn(value_and_grad, params, batch, aux):
        loss, g = value_and_grad(params, batch)
        direction = jax.tree.map(lambda g_, d: alpha * g_ + (1.0 - alpha) * d, g, momentum)
        return loss, direction, aux

    return grad_fn


def client_momentum_round(
    loss_fn: LossFn,
    *,
    alpha: float,
    client_lr: LearningRate,
    weight_decay: float,
    server_lr: float,
    local: LocalSpec,
    cohort: CohortSpec,
    client_map: ClientMap,
    wrap_grad_fn: Callable[[GradFn], GradFn] | None = None,
) -> Algorithm:
    """FedCM's algorithm; `wrap_grad_fn` transforms its local-step hook (MoFedSAM wraps it
    with the SAM gradient)."""
    if not (math.isfinite(alpha) and 0 < alpha <= 1):
        raise ValueError(
            f"FedCM alpha (weight of the local gradient) must be in (0, 1], got {alpha}"
        )
    client_optimizer = client_sgd(client_lr, weight_decay)
    server_opt = server_optimizer_from(server_lr)
    wrap = wrap_grad_fn or (lambda grad_fn: grad_fn)

    def init(params: Params, key: jax.Array) -> FedCMState:
        del key
        return FedCMState(
            params=params,
            opt_state=server_opt.init(params),
            momentum=jax.tree.map(jnp.zeros_like, params),
            round=jnp.int32(0),
        )

    def step(state: FedCMState, data: FederatedData, key: jax.Array):
        inner = local_update_round(
            loss_fn,
            client_optimizer=client_optimizer,
            server_optimizer=server_opt,
            local=local,
            cohort=cohort,
            stragglers=Stragglers(),
            client_map=client_map,
            make_grad_fn=lambda x: wrap(client_momentum_grad_fn(state.momentum, alpha)),
        )
        server = ServerState(state.params, state.opt_state, state.round)
        server, metrics = inner.step(server, data, key)
        steps = local.max_steps(data.max_count)
        scale = 1.0 / (server_lr * lr_at(client_lr, state.round) * steps)
        momentum = tree_scale(tree_sub(state.params, server.params), scale)
        new = FedCMState(server.params, server.opt_state, momentum, server.round)
        return new, {
            **metrics,
            "momentum_norm": tree_norm(momentum),
            "bytes_down": 2 * metrics["bytes_down"],
        }

    return Algorithm(init, step)


def fedcm(
    loss_fn: LossFn,
    *,
    alpha: float = 0.1,
    client_lr: LearningRate = 0.1,
    weight_decay: float = 0.0,
    server_lr: float = 1.0,
    local: LocalSpec = LocalSpec(),
    cohort: CohortSpec = CohortSpec(),
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """FedCM with client-level momentum: local direction `alpha g + (1 - alpha) D`.

    Args:
      loss_fn: `loss_fn(params, batch)`, e.g. `model.loss`.
      alpha: weight of the local gradient, in (0, 1] (the FedMIM paper's 0.1; 1 is FedAvg).
      client_lr: local SGD learning rate, a float or a per-round schedule.
      weight_decay: decay added to the local direction (`optax.add_decayed_weights`).
      server_lr: global learning rate eta_g.
      local, cohort, client_map: local work, participation, mapping.
    """
    return client_momentum_round(
        loss_fn,
        alpha=alpha,
        client_lr=client_lr,
        weight_decay=weight_decay,
        server_lr=server_lr,
        local=local,
        cohort=cohort,
        client_map=client_map,
    )
