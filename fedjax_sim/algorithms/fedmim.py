"""FedMIM: Liu, Sun, Ding, Shen, Liu, Tao, "Enhance Local Consistency in Federated Learning:
A Multi-Step Inertial Momentum Approach" (paper `../shared/papers/001_2c5ce8b390de0188.txt`),
exactly Algorithm 1 as resolved in `../shared/specs/fedmim.md` (sections 2.1-2.3).

Weights alpha_0..alpha_{J-1} >= 0 (sum < 1) and beta_0..beta_{J-1} >= 0, index j = 0 the MOST
RECENT increment (the paper's Table III is 1-based: its alpha_1 is alpha[0] here).
`A = 1 - sum_j alpha_j`. The server keeps the last J global increments
`delta_{t-j} = (x_{t-j-1} - x_{t-j}) / K` (a `[J, ...]` buffer, zero at init, i.e.
x_{-J} = ... = x_{-1} = x_0). Round t:

    M_t = sum_j alpha_j delta_{t-j}    (inertial shift)     P_t = sum_j beta_j delta_{t-j}
    each cohort client, K steps from x_t:   x <- x - M_t - A eta_l(t) grad f_i(x - P_t; xi)
    x_{t+1} = mean of the cohort's x_{i,K};   push delta_{t+1} = (x_t - x_{t+1}) / K

J = 0 or all alpha = beta = 0 is FedAvg (bit for bit); J = 1, beta = 0 is FedCM with weight
1 - alpha_0 (exact for a constant lr). The round is the FedAvg-type `local_update_round`: the
gradient hook returns `A g(x - P_t) + M_t / eta_l(t)`, so the client SGD step
`x - eta_l(t) * direction` is exactly the update above (and alpha = beta = 0 gives FedAvg's
operations bit for bit).

Decisions (spec section 7): the look-ahead uses Algorithm 1's scale (item 1); every client
knows the history (one global buffer, item 3); weight decay either in the loss
(`Model.with_l2`: evaluated at the look-ahead point and damped by A, the spec's resolution,
item 5) or at the iterate (`weight_decay=`: `x <- x - M - A eta g - eta wd x`, the optax SGD
placement); K is the static local-step count (`LocalSpec.steps`, or the longest client's
count with `LocalSpec(epochs=...)`: use equal-size clients then, item 11).
The server mean uses `CohortSpec.weighting` (the paper's 1/S is `weighting="uniform"`,
identical to count weighting for equal-size clients). With Bernoulli participation an empty
round keeps x_t and pushes delta = 0 (spec 2.3). `bytes_down` counts the cohort's copies of
x_t only (the paper broadcasts x_t to every client so that all of them hold the history).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

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
    tree_norm,
    tree_scale,
    tree_sub,
)
from fedjax_sim.algorithms.fedavg import local_update_round
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.parallel import ClientMap
from fedjax_sim.schedules import LearningRate, client_sgd, lr_at


@struct.dataclass
class FedMIMState:
    params: Params  # x_t
    history: Params  # leaves [J, ...]: history[j] = delta_{t-j} = (x_{t-j-1} - x_{t-j}) / K
    round: jax.Array  # [] int32


def inertial_grad_fn(inertia: Params, lookahead: Params, damping: float, lr) -> GradFn:
    """Local-step hook: direction `A g(x - P) + M / eta`, so that the SGD step
    `x - eta * direction` is Algorithm 1's `x - M - A eta g(x - P)`."""
    inv_lr = 1.0 / lr

    def grad_fn(value_and_grad, params, batch, aux):
        loss, g = value_and_grad(tree_sub(params, lookahead), batch)
        direction = jax.tree.map(lambda g_, m: damping * g_ + m * inv_lr, g, inertia)
        return loss, direction, aux

    return grad_fn


def _weights(name: str, values: float | Sequence[float]) -> tuple[float, ...]:
    values = (values,) if isinstance(values, numbers.Real) else tuple(values)
    for v in values:
        if not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
            raise ValueError(f"FedMIM {name} weights must be finite numbers >= 0, got {values}")
    return tuple(float(v) for v in values)


