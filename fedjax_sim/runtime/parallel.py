"""`ClientMap`: how a per-client function is mapped over the cohort axis.

- `vmap`: one batched computation over all cohort clients. Fastest on GPU/TPU for small models.
- `map`: `lax.scan` over chunks of `batch_size` clients, each chunk vmapped (a chunk of one
  client is a plain call: `_chunk_fn` says why). Bounds memory to `batch_size` model copies
  and is faster on CPU (measured on 2 CPU cores, a FedAvg round of 1000 MLP 784-200-200-10
  clients: vmap 9.5 s and 3.8 GB peak RSS, `map(batch_size=5)` 4.8 s; vmap streams 1000
  parameter copies through memory every step).
- `auto` (default): measured. The first time a per-client function of a given structure and
  cohort size is mapped on a backend, `fedjax_sim.runtime.autotune` times `map` with chunks of 1, 4,
  16 and `vmap` and caches the fastest on disk (keyed by the structure and shapes of the
  function's jaxpr, backend, device kind and jax version). With `FEDJAX_SIM_AUTOTUNE=0` (the
  test suite), under `jax.disable_jit()` or with a `batch_size` given: `vmap` on
  accelerators, `map` with `batch_size` (default 8) on CPU.

Each map runs in a named scope `client_map=<mode>` (`"vmap"`, `"map:4"`): `recorded_modes`
reads the modes back from a traced computation; `simulate` stores them as
`History.meta["client_map"]`.

`fit_client_map(cohort, per_client_bytes, budget_bytes)` picks a concrete mode and chunk
for a memory budget (a small heuristic, documented on the function); `fit_population`
chooses between the population's data (and per-client state rows) on device and streamed
(`fedjax_sim.run.streaming`).

`map_sum` fuses the aggregation into the map: the summands are accumulated chunk by chunk, so
a FedAvg round never materialises `[M, d]` client updates in `map` mode. All modes compute the
same per-client values; sums may differ in the last bits (summation order).

With a `mesh` (an axis named `"clients"` by default), the cohort is sharded over devices with
`jax.shard_map`: each device maps its slice with the mode above and the sums are combined
with `psum`. A cohort not divisible by the device count is padded with masked copies of its
first client. Inside the sharded map, `to_varying` marks replicated values as per-device
(`jax.lax.pcast(..., to="varying")`); `local_train` applies it to its carry, otherwise the
gradient with respect to the replicated server params would be summed over devices.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fedjax_sim.runtime import autotune

MapMode = Literal["auto", "vmap", "map"]
CPU_DEFAULT_BATCH = 8
# target working set of one chunk of clients on CPU: about half the last-level cache of the
# machines measured here (32 MiB L3); W1's MLP clients (~2.6 MB each) then run 6 at a time,
# next to the measured optimum map(batch_size=5) (see the module docstring)
CPU_CHUNK_BYTES = 16 * 2**20
CLIENT_AXIS = "clients"

_ACTIVE_AXIS: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "fedjax_sim_client_axis", default=None
)


def recorded_modes(closed_jaxpr: Any) -> list[str]:
    """The concrete modes (`"vmap"`, `"map:<chunk>"`, each once, in order) of the client
    maps in a traced computation (`jax.make_jaxpr(step)(...)`). Each map names its scope
    after its mode, so sub-computations JAX reused from its tracing caches are found too."""
    modes: list[str] = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            for mode in _MODE_SCOPE.findall(str(eqn.source_info.name_stack)):
                if mode not in modes:
                    modes.append(mode)
            for sub in jex_core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed_jaxpr.jaxpr)
    return modes


_MODE_SCOPE = re.compile(r"client_map=(vmap|map:\d+)")


_BATCHED_RUNS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fedjax_sim_batched_runs", default=False
)


@contextlib.contextmanager
def batched_runs() -> Iterator[None]:
    """While tracing a step vmapped over a group of runs (`sweep`): `ClientMap("auto")` maps
    the cohort with `vmap`, so the runs x clients lanes form one batch (measured on the
    default digits job, 16 runs: vmap 1.8x the throughput of the single run's static choice
    map(8); `benchmarks/README.md`, sweeps)."""
    token = _BATCHED_RUNS.set(True)
    try:
        yield
    finally:
        _BATCHED_RUNS.reset(token)


@contextlib.contextmanager
def _client_axis(name: str) -> Iterator[None]:
    token = _ACTIVE_AXIS.set(name)
    try:
        yield
    finally:
        _ACTIVE_AXIS.reset(token)


def to_varying(tree: Any) -> Any:
    """Inside a sharded client map: cast replicated (device-invariant) leaves to per-device
    values, so that differentiating with respect to them is local. Outside: identity."""
    axis = _ACTIVE_AXIS.get()
    if axis is None:
        return tree

    def cast(x):
        x = jnp.asarray(x)
        manual = getattr(jax.typeof(x), "manual_axis_type", None)
        if manual is not None and axis in manual.varying:
            return x
        return lax.pcast(x, axis, to="varying")

    return jax.tree.map(cast, tree)


def client_mesh(num_devices: int | None = None, axis: str = CLIENT_AXIS) -> Mesh:
    """A 1-D mesh named `axis` over the first `num_devices` devices (all by default)."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not 1 <= n <= len(devices):
        raise ValueError(f"asked for {n} devices, {len(devices)} available: {devices}")
    return Mesh(devices[:n], (axis,))


