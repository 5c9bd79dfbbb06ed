"""Gradients through federated rounds: the value and gradient of an objective evaluated after T
rounds with respect to numeric hyper-parameters and the initial model.

A run is a pure function of `(hyper-parameters, initial model, data, key)`: the algorithm is
built *inside* the differentiated function from the hyper-parameters (as `sweep` builds it
inside a `jax.vmap`), its `init` and T `step`s run under `lax.scan` (the step `simulate`
compiles), and the objective reads the final state. Cohorts, minibatches, straggler draws,
DP noise and asynchronous fire masks are functions of the key, so the objective is a
deterministic, differentiable function of every continuous hyper-parameter given the key::

    def make_algorithm(hp):
        return fedavg(model.loss, client_optimizer=array_schedule(hp["lrs"]),
                      server_optimizer=hp["server_lr"], local=LocalSpec(steps=5))

    run = differentiable_run(make_algorithm, central_loss(model, test), num_rounds=T)
    value, grads = run.value_and_grad({"lrs": jnp.full(T, 0.1), "server_lr": 1.0},
                                      params, data, key)
    grads.hparams["lrs"]   # [T] d loss / d lr_t;  grads.params: d loss / d x_0

Memory: the rounds run as chunks of `remat=L` rounds under `jax.checkpoint`, so reverse mode
holds only the states at chunk boundaries (T / L of them) and one chunk's residuals; the
default L = 1 keeps one state per round and recomputes each round once on the way back
(docs/design.md, "Differentiable runs": why 1); `remat="sqrt"` takes L = ceil(sqrt(T)),
`remat=None` keeps every round's residuals (the fastest on an accelerator while they fit). A
truncation window `window=W` differentiates only the last W rounds: the state before them is
a constant (`lax.stop_gradient`; the first T - W rounds run without tangents), the
hyper-parameters still act on the last W rounds. `mode="forward"` computes the gradient with
one `jax.jvp` per input coordinate (vmapped), cheaper than reverse mode for a few scalar
hyper-parameters (no residuals at all).

Hyper-parameters are a pytree of real numbers (Python floats or floating arrays); a 1-D leaf
is a per-round schedule and must have T entries (`array_schedule` turns it into a schedule
`round -> value`). Bad inputs are refused with one-line ValueErrors before compiling.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.flatten_util import ravel_pytree

from fedjax_sim.algorithms.core import Algorithm, float_dtype
from fedjax_sim.data.federated import ArrayData, FederatedData
from fedjax_sim.models.base import Model
from fedjax_sim.run.evaluation import client_stats, evaluate_central
from fedjax_sim.run.simulate import INIT_PURPOSE

HParams = Any  # a pytree of real scalars / arrays
MakeAlgorithm = Callable[[HParams], Algorithm]
Objective = Callable[[Any], jax.Array]  # final state -> scalar
Mode = Literal["reverse", "forward"]
WRT = ("hparams", "params")
TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
)


class Gradients(NamedTuple):
    """Gradients of the objective: w.r.t. the hyper-parameters (same pytree) and the initial
    model (same pytree as the params); None for what was not asked (`wrt`)."""

    hparams: Any
    params: Any


# ------------------------------------------------------------------------------ schedules
def array_schedule(values: Any) -> Callable[[jax.Array], jax.Array]:
    """The schedule `round -> values[round]` of a `[T]` array (rounds past the end use the
    last entry): a per-round learning rate that is differentiable entry by entry."""
    values = jnp.asarray(values)
    if values.ndim != 1 or values.shape[0] < 1:
        raise ValueError(f"a per-round schedule is a non-empty 1-D array, got shape {values.shape}")
    last = values.shape[0] - 1

    def schedule(count):
        return values[jnp.clip(jnp.asarray(count), 0, last)]

    return schedule


# ------------------------------------------------------------------------------ objectives
def central_loss(model: Model, test: ArrayData, batch_size: int = 1024) -> Objective:
    """The mean loss of the final global model on a central (validation) set."""
    return lambda state: evaluate_central(model, state.params, test, batch_size)["test_loss"]


def clients_loss(model: Model, x: jax.Array, y: jax.Array, counts: jax.Array) -> Objective:
    """The pooled (example-weighted) loss of the final global model on per-client data
    `x [C', N, ...]`, `y`, `counts [C']`: held-out clients, or the clients' test split
    (`data.x_test, data.y_test, data.test_counts`)."""

    def objective(state):
        stats = client_stats(model, state.params, x, y, counts)
        return jnp.sum(stats["loss"]) / jnp.maximum(jnp.sum(stats["count"]), 1.0)

    return objective


def initial_params(model: Model, key: jax.Array) -> Any:
    """The initial model `simulate` uses for run key `key` (`model.init(fold_in(key, 7))`)."""
    return model.init(jax.random.fold_in(key, INIT_PURPOSE))


# ------------------------------------------------------------------------------ checks
def _check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return int(value)


def remat_length(remat: int | str | None, num_rounds: int) -> int | None:
    """Rounds per `jax.checkpoint` chunk: None (no remat), an int in [1, T] or "sqrt"."""
    if remat is None:
        return None
    if remat == "sqrt":
        return max(1, math.ceil(math.sqrt(num_rounds)))
    if isinstance(remat, str):
        raise ValueError(f"remat must be None, an int or 'sqrt', got {remat!r}")
    return _check_int("remat (rounds per checkpointed chunk)", remat, 1, num_rounds)


def _numeric_leaves(name: str, tree: Any, num_rounds: int | None, required: bool = True) -> Any:
    """`tree` with Python numbers as float arrays; ValueError (one line) for a leaf that is
    not a real floating number / array, a non-finite value, or (hyper-parameters) a 1-D
    leaf whose length is not T."""
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not path_leaves and required:
        raise ValueError(f"{name} is empty: nothing to differentiate")
    out = []
    for path, leaf in path_leaves:
        where = f"{name}{jax.tree_util.keystr(path)}"
        if isinstance(leaf, bool | np.bool_) or (
            not isinstance(leaf, numbers.Real) and not hasattr(leaf, "dtype")
        ):
            raise ValueError(f"{where} must be a real number or array, got {type(leaf).__name__}")
        if isinstance(leaf, numbers.Real) and not hasattr(leaf, "dtype"):
            leaf = jnp.asarray(float(leaf), float_dtype())
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{where} has dtype {dtype}: only floating values can be differentiated "
                "(pass it as a float, or keep integers out of the differentiated pytree)"
            )
        if not isinstance(leaf, jax.core.Tracer) and not np.all(np.isfinite(np.asarray(leaf))):
            raise ValueError(f"{where} has non-finite values")
        if num_rounds is not None and np.ndim(leaf) == 1 and np.shape(leaf)[0] != num_rounds:
            raise ValueError(
                f"{where} has {np.shape(leaf)[0]} entries: a 1-D hyper-parameter is a per-round "
                f"schedule and needs num_rounds = {num_rounds}"
            )
        out.append(leaf)
    return jax.tree.unflatten(treedef, out)


# ------------------------------------------------------------------------------ rounds
def run_rounds(
    algorithm: Algorithm,
    state: Any,
    data: FederatedData,
    key: jax.Array,
    num_rounds: int,
    remat: int | None = None,
) -> Any:
    """`num_rounds` steps of `algorithm` under `lax.scan` (metrics dropped); with `remat=L`,
    as chunks of L rounds under `jax.checkpoint` (and a last shorter chunk)."""

    def one(state, _):
        return algorithm.step(state, data, key)[0], None

    def rounds(state, n):
        return lax.scan(one, state, None, length=n)[0] if n else state

    if remat is None:
        return rounds(state, num_rounds)
    if remat >= num_rounds:
        return jax.checkpoint(lambda s: rounds(s, num_rounds))(state)
    chunk = jax.checkpoint(lambda s: rounds(s, remat))
    chunks, rest = divmod(num_rounds, remat)
    state = lax.scan(lambda s, _: (chunk(s), None), state, None, length=chunks)[0]
    if rest:
        state = jax.checkpoint(lambda s: rounds(s, rest))(state)
    return state


def one_model(algorithm: Algorithm) -> Algorithm:
    """`algorithm`, or ValueError if its state holds more than the one global model the
    objectives read as `state.params` (`Algorithm.model`: IFCA's K cluster models)."""
    if algorithm.model is not None:
        raise ValueError(
            "differentiable_run: this algorithm declares its global model (Algorithm.model, "
            "e.g. IFCA's K cluster models); the objectives read one model, state.params"
        )
    return algorithm


def final_state(
    make_algorithm: MakeAlgorithm,
    hparams: HParams,
    params: Any,
    data: FederatedData,
    key: jax.Array,
    *,
    num_rounds: int,
    remat: int | None = None,
    window: int | None = None,
) -> Any:
    """The state after `num_rounds` rounds of `make_algorithm(hparams)` from `params` (pure,
    traceable: differentiate it with any JAX transformation). With `window=W < T` the first
    T - W rounds run on constants (`lax.stop_gradient` of the hyper-parameters and of the
    initial model) and the state they reach is a constant for the last W rounds."""
    if window is None or window >= num_rounds:
        algorithm = one_model(make_algorithm(hparams))
        state = algorithm.init(params, key)
        return run_rounds(algorithm, state, data, key, num_rounds, remat)
    frozen = one_model(make_algorithm(lax.stop_gradient(hparams)))
    state = frozen.init(lax.stop_gradient(params), key)
    state = run_rounds(frozen, state, data, key, num_rounds - window, remat)
    state = lax.stop_gradient(state)
    return run_rounds(make_algorithm(hparams), state, data, key, window, remat)


# ------------------------------------------------------------------------------ the API
class DifferentiableRun:
    """The objective `objective(final state)` after `num_rounds` rounds of
    `make_algorithm(hparams)` started from the initial model, differentiable w.r.t. the
    hyper-parameters and the initial model.

    Args:
      make_algorithm: `hparams -> Algorithm`, called inside the differentiated function
        with traced values (every preset accepts traced numeric hyper-parameters).
      objective: `final state -> real scalar`: `central_loss(model, test)`,
        `clients_loss(model, x, y, counts)`, or any function of the state.
      num_rounds: T >= 1.
      remat: L in [1, T] rounds per `jax.checkpoint` chunk (default 1: every round),
        "sqrt" (L = ceil(sqrt(T))) or None (no rematerialisation: every round's residuals).
      window: differentiate only the last W rounds (1 <= W <= T; W = T is the full gradient).
      mode: "reverse" (`jax.value_and_grad`) or "forward" (one `jax.jvp` per coordinate of
        the inputs in `wrt`: for a few scalar hyper-parameters).
      wrt: "hparams", "params" or both (the default).

    Raises ValueError (one line) for a bad setting here, and for bad inputs when called
    (before compiling).

    Methods (each compiled once per input structure): `value`, `value_and_grad`,
    `final_state`, all of `(hparams, params, data, key)`.
    """

    def __init__(
        self,
        make_algorithm: MakeAlgorithm,
        objective: Objective,
        *,
        num_rounds: int,
        remat: int | str | None = 1,
        window: int | None = None,
        mode: Mode = "reverse",
        wrt: Sequence[str] | str = WRT,
    ):
        if not callable(make_algorithm):
            raise ValueError("make_algorithm must be a callable hparams -> Algorithm")
        if not callable(objective):
            raise ValueError("objective must be a callable final_state -> scalar")
        self.num_rounds = _check_int("num_rounds", num_rounds, 1)
        self.remat = remat_length(remat, self.num_rounds)
        self.window = None if window is None else _check_int("window", window, 1, num_rounds)
        if mode not in ("reverse", "forward"):
            raise ValueError(f"mode must be 'reverse' or 'forward', got {mode!r}")
        self.mode = mode
        wrt = (wrt,) if isinstance(wrt, str) else tuple(wrt)
        if not wrt or set(wrt) - set(WRT) or len(set(wrt)) != len(wrt):
            raise ValueError(f"wrt must name some of {WRT} once each, got {wrt!r}")
        self.wrt = wrt
        self.make_algorithm = make_algorithm
        self.objective = objective
        self._value = jax.jit(self._objective)
        self._value_and_grad = jax.jit(self._grad)
        self._final = jax.jit(self._state)

    # -------------------------------------------------------------- traced parts
    def _state(self, hparams, params, data, key):
        return final_state(
            self.make_algorithm,
            hparams,
            params,
            data,
            key,
            num_rounds=self.num_rounds,
            remat=self.remat,
            window=self.window,
        )

    def _objective(self, hparams, params, data, key):
        value = self.objective(self._state(hparams, params, data, key))
        if jnp.shape(value) != () or not jnp.issubdtype(jnp.result_type(value), jnp.floating):
            raise ValueError(
                f"the objective must return a real scalar, got shape {jnp.shape(value)} "
                f"dtype {jnp.result_type(value)}"
            )
        return value

    def _grad(self, hparams, params, data, key):
        inputs = {"hparams": hparams, "params": params}

        def f(diff):
            full = {**inputs, **diff}
            return self._objective(full["hparams"], full["params"], data, key)

        diff = {name: inputs[name] for name in self.wrt}
        if self.mode == "reverse":
            value, grads = jax.value_and_grad(f)(diff)
        else:
            flat, unravel = ravel_pytree(diff)
            basis = jnp.eye(flat.shape[0], dtype=flat.dtype)
            value, tangents = jax.vmap(
                lambda v: jax.jvp(lambda z: f(unravel(z)), (flat,), (v,)), out_axes=(None, 0)
            )(basis)
            grads = unravel(tangents.astype(flat.dtype))
        return value, Gradients(grads.get("hparams"), grads.get("params"))

    # -------------------------------------------------------------- public
    def _inputs(self, hparams, params):
        hparams = _numeric_leaves("hparams", hparams, self.num_rounds, "hparams" in self.wrt)
        if "params" in self.wrt:
            params = _numeric_leaves("params", params, None)
        return hparams, params

    def _call(self, fn, hparams, params, data, key):
        hparams, params = self._inputs(hparams, params)
        try:
            return fn(hparams, params, data, key)
        except TRACER_ERRORS as e:
            first = str(e).strip().split("\n")[0]
            names = sorted(
                jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(hparams)[0]
            )
            raise ValueError(
                f"the algorithm does not accept traced hyper-parameters {names}: {first}"
            ) from None

    def value(self, hparams: HParams, params: Any, data: FederatedData, key: jax.Array):
        """The objective after T rounds (forward only)."""
        return self._call(self._value, hparams, params, data, key)

    def value_and_grad(
        self, hparams: HParams, params: Any, data: FederatedData, key: jax.Array
    ) -> tuple[jax.Array, Gradients]:
        """`(objective, Gradients(hparams=..., params=...))` after T rounds."""
        return self._call(self._value_and_grad, hparams, params, data, key)

    def final_state(self, hparams: HParams, params: Any, data: FederatedData, key: jax.Array):
        """The final state of the run (as `simulate(..., return_state=True)`)."""
        return self._call(self._final, hparams, params, data, key)


# the API's name: `differentiable_run(make_algorithm, objective, num_rounds=T, ...)`
differentiable_run = DifferentiableRun


__all__ = [
    "DifferentiableRun",
    "Gradients",
    "array_schedule",
    "central_loss",
    "clients_loss",
    "differentiable_run",
    "final_state",
    "initial_params",
    "remat_length",
    "run_rounds",
]
