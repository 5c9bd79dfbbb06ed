"""Step-size schedules of the round counter, client SGD built on them, their caps, and the
rate theory behind the caps.

Schedules used by every algorithm: `constant`, `round_decay` (the FedMIM paper's
`0.1 * 0.998^t`), and the Beikmohammadi et al. schedules below; `client_sgd(lr,
weight_decay, scale=)` turns a float or a schedule into the foundation's
"callable round -> optimizer" client optimizer.

Beikmohammadi, Khirirat, Magnusson, "On the Convergence of Federated Learning Algorithms
without Data Similarity" (IEEE Trans. Big Data 2024); spec
`docs/specs/stepsizes_no_similarity.md` (sections 3 and 6, resolutions 7.4 and 7.8).

A schedule is an optax schedule: `schedule(count) -> s_count` for the 0-indexed round
counter (a traced int32 is fine). It is usable for every algorithm:

- local step size: `client_sgd(schedule)` is a `client_optimizer` (the foundation calls it with
  the round counter each round);
- server step size: `optax.sgd(schedule)` (the server optimizer is updated once per round, so
  its own count is the round counter).

The theory half (caps, constants `b1, b2, b3` of the per-round inequality (1)
`V_{k+1} <= (1 + b1 s_k^2) V_k - b2 s_k W_k + b3 s_k^2` for FedAvg / FedProx / EF-FedAvg /
EF-FedProx, and the bounds of Theorems 1-3) turns runs into falsifiable checks: see
`tests/test_schedules.py` and `tests/algorithms/test_fixed_point.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.core.checks import positive

Schedule = Callable[[jax.Array], jax.Array]
LearningRate = float | Schedule

SQRT6 = math.sqrt(6.0)


def _dtype():
    return jax.dtypes.canonicalize_dtype(jnp.float64)


# ------------------------------------------------------------------------------ schedules
def constant(value: float) -> Schedule:
    """`s_k = value` for every round."""
    positive("step size", value)
    return lambda count: jnp.full(jnp.shape(count), value, _dtype())


def fixed(c: float, num_rounds: int) -> Schedule:
    """Theorem 1's fixed schedule `s_k = c / sqrt(K)` for a run of `K = num_rounds` rounds
    (the paper's experiments: c = 2, K = 400, s = 0.1)."""
    positive("c", c)
    if not (isinstance(num_rounds, int) and num_rounds >= 1):
        raise ValueError(f"num_rounds must be an int >= 1, got {num_rounds!r}")
    return constant(c / math.sqrt(num_rounds))


def diminishing(c: float, nu: float) -> Schedule:
    """Theorem 2's `s_k = c / (k + 1)^nu`, nu in (1/2, 1) for the theory (the experiments:
    c = 0.8, nu = 0.51). Any nu > 0 is accepted (the schedule is still non-increasing)."""
    positive("c", c)
    positive("nu", nu)

    def schedule(count):
        k = jnp.asarray(count).astype(_dtype())
        return c / jnp.power(k + 1.0, nu)

    return schedule


def step_decay(s0: float, rho: float, period: int) -> Schedule:
    """Theorem 3's `s_k = s0 / rho^floor(k / P)` with rho > 1 and phase length
    `P = period` (the experiments: s0 = 0.8, rho = 2, P = 50; the theory:
    `P = theory_phase_length(K, rho)`)."""
    positive("s0", s0)
    if not (isinstance(rho, (int, float)) and rho > 1):
        raise ValueError(f"step-decay rho must be > 1, got {rho!r}")
    if not (isinstance(period, int) and period >= 1):
        raise ValueError(f"step-decay period must be an int >= 1, got {period!r}")

    def schedule(count):
        phase = (jnp.asarray(count) // period).astype(_dtype())
        return s0 / jnp.power(jnp.asarray(rho, _dtype()), phase)

    return schedule


def theory_phase_length(num_rounds: int, rho: float) -> float:
    """Theorem 3's phase length `P = 2K / log_rho(K)` (M = K / P = log_rho(K) / 2 phases)."""
    if num_rounds < 2:
        raise ValueError(f"num_rounds must be >= 2, got {num_rounds}")
    return 2.0 * num_rounds / (math.log(num_rounds) / math.log(rho))


def round_decay(lr0: float = 0.1, decay: float = 0.998) -> Schedule:
    """`eta(t) = lr0 * decay**t` with t the round counter (the FedMIM paper: 0.1 * 0.998^t).

    `optax.exponential_decay` evaluated at the counter cast to the default float dtype (an
    int32 counter would make it float32 even under float64)."""
    positive("initial learning rate", lr0)
    if not isinstance(decay, jax.core.Tracer) and not 0 < decay <= 1:
        raise ValueError(f"learning-rate decay must be in (0, 1], got {decay}")
    schedule = optax.exponential_decay(lr0, transition_steps=1, decay_rate=decay)
    return lambda round_: schedule(jnp.asarray(round_, _dtype()))


def lr_at(lr: LearningRate, round_: jax.Array) -> jax.Array | float:
    """The learning rate used in round `round_` (a float is constant)."""
    return lr(round_) if callable(lr) else lr


def check_lr(lr: LearningRate, name: str = "client_lr") -> None:
    """Raises ValueError unless `lr` (or the schedule's value at round 0) is finite and > 0."""
    value = float(lr(0)) if callable(lr) else float(lr)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0 (or a schedule), got {value}")


def check_weight_decay(weight_decay: float) -> None:
    """Raises ValueError unless `weight_decay` is finite and >= 0."""
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay}")


def client_sgd(
    lr: LearningRate, weight_decay: float = 0.0, *, scale: float = 1.0
) -> Callable[[jax.Array], optax.GradientTransformation]:
    """A `client_optimizer` for the foundation: `round -> optax.sgd(scale * lr(round))`,
    preceded by `add_decayed_weights(weight_decay)` when `weight_decay > 0`.

    Weight decay is applied at the iterate, as torch's SGD does (the FedMIM authors'
    FL-Simulator code). The FedMIM spec (section 7 item 5) instead puts `wd/2 ||x||^2` into
    each client's loss (`Model.with_l2(wd)`), so that it is evaluated where the data gradient
    is evaluated (FedMIM's look-ahead point, FedSAM's perturbed point); for plain SGD the two
    are the same update. FedAvg's local step of the Beikmohammadi et al. theory is
    `client_sgd(schedule, scale=1 / T)`."""
    check_lr(lr)
    check_weight_decay(weight_decay)
    positive("scale", scale)

    def optimizer(round_: jax.Array) -> optax.GradientTransformation:
        sgd = optax.sgd(lr_at(lr, round_) if scale == 1 else scale * lr_at(lr, round_))
        if weight_decay == 0:
            return sgd
        return optax.chain(optax.add_decayed_weights(weight_decay), sgd)

    return optimizer


def values(schedule: Schedule, num_rounds: int) -> jax.Array:
    """`[K]` array `(s_0, ..., s_{K-1})`."""
    return jax.vmap(schedule)(jnp.arange(num_rounds, dtype=jnp.int32))


def check_cap(schedule: Schedule, cap: float, num_rounds: int, name: str = "step size") -> None:
    """Raises ValueError if some `s_k > cap` (k < K) or the schedule increases somewhere
    (the EF proofs need a non-increasing schedule)."""
    s = jax.device_get(values(schedule, num_rounds))
    over = [k for k in range(num_rounds) if s[k] > cap]
    if over:
        k = over[0]
        raise ValueError(f"{name} s_{k} = {s[k]:.6g} exceeds the theory cap {cap:.6g}")
    up = [k for k in range(1, num_rounds) if s[k] > s[k - 1]]
    if up:
        raise ValueError(f"{name} increases at round {up[0]}; the theory needs it non-increasing")


# ------------------------------------------------------------------------------ caps
def _ef_factor(delta: float) -> float:
    """`(1 - delta)(1 + 2 / delta)` (0 for delta = 1: the identity compressor)."""
    if not 0 < delta <= 1:
        raise ValueError(f"compressor delta must be in (0, 1], got {delta}")
    return (1.0 - delta) * (1.0 + 2.0 / delta)


def fedavg_cap(lipschitz: float) -> float:
    """Proposition 1: `s_k <= 1 / (sqrt6 L)` (local lr `s_k / T`)."""
    positive("L", lipschitz)
    return 1.0 / (SQRT6 * lipschitz)


def fedprox_cap(lipschitz: float) -> float:
    """Proposition 2: `s_k <= 1 / (sqrt6 L)` (prox parameter)."""
    return fedavg_cap(lipschitz)


def ef_fedavg_cap(lipschitz: float, delta: float) -> float:
    """Proposition 3: `a_hat = (1/L) min(1/6, sqrt(3 delta / (64 (1-delta)(1+2/delta))))`
    (the square root is +inf for delta = 1, spec 7.8)."""
    positive("L", lipschitz)
    factor = _ef_factor(delta)
    root = math.inf if factor == 0 else math.sqrt(3.0 * delta / (64.0 * factor))
    return min(1.0 / 6.0, root) / lipschitz


def ef_fedprox_cap(lipschitz: float, delta: float) -> float:
    """Proposition 4: `g_bar = min(1/(6L), sqrt(delta / C1) / 2)`,
    `C1 = (1-delta)(1+2/delta)(4 + 4L^2/3)`."""
    positive("L", lipschitz)
    c1 = _ef_factor(delta) * (4.0 + 4.0 * lipschitz**2 / 3.0)
    root = math.inf if c1 == 0 else 0.5 * math.sqrt(delta / c1)
    return min(1.0 / (6.0 * lipschitz), root)


# ------------------------------------------------------------------------------ inequality (1)
class RateConstants(NamedTuple):
    """Constants of `V_{k+1} <= (1 + b1 s^2) V_k - b2 s W_k + b3 s^2` and the weight of the
    error memory in `V_k = f(z^k) - f_inf + error_weight * s_k / n * sum_i ||e_i^k||^2`
    (0 for the full-precision algorithms, where `V_k = f(x^k) - f_inf`)."""

    b1: float
    b2: float
    b3: float
    error_weight: float = 0.0


def fedavg_constants(
    lipschitz: float, local_steps: int, sigma2: float, delta_inf: float
) -> RateConstants:
    """Proposition 1 (FedAvg, local lr `s_k / T`, `s_k <= 1/(sqrt6 L)`)."""
    L, T = lipschitz, local_steps
    b1 = SQRT6 * L**2 * T
    return RateConstants(b1, 0.5, b1 * delta_inf + L * (1.0 + 3.0 / SQRT6 * T) * sigma2)


def fedprox_constants(lipschitz: float, sigma2: float, delta_inf: float) -> RateConstants:
    """Proposition 2 (FedProx, one exact prox per round, `s_k <= 1/(sqrt6 L)`)."""
    L = lipschitz
    b1 = SQRT6 * L**2
    return RateConstants(b1, 0.5, b1 * delta_inf + L * (1.0 + 3.0 / SQRT6) * sigma2)


def ef_fedavg_constants(
    lipschitz: float,
    delta: float,
    sigma2: float,
    delta_inf: float,
    *,
    sigma_coefficient: float | None = None,
) -> RateConstants:
    """Proposition 3 (EF-FedAvg, `s_k <= a_hat`, non-increasing), the paper's constants.

    `sigma_coefficient` replaces the paper's `13L/8` in C3t (spec 7.8 recommends `9L/4` for
    stochastic checks; it does not matter when sigma2 = 0)."""
    L = lipschitz
    factor = _ef_factor(delta)
    weight = 4.0 * (1.0 + 1.5 * L) * L**2 / delta
    a = weight * ef_fedavg_cap(L, delta)
    c2 = 16.0 * factor * a / 3.0 + 1.5 * L
    c3 = 14.0 * factor * a / 3.0 + (
        13.0 * L / 8.0 if sigma_coefficient is None else sigma_coefficient
    )
    return RateConstants(2.0 * L * c2, 0.25, 2.0 * L * c2 * delta_inf + c3 * sigma2, weight)


def ef_fedprox_constants(
    lipschitz: float, delta: float, sigma2: float, delta_inf: float
) -> RateConstants:
    """Proposition 4 (EF-FedProx, `s_k <= g_bar`, non-increasing)."""
    L = lipschitz
    factor = _ef_factor(delta)
    weight = 3.0 * L**2 / delta
    a = weight * ef_fedprox_cap(L, delta)
    c2 = factor * (4.0 + 4.0 / 3.0)
    c3 = factor * (4.0 + 2.0 / 3.0)
    b1 = 2.0 * L * (1.5 * L + a * c2)
    return RateConstants(b1, 0.25, b1 * delta_inf + (2.25 * L + a * c3) * sigma2, weight)


# ------------------------------------------------------------------------------ theorems
def fixed_bound(rc: RateConstants, v0: float, step: float, num_rounds: int) -> float:
    """Theorem 1's intermediate bound on `min_k W_k` for any fixed step s:
    `(1 + b1 s^2)^K V_0 / (K b2 s) + b3 s / b2`."""
    K = num_rounds
    growth = math.exp(K * math.log1p(rc.b1 * step**2))
    return growth * v0 / (K * rc.b2 * step) + rc.b3 * step / rc.b2


def theorem1_bound(rc: RateConstants, v0: float, c: float, num_rounds: int) -> float:
    """Theorem 1 (s = c / sqrt K): `(exp(b1 c^2) V_0 / (b2 c) + b3 c / b2) / sqrt K`."""
    return (math.exp(rc.b1 * c**2) * v0 / (rc.b2 * c) + rc.b3 * c / rc.b2) / math.sqrt(num_rounds)


def diminishing_bound(rc: RateConstants, v0: float, steps: jax.Array) -> float:
    """Theorem 2's intermediate bound for any non-increasing steps `s_0..s_{K-1}`:
    `(V_0/b2 + (b3/b2) sum s_k^2) exp(b1 sum s_k^2) / (K s_{K-1})`."""
    steps = [float(s) for s in jax.device_get(steps)]
    sq = sum(s * s for s in steps)
    return (v0 / rc.b2 + rc.b3 / rc.b2 * sq) * math.exp(rc.b1 * sq) / (len(steps) * steps[-1])


def theorem2_bound(rc: RateConstants, v0: float, c: float, nu: float, num_rounds: int) -> float:
    """Theorem 2 (s_k = c/(k+1)^nu, nu in (1/2, 1)):
    `(V_0/b2 + (b3/b2) S) exp(b1 S) / (c K^{1-nu})`, `S = 2 nu c^2 / (2 nu - 1)`."""
    if not 0.5 < nu < 1:
        raise ValueError(f"Theorem 2 needs nu in (1/2, 1), got {nu}")
    s = lemma2_sum(c, nu)
    return (v0 / rc.b2 + rc.b3 / rc.b2 * s) * math.exp(rc.b1 * s) / (c * num_rounds ** (1 - nu))


def lemma2_sum(c: float, nu: float) -> float:
    """Lemma 2: `sum_k c^2 / (k+1)^{2 nu} <= 2 nu c^2 / (2 nu - 1)` for nu > 1/2."""
    return 2.0 * nu * c**2 / (2.0 * nu - 1.0)


def single_phase_bound(
    rc: RateConstants, r_max: float, s0: float, rho: float, period: int, phases: int
) -> float:
    """Spec 7.4's valid step-decay bound (sum (1) over one phase, `0 <= V_k <= R`):
    `min_m [R / (b2 s_m P) + s_m (b1 R + b3) / b2]`, `s_m = s0 / rho^m`, m < M."""
    out = math.inf
    for m in range(phases):
        s = s0 / rho**m
        out = min(out, r_max / (rc.b2 * s * period) + s * (rc.b1 * r_max + rc.b3) / rc.b2)
    return out


def theorem3_bound(
    rc: RateConstants, r_max: float, s0: float, rho: float, num_rounds: int
) -> float:
    """Theorem 3 as stated (`K = M P`, `P = 2K / log_rho K`, `0 <= V_k <= R`):
    `R / (b2 s0 sqrt K) + C B log_rho(K) / (2 s0 sqrt K)`, `B = exp(2 b1 s0^2 /
    min(log_rho 2, 1))`, `C = (R + b3/b1) / b2`. Its proof is flawed (spec 7.4); it is implied
    by `single_phase_bound` only for rho <= 2."""
    K = num_rounds
    log_k = math.log(K) / math.log(rho)
    b = math.exp(2.0 * rc.b1 * s0**2 / min(math.log(2.0) / math.log(rho), 1.0))
    c = (r_max + rc.b3 / rc.b1) / rc.b2
    return r_max / (rc.b2 * s0 * math.sqrt(K)) + c * b * log_k / (2.0 * s0 * math.sqrt(K))
