"""`simulate`: run an `Algorithm` for many rounds as compiled `lax.scan` chunks.

Rounds between two evaluations (or checkpoints) run as one jitted `lax.scan`; the host only
sees chunk boundaries, where `fedjax_sim.run.loop.run_loop` (shared with `simulate_streamed` and
`sweep`) evaluates the global model, updates the progress bar, writes the history and
checkpoints. A non-finite global model stops the run with an error naming the first bad
round.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from fedjax_sim.algorithms.core import Algorithm, global_model, tree_all_finite
from fedjax_sim.data.federated import ArrayData, FederatedData
from fedjax_sim.models.base import Model
from fedjax_sim.run.evaluation import (  # noqa: F401 (client_stats: re-exported)
    client_stats,
    evaluate_central,
    evaluate_clients,
    evaluate_personal,
    evaluate_unseen,
)
from fedjax_sim.run.history import History
from fedjax_sim.run.loop import RunOptions, chunk_length, run_loop, run_options
from fedjax_sim.runtime import distributed
from fedjax_sim.runtime.parallel import ClientMap, recorded_modes

INIT_PURPOSE = 7  # key purpose of the initial model


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What to evaluate at each evaluation point.

    Attributes:
      every: rounds between evaluations (also the length of each compiled scan chunk).
      central: evaluate on the central test set (if given).
      clients: evaluate on each client's test split (if the data has one).
      train: evaluate the global training objective on every client's training data.
      batch_size: central-evaluation batch size.
      client_rows: rows of each client evaluated at once by the per-client evaluations
        (`clients`, `train`; blocks summed in a `lax.map`, the same sums up to the last
        bits); None: all its rows. Bounds their memory, `[C, client_rows, ...]` activations
        for a vmapped cohort instead of `[C, N_max, ...]` (a transformer on 64 Shakespeare
        clients of 203 windows, whole: ~5 GB per run).
      extra: optional jittable `extra(params, data, test) -> {name: scalar}` merged into
        every evaluation row (e.g. `fedjax_sim.run.dro.dro_evaluator(...)`: worst-group metrics).
      personal: evaluate each client's own model (`Algorithm.personalize`; the global model
        for an algorithm without one) on its test split: `personal_accuracy_mean`, `_worst`,
        `_p10`, `personal_loss_mean`, `_worst`, `_pooled`, and per client (in
        `History.client_evals`) `personal_accuracy`, `personal_loss` and the global model's
        `client_accuracy`, `client_loss` (`simulate` only; needs per-client test splits).
      unseen_steps, unseen_lr, unseen_batch_size: the adaptation of unseen clients
        (`simulate(unseen=...)`): local SGD steps of size `unseen_lr` on minibatches of
        `unseen_batch_size` from the global model before their test split is evaluated
        (`unseen_*` metrics; 0 steps: the global model).
    """

    every: int = 10
    central: bool = True
    clients: bool = True
    train: bool = False
    batch_size: int = 1024
    client_rows: int | None = None
    extra: Callable[[Any, FederatedData, ArrayData | None], dict[str, jax.Array]] | None = None
    personal: bool = False
    unseen_steps: int = 5
    unseen_lr: float = 0.1
    unseen_batch_size: int = 32

    def __post_init__(self):
        if self.client_rows is not None and not (
            isinstance(self.client_rows, int) and self.client_rows >= 1
        ):
            raise ValueError(f"EvalSpec client_rows must be an int >= 1, got {self.client_rows!r}")
        steps = self.unseen_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"EvalSpec unseen_steps must be an int >= 0, got {steps!r}")
        if not self.unseen_lr > 0:
            raise ValueError(f"EvalSpec unseen_lr must be > 0, got {self.unseen_lr!r}")
        if self.unseen_batch_size < 1:
            raise ValueError(
                f"EvalSpec unseen_batch_size must be >= 1, got {self.unseen_batch_size!r}"
            )


