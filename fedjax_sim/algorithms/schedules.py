"""Per-round client learning rates and weight decay, as optax schedules and transforms.

The FedMIM paper (and the baselines it compares with) use local SGD whose learning rate decays
once per communication round, `eta_l(t) = eta_0 * 0.998^t` (`round_decay`), with weight decay
1e-3. A learning rate is a float or an `optax.Schedule` evaluated at the round counter;
`client_sgd(lr, weight_decay)` turns it into the foundation's "callable round -> optimizer"
form accepted by `local_update_round` / `fedavg(client_optimizer=...)`.

Weight-decay placement: `client_sgd(..., weight_decay=wd)` adds `wd * x` at the iterate
(`optax.add_decayed_weights` before `optax.sgd`, as torch's SGD does in the FedMIM authors'
group's FL-Simulator code). The FedMIM spec (section 7 item 5) instead puts `wd/2 ||x||^2`
into each client's loss (`Model.with_l2(wd)`), so that it is evaluated where the data
gradient is evaluated (FedMIM's look-ahead point, FedSAM's perturbed point). For plain SGD
baselines (FedAvg, FedCM, SCAFFOLD, FedDyn) the two are the same update.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.core import float_dtype

LearningRate = float | optax.Schedule


def round_decay(lr0: float = 0.1, decay: float = 0.998) -> optax.Schedule:
    """`eta(t) = lr0 * decay**t` with t the round counter (the paper: 0.1 * 0.998^t).

    `optax.exponential_decay` evaluated at the counter cast to the default float dtype (an
    int32 counter would make it float32 even under float64)."""
    if not lr0 > 0:
        raise ValueError(f"initial learning rate must be > 0, got {lr0}")
    if not 0 < decay <= 1:
        raise ValueError(f"learning-rate decay must be in (0, 1], got {decay}")
    schedule = optax.exponential_decay(lr0, transition_steps=1, decay_rate=decay)
    return lambda round_: schedule(jnp.asarray(round_, float_dtype()))


def lr_at(lr: LearningRate, round_: jax.Array) -> jax.Array | float:
    """The learning rate used in round `round_`."""
    return lr(round_) if callable(lr) else lr


def check_lr(lr: LearningRate, name: str = "client_lr") -> None:
    """Raises ValueError unless `lr` (or the schedule's value at round 0) is finite and > 0."""
    value = float(lr(0)) if callable(lr) else float(lr)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0 (or a schedule), got {value}")


def check_weight_decay(weight_decay: float) -> None:
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay}")


def client_sgd(
    lr: LearningRate, weight_decay: float = 0.0
) -> Callable[[jax.Array], optax.GradientTransformation]:
    """`round -> optax.sgd(lr(round))`, preceded by `add_decayed_weights(weight_decay)`
    when `weight_decay > 0` (decay at the iterate; see the module docstring)."""
    check_lr(lr)
    check_weight_decay(weight_decay)

    def optimizer(round_: jax.Array) -> optax.GradientTransformation:
        sgd = optax.sgd(lr_at(lr, round_))
        if weight_decay == 0:
            return sgd
        return optax.chain(optax.add_decayed_weights(weight_decay), sgd)

    return optimizer
