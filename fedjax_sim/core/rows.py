"""Per-client state rows and the one pair of functions that reads and writes them.

`Rows` is a streamed table of per-client rows: a pytree `value` of `[U, ...]` arrays for the
clients `slot_ids [U]`, addressed by real client id (the stand-in for a `[C, ...]` state
leaf while `simulate_streamed(state_rows="host")` keeps the rows on the host).

`gather_rows(tree, ids)` and `scatter_rows(tree, ids, active, values)` are the only row
functions: every leaf of `tree` is a `[C, ...]` array (row i is client i) or a `Rows` table;
both are read and written through the same code (a client id is mapped to its table position
first).

Ids may be padding ids C (an event iteration's empty slots, a Bernoulli cohort's buffer):
a read of id C returns row C - 1 (the caller masks it), a write of an inactive slot is dropped.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

Array = Any


@struct.dataclass
class Rows:
    """Per-client state rows of some clients, addressed by real client ids: the streamed
    stand-in for a `[C, ...]` state leaf (control variates, duals, memories, read models).

    `value` is a pytree of `[U, ...]` arrays for the clients `slot_ids [U]` (int32, sorted,
    distinct), gathered from a host store before a chunk of rounds and scattered back after
    it. `num_clients` C (static; None: unknown) clamps padding ids C to C - 1, as a read of
    a `[C, ...]` array does. Every id an algorithm reads must be in `slot_ids` (the streamed
    driver gathers the union of a chunk's cohorts)."""

    value: Any
    slot_ids: Array
    num_clients: int | None = struct.field(pytree_node=False, default=None)

    def positions(self, ids: Array) -> Array:
        """Table positions `[K]` of client ids `[K]` (ids not in the table: a neighbour's)."""
        if self.num_clients is not None:
            ids = jnp.minimum(ids, self.num_clients - 1)
        m = self.slot_ids.shape[0]
        return jnp.minimum(jnp.searchsorted(self.slot_ids, ids), m - 1).astype(jnp.int32)


def is_rows(x: Any) -> bool:
    """Whether `x` is a `Rows` table (the `is_leaf` of tree maps over per-client state)."""
    return isinstance(x, Rows)


def _take(a: Array, ids: Array) -> Array:
    """`a[ids]` of `a [N, ...]` for positions `[B]` (padding N reads row N - 1), always as a
    gather (for B = 1 the row is gathered twice: a single-row read becomes a dynamic-slice
    that XLA fuses into its consumers, which defeats the in-place update of `_put`)."""
    safe = jnp.minimum(ids, a.shape[0] - 1)
    if ids.shape[0] == 1:
        return a[jnp.concatenate([safe, safe])][:1]
    return a[safe]


def _put(a: Array, ids: Array, active: Array, v: Array) -> Array:
    """`a[ids[b]] = v[b]` for the active slots (padding N and inactive slots dropped), in
    place under jit.

    In-place matters: cost must follow the cohort / firing clients, not C. XLA updates the
    stacked array in place only if every read of it is ordered before the write. Reads of the
    same rows elsewhere in the step (`_take`, merged with this one by CSE) feed other outputs
    and could be scheduled after the write, so XLA would copy the whole `[C, ...]` array every
    step (measured: 2 copies per array per event iteration). Writing `where(active, values,
    old rows)` makes the write depend on the read and removes the copies; one slot is padded
    to two because XLA turns a one-row scatter into an update plus a select over the whole
    array."""
    n = a.shape[0]
    keep = active.reshape((-1,) + (1,) * (a.ndim - 1))
    v = jnp.where(keep, v.astype(a.dtype), _take(a, ids))
    write = jnp.where(active, ids, n)
    if ids.shape[0] == 1:
        write = jnp.concatenate([write, jnp.full((1,), n, write.dtype)])
        v = jnp.concatenate([v, v])
    return a.at[write].set(v, mode="drop")


def gather_rows(tree: Any, ids: Array) -> Any:
    """The rows of clients `ids [B]` (padding id C reads row C - 1) of every leaf of `tree`:
    `[C, ...]` arrays and `Rows` tables; `[B, ...]` leaves in the tree's structure (a `Rows`
    table gives its `value`'s)."""

    def take(a):
        if is_rows(a):
            s = a.positions(ids)
            return jax.tree.map(lambda r: _take(r, s), a.value)
        return _take(a, ids)

    return jax.tree.map(take, tree, is_leaf=is_rows)


def scatter_rows(tree: Any, ids: Array, active: Array, values: Any) -> Any:
    """`tree` with the rows of the clients `ids [B]` replaced by `values [B, ...]` where
    `active [B]` (inactive and padding slots write nothing; a client in two active slots
    keeps one of its new rows). Leaves: `[C, ...]` arrays and `Rows` tables."""

    def put(a, v):
        if is_rows(a):
            s = a.positions(ids)
            return a.replace(value=jax.tree.map(lambda r, x: _put(r, s, active, x), a.value, v))
        return _put(a, ids, active, v)

    return jax.tree.map(put, tree, values, is_leaf=is_rows)


def streamed_rows(tree: Any) -> bool:
    """Whether `tree` holds streamed `Rows` tables (only a chunk's clients on device):
    population statistics over the rows are then not available."""
    return any(is_rows(r) for r in jax.tree.leaves(tree, is_leaf=is_rows))


def check_rows(tree: Any, num_clients: int, what: str) -> None:
    """Raises ValueError if the per-client leaves of `tree` were built for another C."""
    for leaf in jax.tree.leaves(tree, is_leaf=is_rows):
        c = leaf.num_clients if is_rows(leaf) else leaf.shape[0]
        if c != num_clients:
            raise ValueError(
                f"{what} was built for num_clients={c} but the data has "
                f"{num_clients} clients; build the algorithm with num_clients=data.num_clients"
            )
