"""Multi-device and multi-process runs with JAX's own SPMD machinery (no RPC, no Ray).

- One host, many devices: `mesh = client_mesh()` and `ClientMap(mesh=mesh)` shard every
  cohort over the `"clients"` axis; `simulate(..., mesh=mesh)` places the per-client arrays
  (`place_run`: the data's rows and the state's `Rows`) sharded by client and everything
  else replicated.
- Many processes / hosts: call `initialize(...)` first in every process (coordinator
  address, process count and id from arguments or the `FEDJAX_SIM_*` environment; with the
  coordinator "auto", JAX auto-detects SLURM, Open MPI and Cloud TPU pods). The mesh then
  spans the devices of all processes; `local_rows(data, mesh, C, all_rows=True)` keeps only
  this process's clients and `globalize(local, mesh, C, all_rows=True)` assembles global
  arrays from them.

Which leaves are per-client is declared by their type, never read off a shape: the leaves
inside a `core.rows.Rows` (or every leaf, `all_rows=True`, for a `FederatedData`, whose
arrays are all `[C, ...]`). A model parameter whose first dimension happens to equal C stays
replicated.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fedjax_sim.core.rows import is_rows
from fedjax_sim.runtime.parallel import CLIENT_AXIS

if TYPE_CHECKING:
    from fedjax_sim.data.federated import FederatedData

ENV = {
    "coordinator_address": "FEDJAX_SIM_COORDINATOR",
    "num_processes": "FEDJAX_SIM_NUM_PROCESSES",
    "process_id": "FEDJAX_SIM_PROCESS_ID",
}


def host_device_flags(devices: int, flags: str = "") -> str:
    """`XLA_FLAGS` (extending `flags`) for a CPU process with `devices` host devices: a
    start-up option, set before JAX initialises its backend (or in a child's environment)."""
    flag = f"--xla_force_host_platform_device_count={devices}"
    if devices == 1 or flag in flags:
        return flags
    return f"{flags} {flag}".strip()


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_collectives: str = "gloo",
) -> None:
    """`jax.distributed.initialize` from arguments or `FEDJAX_SIM_COORDINATOR`,
    `FEDJAX_SIM_NUM_PROCESSES`, `FEDJAX_SIM_PROCESS_ID` (all three together), or with the
    coordinator `"auto"`, JAX's cluster auto-detection (SLURM, Open MPI, Cloud TPU pods).
    On CPU, collectives across processes use `cpu_collectives`.
    """
    values = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    for name, var in ENV.items():
        if values[name] is None and os.environ.get(var):
            values[name] = os.environ[var]
    if values["num_processes"] is not None:
        values["num_processes"] = int(values["num_processes"])
    if values["process_id"] is not None:
        values["process_id"] = int(values["process_id"])
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    if values["coordinator_address"] == "auto":  # cluster auto-detection (SLURM, MPI, TPU)
        jax.distributed.initialize()
        return
    given = [v is not None for v in values.values()]
    if any(given) and not all(given):
        raise ValueError(
            "multi-process runs need the coordinator address, the number of processes and "
            f"this process's id together; got {values}"
        )
    n, pid = values["num_processes"], values["process_id"]
    if n is not None and not 0 <= pid < n:
        raise ValueError(f"process id {pid} outside [0, {n})")
    jax.distributed.initialize(**{k: v for k, v in values.items() if v is not None})


def is_main_process() -> bool:
    return jax.process_index() == 0


def _by_rows(fn: Callable[[Any, bool], Any], tree: Any, all_rows: bool) -> Any:
    """`fn(leaf, per_client)` for every leaf of `tree`: `per_client` for the leaves inside a
    `Rows` (every leaf with `all_rows`)."""

    def node(x: Any) -> Any:
        if is_rows(x):
            return jax.tree.map(lambda a: fn(a, True), x)
        return fn(x, all_rows)

    return jax.tree.map(node, tree, is_leaf=is_rows)


