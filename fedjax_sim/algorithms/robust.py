"""Byzantine-robust aggregators over the cohort axis (`Aggregator(stacked=True)`).

- `median()`: coordinate-wise median (Yin, Chen, Ramchandran, Bartlett, "Byzantine-Robust
  Distributed Learning: Towards Optimal Statistical Rates", ICML 2018).
- `trimmed_mean(beta)`: coordinate-wise beta-trimmed mean (Yin et al. 2018).
- `krum(f)` / `multi_krum(f, m)`: Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning
  with Adversaries: Byzantine Tolerant Gradient Descent" (NeurIPS 2017).
- `geometric_median(iters, nu)`: RFA's smoothed Weiszfeld (Pillutla, Kakade, Harchaoui,
  "Robust Aggregation for Federated Learning", IEEE TSP 2022, Algorithm 2).
- `centered_clip(tau, iters)`: Karimireddy, He, Jaggi, "Learning from History for Byzantine
  Robust Optimization" (ICML 2021), centred at the previous round's aggregate.

`reduce` receives the sent updates stacked `[M, ...]` (a pytree) and the cohort weights
`[M]`. Only rows with weight > 0 count (Bernoulli cohorts pad the buffer with weight-0
slots): the statistics are computed with masks, so everything is jittable with a traced
number of participants n. Median, trimmed mean, Krum and centered clipping treat the
participants equally (the Byzantine literature's rules; the weights' magnitudes are ignored);
the geometric median uses the weights as RFA's alpha_i. With no participant the update is 0.

Memory. Every robust aggregator needs the `[M, d]` sent updates (4 M d bytes in float32;
`compose` stacks them instead of fusing the sum). On top of that: median / trimmed mean
sort a copy (`[M, d]`, or `[M, chunk]` with `chunk=`: they are coordinate-wise, so the sort
runs over column blocks under `lax.map`); Krum needs the `[M, M]` distance matrix (Gram
matrix, O(M^2 d) flops); the geometric median and centered clipping `[M]` distances per
iteration and one `[M, d]` temporary. Everything works leaf by leaf (no flattened copy).

Composes with compression (`compressed(Q, median())`: each client sends Q(Delta_i), the
server takes the median of the decoded updates) and with any server optimizer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.aggregators import Aggregator
from fedjax_sim.core.checks import check_number, positive


def _valid(weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    valid = weights > 0
    return valid, jnp.sum(valid)


def _columns(fn, x: jax.Array, chunk: int | None) -> jax.Array:
    """`fn([M, n]) -> [n]` on `x [M, ...]` (flattened to `[M, n]`), over column blocks of
    `chunk` under `lax.map` (bounded temporaries) or all at once."""
    m = x.shape[0]
    flat = x.reshape(m, -1)
    n = flat.shape[1]
    if chunk is None or chunk >= n:
        return fn(flat).reshape(x.shape[1:])
    blocks = -(-n // chunk)
    padded = jnp.pad(flat, ((0, 0), (0, blocks * chunk - n)))
    out = jax.lax.map(
        lambda b: fn(jax.lax.dynamic_slice_in_dim(padded, b * chunk, chunk, axis=1)),
        jnp.arange(blocks),
    )
    return out.reshape(-1)[:n].reshape(x.shape[1:])


def _sorted_valid(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Sorts `[M, n]` along the cohort with invalid rows at +inf (they end up last)."""
    return jnp.sort(jnp.where(valid[:, None], x.astype(jnp.float32), jnp.inf), axis=0)


