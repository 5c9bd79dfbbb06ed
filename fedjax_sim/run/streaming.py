"""`simulate_streamed`: populations beyond device memory.

The population's data stays outside the device, in a `ClientStore` (host RAM or memory-mapped
files on disk) or a procedural `Population` (data generated on device from `(seed, client
id)`). Each round's cohort depends only on `(key, round)` (or on the event engine's own
state, which does not depend on the model), so a `CohortPlan` draws the ids of the coming
rounds on the host side; a background thread gathers their rows and `device_put`s them
while the device runs the current chunk of rounds. The algorithm's `step` gets a
`CohortData` view: the cohort's rows plus the population's `[C]` counts, indexed by real
client ids, so the run is bit-for-bit the on-device run (`exact` plans). Device memory is
O(cohort x chunk + model + 8 bytes per client for the algorithm's own cohort draw), plus the
per-client state rows `[C, ...]` (SCAFFOLD's control variates, FedDyn's h_i, error-feedback
memories, MIFA's and AREA's read models and memories), unless `state_rows="host"`: then they
live in a host `HostStore` (RAM or memory-mapped files) and each chunk gets only the rows of
the clients it touches, as `core.rows.Rows` tables that the row functions
(`core.rows.gather_rows` / `scatter_rows`) address by real client id (see `simulate_streamed`).

Plans:
- `AlgorithmCohorts(cohort, counts)`: the ids `CohortSpec.sample` draws in the FedAvg-type
  and stateful algorithms (`round_key(key, round, COHORT)`); exact.
- `EventCohorts(events)`: the firing slots of the asynchronous event engine, replayed
  without the model (padding slots read client C-1, as the algorithms do); exact.
- `UniformCohorts(num_clients, size)`: M distinct ids drawn on the host in O(M) (numpy,
  seeded by the key and the round), for populations too large for an O(C) draw (10^9). The
  algorithm then sees the cohort as its whole population (`CohortSpec()` full participation;
  client keys use the slot 0..M-1): the same distribution of rounds, not the same bits, and
  only for algorithms without per-client state.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol, Unpack

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from fedjax_sim.algorithms.core import (
    COHORT,
    Algorithm,
    CohortSpec,
    global_model,
    round_key,
    tree_all_finite,
)
from fedjax_sim.core.rows import Rows, is_rows
from fedjax_sim.data.federated import ArrayData, FederatedData
from fedjax_sim.data.procedural import Population
from fedjax_sim.data.store import ClientStore, CohortData, HostStore
from fedjax_sim.models.base import Model
from fedjax_sim.run.history import History
from fedjax_sim.run.loop import RunOptions, chunk_length, run_loop, run_options, spans
from fedjax_sim.run.simulate import INIT_PURPOSE, EvalSpec, evaluate_central


# ------------------------------------------------------------------------------ plans
class CohortPlan(Protocol):
    """The client ids each round reads, drawn ahead of the rounds."""

    size: int  # M, ids per round
    num_clients: int  # C, the population the ids come from
    exact: bool  # the algorithm draws the same ids itself from the [C] counts

    def cohorts(self, key: jax.Array, start: int, num: int) -> np.ndarray:
        """`[num, M]` int ids of rounds `start .. start + num - 1` (0-based)."""
        ...


@functools.partial(jax.jit, static_argnums=0)
def _sample_rounds(cohort: CohortSpec, key: jax.Array, counts: jax.Array, rounds: jax.Array):
    return jax.vmap(lambda r: cohort.sample(round_key(key, r, COHORT), counts)[0])(rounds)


class AlgorithmCohorts:
    """Ids drawn by `cohort.sample(round_key(key, round, COHORT), counts)`, the sampler of
    every FedAvg-type and stateful algorithm."""

    exact = True

    def __init__(self, cohort: CohortSpec, counts: Any):
        counts = np.asarray(counts, np.int32)
        cohort.check(counts.shape[0])
        self.cohort = cohort
        self.counts = jnp.asarray(counts)
        self.num_clients = c = int(counts.shape[0])
        self.size = c if cohort.size is None else cohort.size

    def cohorts(self, key: jax.Array, start: int, num: int) -> np.ndarray:
        rounds = jnp.arange(start, start + num, dtype=jnp.int32)
        return np.asarray(_sample_rounds(self.cohort, key, self.counts, rounds))


class EventCohorts:
    """The event engine's firing slots per iteration, replayed from `events.init(key)`
    without the model (`draw` then `advance`; the arrival process does not depend on the
    model or on `read_after_aggregate`)."""

    exact = True

    def __init__(self, events: Any):
        if getattr(events, "concurrency", None) is not None:
            raise ValueError(
                "a concurrency cap is not supported in streamed runs (starting clients read "
                "the model outside the firing slots)"
            )
        self.events = events
        self.num_clients = int(events.num_clients)
        self.size = int(events.slots)
        self._state: Any = None
        self._next = 0
        self._key_data: np.ndarray | None = None
        ev = events

        def run(state, key, num):
            def body(st, _):
                tick = ev.draw(st, round_key(key, st.k, COHORT))
                return ev.advance(st, tick), jnp.minimum(tick.ids, ev.num_clients - 1)

            return lax.scan(body, state, None, length=num)

        self._run = jax.jit(run, static_argnums=2)

    def cohorts(self, key: jax.Array, start: int, num: int) -> np.ndarray:
        kd = np.asarray(jax.random.key_data(key))
        if self._state is None or start != self._next or not np.array_equal(kd, self._key_data):
            self._state, self._next, self._key_data = self.events.init(key), 0, kd
            if start > 0:
                self._state, _ = self._run(self._state, key, start)
                self._next = start
        self._state, ids = self._run(self._state, key, num)
        self._next = start + num
        return np.asarray(ids)


@dataclasses.dataclass
class UniformCohorts:
    """`size` distinct ids uniform over `num_clients`, drawn on the host in O(size) from
    `(key, round)`; the algorithm sees the cohort as its population (not `exact`)."""

    num_clients: int
    size: int
    exact: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self):
        if not 1 <= self.size <= self.num_clients:
            raise ValueError(f"cohort size must be in [1, {self.num_clients}], got {self.size}")

    def cohorts(self, key: jax.Array, start: int, num: int) -> np.ndarray:
        kd = [int(v) for v in np.asarray(jax.random.key_data(key)).reshape(-1)]
        out = np.empty((num, self.size), np.int64)
        for j in range(num):  # one draw per round (host side, O(M) each)
            rng = np.random.default_rng([*kd, start + j])
            out[j] = rng.choice(self.num_clients, self.size, replace=False)
        return out


# ------------------------------------------------------------------------------ sources
@dataclasses.dataclass(frozen=True)
class _Rows:
    """How a chunk's device rows are made from what the host sent (hashable: part of the
    compiled chunk's cache key)."""

    decode: Any = None  # store: on-device decode of x
    population: Population | None = None  # procedural: rows generated from the ids

    def __call__(self, host: dict[str, jax.Array], ids: jax.Array):
        if self.population is not None:
            x, y = self.population.rows(ids)
            return x, y, self.population.counts(ids)
        return self.decode(host["x"]), host["y"], host["counts"]


