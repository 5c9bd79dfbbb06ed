"""FedAdam as in Reddi et al., "Adaptive Federated Optimization" (ICLR 2021), Algorithm 2,
and as the FedMIM paper's baseline (`docs/specs/fedmim.md` section 2.4): clients as in
FedAvg; the server runs Adam on the mean client update Delta_t WITHOUT bias correction,

    m <- b1 m + (1 - b1) Delta_t;   v <- b2 v + (1 - b2) Delta_t^2
    x_{t+1} = x_t + eta_g m / (sqrt(v) + tau)

with m = v = 0 at init. `adam_without_bias_correction` is that server step as an optax
`GradientTransformation` (applied to the pseudo-gradient `-Delta_t`, as every server optimizer).

Difference from the registry's `fedadam` (= `fedopt(server="adam")`, i.e. `optax.adam`):
optax divides m and v by `1 - b^t` (bias correction). Without it, round t's step equals
optax's step times `(1 - b1^t) / sqrt(1 - b2^t)` with tau replaced by `tau / sqrt(1 - b2^t)`:
with the defaults the factor is 1 at t = 1 (but the effective tau is 10x larger), rises to
about 2.1 around t = 13 (b2 > b1: v is under-estimated more than m) and returns to 1 only
after a few hundred rounds, where both rules coincide. Defaults here are the FedMIM
spec's: eta_g = 0.1 (paper), b1 = 0.9, b2 = 0.99, tau = 0.01 (not given by the paper; the
authors' group's FL-Simulator code's defaults).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.compose import Options, preset, synchronous
from fedjax_sim.algorithms.core import Algorithm, LossFn, Params
from fedjax_sim.core.checks import check_number, positive


class AdamNoBiasCorrectionState(NamedTuple):
    mu: Params  # first moment m
    nu: Params  # second moment v


def adam_without_bias_correction(
    learning_rate: float, b1: float = 0.9, b2: float = 0.99, eps: float = 0.01
) -> optax.GradientTransformation:
    """Adam without bias correction, `eps` (Reddi et al.'s tau) outside the square root
    (Reddi et al. Alg. 2): `m <- b1 m + (1-b1) g; v <- b2 v + (1-b2) g^2;
    update = -lr m / (sqrt(v) + eps)`."""
    positive("server Adam learning_rate", learning_rate)
    check_number("server Adam b1", b1, lambda v: 0 <= v < 1, "in [0, 1)")
    check_number("server Adam b2", b2, lambda v: 0 <= v < 1, "in [0, 1)")
    positive("server Adam eps", eps)
    tau = eps

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return AdamNoBiasCorrectionState(mu=zeros, nu=zeros)

    def update(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), state.nu, updates)
        step = jax.tree.map(lambda m, v: -learning_rate * m / (jnp.sqrt(v) + tau), mu, nu)
        return step, AdamNoBiasCorrectionState(mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


@preset(server_optimizer=0.1)
def fedadam_reddi(
    loss_fn: LossFn,
    *,
    b1: float = 0.9,
    b2: float = 0.99,
    eps: float = 0.01,
    options: Options,
) -> Algorithm:
    """FedAdam without bias correction (Reddi et al. Alg. 2; the FedMIM paper's baseline):
    `server_optimizer` is its learning rate eta_g (a float), `eps` its tau."""
    opt = options.server_optimizer
    if not isinstance(opt, optax.GradientTransformation):
        opt = adam_without_bias_correction(opt, b1, b2, eps)
    return synchronous(loss_fn, dataclasses.replace(options, server_optimizer=opt))