def coordinate_median(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Median over the valid rows of `x [M, n]` -> `[n]` (mean of the two middle values for
    an even count; 0 with no valid row)."""
    n = jnp.sum(valid)
    s = _sorted_valid(x, valid)
    lo = jnp.take(s, jnp.maximum(n - 1, 0) // 2, axis=0)
    hi = jnp.take(s, n // 2, axis=0, mode="clip")
    return jnp.where(n > 0, 0.5 * (lo + hi), 0.0)


def coordinate_trimmed_mean(x: jax.Array, valid: jax.Array, beta: float) -> jax.Array:
    """Mean over the valid rows of `x [M, n]` after dropping the k = floor(beta n) smallest
    and largest values of each coordinate -> `[n]`."""
    n = jnp.sum(valid)
    k = jnp.floor(beta * n).astype(n.dtype)
    s = _sorted_valid(x, valid)
    j = jnp.arange(x.shape[0])[:, None]
    keep = (j >= k) & (j < n - k)
    total = jnp.sum(jnp.where(keep, s, 0.0), axis=0)
    return jnp.where(n > 0, total / jnp.maximum(n - 2 * k, 1), 0.0)


def _coordinatewise(fn, chunk: int | None) -> Aggregator:
    def reduce(server, total, weight, stacked, cohort, key):
        weights = cohort.weights
        valid, _ = _valid(weights)
        update = jax.tree.map(
            lambda x: _columns(lambda c: fn(c, valid), x, chunk).astype(x.dtype), stacked
        )
        return update, server, {}

    return _stacked(reduce)


def _stacked(reduce, init=None) -> Aggregator:
    return Aggregator(
        init=init or (lambda params, num_clients: (None, {})),
        encode=lambda update, rows, key, server: (update, rows),
        reduce=reduce,
        stacked=True,
    )


def _check_chunk(chunk: int | None) -> None:
    if chunk is not None and not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"chunk must be an int >= 1 or None, got {chunk!r}")


def median(*, chunk: int | None = None) -> Aggregator:
    """Coordinate-wise median of the participants' updates (Yin et al. 2018); `chunk`
    coordinates are sorted at a time (None: all)."""
    _check_chunk(chunk)
    return _coordinatewise(coordinate_median, chunk)


def trimmed_mean(beta: float = 0.1, *, chunk: int | None = None) -> Aggregator:
    """Coordinate-wise beta-trimmed mean (Yin et al. 2018): per coordinate, drop the
    floor(beta n) smallest and largest of the n participants' values, average the rest;
    0 <= beta < 1/2."""
    check_number("trimmed mean beta", beta, lambda v: 0 <= v < 0.5, "in [0, 0.5)")
    _check_chunk(chunk)
    return _coordinatewise(lambda c, v: coordinate_trimmed_mean(c, v, beta), chunk)


# ------------------------------------------------------------------------------ distances
def _gram(stacked: Any) -> jax.Array:
    """`[M, M]` Gram matrix `<z_i, z_j>` summed over the leaves."""
    return sum(
        (lambda f: f @ f.T)(x.reshape(x.shape[0], -1).astype(jnp.float32))
        for x in jax.tree.leaves(stacked)
    )


def pairwise_sq_distances(stacked: Any) -> jax.Array:
    """`[M, M]` squared distances `||z_i - z_j||^2` of the stacked updates."""
    g = _gram(stacked)
    sq = jnp.diag(g)
    return jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * g, 0.0)


def krum_scores(d2: jax.Array, valid: jax.Array, f: int) -> jax.Array:
    """Krum scores `[M]`: the sum of a valid update's n - f - 2 smallest squared distances to
    the other valid updates (at least 1 neighbour); +inf for invalid rows."""
    m = d2.shape[0]
    n = jnp.sum(valid)
    pair = valid[:, None] & valid[None, :] & ~jnp.eye(m, dtype=bool)
    s = jnp.sort(jnp.where(pair, d2, jnp.inf), axis=1)
    k = jnp.clip(n - f - 2, 1, jnp.maximum(n - 1, 1))
    near = jnp.arange(m)[None, :] < k
    scores = jnp.sum(jnp.where(near & jnp.isfinite(s), s, 0.0), axis=1)
    return jnp.where(valid, scores, jnp.inf)


def multi_krum(f: int = 1, m: int = 1) -> Aggregator:
    """Multi-Krum (Blanchard et al. 2017): the mean of the `m` participants with the lowest
    Krum scores (ties: the lower cohort position); `m = 1` is Krum. `f` is the assumed number
    of Byzantine clients (Krum's guarantee needs n > 2 f + 2 participants, and m <= n:
    `min_participants`). Metric `krum_selected`: how many updates were averaged."""
    if not (isinstance(f, int) and f >= 0):
        raise ValueError(f"krum f must be an int >= 0, got {f!r}")
    if not (isinstance(m, int) and m >= 1):
        raise ValueError(f"multi-krum m must be an int >= 1, got {m!r}")

    def reduce(server, total, weight, stacked, cohort, key):
        weights = cohort.weights
        valid, n = _valid(weights)
        scores = krum_scores(pairwise_sq_distances(stacked), valid, f)
        order = jnp.argsort(scores, stable=True)
        rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
        chosen = valid & (rank < m)
        c = chosen.astype(jnp.float32)
        count = jnp.maximum(jnp.sum(c), 1.0)
        update = jax.tree.map(
            lambda x: (jnp.tensordot(c, x.astype(jnp.float32), axes=1) / count).astype(x.dtype),
            stacked,
        )
        return update, server, {"krum_selected": jnp.sum(c)}

    return _stacked(reduce)


def min_participants(f: int = 1, m: int = 1) -> int:
    """Fewest participants n for which (multi-)Krum with `f` and `m` is defined: n > 2 f + 2
    (Blanchard et al.'s condition) and n >= m."""
    return max(2 * f + 3, m)


def krum(f: int = 1) -> Aggregator:
    """Krum (Blanchard et al. 2017): the participant's update with the lowest score."""
    return multi_krum(f, 1)


def _weighted_mean(stacked: Any, a: jax.Array) -> Any:
    s = jnp.maximum(jnp.sum(a), jnp.finfo(jnp.float32).tiny)
    return jax.tree.map(lambda x: jnp.tensordot(a, x.astype(jnp.float32), axes=1) / s, stacked)


def _sq_distances_to(stacked: Any, v: Any) -> jax.Array:
    return sum(
        jnp.sum(jnp.square(x.astype(jnp.float32) - c[None]).reshape(x.shape[0], -1), axis=1)
        for x, c in zip(jax.tree.leaves(stacked), jax.tree.leaves(v), strict=True)
    )


def geometric_median(iters: int = 10, nu: float = 1e-6) -> Aggregator:
    """RFA (Pillutla et al. 2022, Alg. 2): `iters` smoothed Weiszfeld steps from the weighted
    mean, `v <- sum_i beta_i z_i / sum_i beta_i` with `beta_i = alpha_i / max(nu, ||v -
    z_i||)`, alpha_i the cohort weights (0 for padding). Metric `gm_objective`: the weighted
    sum of distances at the result."""
    if not (isinstance(iters, int) and iters >= 1):
        raise ValueError(f"geometric median iters must be an int >= 1, got {iters!r}")
    positive("geometric median nu", nu)

    def reduce(server, total, weight, stacked, cohort, key):
        weights = cohort.weights
        a = jnp.where(weights > 0, weights, 0.0).astype(jnp.float32)

        def body(_, v):
            d = jnp.sqrt(_sq_distances_to(stacked, v))
            return _weighted_mean(stacked, a / jnp.maximum(nu, d))

        v = jax.lax.fori_loop(0, iters, body, _weighted_mean(stacked, a))
        obj = jnp.sum(a * jnp.sqrt(_sq_distances_to(stacked, v))) / jnp.maximum(jnp.sum(a), 1e-30)
        dtypes = jax.tree.map(lambda x: x.dtype, stacked)
        update = jax.tree.map(lambda u, dt: u.astype(dt), v, dtypes)
        return update, server, {"gm_objective": obj}

    return _stacked(reduce)


def centered_clip(tau: float = 1.0, iters: int = 1) -> Aggregator:
    """Centered clipping (Karimireddy et al. 2021): from the previous round's aggregate v
    (server state, 0 at first), `iters` times `v <- v + (1/n) sum_i (z_i - v) min(1, tau /
    ||z_i - v||)` over the n participants."""
    positive("centered clipping tau", tau)
    if not (isinstance(iters, int) and iters >= 1):
        raise ValueError(f"centered clipping iters must be an int >= 1, got {iters!r}")

    def init(params, num_clients):
        return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params), {}

    def reduce(server, total, weight, stacked, cohort, key):
        weights = cohort.weights
        valid, n = _valid(weights)
        c = valid.astype(jnp.float32)

        def body(_, v):
            d = jnp.sqrt(_sq_distances_to(stacked, v))
            s = c * jnp.minimum(1.0, tau / jnp.maximum(d, jnp.finfo(jnp.float32).tiny))
            return jax.tree.map(
                lambda x, vv: (
                    vv
                    + jnp.tensordot(s, x.astype(jnp.float32) - vv[None], axes=1) / jnp.maximum(n, 1)
                ),
                stacked,
                v,
            )

        v = jax.lax.fori_loop(0, iters, body, server)
        v = jax.tree.map(lambda u, old: jnp.where(n > 0, u, old), v, server)
        dtypes = jax.tree.map(lambda x: x.dtype, stacked)
        return jax.tree.map(lambda u, dt: u.astype(dt), v, dtypes), v, {}

    return _stacked(reduce, init)


ROBUST = {
    "median": median,
    "trimmed_mean": trimmed_mean,
    "krum": krum,
    "multi_krum": multi_krum,
    "geometric_median": geometric_median,
    "centered_clip": centered_clip,
}
"""Robust aggregators by name (the CLI's `--aggregator`)."""

__all__ = [*ROBUST, "coordinate_median", "coordinate_trimmed_mean", "krum_scores"]
