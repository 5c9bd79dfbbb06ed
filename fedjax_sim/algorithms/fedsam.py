"""FedSAM and MoFedSAM: Qu et al., "Generalized Federated Learning via Sharpness Aware
Minimization" (ICML 2022). Baselines of the FedMIM paper; rules of
`../shared/specs/fedmim.md` section 2.4.

Every local step takes a SAM step on its minibatch xi:

    g = grad f_i(x; xi);  e = rho g / ||g||;  g~ = grad f_i(x + e; xi);  x <- x - eta_l g~

(the same minibatch for both gradients; `e = 0` when `g = 0`; ||.|| is the global norm over
all parameters). FedSAM aggregates like FedAvg; MoFedSAM is FedCM (`fedcm`) with g~ in place
of g. The reported train loss is the loss at x (before the perturbation). `with_sam` turns
any local-step hook into its SAM version.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.core import (
    Algorithm,
    CohortSpec,
    GradFn,
    LocalSpec,
    LossFn,
    Stragglers,
    ValueAndGrad,
    default_grad_fn,
    tree_norm,
)
from fedjax_sim.algorithms.fedavg import local_update_round
from fedjax_sim.algorithms.fedcm import client_momentum_round
from fedjax_sim.parallel import ClientMap
from fedjax_sim.schedules import LearningRate, client_sgd


def sam_value_and_grad(value_and_grad: ValueAndGrad, rho: float) -> ValueAndGrad:
    """`(params, batch) -> (loss at params, gradient at params + rho g/||g||)`."""

    def vg(params, batch):
        loss, g = value_and_grad(params, batch)
        norm = tree_norm(g)
        scale = jnp.where(norm > 0, rho / jnp.where(norm > 0, norm, 1.0), 0.0)
        perturbed = jax.tree.map(lambda p, g_: p + scale * g_, params, g)
        _, g_tilde = value_and_grad(perturbed, batch)
        return loss, g_tilde

    return vg


def with_sam(grad_fn: GradFn, rho: float) -> GradFn:
    """The local-step hook `grad_fn` with every gradient replaced by the SAM gradient."""

    def sam_grad_fn(value_and_grad, params, batch, aux):
        return grad_fn(sam_value_and_grad(value_and_grad, rho), params, batch, aux)

    return sam_grad_fn


def _check_rho(rho: float) -> None:
    if not (math.isfinite(rho) and rho >= 0):
        raise ValueError(f"SAM radius rho must be a finite number >= 0, got {rho}")


def fedsam(
    loss_fn: LossFn,
    *,
    rho: float = 0.1,
    client_lr: LearningRate = 0.1,
    weight_decay: float = 0.0,
    server_lr: float = 1.0,
    local: LocalSpec = LocalSpec(),
    cohort: CohortSpec = CohortSpec(),
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """FedSAM: FedAvg whose local steps are SAM steps of radius `rho`.

    Args:
      loss_fn: `loss_fn(params, batch)`, e.g. `model.loss`.
      rho: SAM radius (>= 0; not given by the FedMIM paper, 0.1 as in the authors' group's
        code; 0 is FedAvg).
      client_lr: local SGD learning rate, a float or a per-round schedule.
      weight_decay: decay added to the local direction (`optax.add_decayed_weights`).
      server_lr: global learning rate.
      local, cohort, client_map: local work, participation, mapping.
    """
    _check_rho(rho)
    return local_update_round(
        loss_fn,
        client_optimizer=client_sgd(client_lr, weight_decay),
        server_optimizer=server_lr,
        local=local,
        cohort=cohort,
        stragglers=Stragglers(),
        client_map=client_map,
        make_grad_fn=lambda anchor: with_sam(default_grad_fn, rho),
    )


def mofedsam(
    loss_fn: LossFn,
    *,
    alpha: float = 0.1,
    rho: float = 0.1,
    client_lr: LearningRate = 0.1,
    weight_decay: float = 0.0,
    server_lr: float = 1.0,
    local: LocalSpec = LocalSpec(),
    cohort: CohortSpec = CohortSpec(),
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """MoFedSAM: FedCM (local gradient weight `alpha`) with SAM gradients of radius `rho`.

    Args are those of `fedcm` plus `rho` (see `fedsam`)."""
    _check_rho(rho)
    return client_momentum_round(
        loss_fn,
        alpha=alpha,
        client_lr=client_lr,
        weight_decay=weight_decay,
        server_lr=server_lr,
        local=local,
        cohort=cohort,
        client_map=client_map,
        wrap_grad_fn=lambda grad_fn: with_sam(grad_fn, rho),
    )
