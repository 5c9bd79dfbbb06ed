"""Per-client state rows `[C, ...]` (or streamed `CohortRows`): gathered for the cohort and
scattered back."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedjax_sim.data.store import is_rows


def gather_rows(rows: Any, ids: jax.Array) -> Any:
    """Cohort rows `rows[ids]` of per-client state `[C, ...]` (or streamed `CohortRows`)."""
    return jax.tree.map(lambda r: r.gather(ids) if is_rows(r) else r[ids], rows, is_leaf=is_rows)


def scatter_rows(rows: Any, ids: jax.Array, keep: jax.Array, new: Any) -> Any:
    """Writes the new cohort rows of clients with `keep [M]` back into `[C, ...]` (or
    streamed `CohortRows`; others keep theirs; a client drawn twice keeps one of its new
    rows)."""

    def write(r, n):
        if is_rows(r):
            return r.scatter(ids, keep, n)
        k = keep.reshape(-1, *([1] * (n.ndim - 1)))
        return r.at[ids].set(jnp.where(k, n, r[ids]))

    return jax.tree.map(write, rows, new, is_leaf=is_rows)


def streamed_rows(rows: Any) -> bool:
    """Whether per-client state is streamed `CohortRows` (only the chunk's clients on
    device): population statistics over the rows are then not available."""
    return any(is_rows(r) for r in jax.tree.leaves(rows, is_leaf=is_rows))


def check_rows(rows: Any, num_clients: int, what: str) -> None:
    for leaf in jax.tree.leaves(rows, is_leaf=is_rows):
        c = leaf.num_clients if is_rows(leaf) else leaf.shape[0]
        if c != num_clients:
            raise ValueError(
                f"{what} was built for num_clients={c} but the data has "
                f"{num_clients} clients; build the algorithm with num_clients=data.num_clients"
            )