def _source_info(source: ClientStore | Population) -> tuple[int, int, np.ndarray | None]:
    if isinstance(source, ClientStore):
        return source.num_clients, source.num_classes, source.counts
    if isinstance(source, Population):
        return source.num_clients, source.num_classes, None
    raise TypeError(f"source must be a ClientStore or a procedural Population, got {type(source)}")


# ------------------------------------------------------------------------------ state rows
INIT_BLOCK_BYTES = 4 * 2**20  # host rows: `algorithm.init`'s rows computed this much at a time


@dataclasses.dataclass
class InitBlocks:
    """`algorithm.init(params, key)` with its `Rows` computed in blocks of rows (see
    `init_blocks`): `nodes` the state flattened down to its `Rows` (non-row nodes as arrays
    on the host CPU, `Rows` of `jax.ShapeDtypeStruct`), `spec` the `[C, ...]` shape of each
    row leaf by store name (`leaf{node}_{leaf}`, flat order), `block` rows per block."""

    nodes: list
    treedef: Any
    spec: dict[str, jax.ShapeDtypeStruct]
    block: int
    temp_bytes: int | None  # the compiled block function's scratch memory (None: unknown)
    _rows: Callable[[Any], list]

    def blocks(self):
        """`(start, {name: rows [start, start + K)})` covering all C rows in order (the last
        block may start before the previous one ends: the same rows again)."""
        c = next(iter(self.spec.values())).shape[0]
        for start in range(0, c, self.block):
            start = min(start, c - self.block)
            rows = self._rows(np.int32(start))
            yield start, {n: np.asarray(r) for n, r in zip(self.spec, rows, strict=True)}


