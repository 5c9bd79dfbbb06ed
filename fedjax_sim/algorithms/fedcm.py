"""FedCM and MoFedSAM: client-level momentum (Xu et al., "FedCM: Federated Learning with
Client-level Momentum", 2021) and its SAM version (Qu et al., ICML 2022). Baselines of the
FedMIM paper; rules of `docs/specs/fedmim.md` section 2.4, as presets of the
`client_momentum(m)` hook (and `sam(rho)` first in the chain for MoFedSAM):

    local (K steps from x_t):  x <- x - eta_l(t) ((1 - m) g_i(x) + m D_t)
    server:  x_{t+1} = server step on Delta_t = weighted mean of (x_{i,K} - x_t)
             D_{t+1} = -Delta_t / (eta_l(t) K)

The paper's FedCM writes the weight of the gradient as alpha = 1 - m (its 0.1 is m = 0.9).
K is the static local-step count. An empty round keeps x_t and sets D_{t+1} = 0. With
J = 1, momentum (m,), lookahead (0,) and a constant learning rate FedMIM is FedCM.
"""

from __future__ import annotations

from fedjax_sim.algorithms.compose import Options, preset, synchronous
from fedjax_sim.algorithms.core import Algorithm, LossFn
from fedjax_sim.algorithms.hooks import client_momentum, sam


@preset()
def fedcm(loss_fn: LossFn, *, momentum: float = 0.9, options: Options) -> Algorithm:
    """FedCM: local direction `(1 - momentum) g + momentum D` (`momentum` in [0, 1); the
    paper's alpha = 0.1 is momentum 0.9; 0 is FedAvg)."""
    return synchronous(loss_fn, options, client_momentum(momentum))


@preset()
def mofedsam(
    loss_fn: LossFn, *, momentum: float = 0.9, rho: float = 0.1, options: Options
) -> Algorithm:
    """MoFedSAM: FedCM (`momentum`) with SAM gradients of radius `rho`."""
    return synchronous(loss_fn, options, sam(rho), client_momentum(momentum))
