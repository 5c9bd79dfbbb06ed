"""Client and server optimizers as the composable layer accepts them: a float (SGD learning
rate), a schedule of the round, an optax transformation, or `round -> transformation`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.core.checks import positive

# ------------------------------------------------------------------------------ optimizers
# float (SGD learning rate) | schedule (round -> learning rate) | optax transformation |
# callable round -> optax transformation
ClientOptimizer = Any
ServerOptimizer = Any  # float (SGD learning rate) | optax transformation


def client_optimizer_at(opt: ClientOptimizer, round_: jax.Array) -> optax.GradientTransformation:
    """The client optimizer of round `round_`: a float or a schedule's value is
    `optax.sgd(lr)`; a callable may also return an optax transformation (per-round
    optimizers)."""
    if isinstance(opt, optax.GradientTransformation):
        return opt
    if callable(opt):
        value = opt(round_)
        return value if isinstance(value, optax.GradientTransformation) else optax.sgd(value)
    return optax.sgd(opt)


def client_lr_at(opt: ClientOptimizer, round_: jax.Array) -> Any:
    """The learning rate of a float / schedule client optimizer at `round_`; None for an
    optax transformation (its learning rate is not known)."""
    if isinstance(opt, optax.GradientTransformation):
        return None
    if callable(opt):
        value = opt(round_)
        return None if isinstance(value, optax.GradientTransformation) else value
    return opt


def check_client_optimizer(opt: ClientOptimizer) -> None:
    """Validates a client optimizer where its value is concrete (round 0 of a schedule): a
    learning rate must be > 0 (to freeze the model, pass `optax.sgd(0.0)` explicitly)."""
    if isinstance(opt, optax.GradientTransformation):
        return
    if callable(opt):
        value = opt(jnp.int32(0))
        if isinstance(value, optax.GradientTransformation):
            return
        if isinstance(value, jax.Array) and value.ndim == 0:
            value = value if isinstance(value, jax.core.Tracer) else float(value)
        positive("client_optimizer (learning rate at round 0)", value)
        return
    positive("client_optimizer (learning rate)", opt)


def server_optimizer_from(opt: ServerOptimizer) -> optax.GradientTransformation:
    """A float is `optax.sgd(lr)` (lr 1 is plain averaging of the updates)."""
    if isinstance(opt, optax.GradientTransformation):
        return opt
    positive("server_optimizer (learning rate)", opt)
    return optax.sgd(opt)