# ------------------------------------------------------------------------------ runner
def simulate(
    algorithm: Algorithm,
    data: FederatedData,
    key: jax.Array,
    *,
    model: Model,
    num_rounds: int,
    test: ArrayData | None = None,
    params: Any = None,
    evaluation: EvalSpec = EvalSpec(),
    meta: dict[str, Any] | None = None,
    client_map: ClientMap = ClientMap(),
    mesh: Mesh | None = None,
    return_state: bool = False,
    unseen: FederatedData | None = None,
    **options: Unpack[RunOptions],
) -> History | tuple[History, Any]:
    """Runs `num_rounds` steps of `algorithm` and returns the `History` (with `return_state`,
    `(history, final state)`, as `simulate_streamed`).

    Args:
      algorithm: an `Algorithm` (e.g. `fedavg(model.loss, ...)`).
      data: the federated training data (passed to every `step`).
      key: the run key; the model init, cohorts and local batches all derive from it.
      model: used for the initial params (unless `params` is given) and for evaluation.
      num_rounds: total rounds (steps) of the run, including those before a resume.
      test: the central test set.
      evaluation: what to evaluate, and every how many rounds.
      meta: extra information stored in `History.meta` (e.g. the CLI config).
      client_map: mapping used for per-client evaluation; `ClientMap("auto")` uses the
        round's (first) mode. The modes of the round's client maps are recorded in
        `History.meta["client_map"]` (`"vmap"`, `"map:4"`; `ClientMap.recorded`): an
        explicit map of that mode reproduces a measured `auto` run bit for bit.
      mesh: a device mesh with a `"clients"` axis: per-client arrays of the data and of the
        state are placed sharded by client, the rest replicated (build the algorithm with
        `ClientMap(mesh=mesh)` so cohorts are sharded too). Multi-process runs pass global
        `data` (see `fedjax_sim.runtime.distributed`); only process 0 writes outputs.
      return_state: also return the final algorithm state (e.g. to continue it, or to read
        per-client rows); a run resumed at or past `num_rounds` returns the restored one.
      unseen: clients never trained on (e.g. `data.unseen.held_out`): at every evaluation
        each adapts from the global model on its training rows (`EvalSpec.unseen_steps`)
        and is evaluated on its test split (`unseen_*` metrics).
      **options: `RunOptions` (`out_dir`, `checkpoint_dir`, `checkpoint_every`, `resume`,
        `progress`, `on_resume`, `privacy`), the same in every driver.

    Raises:
      NonFiniteError: the global model became NaN/Inf (the message names the round).
      Interrupted: Ctrl-C (a KeyboardInterrupt), after saving a checkpoint if possible.
      CheckpointError: the checkpoint to resume from is unusable.
    """
    options = run_options("simulate", options, num_rounds, evaluation.every)
    if evaluation.personal and not data.has_client_test:
        raise ValueError(
            "EvalSpec(personal=True) evaluates each client's model on its test split: "
            "the data has no per-client test splits"
        )
    if unseen is not None and not unseen.has_client_test:
        raise ValueError("unseen clients need test splits (their training rows adapt the model)")
    if unseen is not None and mesh is not None:
        raise ValueError("unseen clients are evaluated without a mesh: run them unsharded")
    if params is None:
        params = model.init(jax.random.fold_in(key, INIT_PURPOSE))
    state = algorithm.init(params, key)
    if mesh is not None:
        state, data = distributed.place_run(state, data, mesh)
        if test is not None:  # the central test set: no per-client rows
            test = distributed.place(test, mesh, data.num_clients)
    meta = dict(meta or {})
    # resolves (measures) ClientMap("auto") before compiling; the round's modes are recorded
    modes = recorded_modes(jax.make_jaxpr(algorithm.step)(state, data, key))
    if modes:
        meta["client_map"] = ", ".join(modes)
        if client_map == ClientMap():
            client_map = ClientMap.recorded(modes[0])
    source = _Chunks(
        _compiled_chunk(
            algorithm, chunk_length(num_rounds, evaluation.every, options["checkpoint_every"])
        ),
        compiled_evaluator(model, evaluation, client_map, test is not None),
        data,
        test,
        key,
        _compiled_state_evaluator(model, evaluation, algorithm, client_map, unseen is not None)
        if evaluation.personal or unseen is not None
        else None,
        unseen,
        functools.partial(global_model, algorithm),
    )
    (history,), state = run_loop(
        source,
        state,
        key,
        [meta],
        num_rounds=num_rounds,
        every=evaluation.every,
        options=options,
    )
    return (history, state) if return_state else history