def _check_row(x: Any, num_clients: int) -> None:
    if np.shape(x)[:1] != (num_clients,):
        raise ValueError(
            f"a leaf declared per-client has shape {np.shape(x)}, not [{num_clients}, ...]"
        )


def place(
    tree: Any, mesh: Mesh, num_clients: int, *, all_rows: bool = False, axis: str = CLIENT_AXIS
) -> Any:
    """Puts the per-client leaves of `tree` (`[num_clients, ...]`: those inside a `Rows`,
    or every leaf with `all_rows`) sharded over `axis` when the shards divide `num_clients`,
    and every other leaf replicated. Leaves that are already global multi-process arrays are
    kept. Placement never changes results, only where data lives."""
    shards = mesh.shape[axis]

    def put(x: Any, per_client: bool) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x
        if per_client:
            _check_row(x, num_clients)
        sharded = per_client and num_clients % shards == 0
        return jax.device_put(x, NamedSharding(mesh, P(axis) if sharded else P()))

    return _by_rows(put, tree, all_rows)


def place_run(
    state: Any, data: FederatedData, mesh: Mesh, *, axis: str = CLIENT_AXIS
) -> tuple[Any, FederatedData]:
    """`(state, data)` of a sharded run: every data array (a `FederatedData` holds `[C, ...]`
    arrays only) and the state's `Rows` sharded over `axis`; the rest of the state
    replicated."""
    c = data.num_clients
    state = place(state, mesh, c, axis=axis)
    return state, place(data, mesh, c, all_rows=True, axis=axis)


def process_rows(num_clients: int, mesh: Mesh, axis: str = CLIENT_AXIS) -> tuple[int, int]:
    """`[start, stop)` of the client rows stored on this process's devices (the mesh's
    devices are taken in order, so a process owns one contiguous block)."""
    shards = mesh.shape[axis]
    if num_clients % shards:
        raise ValueError(
            f"{num_clients} clients cannot be split evenly over {shards} devices; choose a "
            "multiple of the device count"
        )
    per = num_clients // shards
    mine = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]
    start, stop = min(mine) * per, (max(mine) + 1) * per
    if stop - start != len(mine) * per:
        raise ValueError("this process's devices are not contiguous on the mesh")
    return start, stop


def local_rows(
    tree: Any, mesh: Mesh, num_clients: int, *, all_rows: bool = False, axis: str = CLIENT_AXIS
) -> Any:
    """This process's rows of every per-client leaf (inside a `Rows`, or every leaf with
    `all_rows`); other leaves unchanged."""
    start, stop = process_rows(num_clients, mesh, axis)

    def take(x: Any, per_client: bool) -> Any:
        if not per_client:
            return x
        _check_row(x, num_clients)
        return x[start:stop]

    return _by_rows(take, tree, all_rows)


def globalize(
    local: Any, mesh: Mesh, num_clients: int, *, all_rows: bool = False, axis: str = CLIENT_AXIS
) -> Any:
    """Global arrays from each process's rows: the per-client leaves (inside a `Rows`, or
    every leaf with `all_rows`; this process's rows of them) become `[num_clients, ...]`
    arrays sharded over `axis`; other leaves are replicated (every process must pass the same
    values for them)."""
    start, stop = process_rows(num_clients, mesh, axis)

    def make(x: Any, per_client: bool) -> jax.Array:
        x = np.asarray(x)
        if not per_client:
            return jax.make_array_from_process_local_data(NamedSharding(mesh, P()), x, x.shape)
        _check_row(x, stop - start)
        sharding = NamedSharding(mesh, P(axis))
        return jax.make_array_from_process_local_data(sharding, x, (num_clients, *x.shape[1:]))

    return _by_rows(make, local, all_rows)


def fetch(tree: Any) -> Any:
    """Host NumPy values of (possibly multi-process) arrays, identical on every process."""
    from jax.experimental import multihost_utils

    def get(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(get, tree)
