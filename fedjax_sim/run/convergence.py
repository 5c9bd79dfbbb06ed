"""Paper-table metrics: pooled accuracy over clients, rounds to a target, speed-up.

As reported by Buttaci & Calafiore (FedLPS; spec docs/specs/fedlps_local_perturbation.md,
section 4): (i) test accuracy `sum_i (N_i / N) acc_i(w)` over the unseen test clients, which is
the pooled accuracy over all their examples; (ii) rounds to converge, the first round t
(counted after aggregation, round 1 = after the first) with accuracy `>= c`; (iii) speed-up
`rounds(reference) / rounds(method)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.models.base import Model
from fedjax_sim.run.evaluation import client_stats
from fedjax_sim.runtime.parallel import ClientMap


def pooled_accuracy(
    model: Model,
    params: Any,
    x: jax.Array,
    y: jax.Array,
    counts: jax.Array,
    client_map: ClientMap = ClientMap(),
) -> tuple[jax.Array, jax.Array]:
    """`(pooled accuracy, per-client accuracy [C])` of `params` on padded clients
    `x [C, N_max, ...]`; pooled = `sum_i (N_i / N) acc_i` (clients without data: acc 0, weight
    0)."""
    stats = client_stats(model, params, x, y, counts, client_map)
    per_client = stats["correct"] / jnp.maximum(stats["count"], 1.0)
    pooled = jnp.sum(stats["correct"]) / jnp.maximum(jnp.sum(stats["count"]), 1.0)
    return pooled, per_client


def rounds_to_target(
    rounds: Sequence[int] | np.ndarray, values: Sequence[float] | np.ndarray, target: float
) -> int | None:
    """First round whose value is `>= target` (None if never reached); `rounds` ascending."""
    rounds, values = np.asarray(rounds), np.asarray(values, np.float64)
    if rounds.shape != values.shape or rounds.ndim != 1:
        raise ValueError(
            f"rounds and values must be equal-length 1-D, got {rounds.shape}, {values.shape}"
        )
    if rounds.size > 1 and np.any(np.diff(rounds) <= 0):
        raise ValueError("rounds must be strictly increasing")
    hit = np.flatnonzero(values >= target)
    return int(rounds[hit[0]]) if hit.size else None


def speedup(reference_rounds: int | None, rounds: int | None) -> float | None:
    """`reference_rounds / rounds` (None when either did not reach the target)."""
    if reference_rounds is None or rounds is None:
        return None
    if rounds <= 0 or reference_rounds <= 0:
        raise ValueError(f"rounds must be >= 1, got {reference_rounds}, {rounds}")
    return reference_rounds / rounds