def init_blocks(
    algorithm: Algorithm, params: Any, key: jax.Array, c: int, block_bytes: int = INIT_BLOCK_BYTES
) -> InitBlocks:
    """`algorithm.init(params, key)` without its `[C, ...]` rows in memory: the state's
    structure from `jax.eval_shape`, its non-row part from one compiled function (the rows
    are dead code there) and the rows from another that returns rows `[start, start + B)`
    (`lax.dynamic_slice` of the init's rows; B from `block_bytes`). Rows that `init`
    broadcasts from one row (every hook row, memory and read model) are then computed B at
    a time: XLA turns a slice of a broadcast into a smaller broadcast, so the block function
    needs no `[C, ...]` buffer. If its compiled scratch memory shows it does (rows that XLA
    cannot slice through), B is C: one block, the rows in memory once. The values are those
    of `algorithm.init` either way. Runs on the host CPU."""
    cpu = jax.devices("cpu")[0]
    params, key = jax.device_put((params, key), cpu)
    shapes = jax.eval_shape(algorithm.init, params, key)
    nodes, treedef = jax.tree.flatten(shapes, is_leaf=is_rows)
    if not any(is_rows(n) for n in nodes):
        raise ValueError(
            'state_rows="host": the algorithm keeps no per-client rows (no core.rows.Rows '
            "in its state)"
        )
    spec = {
        f"leaf{i}_{j}": a
        for i, n in enumerate(nodes)
        if is_rows(n)
        for j, a in enumerate(jax.tree.leaves(n.value))
    }
    for name, a in spec.items():
        if a.shape[:1] != (c,):
            raise ValueError(f"state row {name} has shape {a.shape}, expected [{c}, ...]")
    row_bytes = sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in spec.values())
    block = max(1, min(c, block_bytes // max(1, row_bytes)))

    def split(p, k):
        return treedef.flatten_up_to(algorithm.init(p, k))

    def rest(p, k):
        return [None if is_rows(n) else n for n in split(p, k)]

    def rows(p, k, start, size):
        leaves = [a for n in split(p, k) if is_rows(n) for a in jax.tree.leaves(n.value)]
        return [lax.dynamic_slice_in_dim(a, start, size) for a in leaves]

    def compile_rows(size):
        fn = functools.partial(rows, size=size)
        compiled = jax.jit(fn).lower(params, key, np.int32(0)).compile()
        analysis = compiled.memory_analysis()
        return compiled, None if analysis is None else int(analysis.temp_size_in_bytes)

    with jax.default_device(cpu):
        compiled, temp = compile_rows(block)
        if block < c and temp is not None and temp > 2 * block * row_bytes + 2**20:
            compiled, temp = compile_rows(c)  # XLA could not slice the init's rows: one block
            block = c
        rest_nodes = jax.jit(rest)(params, key)
    nodes = [n if is_rows(n) else r for n, r in zip(nodes, rest_nodes, strict=True)]
    return InitBlocks(nodes, treedef, spec, block, temp, functools.partial(compiled, params, key))


@jax.jit
def _patch(table: list, slots: jax.Array, prev: list, prev_slots: jax.Array) -> list:
    """Rows `table [U, ...]` of clients `slots [U]`, with those the previous chunk holds
    (`prev [U, ...]` of `prev_slots [U]`, newer than the host's) taken from it."""
    s = jnp.minimum(jnp.searchsorted(prev_slots, slots), prev_slots.shape[0] - 1)
    fresh = prev_slots[s] == slots
    return [
        jnp.where(fresh.reshape(-1, *([1] * (t.ndim - 1))), p[s], t)
        for t, p in zip(table, prev, strict=True)
    ]


class _RowStore:
    """`state_rows="host"`: the `Rows` of the algorithm state (`[C, ...]`) in a `HostStore`,
    the device rows of the chunk that ran last, and their write-back.

    Order: chunk i's rows are gathered (background thread, while chunk i - 1 computes) once
    chunks `< i - 1` are written back (`wait_written`); `enter` patches in the rows chunk
    i - 1 changed from its device table; `write_back` (main thread, after chunk i is
    dispatched, so while it runs) returns chunk i - 1's rows. Gathers and write-backs never
    touch the store at the same time: chunk i's rows are out of the queue before chunk
    i - 1's write-back starts, and chunk i + 1's gather waits for it.

    The state is flattened down to its `Rows` (`nodes`); each `Rows`' value leaves are the
    store's arrays `leaf{node}_{leaf}`, in flat order (`names`)."""

    def __init__(self, store: HostStore, treedef: Any, nodes: list, c: int):
        self.store, self.treedef, self.num_clients = store, treedef, c
        self.mask = [is_rows(n) for n in nodes]
        # per Rows node: (the structure of its value, the names of its leaves in the store)
        self.values = [
            (d, [f"leaf{i}_{j}" for j in range(d.num_leaves)])
            for i, n in enumerate(nodes)
            if is_rows(n)
            for d in [jax.tree.structure(n.value)]
        ]
        self.names = [name for _, names in self.values for name in names]
        self.device = jax.devices()[0]  # where the chunks run
        # the state between chunks: device leaves, no rows (they are on the host)
        self.device_state = treedef.unflatten(
            [None if m else a for a, m in zip(nodes, self.mask, strict=True)]
        )
        self.prev: tuple[jax.Array, list] | None = None  # (slots, rows) of the last chunk
        self.pending: tuple[jax.Array, list] | None = None  # not yet written back
        self.written = 0  # chunks written back
        self.cond = threading.Condition()

    @classmethod
    def init(
        cls,
        algorithm: Algorithm,
        params: Any,
        key: jax.Array,
        c: int,
        path: str | None,
        block_bytes: int = INIT_BLOCK_BYTES,
    ) -> _RowStore:
        """The initial state built on the host CPU (its rows never reach the device); rows
        in RAM, or in memory-mapped files under `path`, written block by block
        (`init_blocks`: host memory O(block), not O(C x row), when the rows go to disk)."""
        init = init_blocks(algorithm, params, key, c, block_bytes)
        spec = {n: (s.shape[1:], s.dtype) for n, s in init.spec.items()}
        if path is None:  # the C rows once (no second copy of them)
            store = HostStore({n: np.empty((c, *shape), dt) for n, (shape, dt) in spec.items()})
        else:
            store = HostStore.create(path, c, spec)
        for start, rows in init.blocks():
            store.write_rows(start, rows)
        device = jax.devices()[0]
        nodes = [n if is_rows(n) else jax.device_put(n, device) for n in init.nodes]
        return cls(store, init.treedef, nodes, c)

    def _with_rows(self, state: Any, rows: list) -> Any:
        """`state` with its `Rows` replaced by `rows` (in flat order)."""
        it = iter(rows)
        nodes = self.treedef.flatten_up_to(state)
        return self.treedef.unflatten(
            [next(it) if m else a for a, m in zip(nodes, self.mask, strict=True)]
        )

    def _rows(self, leaves: list, slots: Any = None) -> list[Rows]:
        """One `Rows` per row node from the flat `leaves` (tables of `slots` if given; one
        slot-id array per table: the chunk donates its state, and a donated argument cannot
        hold one buffer twice)."""
        out, it = [], iter(leaves)
        for k, (treedef, names) in enumerate(self.values):
            value = treedef.unflatten([next(it) for _ in names])
            if slots is None:
                out.append(Rows(value, num_clients=self.num_clients))
            else:
                out.append(Rows(value, jnp.copy(slots) if k else slots, self.num_clients))
        return out

    def _leaves(self, state: Any) -> tuple[list[Rows], list]:
        """The `Rows` of `state` and their value leaves in flat order."""
        nodes = self.treedef.flatten_up_to(state)
        rows = [a for a, m in zip(nodes, self.mask, strict=True) if m]
        return rows, [leaf for r in rows for leaf in jax.tree.leaves(r.value)]

    def wait_written(self, chunks: int, stop: threading.Event) -> bool:
        """Waits until `chunks` chunks are written back (False: the run stopped)."""
        with self.cond:
            while self.written < chunks:
                if stop.is_set():
                    return False
                self.cond.wait(0.1)
        return True

    def gather(self, ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """`(slots [U], rows [U, ...] per row leaf)` for a chunk's ids `[T, M]`: the union of
        its cohorts padded with the lowest other ids to `U = min(C, T x M)` (one shape)."""
        size = min(self.num_clients, ids.size)
        slots = np.unique(ids)
        if slots.size < size:
            extra = np.setdiff1d(np.arange(size), slots, assume_unique=True)
            slots = np.sort(np.concatenate([slots, extra[: size - slots.size]]))
        rows = self.store.gather(slots)
        return slots.astype(np.int32), [rows[n] for n in self.names]

    def enter(self, state: Any, slots: jax.Array, table: list) -> Any:
        """`state` with its `Rows` the chunk's tables `[U, ...]` (patched)."""
        if self.prev is not None:
            table = _patch(table, slots, self.prev[1], self.prev[0])
        return self._with_rows(state, self._rows(table, slots))

    def leave(self, state: Any) -> None:
        """Keeps the chunk's new rows (to patch the next chunk) and queues their write-back."""
        rows, leaves = self._leaves(state)
        self.prev = self.pending = (rows[0].slot_ids, leaves)

    def write_back(self) -> int:
        """Writes the queued rows to the host store; returns the bytes."""
        if self.pending is None:
            return 0
        slots, table = self.pending
        host = {n: np.asarray(t) for n, t in zip(self.names, table, strict=True)}
        self.store.scatter(np.asarray(slots), host)
        self.pending = None
        with self.cond:
            self.written += 1
            self.cond.notify_all()
        return sum(v.nbytes for v in host.values())

    def final_state(self, state: Any) -> Any:
        """`state` with its `Rows` the host store's `[C, ...]` arrays."""
        self.store.flush()
        return self._with_rows(state, self._rows([self.store.arrays[n] for n in self.names]))

    def saved(self, state: Any) -> Any:
        """`state` with its `Rows` the host store's `[C, ...]` arrays (written back)."""
        self.write_back()
        return self.final_state(state)

    def restored(self, tree: Any) -> Any:
        """The device state of a checkpoint's `tree`; its rows go to the host store."""
        _, leaves = self._leaves(tree)
        rows = [np.asarray(a) for a in leaves]
        self.store.scatter(np.arange(self.num_clients), dict(zip(self.names, rows, strict=True)))
        self.prev = self.pending = None
        nodes = self.treedef.flatten_up_to(tree)
        return self.treedef.unflatten(
            [
                None if m else jax.device_put(a, self.device)
                for a, m in zip(nodes, self.mask, strict=True)
            ]
        )


# ------------------------------------------------------------------------------ runner
@dataclasses.dataclass
class StreamStats:
    """Host-side data pipeline timings of a streamed run (seconds)."""

    prefetch_seconds: float = 0.0  # drawing ids + gathering rows + device_put, all chunks
    stall_seconds: float = 0.0  # the main loop waiting for data, chunks after the first
    first_chunk_seconds: float = 0.0  # data of the first chunk (cannot overlap anything)
    bytes_sent: int = 0  # data, ids and (state_rows="host") state rows sent to the device
    bytes_returned: int = 0  # state rows written back to the host store
    writeback_seconds: float = 0.0  # main loop: state rows to the host, while a chunk runs
    chunks: int = 0
    chunk_seconds: list[float] = dataclasses.field(default_factory=list)  # wall, incl. stalls

    @property
    def overlap(self) -> float:
        """Fraction of the prefetch work (after the first chunk) hidden behind compute."""
        work = self.prefetch_seconds - self.first_chunk_seconds
        return 1.0 if work <= 0 else max(0.0, 1.0 - self.stall_seconds / work)

    def to_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "overlap": self.overlap}


def simulate_streamed(
    algorithm: Algorithm,
    source: ClientStore | Population,
    key: jax.Array,
    *,
    plan: CohortPlan,
    model: Model,
    num_rounds: int,
    test: ArrayData | None = None,
    params: Any = None,
    evaluation: EvalSpec = EvalSpec(clients=False),
    prefetch: int = 2,
    meta: dict[str, Any] | None = None,
    state_rows: Literal["device", "host"] = "device",
    rows_dir: str | None = None,
    mesh: Mesh | None = None,
    return_state: bool = False,
    **options: Unpack[RunOptions],
) -> History | tuple[History, Any]:
    """Runs `num_rounds` of `algorithm` on a population outside device memory.

    The loop of `simulate` (`fedjax_sim.run.loop.run_loop`: scan chunks, central evaluation,
    progress bar, NaN guard, Ctrl-C; `**options` the same `RunOptions` as `simulate`'s:
    `out_dir` files, checkpoints and resume, `privacy`), but each chunk's cohort rows
    `[T, M, ...]` are gathered from `source` by a background thread (`prefetch` chunks ahead)
    and passed to the compiled chunk; rounds see a `CohortData` view (exact plans) or the
    cohort as their population (`UniformCohorts`). `History.meta["streaming"]` holds the
    pipeline timings (`StreamStats`).

    Per-client state rows (the state's `core.rows.Rows`: hook rows, aggregator memories,
    asynchronous read models and memories):
    - `state_rows="device"`: `[C, ...]` in the algorithm state on device.
    - `state_rows="host"`: `[C, ...]` in a `HostStore` (NumPy; memory-mapped files under
      `rows_dir` if given, read and written with `pread` / `pwrite`; `algorithm.init`'s
      rows are written a block at a time, `init_blocks`: host memory O(block), not
      O(C x row), with rows on disk). The background
      thread gathers the rows of the union of each chunk's cohorts (padded with other
      clients to `U = min(C, T x M)` rows, one compiled shape) and the chunk runs on a
      state whose `Rows` are tables `[U, ...]` (read and written by real client id; keys
      and data use the real ids). A chunk's rows are gathered once the rows of the
      chunk before the previous one are back on the host; the rows the previous chunk
      changed are taken from its device table (`_patch`), and its write-back runs while the
      next chunk computes. Bit for bit the `"device"` run, except statistics over all C
      rows (`uplink_memory_rms`, FGDRO's objectives), not reported.
    `return_state`: also return the final state (host-mode row leaves as host arrays).
    Checkpoints hold the full state (host rows written back first); a resume puts the rows
    back in the host store. `mesh` is refused (the chunk's rows are on one device).

    Raises ValueError (before compiling) for settings a cohort view cannot serve: per-client
    or training-set evaluation, a plan over another population size, `prefetch < 1`, host
    rows with a non-exact plan or an algorithm whose state holds no `Rows`.
    """
    options = run_options("simulate_streamed", options, num_rounds, evaluation.every)
    checkpoint_every = options["checkpoint_every"]
    if mesh is not None:
        raise ValueError(
            "mesh: a streamed run puts each chunk's cohort rows on one device (not sharded "
            "yet); shard an on-device population with simulate(mesh=...)"
        )
    if evaluation.train or evaluation.extra is not None:
        raise ValueError("a streamed run evaluates on the central test set only (no train/extra)")
    if evaluation.personal:
        raise ValueError(
            "a streamed run evaluates on the central test set only: personal models are "
            "evaluated on per-client test splits by simulate"
        )
    if prefetch < 1:
        raise ValueError(f"prefetch must be >= 1, got {prefetch}")
    num_clients, num_classes, host_counts = _source_info(source)
    plan_c = getattr(plan, "num_clients", None)
    if plan_c is not None and plan_c != num_clients:
        raise ValueError(f"the cohort plan is for {plan_c} clients, the source has {num_clients}")
    if plan.exact and isinstance(source, Population) and num_clients > 2**27:
        raise ValueError(
            f"an exact plan draws cohorts over all {num_clients} clients on device; use "
            "UniformCohorts for populations this large"
        )
    if state_rows not in ("device", "host"):
        raise ValueError(f'state_rows must be "device" or "host", got {state_rows!r}')
    host_rows = state_rows == "host"
    if host_rows and not plan.exact:
        raise ValueError(
            'state_rows="host" needs an exact cohort plan (the rows are read by real client id)'
        )
    if rows_dir is not None and not host_rows:
        raise ValueError('rows_dir holds host state rows: give it with state_rows="host"')

    if params is None:
        params = model.init(jax.random.fold_in(key, INIT_PURPOSE))
    rows_store: _RowStore | None = None
    if host_rows:
        rows_store = _RowStore.init(algorithm, params, key, num_clients, rows_dir)
        state = rows_store.device_state
    else:
        state = algorithm.init(params, key)
    counts_dev = None
    if plan.exact:
        counts_dev = jnp.asarray(host_counts) if host_counts is not None else source.all_counts()
    rows = _Rows(population=source) if isinstance(source, Population) else _Rows(source.decode)
    chunk = chunk_length(num_rounds, evaluation.every, checkpoint_every)
    stream = _Stream(
        run_chunk=_compiled_stream_chunk(algorithm, chunk, rows, num_classes, plan.exact),
        evaluator=_compiled_central(model, evaluation.batch_size) if test is not None else None,
        test=test,
        source=source,
        plan=plan,
        key=key,
        counts=counts_dev,
        rows_store=rows_store,
        chunk=chunk,
        model_of=functools.partial(global_model, algorithm),
        prefetch=prefetch,
        spans=functools.partial(
            spans, num_rounds=num_rounds, every=evaluation.every, checkpoint_every=checkpoint_every
        ),
    )
    try:
        (history,), state = run_loop(
            stream,
            state,
            key,
            [dict(meta or {})],
            num_rounds=num_rounds,
            every=evaluation.every,
            options=options,
            nonfinite_hint="lower the learning rates, check the data, or check that the cohort "
            "plan covers every id the algorithm reads (missing clients read NaN features)",
        )
        if rows_store is not None:
            state = rows_store.saved(state)
    finally:
        stream.stop.set()
    history.meta["streaming"] = stream.stats.to_dict()
    return (history, state) if return_state else history


class _Stream:
    """`simulate_streamed`'s chunks: each chunk's cohort rows (and host state rows) come
    from a background thread that gathers them `prefetch` chunks ahead, from the chunk the
    loop starts at."""

    def __init__(
        self,
        *,
        run_chunk: Callable[..., Any],
        evaluator: Callable[..., Any] | None,
        test: ArrayData | None,
        source: ClientStore | Population,
        plan: CohortPlan,
        key: jax.Array,
        counts: jax.Array | None,
        rows_store: _RowStore | None,
        chunk: int,
        prefetch: int,
        spans: Callable[[int], list[tuple[int, int]]],
        model_of: Callable[[Any], Any],
    ):
        self.run_chunk, self.evaluator, self.test = run_chunk, evaluator, test
        self.source, self.plan, self.key, self.counts = source, plan, key, counts
        self.rows_store, self.chunk, self.spans = rows_store, chunk, spans
        self.stats = StreamStats()
        self.model_of = model_of  # the global model of a state (`Algorithm.model`)
        self.queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self.stop = threading.Event()
        self.worker: threading.Thread | None = None

    def _produce(self, spans: list[tuple[int, int]]) -> None:
        source, rows_store, stats = self.source, self.rows_store, self.stats
        try:
            for i, (r0, r1) in enumerate(spans):
                t0 = time.perf_counter()
                ids = self.plan.cohorts(self.key, r0, r1 - r0)
                ids = np.sort(np.asarray(ids).reshape(r1 - r0, -1), axis=1).astype(np.int32)
                if ids.shape[0] < self.chunk:  # padded rounds are skipped by the chunk
                    ids = np.concatenate([ids, np.repeat(ids[:1], self.chunk - ids.shape[0], 0)])
                host: dict[str, np.ndarray] = {}
                if isinstance(source, ClientStore):
                    flat = ids.reshape(-1)
                    host = source.rows.gather(flat)
                    host = {k: v.reshape(*ids.shape, *v.shape[1:]) for k, v in host.items()}
                    host["counts"] = source.counts[flat].reshape(ids.shape)
                sent = {"ids": ids, **host}
                if rows_store is not None:
                    # chunks up to i - 2 written back; chunk i - 1's rows are patched in
                    if not rows_store.wait_written(i - 1, self.stop):
                        return
                    sent["slots"], sent["rows"] = rows_store.gather(ids)
                item = (ids, host, sent.get("slots"), sent.get("rows"))
                # host rows: committed, as the patched rows of later chunks (one compilation)
                item = jax.device_put(item, None if rows_store is None else rows_store.device)
                jax.block_until_ready(item)
                dt = time.perf_counter() - t0
                stats.prefetch_seconds += dt
                stats.first_chunk_seconds += dt if i == 0 else 0.0
                stats.bytes_sent += sum(v.nbytes for v in jax.tree.leaves(sent))
                while not self.stop.is_set():
                    try:
                        self.queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self.stop.is_set():
                    return
        except BaseException as e:  # handed to the main loop
            self.queue.put(e)

    def run(self, state: Any, start: int, stop: int) -> tuple[Any, list[dict[str, np.ndarray]]]:
        if self.worker is None:
            self.worker = threading.Thread(
                target=self._produce,
                args=(self.spans(start),),
                name="fedjax-sim-prefetch",
                daemon=True,
            )
            self.worker.start()
        t_wait = time.perf_counter()
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if self.stats.chunks > 0:
            self.stats.stall_seconds += time.perf_counter() - t_wait
        ids, host, slots, table = item
        if self.rows_store is not None:
            state = self.rows_store.enter(state, slots, table)
        state, metrics = self.run_chunk(state, host, ids, self.counts, self.key, stop - start)
        if self.rows_store is not None:  # the previous chunk's rows, while this one runs
            t_back = time.perf_counter()
            self.stats.bytes_returned += self.rows_store.write_back()
            self.stats.writeback_seconds += time.perf_counter() - t_back
        metrics = jax.tree.map(lambda m: np.asarray(m)[: stop - start], metrics)
        if self.rows_store is not None:
            self.rows_store.leave(state)
        self.stats.chunks += 1
        self.stats.chunk_seconds.append(time.perf_counter() - t_wait)  # incl. waiting for data
        return state, [metrics]

    def evaluate(self, state: Any) -> list[dict[str, float]]:
        if self.evaluator is None:
            return [{}]  # as `simulate`: a row per evaluation point
        return [{k: float(v) for k, v in self.evaluator(self.model_of(state), self.test).items()}]

    def saved(self, state: Any) -> Any:
        return state if self.rows_store is None else self.rows_store.saved(state)

    def restored(self, tree: Any) -> Any:
        return tree if self.rows_store is None else self.rows_store.restored(tree)


@functools.lru_cache(maxsize=16)
def _compiled_stream_chunk(
    algorithm: Algorithm, length: int, rows: _Rows, num_classes: int, exact: bool
):
    """`jit(run(state, host [T, M, ...], ids [T, M], counts, key, n))`: like
    `simulate._compiled_chunk` (the state donated), with round t's cohort rows as the scan's
    input."""

    def run(state, host, ids, counts, key, n):
        def advance(state, host_t, ids_t):
            x, y, cohort_counts = rows(host_t, ids_t)
            if exact:
                view = CohortData(x=x, y=y, counts=counts, slot_ids=ids_t, num_classes=num_classes)
            else:
                view = FederatedData(x=x, y=y, counts=cohort_counts, num_classes=num_classes)
            state, metrics = algorithm.step(state, view, key)
            return state, {**metrics, "params_finite": tree_all_finite(state.params)}

        out_shape = jax.eval_shape(advance, state, jax.tree.map(lambda a: a[0], host), ids[0])[1]

        def body(state, xs):
            i, host_t, ids_t = xs

            def skip(state, host_t, ids_t):
                return state, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)

            return lax.cond(i < n, advance, skip, state, host_t, ids_t)

        return lax.scan(body, state, (jnp.arange(length), host, ids))

    return jax.jit(run, donate_argnums=0)


@functools.lru_cache(maxsize=16)
def _compiled_central(model: Model, batch_size: int):
    return jax.jit(lambda params, test: evaluate_central(model, params, test, batch_size))


__all__ = [
    "AlgorithmCohorts",
    "CohortPlan",
    "EventCohorts",
    "StreamStats",
    "UniformCohorts",
    "simulate_streamed",
]