def check_weights(
    alpha: float | Sequence[float], beta: float | Sequence[float] | None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Validated `(alpha, beta)` of equal length J (beta None: zeros); sum(alpha) < 1."""
    alpha = _weights("alpha", alpha)
    beta = (0.0,) * len(alpha) if beta is None else _weights("beta", beta)
    if len(beta) != len(alpha):
        raise ValueError(
            f"FedMIM alpha and beta must have the same length J, got J={len(alpha)} alphas "
            f"and {len(beta)} betas"
        )
    if not sum(alpha) < 1:
        raise ValueError(
            f"FedMIM needs sum(alpha) < 1 (A = 1 - sum(alpha) > 0), got sum(alpha) = {sum(alpha)}"
        )
    return alpha, beta


def fedmim(
    loss_fn: LossFn,
    *,
    alpha: float | Sequence[float] = (0.6, 0.3),
    beta: float | Sequence[float] | None = (0.9, 0.1),
    client_lr: LearningRate = 0.1,
    weight_decay: float = 0.0,
    local: LocalSpec = LocalSpec(),
    cohort: CohortSpec = CohortSpec(),
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """FedMIM (Algorithm 1) with J = len(alpha) inertial steps.

    Args:
      loss_fn: `loss_fn(params, batch)`, e.g. `model.loss` (its l2 is the paper's weight
        decay evaluated at the look-ahead point).
      alpha: inertial weights alpha_0..alpha_{J-1} (newest first), >= 0 with sum < 1;
        default the paper's best (0.6, 0.3). A float is J = 1; `()` is J = 0 (FedAvg).
      beta: look-ahead weights of the same length (None: zeros); default (0.9, 0.1).
      client_lr: local learning rate eta_l, a float or a per-round schedule
        (`schedules.round_decay(0.1, 0.998)` is the paper's).
      weight_decay: decay `wd * x` at the iterate (`optax.add_decayed_weights`, not damped).
      local, cohort, client_map: local work (K steps), participation (uniform S of C, or
        Bernoulli with an empty round a no-op), mapping.
    """
    alpha, beta = check_weights(alpha, beta)
    num_inertial = len(alpha)
    damping = 1.0 - sum(alpha)  # A
    client_optimizer = client_sgd(client_lr, weight_decay)

    def init(params: Params, key: jax.Array) -> FedMIMState:
        del key
        history = jax.tree.map(lambda p: jnp.zeros((num_inertial, *p.shape), p.dtype), params)
        return FedMIMState(params=params, history=history, round=jnp.int32(0))

    def combine(weights: tuple[float, ...], history: Params) -> Params:
        return jax.tree.map(
            lambda h: jnp.tensordot(jnp.asarray(weights, h.dtype), h, axes=1), history
        )

    def step(state: FedMIMState, data: FederatedData, key: jax.Array):
        inertia = combine(alpha, state.history)  # M_t
        lookahead = combine(beta, state.history)  # P_t
        lr = lr_at(client_lr, state.round)
        inner = local_update_round(
            loss_fn,
            client_optimizer=client_optimizer,
            server_optimizer=1.0,
            local=local,
            cohort=cohort,
            stragglers=Stragglers(),
            client_map=client_map,
            make_grad_fn=lambda anchor: inertial_grad_fn(inertia, lookahead, damping, lr),
        )
        server = inner.init(state.params, key).replace(round=state.round)
        server, metrics = inner.step(server, data, key)
        history = state.history
        if num_inertial:
            steps = local.max_steps(data.max_count)
            newest = tree_scale(tree_sub(state.params, server.params), 1.0 / steps)
            history = jax.tree.map(lambda h, d: jnp.concatenate([d[None], h[:-1]]), history, newest)
        new = FedMIMState(params=server.params, history=history, round=server.round)
        return new, {**metrics, "inertia_norm": tree_norm(inertia)}

    return Algorithm(init, step)
