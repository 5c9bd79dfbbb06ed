"""Compressors of client uploads, their contraction and payload size, and error feedback.

Beikmohammadi, Khirirat, Magnusson, "On the Convergence of Federated Learning Algorithms
without Data Similarity" (IEEE Trans. Big Data 2024), Assumption 3 and Algorithm 2; spec
`docs/specs/stepsizes_no_similarity.md` (sections 2.4, 2.5, 7.7, 7.10).

A compressor `Q` maps a flat vector `v [d]` (all layers of a model update concatenated:
compression is global, not per layer) to `Q(v) [d]` and reports

- `delta(d)`: its contraction, `||Q(v) - v||^2 <= (1 - delta) ||v||^2` (Assumption 3;
  deterministic for top-k and scaled sign, in expectation for random-k and QSGD);
- `payload_bytes(d, itemsize)`: what one client sends (values + indices / signs / norms).

Compressors: `Identity`, `TopK` (exactly k entries, ties broken towards the lower index),
`RandomK` (unscaled: contractive; scaled by d/k: unbiased), `ScaledSign`
(`||v||_1 / d * sign(v)`), `QSGD` (Alistarh et al. 2017, stochastic rounding to `levels`
levels; `scaled=True` divides by `1 + omega`, which makes it contractive). The paper runs only
top-k (1% of the parameters); it cites scaled sign and a ternary quantizer (QSGD with one
level is the l2-normed ternary quantizer; spec 7.7's inf-norm variant is not provided).

Compression of uploads works with every algorithm through the aggregators of
`fedjax_sim.algorithms.compose`: `error_feedback(compressor)` (Algorithm 2: per-client memory
`e [C, ...]`, `u_i = Delta_i + e_i`, send `Q(u_i)`, keep `e_i <- u_i - Q(u_i)`; clients that
do not send keep their memory, spec 7.10) and `compressed(compressor)` (send `Q(Delta_i)`, no
memory: FedPAQ-style, `e = 0`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.flatten_util import ravel_pytree

from fedjax_sim.data.federated import tree_size_bytes

Params = Any
INDEX_BYTES = 4  # int32 index of a kept entry


def _count(name: str, k: int | None, fraction: float | None) -> None:
    if (k is None) == (fraction is None):
        raise ValueError(f"{name}: give exactly one of k and fraction")
    if k is not None and (not isinstance(k, int) or k < 1):
        raise ValueError(f"{name}: k must be an int >= 1, got {k!r}")
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"{name}: fraction must be in (0, 1], got {fraction!r}")


def _kept(k: int | None, fraction: float | None, d: int) -> int:
    """Number of kept entries of a length-d vector: k, or max(1, floor(fraction * d))."""
    n = k if k is not None else max(1, math.floor(fraction * d))
    return min(n, d)


class Compressor(Protocol):
    """`Q(v, key) -> [d]` for a flat `v [d]`, with its contraction and payload."""

    name: str

    def __call__(self, v: jax.Array, key: jax.Array) -> jax.Array: ...

    def delta(self, d: int) -> float: ...

    def payload_bytes(self, d: int, itemsize: int = 4) -> int: ...


@dataclasses.dataclass(frozen=True)
class Identity:
    """`Q(v) = v` (delta = 1): error feedback with it is exactly Algorithm 1."""

    name: str = "identity"

    def __call__(self, v, key=None):
        return v

    def delta(self, d):
        return 1.0

    def payload_bytes(self, d, itemsize=4):
        return d * itemsize


@dataclasses.dataclass(frozen=True)
class TopK:
    """Keeps exactly the k largest-magnitude entries (`lax.top_k`: among equal magnitudes the
    lower index wins), zeros the rest. delta = k/d; sends k values + k int32 indices.
    `fraction` keeps `max(1, floor(fraction d))` entries (paper: 1% of 431,080 = 4310)."""

    k: int | None = None
    fraction: float | None = None
    name: str = "top_k"

    def __post_init__(self):
        _count("top_k", self.k, self.fraction)

    def num_kept(self, d: int) -> int:
        return _kept(self.k, self.fraction, d)

    def __call__(self, v, key=None):
        _, idx = lax.top_k(jnp.abs(v), self.num_kept(v.shape[0]))
        return jnp.zeros_like(v).at[idx].set(v[idx])

    def delta(self, d):
        return self.num_kept(d) / d

    def payload_bytes(self, d, itemsize=4):
        return self.num_kept(d) * (itemsize + INDEX_BYTES)


@dataclasses.dataclass(frozen=True)
class RandomK:
    """Keeps k uniformly random entries (without replacement).

    Unscaled: contractive in expectation, `E||Q(v)-v||^2 = (1 - k/d)||v||^2`, delta = k/d.
    Scaled (`scaled=True`, times d/k): unbiased with variance factor `omega = d/k - 1`, not
    contractive for k < d/2; `delta` reports k/d, the contraction of its rescaling
    `Q / (1 + omega)`, which is the unscaled compressor. Sends k values + k indices."""

    k: int | None = None
    fraction: float | None = None
    scaled: bool = False
    name: str = "random_k"

    def __post_init__(self):
        _count("random_k", self.k, self.fraction)

    def num_kept(self, d: int) -> int:
        return _kept(self.k, self.fraction, d)

    def __call__(self, v, key):
        d = v.shape[0]
        k = self.num_kept(d)
        _, idx = lax.top_k(jax.random.uniform(key, (d,)), k)
        scale = d / k if self.scaled else 1.0
        return jnp.zeros_like(v).at[idx].set(v[idx] * scale)

    def delta(self, d):
        return self.num_kept(d) / d

    def omega(self, d: int) -> float:
        """Variance factor of the scaled (unbiased) version."""
        return d / self.num_kept(d) - 1.0

    def payload_bytes(self, d, itemsize=4):
        return self.num_kept(d) * (itemsize + INDEX_BYTES)


@dataclasses.dataclass(frozen=True)
class ScaledSign:
    """`Q(v) = (||v||_1 / d) sign(v)` (Karimireddy et al. 2019): `||Q(v)-v||^2 = ||v||^2 -
    ||v||_1^2 / d <= (1 - 1/d)||v||^2`, delta = 1/d. Sends d sign bits + one scale."""

    name: str = "scaled_sign"

    def __call__(self, v, key=None):
        return jnp.sum(jnp.abs(v)) / v.shape[0] * jnp.sign(v)

    def delta(self, d):
        return 1.0 / d

    def payload_bytes(self, d, itemsize=4):
        return math.ceil(d / 8) + itemsize


@dataclasses.dataclass(frozen=True)
class QSGD:
    """QSGD (Alistarh et al. 2017) with `levels` = s quantisation levels:
    `Q(v)_j = ||v||_2 sign(v_j) xi_j / s`, `xi_j = floor(s|v_j|/||v||) + Bernoulli(frac)`,
    unbiased with `omega = min(d / s^2, sqrt(d) / s)`. `scaled=True` (default) divides by
    `1 + omega`: contractive in expectation with `delta = 1 / (1 + omega)`. Sends the norm
    plus d x (1 sign bit + ceil(log2(s + 1)) level bits), no entropy coding."""

    levels: int = 1
    scaled: bool = True
    name: str = "qsgd"

    def __post_init__(self):
        if not isinstance(self.levels, int) or self.levels < 1:
            raise ValueError(f"qsgd: levels must be an int >= 1, got {self.levels!r}")

    def omega(self, d: int) -> float:
        return min(d / self.levels**2, math.sqrt(d) / self.levels)

    def __call__(self, v, key):
        d, s = v.shape[0], self.levels
        norm = jnp.linalg.norm(v)
        safe = jnp.where(norm > 0, norm, 1.0)
        level = s * jnp.abs(v) / safe
        low = jnp.floor(level)
        xi = low + (jax.random.uniform(key, v.shape, dtype=level.dtype) < level - low)
        q = norm * jnp.sign(v) * xi / s
        if self.scaled:
            q = q / (1.0 + self.omega(d))
        return q.astype(v.dtype)

    def delta(self, d):
        return 1.0 / (1.0 + self.omega(d)) if self.scaled else 0.0

    def payload_bytes(self, d, itemsize=4):
        bits = d * (1 + math.ceil(math.log2(self.levels + 1)))
        return math.ceil(bits / 8) + itemsize


COMPRESSORS = {
    "identity": Identity,
    "top_k": TopK,
    "random_k": RandomK,
    "scaled_sign": ScaledSign,
    "qsgd": QSGD,
}


def make(name: str, **kwargs: Any) -> Compressor:
    """A compressor by name, e.g. `make("top_k", fraction=0.01)`."""
    if name not in COMPRESSORS:
        raise ValueError(f"unknown compressor {name!r}; choose from {sorted(COMPRESSORS)}")
    return COMPRESSORS[name](**kwargs)


def compress_tree(compressor: Compressor, tree: Params, key: jax.Array) -> Params:
    """Applies `compressor` to the concatenation of all leaves of `tree` (global, not per
    layer) and returns a tree of the same structure."""
    flat, unravel = ravel_pytree(tree)
    return unravel(compressor(flat, key))


def tree_dim(tree: Params) -> int:
    """Number of scalars d of a pytree."""
    return int(sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(tree)))


def tree_payload_bytes(compressor: Compressor, tree: Params) -> int:
    """Bytes one client sends when uploading `Q(tree)`."""
    d = tree_dim(tree)
    itemsize = tree_size_bytes(tree) // max(d, 1)
    return compressor.payload_bytes(d, itemsize)
