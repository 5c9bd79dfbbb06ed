"""Online hypergradient descent on an algorithm's hyper-parameters during training: one
compiled program per run, R runs at once through the sweep engine's mapping of runs.

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
(scale-free, positive), clipped to `[lower, upper]`. Known bias: a short horizon (window 1)
favours smaller learning rates than the best fixed one (Wu et al., "Understanding
Short-Horizon Bias in Stochastic Meta-Optimization", ICLR 2018).

Accept / reject (the "bold driver" rule of Vogl et al., "Accelerating the convergence of
the back-propagation method", Biol. Cybern. 1988, named by Battiti, Complex Systems 1989):
a window is accepted iff its objective, model and hypergradient are finite and its
objective is at most `(1 + tolerance)` times (`+ tolerance * |ref|`) the objective `ref`
at the window's start (the last accepted state's). A rejected window is undone (the state,
Adam's moments and `ref` are those before it, bit for bit) and every tuned value is divided
by `backoff`; the next window retries from the same state (the same round keys, hence the
same cohorts) with the smaller values, like a backtracking line search on the learning
rates. Differences from Vogl et al., stated: no increase factor on acceptance (the
hypergradient step raises the values), Adam's moments kept rather than zeroed. Why: a
client lr 10x too large kills a ReLU network within one window (accuracy at chance)
while its loss rises by a few percent at most or not at all, after which no hypergradient
is informative; the earlier safeguard (reject only non-finite windows or a 10x rise, i.e.
`tolerance=9`) never fired there. Costs: a rejected window's client-steps (and backward
pass) are spent without progress, and the run has the same number of windows, so it
trains fewer accepted rounds; with cohort noise an accepted-quality window can be rejected
(the tolerance absorbs rises smaller than it). Not caught: a window that kills the model
while lowering the objective (e.g. a dead network fitting the label prior with its output
bias); `experiments/README.md` reports how often that happened.

    tuner = hypergradient_tuner(make_algorithm, objective, num_rounds=200)
    result = tuner({"client_lr": 0.01, "server_lr": 1.0}, params, data, key)
    result.trace["hparams"]["client_lr"]   # [200 / window] values used
    results = tuner.many(hparams_r, params, data, keys_r)   # R tuners: leading axis [R]
    runs, results = tuner.sweep({"client_lr": [0.01, 1.0], "server_lr": [1.0]}, data,
                                seeds=5, model=model)   # starts x seeds, as `sweep` runs them

R tuners are mapped over runs by the sweep engine's `sweep.map_runs` (one `jax.vmap`, or
`lax.map` over vmapped groups of `runs_per_group`), and `Tuner.sweep` orders its runs and
draws their keys and initial models as `sweep` does (`sweep.expand_grid`): run r equals the
single tuner of its start and seed to float32 round-off (`tests/test_tuner.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from fedjax_sim.algorithms.core import tree_all_finite
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.base import Model
from fedjax_sim.run.differentiate import (
    MakeAlgorithm,
    Objective,
    _check_int,
    _numeric_leaves,
    one_model,
    remat_length,
    run_rounds,
)
from fedjax_sim.run.simulate import INIT_PURPOSE
from fedjax_sim.run.sweep import RunSpec, expand_grid, map_runs, stack_hparams, stack_keys


@dataclasses.dataclass(frozen=True)
class TunerSpec:
    """How the tuner moves the hyper-parameters.

    Attributes:
      step_size: Adam's step on the log of each hyper-parameter per update (0.05: a factor
        10 takes about 46 updates of consistent sign).
      window: rounds unrolled per hypergradient (the tuner updates every `window` rounds).
      b1, b2, eps: Adam's moment rates and epsilon.
      lower, upper: bounds on every tuned value.
      backoff, tolerance: a window is rejected if its model, objective or hypergradient is
        non-finite or its objective exceeds `ref + tolerance * |ref|`, `ref` the objective
        at the window's start (the last accepted state's; initially the initial state's);
        a rejected window is undone (state and Adam's moments as before it) and every
        tuned value divided by `backoff` (its rounds still count as work done).
        `tolerance=0.01` rejects rises over 1 %; `tolerance=9` is the earlier safeguard
        (non-finite or a 10x rise only).
    """

    step_size: float = 0.05
    window: int = 1
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    lower: float = 1e-5
    upper: float = 10.0
    backoff: float = 2.0
    tolerance: float = 0.01

    def __post_init__(self):
        if not (isinstance(self.step_size, int | float) and self.step_size > 0):
            raise ValueError(f"step_size must be > 0, got {self.step_size!r}")
        _check_int("window", self.window, 1)
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not (isinstance(self.tolerance, int | float) and 0 <= self.tolerance < math.inf):
            raise ValueError(f"tolerance must be a finite number >= 0, got {self.tolerance!r}")
        if not self.backoff > 1:
            raise ValueError(f"backoff must be > 1, got {self.backoff}")
        if not 0 < self.lower < self.upper:
            raise ValueError(f"need 0 < lower < upper, got {self.lower}, {self.upper}")


class TuneResult(NamedTuple):
    """`state`: the final algorithm state; `hparams`: the tuned values at the end; `trace`:
    per update `[U, ...]` the values used (`hparams`), the objective after the window
    (`objective`), the hypergradient w.r.t. the log values (`hypergradient`) and whether
    the window was rejected and undone (`rejected`). R tuners: a leading `[R]` axis."""

    state: Any
    hparams: Any
    trace: dict[str, Any]


class Tuner:
    """`tuner(hparams, params, data, key) -> TuneResult` (jitted), `tuner.many(...)` for R
    tuners stacked on a leading axis and `tuner.sweep(starts, data, seeds=...)` for the
    starts x seeds of a sweep. Build with `hypergradient_tuner`."""

    def __init__(self, make_algorithm, objective, num_rounds, spec, remat):
        self.make_algorithm, self.objective, self.spec = make_algorithm, objective, spec
        self.num_rounds = _check_int("num_rounds", num_rounds, 1)
        if num_rounds % spec.window:
            raise ValueError(
                f"num_rounds {num_rounds} must be a multiple of the tuner's window {spec.window}"
            )
        self.remat = remat_length(remat, spec.window)
        self._one = jax.jit(self._run)
        self._mapped: dict[tuple, Any] = {}  # (group, per-run params, model) -> jitted map

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
            accept = jnp.isfinite(value) & tree_all_finite(new.params) & tree_all_finite(grad)
            accept &= value <= ref + spec.tolerance * jnp.abs(ref)
            grad = jax.tree.map(lambda g: jnp.where(accept, g, 0.0), grad)
            updates, adam = opt.update(grad, opt_state)
            stepped = optax.apply_updates(log_hp, updates)
            # a rejected window is undone (state, Adam's moments and ref as before it) and
            # every tuned value divided by `backoff`
            backed = jax.tree.map(lambda v: v - math.log(spec.backoff), log_hp)
            new_log = jax.tree.map(
                lambda a, b: jnp.clip(jnp.where(accept, a, b), lo, hi), stepped, backed
            )
            keep = lambda a, b: jnp.where(accept, a, b)  # noqa: E731
            state_out = jax.tree.map(keep, new, state)
            opt_state = jax.tree.map(keep, adam, opt_state)
            used = jax.tree.map(jnp.exp, log_hp)
            ref = jnp.where(accept, value, ref)
            return (state_out, new_log, opt_state, ref), {
                "hparams": used,
                "objective": value,
                "hypergradient": grad,
                "rejected": ~accept,
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

    def _map(self, group: int, per_run_params: bool, model: Model | None):
        """`jit((hparams [R], keys [R], params, data) -> TuneResult [R])`: the tuners mapped
        over runs by `sweep.map_runs`; `params` per run (`per_run_params`), shared, or (None)
        each run's `model.init(fold_in(key, INIT_PURPOSE))` as in `sweep`."""
        sig = (group, per_run_params, model)
        if sig not in self._mapped:

            def run(hps, keys, params, data):
                def one(hp, key, *p):
                    if model is not None:
                        p = (model.init(jax.random.fold_in(key, INIT_PURPOSE)),)
                    return self._run(hp, p[0] if p else params, data, key)

                xs = (hps, keys, params) if per_run_params else (hps, keys)
                return map_runs(one, xs, group)

            self._mapped[sig] = jax.jit(run)
        return self._mapped[sig]

    def __call__(self, hparams: Any, params: Any, data: FederatedData, key: jax.Array):
        """One tuner from `hparams` (a pytree of positive scalars)."""
        return self._one(self._checked(hparams), params, data, key)

    def many(
        self,
        hparams: Any,
        params: Any,
        data: FederatedData,
        keys: jax.Array,
        *,
        per_run_params: bool = False,
        runs_per_group: int | None = None,
    ) -> TuneResult:
        """R tuners at once: `hparams` leaves `[R]`, `keys [R]`; `params` shared, or `[R, ...]`
        per run with `per_run_params=True`. `runs_per_group`: runs vmapped together (the
        groups `lax.map`-ed, `sweep.map_runs`); default all R in one vmap."""
        hparams = self._checked(hparams)
        num = keys.shape[0]
        return self._map(_group(runs_per_group, num), per_run_params, None)(
            hparams, keys, params, data
        )

    def sweep(
        self,
        starts: Mapping[str, Sequence[float]],
        data: FederatedData,
        *,
        seeds: int | Sequence[int],
        model: Model | None = None,
        params: Any = None,
        runs_per_group: int | None = None,
    ) -> tuple[list[RunSpec], TuneResult]:
        """The tuners of `starts x seeds` (`sweep.expand_grid`: start points in product
        order, seeds innermost; run r's key `jax.random.key(seed_r)` and, without `params`,
        its initial model `model.init(fold_in(key, INIT_PURPOSE))`, as `sweep` draws them).
        Returns the runs and their results on a leading `[R]` axis."""
        if (model is None) == (params is None):
            raise ValueError("Tuner.sweep needs one of model (an initial model per seed) or params")
        runs = expand_grid(seeds, starts)
        hps = self._checked(stack_hparams(runs))
        keys = stack_keys(runs)
        fn = self._map(_group(runs_per_group, len(runs)), False, model)
        return runs, fn(hps, keys, params, data)


def _group(runs_per_group: int | None, num: int) -> int:
    if runs_per_group is None:
        return num
    return min(_check_int("runs_per_group", runs_per_group, 1), num)


def hypergradient_tuner(
    make_algorithm: MakeAlgorithm,
    objective: Objective,
    *,
    num_rounds: int,
    spec: TunerSpec = TunerSpec(),
    remat: int | str | None = 1,
) -> Tuner:
    """Online hypergradient descent on the positive hyper-parameters given to the tuner
    (e.g. `{"client_lr": ..., "server_lr": ...}`; `make_algorithm(hparams)` builds the
    algorithm from them) during a run of `num_rounds` rounds (a multiple of
    `spec.window`); `objective(state)` is the validation objective after each window;
    `remat`: rounds per `jax.checkpoint` chunk inside a window (as `differentiable_run`'s:
    an int in [1, window], "sqrt" or None; default 1)."""
    if not callable(make_algorithm) or not callable(objective):
        raise ValueError("make_algorithm and objective must be callables")
    return Tuner(make_algorithm, objective, num_rounds, spec, remat)


__all__ = ["TuneResult", "Tuner", "TunerSpec", "hypergradient_tuner"]
