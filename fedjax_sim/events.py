"""Participation models: which clients take part in a round.

Synchronous cohorts (this module's foundation part):
- full participation: every client, in id order;
- `uniform`: M of C without replacement (Gumbel top-k over equal logits, O(C) per round);
- `proportional`: M draws with replacement, P(client i) proportional to n_i (Li et al. 2020's
  scheme I; pair it with uniform aggregation weights for an unbiased average).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SAMPLINGS = ("uniform", "proportional")


def sample_cohort(
    key: jax.Array,
    num_clients: int,
    size: int | None,
    *,
    sampling: str = "uniform",
    counts: jax.Array | None = None,
) -> jax.Array:
    """Client ids of one round's cohort, `[M]` int32 (`M = num_clients` when `size` is None)."""
    if size is None or (size == num_clients and sampling == "uniform"):
        return jnp.arange(num_clients, dtype=jnp.int32)
    if not 1 <= size <= num_clients:
        raise ValueError(f"cohort size must be in [1, {num_clients}], got {size}")
    if sampling == "uniform":
        _, idx = jax.lax.top_k(jax.random.uniform(key, (num_clients,)), size)
        return idx.astype(jnp.int32)
    if sampling == "proportional":
        if counts is None:
            raise ValueError("proportional sampling needs client counts")
        logits = jnp.log(counts.astype(jnp.float32))  # empty clients: -inf, never drawn
        return jax.random.categorical(key, logits, shape=(size,)).astype(jnp.int32)
    raise ValueError(f"unknown cohort sampling {sampling!r}; choose from {SAMPLINGS}")