@dataclasses.dataclass(frozen=True)
class ClientMap:
    """Maps a per-client function over the leading (cohort) axis of its arguments."""

    mode: MapMode = "auto"
    batch_size: int | None = None
    mesh: Mesh | None = None
    axis: str = CLIENT_AXIS

    def __post_init__(self):
        if self.mode not in ("auto", "vmap", "map"):
            raise ValueError(f"client_map mode must be 'auto', 'vmap' or 'map', got {self.mode!r}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"client_map batch_size must be >= 1, got {self.batch_size}")
        if self.mesh is not None and self.axis not in self.mesh.axis_names:
            raise ValueError(f"mesh has axes {self.mesh.axis_names}, not {self.axis!r}")

    @classmethod
    def recorded(cls, mode: str) -> ClientMap:
        """The `ClientMap` of a mode as `recorded_modes` returns it (`"vmap"`, `"map:4"`)."""
        name, _, chunk = mode.partition(":")
        if name not in ("vmap", "map") or (name == "map") != chunk.isdigit():
            raise ValueError(f"a recorded client map is 'vmap' or 'map:<chunk>', got {mode!r}")
        return cls(name, int(chunk) if chunk else None)

    @property
    def num_shards(self) -> int:
        return 1 if self.mesh is None else int(self.mesh.shape[self.axis])

    def resolve(self, num: int) -> tuple[str, int]:
        """`(mode, chunk)` used for a cohort of `num` clients."""
        mode = self.mode
        if mode == "auto":
            batched = _BATCHED_RUNS.get() and self.batch_size is None
            mode = "map" if jax.default_backend() == "cpu" and not batched else "vmap"
        if mode == "vmap":
            return "vmap", num
        bs = self.batch_size or CPU_DEFAULT_BATCH
        return "map", max(1, min(bs, num))

    def _measured(self, fn: Callable[..., Any], xs: tuple, reduce: bool) -> ClientMap | None:
        """With `mode="auto"` (no mesh, measuring on): the measured-and-cached concrete map
        (`fedjax_sim.runtime.autotune`); None otherwise."""
        if self.mode != "auto" or self.mesh is not None or self.batch_size is not None:
            return None
        if _ACTIVE_AXIS.get() is not None or _BATCHED_RUNS.get():  # the static rule
            return None
        if not autotune.enabled() or _leading(xs) < 2:
            return None
        mode, bs = autotune.choose(fn, xs, reduce, ClientMap)
        return ClientMap(mode, bs)

    def map(self, fn: Callable[..., Any], *xs: Any) -> Any:
        """`[fn(*x_i) for i]`, stacked on axis 0."""
        if self.mesh is not None:
            return self._sharded(fn, xs, reduce=False)
        measured = self._measured(fn, xs, reduce=False)
        if measured is not None:
            return measured.map(fn, *xs)
        num = _leading(xs)
        mode, bs = self.resolve(num)
        if mode == "vmap" or bs >= num:
            with jax.named_scope("client_map=vmap"):
                return jax.vmap(fn)(*xs)
        with jax.named_scope(f"client_map=map:{bs}"):
            return lax.map(lambda args: fn(*args), xs, batch_size=bs if bs > 1 else None)

    def map_sum(self, fn: Callable[..., tuple[Any, Any]], *xs: Any) -> tuple[Any, Any]:
        """For `fn(*x_i) -> (summand_i, out_i)`: `(sum_i summand_i, stacked out_i)`."""
        if self.mesh is not None:
            return self._sharded(fn, xs, reduce=True)
        measured = self._measured(fn, xs, reduce=True)
        if measured is not None:
            return measured.map_sum(fn, *xs)
        num = _leading(xs)
        mode, bs = self.resolve(num)
        scope = "client_map=vmap" if mode == "vmap" or bs >= num else f"client_map=map:{bs}"
        with jax.named_scope(scope):
            return self._map_sum(fn, xs, num, mode, bs)

    @staticmethod
    def _map_sum(fn: Callable[..., Any], xs: tuple, num: int, mode: str, bs: int) -> Any:
        """`map_sum` in a concrete mode."""
        vfn = _chunk_fn(fn, min(bs, num) if mode == "map" else num)
        if mode == "vmap" or bs >= num:
            summands, outs = vfn(*xs)
            return _sum0(summands), outs
        n_chunks, n_main = num // bs, (num // bs) * bs
        main = jax.tree.map(lambda a: a[:n_main].reshape(n_chunks, bs, *a.shape[1:]), xs)
        summand_shape, _ = jax.eval_shape(fn, *jax.tree.map(lambda a: a[0], xs))
        acc0 = to_varying(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), summand_shape))

        def body(acc, chunk):
            summands, outs = vfn(*chunk)
            return jax.tree.map(jnp.add, acc, _sum0(summands)), outs

        acc, outs = lax.scan(body, acc0, main)
        outs = jax.tree.map(lambda a: a.reshape(n_main, *a.shape[2:]), outs)
        if n_main < num:
            rest = jax.tree.map(lambda a: a[n_main:], xs)
            summands, rest_outs = vfn(*rest)
            acc = jax.tree.map(jnp.add, acc, _sum0(summands))
            outs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), outs, rest_outs)
        return acc, outs

    def _sharded(self, fn: Callable[..., Any], xs: tuple, reduce: bool) -> Any:
        """shard_map over the client axis; pads the cohort to a multiple of the shard count
        with (masked) copies of its first entry."""
        num, shards = _leading(xs), self.num_shards
        padded = -(-num // shards) * shards
        valid = jnp.arange(padded) < num
        xs = jax.tree.map(lambda a: _pad_rows(a, padded), xs)
        local = dataclasses.replace(self, mesh=None)

        def body(valid, *xs):
            with _client_axis(self.axis):
                if not reduce:
                    return local.map(fn, *xs)

                def masked(v, *x):
                    summand, out = fn(*x)
                    return jax.tree.map(lambda a: jnp.where(v, a, jnp.zeros_like(a)), summand), out

                summed, outs = local.map_sum(masked, valid, *xs)
                return lax.psum(summed, self.axis), outs

        spec = P(self.axis)
        out_specs = (P(), spec) if reduce else spec
        out = jax.shard_map(
            body, mesh=self.mesh, in_specs=(spec,) * (1 + len(xs)), out_specs=out_specs
        )(valid, *xs)
        trim = lambda tree: jax.tree.map(lambda a: a[:num], tree)
        return (out[0], trim(out[1])) if reduce else trim(out)


def fit_client_map(
    cohort: int,
    per_client_bytes: int,
    budget_bytes: int,
    *,
    backend: str | None = None,
    mesh: Mesh | None = None,
    axis: str = CLIENT_AXIS,
) -> ClientMap:
    """A `ClientMap` for `cohort` clients whose live working sets fit `budget_bytes`.

    `per_client_bytes` is the working memory of one mapped client (e.g. the slope of XLA's
    temporary buffers in the cohort size, `fedjax_sim.app.bench.suites.per_client_bytes`);
    `budget_bytes` is what is left for it after the data and the model. With a mesh the
    budget is per device and the cohort is split over its `axis`. Heuristic:

    - CPU: `map` in chunks whose working set is about `CPU_CHUNK_BYTES` (cache-sized chunks;
      vmap over a large cohort is the slowest compiled form there), capped by the budget.
    - GPU/TPU: `vmap` over the whole (per-device) cohort if it fits, else `map` with the
      largest chunk that fits.

    Raises ValueError if not even one client fits.
    """
    if cohort < 1 or per_client_bytes < 1:
        raise ValueError(
            f"cohort and per_client_bytes must be >= 1, got {cohort}, {per_client_bytes}"
        )
    fit = budget_bytes // per_client_bytes
    if fit < 1:
        raise ValueError(
            f"one client needs ~{per_client_bytes / 2**20:.1f} MiB, more than the memory "
            f"budget left for clients ({budget_bytes / 2**20:.1f} MiB)"
        )
    shards = 1 if mesh is None else int(mesh.shape[axis])
    local = -(-cohort // shards)
    backend = backend or jax.default_backend()
    if backend == "cpu":
        chunk = max(1, min(fit, CPU_CHUNK_BYTES // per_client_bytes, local))
        return ClientMap("map", chunk, mesh=mesh, axis=axis)
    if local <= fit:
        return ClientMap("vmap", mesh=mesh, axis=axis)
    return ClientMap("map", int(fit), mesh=mesh, axis=axis)


def _chunk_fn(fn: Callable[..., Any], size: int) -> Callable[..., Any]:
    """`fn` over a chunk of `size` clients (leading axis): `vmap`, or for one client a plain
    call. A size-1 vmap axis is not free on XLA:CPU: it turns every weight-gradient dot into
    a batched dot whose transposed output XLA no longer folds into the operands, so the
    optimizer adds a strided transpose of each kernel's gradient per step (pfl's CIFAR CNN,
    map(batch_size=1): 13 % of a round went to the dense kernel's transposed add and copy)."""
    if size > 1:
        return jax.vmap(fn)

    def one(*chunk):
        out = fn(*jax.tree.map(lambda a: a[0], chunk))
        return jax.tree.map(lambda a: a[None], out)

    return one


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
    a = jnp.asarray(a)
    if a.shape[0] == rows:
        return a
    fill = jnp.broadcast_to(a[:1], (rows - a.shape[0], *a.shape[1:]))
    return jnp.concatenate([a, fill])


def _leading(xs: Any) -> int:
    leaves = jax.tree.leaves(xs)
    if not leaves:
        raise ValueError("client_map needs at least one mapped array argument")
    return int(leaves[0].shape[0])


def _sum0(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.sum(a, axis=0), tree)


@dataclasses.dataclass(frozen=True)
class PopulationPlan:
    """Where a population's data lives and how its cohorts are mapped (`fit_population`).

    Attributes:
      placement: "device" (`simulate`: the whole `[C, ...]` data on device) or "streamed"
        (`fedjax_sim.run.streaming.simulate_streamed`: only the cohort rows in flight).
      client_map: the cohort mapping that fits what is left (`fit_client_map`).
      device_bytes: estimated resident bytes before the clients' working sets.
      state_rows: where the per-client state rows live (`simulate_streamed`'s
        `state_rows`): "device" (`[C, ...]`) or "host" (only the chunks' rows in flight).
    """

    placement: Literal["device", "streamed"]
    client_map: ClientMap
    device_bytes: int
    state_rows: Literal["device", "host"] = "device"


def fit_population(
    num_clients: int,
    cohort: int,
    *,
    data_bytes_per_client: int,
    per_client_bytes: int,
    budget_bytes: int,
    state_bytes_per_client: int = 0,
    fixed_bytes: int = 0,
    in_flight: int = 3,
    backend: str | None = None,
) -> PopulationPlan:
    """On-device vs streamed data and state rows for `num_clients` clients with cohorts of
    `cohort` (the clients of one streamed chunk).

    Resident bytes, first that leaves room for one client's working set wins:
    1. all on device: `C x (data + state rows) + fixed` (no copies per round);
    2. data streamed, state rows on device: `in_flight x cohort x data` (the chunk being
       computed plus the prefetched ones) `+ C x (state rows + 8) + fixed`;
    3. both streamed (`state_rows="host"`): `in_flight x cohort x (data + state rows) +
       cohort x state rows` (the previous chunk's rows, kept to patch the next one)
       `+ C x 8 + fixed`.
    8 bytes per client: the counts and the O(C) cohort draw. Raises ValueError if none fits.
    """
    if min(num_clients, cohort, per_client_bytes) < 1 or data_bytes_per_client < 0:
        raise ValueError("num_clients, cohort and per_client_bytes must be >= 1")
    if cohort > num_clients:
        raise ValueError(f"cohort {cohort} exceeds the population ({num_clients})")
    data, rows = data_bytes_per_client, state_bytes_per_client
    candidates = (
        ("device", "device", num_clients * (data + rows)),
        ("streamed", "device", in_flight * cohort * data + num_clients * (rows + 8)),
        (
            "streamed",
            "host",
            in_flight * cohort * (data + rows) + cohort * rows + num_clients * 8,
        ),
    )
    for placement, where, resident in candidates:
        resident += fixed_bytes
        if budget_bytes - resident >= per_client_bytes:
            cmap = fit_client_map(
                cohort, per_client_bytes, budget_bytes - resident, backend=backend
            )
            return PopulationPlan(placement, cmap, int(resident), where)
    raise ValueError(
        f"no placement fits {budget_bytes / 2**30:.2f} GiB: the smallest, data and state rows "
        f"streamed, needs {resident / 2**30:.2f} GiB plus one client's working set"
    )
