"""Distributors: who takes part in a round, and with which weights (TFF's distributor)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.core import (
    CohortSpec,
    Metrics,
    Params,
)


class DistributorSummary(NamedTuple):
    """The round as the distributor's `finalize` sees it."""

    params: Params  # x_t
    new_params: Params  # x_{t+1}
    update: Params
    ids: jax.Array
    weights: jax.Array
    hook_means: dict[str, Any]  # the hooks' weighted `mean`s, by hook name
    round: jax.Array


class Distributor(NamedTuple):
    """Who takes part in a round (TFF's distributor, with state).

    Attributes:
      init: `num_clients -> state`.
      sample: `(state, key, counts [C], round) -> (ids [M], weights [M])`.
      downloads: `(ids, weights) -> []` number of clients that receive the model.
      finalize: `(state, summary, data, key) -> (state, metrics)` after the round (`key` the
        step's key); its `bytes_up` / `bytes_down` are added to the round's (the
        distributor's own traffic, e.g. DRFA's loss queries).
      distinct: whether the ids of a round are distinct (per-client state needs it).
      uploads: `(ids, weights) -> []` number of clients that train and send (the
        `participants` metric; default those with weight > 0; DRFA's full participation:
        all, lam_i = 0 included).
    """

    init: Callable[[int], Any]
    sample: Callable[[Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
    downloads: Callable[[jax.Array, jax.Array], jax.Array]
    finalize: Callable[..., tuple[Any, Metrics]] = lambda state, summary, data, key: (state, {})
    distinct: bool = True
    uploads: Callable[[jax.Array, jax.Array], jax.Array] = lambda ids, weights: jnp.sum(weights > 0)


def cohort_distributor(spec: CohortSpec) -> Distributor:
    """The stateless `CohortSpec` (uniform / proportional / Bernoulli, weighting) as a
    distributor."""
    return Distributor(
        init=lambda *_: None,
        sample=lambda state, key, counts, round_: spec.sample(key, counts),
        downloads=spec.downloads,
        distinct=spec.sampling != "proportional",
    )


def forced_cohorts(ids: Any, weights: Any = None, *, counts_weighting: bool = True) -> Distributor:
    """Round t's cohort is row `t mod T` of `ids [T, M]` (for controlled experiments); its
    weights are row t of `weights [T, M]`, or the clients' example counts (`counts_weighting`)
    or 1 (clients without data get 0)."""
    ids = jnp.asarray(ids, jnp.int32)
    if ids.ndim != 2:
        raise ValueError(f"forced cohort ids must have shape [T, M], got {ids.shape}")
    if weights is not None:
        weights = jnp.asarray(weights)
        if weights.shape != ids.shape:
            raise ValueError(f"weights must have the shape of ids {ids.shape}, got {weights.shape}")

    def sample(state, key, counts, round_):
        row = ids[round_ % ids.shape[0]]
        n = counts[row].astype(jax.dtypes.canonicalize_dtype(jnp.float64))
        if weights is not None:
            w = jnp.where(n > 0, weights[round_ % ids.shape[0]].astype(n.dtype), 0.0)
        else:
            w = n if counts_weighting else (n > 0).astype(n.dtype)
        return row, w

    distinct = all(len(set(r)) == len(r) for r in ids.tolist())
    return Distributor(
        init=lambda *_: None,
        sample=sample,
        downloads=lambda i, w: jnp.int32(i.shape[0]),
        distinct=distinct,
    )


def as_distributor(cohort: CohortSpec | Distributor) -> Distributor:
    return cohort if isinstance(cohort, Distributor) else cohort_distributor(cohort)
