"""Online hypergradient descent on an algorithm's hyper-parameters during training: one
compiled program per run, R runs at once with `jax.vmap`.

Every `window` rounds the tuner differentiates the objective after those rounds (a
validation loss of the new global model) with respect to the log of each tuned
hyper-parameter, through the rounds themselves (`differentiate.run_rounds`, the step
`simulate` compiles), and takes an Adam step on the log values; the state those rounds
reached is kept, so the hypergradient costs one backward pass of the window on top of the
training rounds. This is the greedy (truncated) hypergradient of Baydin et al. ("Online
Learning Rate Adaptation with Hypergradient Descent", ICLR 2018) applied to the client and
server learning rates of federated rounds, as in Rush, Charles, Garrett ("Federated
Automatic Differentiation", JMLR 2024; their FedAvg with hypergradients) with two
differences, stated: the hypergradient is that of a validation objective given by the caller
(any function of the state, e.g. `differentiate.clients_loss` on held-out clients or
`central_loss`), not the next cohort's training loss, and the update is Adam on log values
(scale-free, positive), clipped to `[lower, upper]`, and a window that diverges (a
non-finite model, objective or hypergradient, or an objective 10x the last accepted one)
is undone and the values divided by
`backoff` (a safeguard of ours: a 10x too large learning rate can diverge in one round,
after which no gradient is informative). Known bias: a short horizon (window 1)
favours smaller learning rates than the best fixed one (Wu et al., "Understanding
Short-Horizon Bias in Stochastic Meta-Optimization", ICLR 2018).

    tuner = hypergradient_tuner(make_algorithm, objective, num_rounds=200)
    result = tuner({"client_lr": 0.01, "server_lr": 1.0}, params, data, key)
    result.trace["hparams"]["client_lr"]   # [200 / window] values used
    results = tuner.many(hparams_r, params, data, keys_r)   # R tuners, one vmap
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from fedjax_sim.algorithms.core import tree_all_finite
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.run.differentiate import (
    MakeAlgorithm,
    Objective,
    _check_int,
    _numeric_leaves,
    one_model,
    run_rounds,
)


@dataclasses.dataclass(frozen=True)
class TunerSpec:
    """How the tuner moves the hyper-parameters.

    Attributes:
      step_size: Adam's step on the log of each hyper-parameter per update (0.05: a factor
        10 takes about 46 updates of consistent sign).
      window: rounds unrolled per hypergradient (the tuner updates every `window` rounds).
      b1, b2, eps: Adam's moment rates and epsilon.
      lower, upper: bounds on every tuned value.
      backoff, divergence: after a window that diverged (a non-finite model, objective or
        hypergradient, or an objective above `divergence` times the last accepted one,
        initially the objective of the initial state), the state before it is kept and
        every tuned value is divided by `backoff` (the rounds of that window still count
        as work done).
    """

    step_size: float = 0.05
    window: int = 1
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    lower: float = 1e-5
    upper: float = 10.0
    backoff: float = 2.0
    divergence: float = 10.0

    def __post_init__(self):
        if not (isinstance(self.step_size, int | float) and self.step_size > 0):
            raise ValueError(f"step_size must be > 0, got {self.step_size!r}")
        _check_int("window", self.window, 1)
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.divergence > 1:
            raise ValueError(f"divergence must be > 1, got {self.divergence}")
        if not self.backoff > 1:
            raise ValueError(f"backoff must be > 1, got {self.backoff}")
        if not 0 < self.lower < self.upper:
            raise ValueError(f"need 0 < lower < upper, got {self.lower}, {self.upper}")


class TuneResult(NamedTuple):
    """`state`: the final algorithm state; `hparams`: the tuned values at the end; `trace`:
    per update `[U, ...]` the values used (`hparams`), the objective after the window
    (`objective`), the hypergradient w.r.t. the log values (`hypergradient`) and whether
    the window diverged and was undone (`diverged`)."""

    state: Any
    hparams: Any
    trace: dict[str, Any]


class Tuner:
    """`tuner(hparams, params, data, key) -> TuneResult` (jitted) and `tuner.many(...)` for R
    tuners stacked on a leading axis (`jax.vmap`). Build with `hypergradient_tuner`."""

    def __init__(self, make_algorithm, objective, num_rounds, spec, remat):
        self.make_algorithm, self.objective, self.spec = make_algorithm, objective, spec
        self.num_rounds = _check_int("num_rounds", num_rounds, 1)
        if num_rounds % spec.window:
            raise ValueError(
                f"num_rounds {num_rounds} must be a multiple of the tuner's window {spec.window}"
            )
        self.remat = remat
        self._one = jax.jit(self._run)
        self._many = jax.jit(jax.vmap(self._run, in_axes=(0, None, None, 0)))

    def _run(self, hparams, params, data, key):
        spec, make = self.spec, self.make_algorithm
        opt = optax.adam(spec.step_size, b1=spec.b1, b2=spec.b2, eps=spec.eps)
        lo, hi = math.log(spec.lower), math.log(spec.upper)
        log_hp = jax.tree.map(jnp.log, hparams)
        state = one_model(make(hparams)).init(params, key)

        def update(carry, _):
            state, log_hp, opt_state, ref = carry

            def f(log_hp):
                algorithm = make(jax.tree.map(jnp.exp, log_hp))
                new = run_rounds(algorithm, state, data, key, spec.window, self.remat)
                return self.objective(new), new

            (value, new), grad = jax.value_and_grad(f, has_aux=True)(log_hp)
            finite = jnp.isfinite(value) & tree_all_finite(new.params)
            finite &= tree_all_finite(grad) & (value <= spec.divergence * ref)
            grad = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grad)
            updates, adam = opt.update(grad, opt_state)
            stepped = optax.apply_updates(log_hp, updates)
            # a diverged window (non-finite model, objective or hypergradient, or the
            # objective `divergence` times the last accepted one) is undone:
            # the state before it is kept and every tuned value is divided by `backoff`
            backed = jax.tree.map(lambda v: v - math.log(spec.backoff), log_hp)
            new_log = jax.tree.map(
                lambda a, b: jnp.clip(jnp.where(finite, a, b), lo, hi), stepped, backed
            )
            keep = lambda a, b: jnp.where(finite, a, b)  # noqa: E731
            state_out = jax.tree.map(keep, new, state)
            opt_state = jax.tree.map(keep, adam, opt_state)
            used = jax.tree.map(jnp.exp, log_hp)
            ref = jnp.where(finite, value, ref)
            return (state_out, new_log, opt_state, ref), {
                "hparams": used,
                "objective": value,
                "hypergradient": grad,
                "diverged": ~finite,
            }

        (state, log_hp, _, _), trace = lax.scan(
            update,
            (state, log_hp, opt.init(log_hp), self.objective(state)),
            None,
            length=self.num_rounds // spec.window,
        )
        return TuneResult(state, jax.tree.map(jnp.exp, log_hp), trace)

    def _checked(self, hparams):
        hparams = _numeric_leaves("hparams", hparams, None)
        for leaf in jax.tree.leaves(hparams):
            if not isinstance(leaf, jax.core.Tracer) and not bool(jnp.all(leaf > 0)):
                raise ValueError("tuned hyper-parameters must be > 0 (they are tuned in log space)")
        return hparams

    def __call__(self, hparams: Any, params: Any, data: FederatedData, key: jax.Array):
        """One tuner from `hparams` (a pytree of positive scalars)."""
        return self._one(self._checked(hparams), params, data, key)

    def many(self, hparams: Any, params: Any, data: FederatedData, keys: jax.Array):
        """R tuners at once: `hparams` leaves `[R]`, `keys [R]` (one compiled vmap)."""
        return self._many(self._checked(hparams), params, data, keys)


def hypergradient_tuner(
    make_algorithm: MakeAlgorithm,
    objective: Objective,
    *,
    num_rounds: int,
    spec: TunerSpec = TunerSpec(),
    remat: int | None = None,
) -> Tuner:
    """Online hypergradient descent on the positive hyper-parameters given to the tuner
    (e.g. `{"client_lr": ..., "server_lr": ...}`; `make_algorithm(hparams)` builds the
    algorithm from them) during a run of `num_rounds` rounds (a multiple of
    `spec.window`); `objective(state)` is the validation objective after each window;
    `remat`: rounds per `jax.checkpoint` chunk inside a window."""
    if not callable(make_algorithm) or not callable(objective):
        raise ValueError("make_algorithm and objective must be callables")
    return Tuner(make_algorithm, objective, num_rounds, spec, remat)


__all__ = ["TuneResult", "Tuner", "TunerSpec", "hypergradient_tuner"]
