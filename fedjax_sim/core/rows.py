"""Per-client state rows: the one type that declares them, and the one pair of functions that
reads and writes them.

`Rows(value)` marks `value`, a pytree of `[C, ...]` arrays, as per-client state: row i is
client i's (hook rows such as SCAFFOLD's control variates, aggregator memories, asynchronous
read models and rule memories). Everything that treats per-client state differently finds it
by this type, never by a shape: `runtime.distributed` shards exactly the `Rows` leaves over
the clients axis (a model parameter whose first dimension happens to equal C stays
replicated), and `simulate_streamed(state_rows="host")` keeps them in a host store. While it
does, a chunk of rounds sees them as streamed tables `Rows(value, slot_ids, C)`: `[U, ...]`
rows of the clients `slot_ids [U]` only, addressed by real client id.

`gather_rows(tree, ids)` and `scatter_rows(tree, ids, active, values)` are the only row
functions: every leaf of `tree` is a `[C, ...]` array (row i is client i) or a `Rows`; all are
read and written through the same code (a `Rows` maps a client id to its table position
first).

Ids may be padding ids C (an event iteration's empty slots, a Bernoulli cohort's buffer):
a read of id C returns row C - 1 (the caller masks it), a write of an inactive slot is dropped.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = Any


@jax.tree_util.register_pytree_with_keys_class
class Rows:
    """Per-client state: a pytree `value` of arrays whose leading axis is the clients'.

    `Rows(value)`: all C clients, `value`'s leaves `[C, ...]` (C = `num_clients`, checked).
    `Rows(value, slot_ids, num_clients)`: a streamed table, `value`'s leaves `[U, ...]` for the
    clients `slot_ids [U]` (int32, sorted, distinct); padding ids C read client C - 1's row;
    every id an algorithm reads must be in `slot_ids` (the streamed driver gathers the union
    of a chunk's cohorts).

    The constructor checks the shapes (every leaf has the same leading dimension, C for
    all clients, that of `slot_ids` for a table); tree maps rebuild a `Rows` around any
    leaves (masks, shardings) without checks. `rows[k]` reads `value[k]` (so that
    `state.rows["control_variates"]["w"]` is the `[C, d]` array)."""

    __slots__ = ("value", "slot_ids", "num_clients")

    def __init__(self, value: Any, slot_ids: Array = None, num_clients: int | None = None):
        lead = {np.shape(a)[:1] for a in jax.tree.leaves(value)}
        if len(lead) > 1 or () in lead:
            shapes = [np.shape(a) for a in jax.tree.leaves(value)]
            raise ValueError(f"per-client rows need one leading (clients) axis, got {shapes}")
        n = next(iter(lead))[0] if lead else None
        if slot_ids is None:
            if num_clients is None:
                num_clients = n
            elif n is not None and n != num_clients:
                raise ValueError(f"per-client rows have {n} rows, not num_clients={num_clients}")
        elif n is not None and np.shape(slot_ids) != (n,):
            raise ValueError(f"a rows table of {n} rows has slot ids of shape {np.shape(slot_ids)}")
        self.value = value
        self.slot_ids = slot_ids
        self.num_clients = None if num_clients is None else int(num_clients)

    # pytree: children (value, slot_ids), static num_clients; rebuilt without checks
    def tree_flatten_with_keys(self):
        keys = jax.tree_util.GetAttrKey
        children = ((keys("value"), self.value), (keys("slot_ids"), self.slot_ids))
        return children, self.num_clients

    @classmethod
    def tree_unflatten(cls, num_clients, children):
        out = object.__new__(cls)
        out.value, out.slot_ids = children
        out.num_clients = num_clients
        return out

    def __repr__(self) -> str:
        table = "" if self.slot_ids is None else f", slot_ids={self.slot_ids!r}"
        return f"Rows({self.value!r}{table}, num_clients={self.num_clients})"

    def __getitem__(self, key: Any) -> Any:
        return self.value[key]

    # compared as a dataclass (trees of shapes, e.g. a checkpoint's against the state's)
    def __eq__(self, other: Any) -> Any:
        if not isinstance(other, Rows):
            return NotImplemented
        mine = (self.value, self.slot_ids, self.num_clients)
        return mine == (other.value, other.slot_ids, other.num_clients)

    __hash__ = None  # holds arrays, as a flax struct dataclass

    @property
    def streamed(self) -> bool:
        """Whether this is a streamed table (some clients' rows), not all C rows."""
        return self.slot_ids is not None

    def replace(self, value: Any) -> Rows:
        """The same rows (clients, table) holding `value`."""
        return Rows.tree_unflatten(self.num_clients, (value, self.slot_ids))

    def positions(self, ids: Array) -> Array:
        """Positions `[K]` in `value` of client ids `[K]` (a table: ids not in it get a
        neighbour's position)."""
        if self.slot_ids is None:
            return ids
        if self.num_clients is not None:
            ids = jnp.minimum(ids, self.num_clients - 1)
        m = self.slot_ids.shape[0]
        return jnp.minimum(jnp.searchsorted(self.slot_ids, ids), m - 1).astype(jnp.int32)


def is_rows(x: Any) -> bool:
    """Whether `x` is a `Rows` (the `is_leaf` of tree maps over per-client state)."""
    return isinstance(x, Rows)


def row_leaves(tree: Any) -> Any:
    """`tree` with True at the leaves inside a `Rows` and False elsewhere (the per-client
    mask of a state, e.g. for placement)."""
    return jax.tree.map(
        lambda node: jax.tree.map(lambda _: True, node) if is_rows(node) else False,
        tree,
        is_leaf=is_rows,
    )


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
            return a.replace(jax.tree.map(lambda r, x: _put(r, s, active, x), a.value, v))
        return _put(a, ids, active, v)

    return jax.tree.map(put, tree, values, is_leaf=is_rows)


def streamed_rows(tree: Any) -> bool:
    """Whether `tree` holds streamed `Rows` tables (only a chunk's clients on device):
    population statistics over the rows are then not available."""
    return any(is_rows(r) and r.streamed for r in jax.tree.leaves(tree, is_leaf=is_rows))


def check_rows(tree: Any, num_clients: int, what: str) -> None:
    """Raises ValueError if the per-client leaves of `tree` were built for another C."""
    for leaf in jax.tree.leaves(tree, is_leaf=is_rows):
        c = leaf.num_clients if is_rows(leaf) else leaf.shape[0]
        if c != num_clients:
            raise ValueError(
                f"{what} was built for num_clients={c} but the data has "
                f"{num_clients} clients; build the algorithm with num_clients=data.num_clients"
            )