@dataclasses.dataclass(frozen=True)
class _Chunks:
    """`simulate`'s chunks: the compiled chunk and evaluator on the whole population."""

    run_chunk: Callable[..., Any]
    evaluator: Callable[..., Any]
    data: FederatedData
    test: ArrayData | None
    key: jax.Array
    state_evaluator: Callable[..., Any] | None = None  # personal models, unseen clients
    unseen: FederatedData | None = None
    model_of: Callable[[Any], Any] = lambda state: state.params  # `Algorithm.model`

    def run(self, state: Any, start: int, stop: int) -> tuple[Any, list[dict[str, np.ndarray]]]:
        state, metrics = self.run_chunk(state, self.data, self.key, stop - start)
        return state, [jax.tree.map(lambda m: m[: stop - start], distributed.fetch(metrics))]

    def evaluate(self, state: Any) -> list[dict[str, Any]]:
        results = self.evaluator(self.model_of(state), self.data, self.test)
        if self.state_evaluator is not None:
            results |= self.state_evaluator(state, self.data, self.key, self.unseen)
        results = distributed.fetch(results)  # scalars, and [C] per-client distributions
        return [{k: float(v) if np.ndim(v) == 0 else np.asarray(v) for k, v in results.items()}]

    def saved(self, state: Any) -> Any:
        return state

    def restored(self, tree: Any) -> Any:
        return tree


@functools.lru_cache(maxsize=16)
def _compiled_chunk(algorithm: Algorithm, length: int):
    """`jit(run(state, data, key, n))`: a `lax.scan` of static `length` whose first `n`
    (dynamic) iterations step the algorithm and the rest pass the state through, so every
    chunk of a run, whatever its size, uses one compilation (cached per algorithm). The
    state is donated: the new state reuses its buffers (per-client `[C, ...]` rows are
    updated in place instead of copied once per chunk)."""

    def run(state, data, key, n):
        def advance(state):
            state, metrics = algorithm.step(state, data, key)
            return state, {**metrics, "params_finite": tree_all_finite(state.params)}

        out_shape = jax.eval_shape(advance, state)[1]

        def body(state, i):
            def skip(state):
                return state, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)

            return lax.cond(i < n, advance, skip, state)

        return lax.scan(body, state, jnp.arange(length))

    return jax.jit(run, donate_argnums=0)


@functools.lru_cache(maxsize=16)
def compiled_evaluator(model: Model, spec: EvalSpec, client_map: ClientMap, has_test: bool):
    def evaluate(params, data: FederatedData, test: ArrayData | None):
        out = {}
        if spec.central and has_test:
            out.update(evaluate_central(model, params, test, spec.batch_size))
        if (spec.clients or spec.personal) and data.has_client_test:
            out.update(
                evaluate_clients(
                    model,
                    params,
                    data.x_test,
                    data.y_test,
                    data.test_counts,
                    client_map,
                    distribution=spec.personal,  # the global model beside the personal ones
                    rows=spec.client_rows,
                )
            )
        if spec.train:
            stats = evaluate_clients(
                model, params, data.x, data.y, data.counts, client_map, prefix="train",
                rows=spec.client_rows,
            )  # fmt: skip
            out["train_objective"] = stats["train_loss_pooled"]
            out["train_accuracy_worst"] = stats["train_accuracy_worst"]
        if spec.extra is not None:
            out.update(spec.extra(params, data, test))
        return out

    return jax.jit(evaluate)


@functools.lru_cache(maxsize=16)
def _compiled_state_evaluator(
    model: Model,
    spec: EvalSpec,
    algorithm: Algorithm,
    client_map: ClientMap,
    has_unseen: bool,
):
    """`jit(evaluate(state, data, key, unseen))`: the evaluations that need the state (each
    client's own model) or other clients (unseen ones, adapted from the global model:
    `Algorithm.model`'s where it declares one)."""

    def evaluate(state, data: FederatedData, key, unseen: FederatedData | None):
        out = {}
        if spec.personal:
            out.update(
                evaluate_personal(model, algorithm.personalize, state, data, key, client_map)
            )
        if has_unseen:
            start = (
                state if algorithm.model is None else state.replace(params=algorithm.model(state))
            )
            out.update(
                evaluate_unseen(
                    model,
                    start,
                    unseen,
                    key,
                    steps=spec.unseen_steps,
                    lr=spec.unseen_lr,
                    batch_size=spec.unseen_batch_size,
                    client_map=client_map,
                )
            )
        return out

    return jax.jit(evaluate)
