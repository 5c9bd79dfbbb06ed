"""The cohort sampler: who takes part in a round, each draw written once.

- full participation: every client, in id order;
- `uniform`: M of C without replacement (Gumbel top-k over equal logits, O(C) per round);
- `proportional`: M draws with replacement, P(client i) proportional to n_i (Li et al. 2020's
  scheme I; pair it with uniform aggregation weights for an unbiased average);
- `weighted`: M draws with replacement with given probabilities (DRFA's lambda);
- `bernoulli`: every client independently with probability p (the FedMIM paper's
  "sampling probability of each client being activated"), compacted into a fixed-capacity
  buffer so shapes stay static.

`sample` dispatches on a `CohortSpec`'s sampling; `CohortSpec.sample`, the distributors
(`distributors`, `sfedavg`, `dro_baselines`) and the streaming planner
(`run.streaming.AlgorithmCohorts`, which replays `CohortSpec.sample` ahead of the rounds)
all draw through these functions, so a planned cohort is the sampler's draw bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SAMPLINGS = ("uniform", "proportional", "bernoulli")


def _keep_top_k(idx: jax.Array) -> jax.Array:
    """Optimization barrier on top_k's indices. Without it XLA:CPU may fold the slice of the
    sorted indices into their consumers (the cohort gathers inside `lax.map`), which defeats
    its sort+slice -> TopK rewrite and leaves a full comparator sort of all C scores: a
    FedAvg round at C = 10^5, cohort 100, measured ~100 ms instead of ~15 ms."""
    return jax.lax.optimization_barrier(idx)


def _check_size(size: int, num_clients: int) -> None:
    if not 1 <= size <= num_clients:
        raise ValueError(f"cohort size must be in [1, {num_clients}], got {size}")


def uniform(key: jax.Array, num_clients: int, size: int | None = None) -> jax.Array:
    """`[M]` int32 distinct client ids, uniform without replacement (`size` None or C: all
    clients in id order)."""
    if size is None or size == num_clients:
        return jnp.arange(num_clients, dtype=jnp.int32)
    _check_size(size, num_clients)
    _, idx = jax.lax.top_k(jax.random.uniform(key, (num_clients,)), size)
    return _keep_top_k(idx).astype(jnp.int32)


def proportional(key: jax.Array, counts: jax.Array, size: int) -> jax.Array:
    """`[M]` int32 client ids drawn with replacement, P(i) proportional to `counts [C]`
    (clients without data are never drawn)."""
    _check_size(size, counts.shape[0])
    logits = jnp.log(counts.astype(jnp.float32))  # empty clients: -inf, never drawn
    return jax.random.categorical(key, logits, shape=(size,)).astype(jnp.int32)


def weighted(key: jax.Array, probabilities: jax.Array, size: int) -> jax.Array:
    """`[M]` int32 client ids drawn with replacement with `probabilities [C]` (summing to 1;
    e.g. DRFA's mixing weights lambda)."""
    c = probabilities.shape[0]
    return jax.random.choice(key, c, (size,), p=probabilities).astype(jnp.int32)


def bernoulli(
    key: jax.Array, num_clients: int, probability: float, capacity: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Each client participates independently with `probability`.

    Returns `(ids [capacity] int32, selected [capacity] bool)`: the ids are distinct; the
    selected clients come first (in random order) and the buffer is padded with unselected
    clients (`selected=False`, to be weighted 0). With `capacity=None` the buffer holds all
    clients (exact, but every client is computed); with a smaller capacity, selected clients
    beyond it are dropped uniformly at random (choose it a few standard deviations above
    `p * num_clients`). The round may be empty (no client selected).
    """
    if not 0.0 < probability <= 1.0:
        raise ValueError(f"participation probability must be in (0, 1], got {probability}")
    cap = num_clients if capacity is None else capacity
    if not 1 <= cap <= num_clients:
        raise ValueError(f"cohort capacity must be in [1, {num_clients}], got {cap}")
    k_draw, k_order = jax.random.split(key)
    selected = jax.random.uniform(k_draw, (num_clients,)) < probability
    if cap == num_clients:
        return jnp.arange(num_clients, dtype=jnp.int32), selected
    score = selected.astype(jnp.float32) + jax.random.uniform(k_order, (num_clients,))
    _, idx = jax.lax.top_k(score, cap)
    idx = _keep_top_k(idx)
    return idx.astype(jnp.int32), selected[idx]


def sample(
    key: jax.Array,
    num_clients: int,
    size: int | None,
    sampling: str = "uniform",
    *,
    counts: jax.Array | None = None,
    probability: float | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """`(ids [M] int32, selected [M] bool or None)` of one round's cohort by `sampling`
    (`M = num_clients` when `size` is None; `selected` only for "bernoulli", whose `size` is
    the buffer's capacity)."""
    if sampling == "bernoulli":
        return bernoulli(key, num_clients, probability, size)
    if sampling == "uniform":
        return uniform(key, num_clients, size), None
    if sampling == "proportional":
        if size is None:
            return jnp.arange(num_clients, dtype=jnp.int32), None
        if counts is None:
            raise ValueError("proportional sampling needs client counts")
        return proportional(key, counts, size), None
    raise ValueError(f"unknown cohort sampling {sampling!r}; choose from {SAMPLINGS}")
