"""Partitioners that run in JAX on device and scale to 10^6 clients over 10^7 examples.

Same splits as `fedjax_sim.data.partition` (the NumPy reference partitioners) in
distribution, not bit for bit: each function is `(key, labels [N], num_clients, ...) ->
client_ids [N] int32`, jit-compiled with `num_clients` and the hyper-parameters static. Every
example gets exactly one client by construction (one scatter of a permutation).

No step is O(N x C) and nothing loops over clients or classes. Measured on CPU, XLA's
multi-operand `lax.sort` is ~8x slower than sorting one uint32 array and `jax.random.gamma` /
`loggamma` take ~100 s for 10^7 draws, so:
- random orders (optionally grouped by label) come from ONE uint32 sort of
  `label << b | F(i)`, where F is a keyed Feistel bijection on b-bit integers (6 rounds, a
  murmur3-finaliser round function, keys from the JAX key); the example index is recovered as
  `F^{-1}(low b bits)`. This is a pseudo-random permutation, not an exactly uniform one (fine for
  partitioning; the NumPy partitioners are the exact reference). When the labels do not fit in
  the `32 - b` spare bits it falls back to a (label, random bits, index) `lax.sort`.
- Gamma draws use Marsaglia-Tsang for `Gamma(alpha + 1)` (3 vectorised tries, then a loop
  that redraws only the rejected entries; uniforms from 24 random bits, normals by Box-Muller)
  and the boost `Gamma(alpha) = Gamma(alpha + 1) U^(1/alpha)` in log space, so alpha = 1e-3
  gives valid, nearly one-hot proportions (no 0/0).
- "which client owns sorted position j" is answered for all j at once by counting how many cut
  points are <= j (a scatter-add histogram of the cut points and a cumulative sum).
All index arithmetic stays in int32 (no x64 needed): equal splits use `N = q C + r` instead
of `j * C / N`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

INT32_MAX = 2**31 - 1


def _check(labels: jax.Array, num_clients: int, *, min_per_client: int) -> int:
    n = int(labels.shape[0]) if labels.ndim == 1 else -1
    if n < 0:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if n == 0:
        raise ValueError("cannot partition an empty dataset (0 examples)")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if min_per_client * num_clients > n:
        raise ValueError(
            f"{num_clients} clients x at least {min_per_client} example(s) each needs "
            f"{min_per_client * num_clients} examples, got {n}"
        )
    return n


def _class_count(labels: jax.Array, num_classes: int | None, who: str) -> int:
    """Checks integer labels in [0, num_classes) (default max + 1) and returns num_classes."""
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"{who} needs integer class labels, got dtype {labels.dtype}")
    lo, hi = int(labels.min()), int(labels.max())
    num_classes = hi + 1 if num_classes is None else int(num_classes)
    if lo < 0 or hi >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got min {lo}, max {hi}")
    return num_classes


def _even_owner(pos: jax.Array, n: int, parts: int) -> jax.Array:
    """Owner of position `pos` in [0, n) when n positions are cut into `parts` contiguous runs
    whose sizes differ by at most one (the first `n % parts` runs are one longer)."""
    q, r = divmod(n, parts)
    big = r * (q + 1)
    return jnp.where(pos < big, pos // (q + 1), r + (pos - big) // max(q, 1)).astype(jnp.int32)


def _owner_from_cuts(cuts: jax.Array, n: int) -> jax.Array:
    """`owner[j] = #{k : cuts[k] <= j}` for j in [0, n) (== searchsorted(cuts, j, 'right')
    for sorted cuts), via a histogram of the cut points and a cumulative sum: O(n + len(cuts))."""
    hist = jnp.zeros(n, jnp.int32).at[cuts].add(1, mode="drop")  # cuts >= n are dropped
    return jnp.cumsum(hist, dtype=jnp.int32)


FEISTEL_ROUNDS = 6


def _mix32(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser (a bijective avalanche mix)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _feistel(x: jax.Array, round_keys: jax.Array, half: int, inverse: bool) -> jax.Array:
    """Keyed bijection on [0, 2^(2 half)) (balanced Feistel network) or its inverse."""
    mask = jnp.uint32((1 << half) - 1)
    left, right = x >> half, x & mask
    keys = round_keys[::-1] if inverse else round_keys
    for r in range(FEISTEL_ROUNDS):  # unrolled, a handful of elementwise ops
        if inverse:
            left, right = right ^ (_mix32(left ^ keys[r]) & mask), left
        else:
            left, right = right, left ^ (_mix32(right ^ keys[r]) & mask)
    return (left << half) | right


def _index_bits(n: int) -> int:
    """Even number of bits b >= 2 with n <= 2^b."""
    b = max(1, (n - 1).bit_length())
    return b + (b % 2)


def _random_order(key: jax.Array, n: int, labels: jax.Array | None = None, num_labels: int = 1):
    """A pseudo-random permutation `order [n]` of [0, n); with labels, grouped by ascending
    label (random order inside each label). Returns `(order, labels[order] or None)`."""
    b = _index_bits(n)
    label_bits = 32 - b
    if labels is not None and num_labels > (1 << label_bits):
        k_bits = jax.random.bits(key, (n,), jnp.uint32)  # fallback: slower multi-operand sort
        sorted_labels, _, order = jax.lax.sort(
            (labels.astype(jnp.int32), k_bits, jnp.arange(n, dtype=jnp.int32)), num_keys=2
        )
        return order, sorted_labels
    round_keys = jax.random.bits(key, (FEISTEL_ROUNDS,), jnp.uint32)
    code = _feistel(jnp.arange(n, dtype=jnp.uint32), round_keys, b // 2, inverse=False)
    if labels is not None and b < 32:
        code = code | (labels.astype(jnp.uint32) << b)
    code = jax.lax.sort(code)
    low = code & jnp.uint32((1 << b) - 1) if b < 32 else code
    order = _feistel(low, round_keys, b // 2, inverse=True).astype(jnp.int32)
    sorted_labels = None if labels is None else (code >> b).astype(jnp.int32)
    return order, sorted_labels


def _uniform_normal(key: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """`(u, z)`: U(0, 1] and N(0, 1) draws (Box-Muller) from one call for random bits."""
    bits = jax.random.bits(key, (3, *shape), jnp.uint32)
    u = ((bits >> 8).astype(jnp.float32) + 1.0) * (1.0 / (1 << 24))  # (0, 1]
    u1, u2, u3 = u[0], u[1], u[2]
    z = jnp.sqrt(-2.0 * jnp.log(u1)) * jnp.cos((2.0 * np.pi) * u2)
    return u3, z


def _log_gamma(key: jax.Array, alpha: jax.Array | float, shape: tuple[int, ...], tries: int = 3):
    """`log Gamma(alpha, 1)` draws: Marsaglia-Tsang for Gamma(alpha + 1) plus the boost
    `log U / alpha`. Entries rejected by all `tries` vectorised attempts are redrawn in a loop
    over a compacted buffer, so every draw is exact."""
    d = alpha + 1.0 - 1.0 / 3.0
    c = 1.0 / jnp.sqrt(9.0 * d)
    size = int(np.prod(shape))

    def attempt(k, shape):  # (log value, accepted)
        u, z = _uniform_normal(k, shape)
        v = (1.0 + c * z) ** 3
        log_v = jnp.log(jnp.where(v > 0, v, 1.0))
        ok = (v > 0) & (jnp.log(u) < 0.5 * z * z + d - d * v + d * log_v)
        return jnp.log(d) + log_v, ok

    k_first, k_loop, k_boost = jax.random.split(key, 3)
    values, oks = attempt(k_first, (tries, size))
    first = jnp.argmax(oks, axis=0)  # first accepted try (0 if none)
    value = jnp.take_along_axis(values, first[None], axis=0)[0]
    done = jnp.any(oks, axis=0)
    buffer = min(size, 1024 + size // 256)

    def redraw(carry):
        value, done, k = carry
        k, k_try = jax.random.split(k)
        (idx,) = jnp.nonzero(~done, size=buffer, fill_value=size)
        new, ok = attempt(k_try, (buffer,))
        value = value.at[idx].set(new, mode="drop")
        done = done.at[idx].set(ok, mode="drop")
        return value, done, k

    value, _, _ = jax.lax.while_loop(lambda c: ~jnp.all(c[1]), redraw, (value, done, k_loop))
    log_u = jnp.log(_uniform_normal(k_boost, (size,))[0])
    return (value + log_u / alpha).reshape(shape)


def _scatter(order: jax.Array, values: jax.Array) -> jax.Array:
    """`ids[order[j]] = values[j]`."""
    return jnp.zeros(order.shape[0], jnp.int32).at[order].set(values, unique_indices=True)


def _cumulative_cuts(probs: jax.Array, total: jax.Array) -> jax.Array:
    """Integer cut points `round(cumsum(p) * total)` along the last axis, monotone, the last one
    exactly `total` (so the pieces tile [0, total) whatever the float32 rounding)."""
    cuts = jnp.round(jnp.cumsum(probs, axis=-1) * total[..., None]).astype(jnp.int32)
    cuts = jnp.minimum(jax.lax.cummax(cuts, axis=cuts.ndim - 1), total[..., None])
    return cuts.at[..., -1].set(total)


@partial(jax.jit, static_argnums=(2,))
def _iid(key, labels, num_clients):
    n = labels.shape[0]
    order, _ = _random_order(key, n)
    return _scatter(order, _even_owner(jnp.arange(n, dtype=jnp.int32), n, num_clients))


def iid(key: jax.Array, labels: jax.Array, num_clients: int) -> jax.Array:
    """Uniformly random split into equal sizes (+-1). Needs N >= C (no empty clients)."""
    labels = jnp.asarray(labels)
    _check(labels, num_clients, min_per_client=1)
    return _iid(key, labels, num_clients)


@partial(jax.jit, static_argnums=(2, 3))
def _dirichlet(key, labels, num_clients, num_classes, alpha):
    n = labels.shape[0]
    k_props, k_order = jax.random.split(key)
    # Dir(alpha 1_C) per class from log-Gamma draws: no underflow to 0/0 for tiny alpha.
    log_g = _log_gamma(k_props, alpha, (num_classes, num_clients))  # [K, C]
    probs = jax.nn.softmax(log_g, axis=-1)
    order, sorted_labels = _random_order(k_order, n, labels, num_classes)
    class_sizes = jnp.zeros(num_classes, jnp.int32).at[labels].add(1)  # [K]
    starts = jnp.cumsum(class_sizes) - class_sizes
    # global cut points: class c's examples occupy sorted positions [starts[c], starts[c] + n_c)
    cuts = starts[:, None] + _cumulative_cuts(probs, class_sizes)  # [K, C]
    below = _owner_from_cuts(cuts.reshape(-1), n)  # = c * C + (client within class c)
    owner = jnp.minimum(below - sorted_labels * num_clients, num_clients - 1)
    return _scatter(order, owner)


def dirichlet(
    key: jax.Array,
    labels: jax.Array,
    num_clients: int,
    *,
    alpha: float = 0.5,
    num_classes: int | None = None,
) -> jax.Array:
    """Label skew: class c's examples are spread over clients with proportions
    `q_c ~ Dir(alpha 1_C)` (cut at `round(cumsum(q_c) n_c)`). Clients may be empty.

    `labels` must be integers in `[0, num_classes)` (`num_classes` defaults to max + 1)."""
    labels = jnp.asarray(labels)
    _check(labels, num_clients, min_per_client=0)
    if not 0 < alpha < float("inf"):
        raise ValueError(f"Dirichlet alpha must be finite and > 0, got {alpha}")
    num_classes = _class_count(labels, num_classes, "dirichlet")
    if num_classes * num_clients > INT32_MAX:
        raise ValueError(f"{num_classes} classes x {num_clients} clients overflows int32 indices")
    return _dirichlet(key, labels, num_clients, num_classes, float(alpha))


@partial(jax.jit, static_argnums=(2, 3, 4))
def _shards(key, labels, num_clients, per_client, num_classes):
    n = labels.shape[0]
    k_order, k_shards = jax.random.split(key)
    num_shards = num_clients * per_client
    order, _ = _random_order(k_order, n, labels, num_classes)
    shard_of_position = _even_owner(jnp.arange(n, dtype=jnp.int32), n, num_shards)
    shard_perm, _ = _random_order(k_shards, num_shards)
    owner_of_shard = shard_perm // per_client
    return _scatter(order, owner_of_shard[shard_of_position])


def shards(
    key: jax.Array,
    labels: jax.Array,
    num_clients: int,
    *,
    per_client: int = 2,
    num_classes: int | None = None,
) -> jax.Array:
    """McMahan et al. (2017): sort by label, cut into `C * per_client` equal shards, deal
    `per_client` random shards to each client. Needs N >= C * per_client and integer labels
    in `[0, num_classes)`."""
    labels = jnp.asarray(labels)
    if per_client < 1:
        raise ValueError(f"per_client must be >= 1, got {per_client}")
    _check(labels, num_clients, min_per_client=per_client)
    num_classes = _class_count(labels, num_classes, "shards")
    return _shards(key, labels, num_clients, int(per_client), num_classes)


@partial(jax.jit, static_argnums=(2, 3, 4))
def _quantity_skew(key, labels, num_clients, sigma, min_size):
    n = labels.shape[0]
    k_sizes, k_order = jax.random.split(key)
    shares = jax.nn.softmax(sigma * jax.random.normal(k_sizes, (num_clients,)))  # LogNormal(0, s)
    rest = jnp.asarray(n - min_size * num_clients, jnp.int32)
    ends = _cumulative_cuts(shares, rest) + min_size * jnp.arange(1, num_clients + 1)
    owner = _owner_from_cuts(ends, n)
    order, _ = _random_order(k_order, n)
    return _scatter(order, owner)


def quantity_skew(
    key: jax.Array,
    labels: jax.Array,
    num_clients: int,
    *,
    sigma: float = 1.0,
    min_size: int = 1,
) -> jax.Array:
    """Log-normal client sizes `n_i = min_size + round share of LogNormal(0, sigma)` weights;
    examples assigned uniformly at random. Needs N >= C * min_size."""
    labels = jnp.asarray(labels)
    if not 0 <= sigma < float("inf"):
        raise ValueError(f"sigma must be finite and >= 0, got {sigma}")
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {min_size}")
    _check(labels, num_clients, min_per_client=min_size)
    return _quantity_skew(key, labels, num_clients, float(sigma), int(min_size))


DEVICE_PARTITIONERS: dict[str, Callable[..., jax.Array]] = {
    "iid": iid,
    "dirichlet": dirichlet,
    "shards": shards,
    "quantity_skew": quantity_skew,
}


def partition(
    name: str, key: jax.Array, labels: jax.Array, num_clients: int, **kwargs: Any
) -> jax.Array:
    """Dispatches to a registered device partitioner by name."""
    if name not in DEVICE_PARTITIONERS:
        raise ValueError(
            f"unknown device partitioner {name!r}; choose from {sorted(DEVICE_PARTITIONERS)}"
        )
    return DEVICE_PARTITIONERS[name](key, labels, num_clients, **kwargs)


@partial(jax.jit, static_argnums=(1,))
def client_counts(client_ids: jax.Array, num_clients: int) -> jax.Array:
    """`[C]` int32 number of examples of each client."""
    return jnp.zeros(num_clients, jnp.int32).at[client_ids].add(1, mode="drop")


@partial(jax.jit, static_argnums=(1, 2))
def client_index(client_ids: jax.Array, num_clients: int, max_count: int) -> jax.Array:
    """`[C, max_count]` int32 example indices of each client in original order, -1 = padding:
    the device-side layout of `pack` (gather features with `x[jnp.maximum(index, 0)]`)."""
    n = client_ids.shape[0]
    counts = client_counts(client_ids, num_clients)
    sorted_ids, order = jax.lax.sort((client_ids, jnp.arange(n, dtype=jnp.int32)), num_keys=1)
    rows = jnp.arange(n, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[sorted_ids]
    index = jnp.full((num_clients, max_count), -1, jnp.int32)
    return index.at[sorted_ids, rows].set(order, mode="drop")


def padding_waste(counts: np.ndarray | jax.Array, max_count: int | None = None) -> int:
    """Padded rows `sum_i (N_max - n_i)` when every client is padded to `max_count`
    (default: the largest client)."""
    counts = np.asarray(counts, np.int64)
    n_max = int(counts.max()) if max_count is None else int(max_count)
    return int(counts.size * n_max - counts.sum())
