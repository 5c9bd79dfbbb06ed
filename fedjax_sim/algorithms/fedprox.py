"""FedProx: Li et al., "Federated Optimization in Heterogeneous Networks" (MLSys 2020).

Each client approximately minimises `h_i(w) = f_i(w) + mu/2 ||w - x_t||^2` by local SGD from
the broadcast model `x_t` (the proximal term enters as `mu (w - x_t)` in every local step).
Systems heterogeneity: a fraction of cohort clients are stragglers that run a random number
of epochs in [1, E] (FedProx keeps their partial work; FedAvg drops them). `mu = 0` and no
stragglers is exactly FedAvg.
"""

from __future__ import annotations

import jax
import optax

from fedjax_sim.algorithms.core import (
    Algorithm,
    ClientOptimizer,
    CohortSpec,
    LocalSpec,
    LossFn,
    Params,
    Stragglers,
)
from fedjax_sim.algorithms.fedavg import local_update_round
from fedjax_sim.compression import Uplink
from fedjax_sim.parallel import ClientMap


def proximal_grad_fn(anchor: Params, mu: float):
    """Local-step hook adding `mu (w - anchor)` to the gradient."""

    def grad_fn(value_and_grad, params, batch, aux):
        loss, grads = value_and_grad(params, batch)
        grads = jax.tree.map(lambda g, p, a: g + mu * (p - a), grads, params, anchor)
        return loss, grads, aux

    return grad_fn


def fedprox(
    loss_fn: LossFn,
    *,
    mu: float = 0.01,
    client_optimizer: ClientOptimizer = 0.1,
    server_optimizer: float | optax.GradientTransformation = 1.0,
    local: LocalSpec = LocalSpec(),
    cohort: CohortSpec = CohortSpec(),
    stragglers: Stragglers = Stragglers(policy="partial"),
    client_map: ClientMap = ClientMap(),
    uplink: Uplink | None = None,
) -> Algorithm:
    """FedProx with proximal coefficient `mu` (>= 0) and FedProx's straggler rule.

    Args are those of `fedavg` (including `uplink`, e.g. error feedback);
    `stragglers=Stragglers(fraction=0.9)` reproduces the paper's "90% stragglers" setting
    (partial work kept)."""
    if mu < 0:
        raise ValueError(f"FedProx mu must be >= 0, got {mu}")
    return local_update_round(
        loss_fn,
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        local=local,
        cohort=cohort,
        stragglers=stragglers,
        client_map=client_map,
        make_grad_fn=lambda anchor: proximal_grad_fn(anchor, mu),
        uplink=uplink,
    )
