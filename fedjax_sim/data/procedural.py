"""Procedural populations: a client's data is a pure function of `(seed, client id)`,
generated on device inside the round, so a population of 10^9 clients costs O(cohort) memory.

A generator is a frozen (hashable) dataclass with `max_count`, `feature_shape`,
`num_classes` and two jittable methods of `(key, cid)`: `rows -> (x [N_max, ...],
y [N_max, ...])` and `count -> []` int32 (rows `>= count` are padding). `Population(generator,
num_clients, seed)` evaluates them for cohorts of ids (`rows(ids)`, `counts(ids)`), and
`materialize()` builds the same clients as an on-device `FederatedData` (for small
populations and exact comparisons). Client `i` uses `fold_in(key(seed), i)` only, so its data
does not depend on which cohort, block or population size it is generated in.

Built-in generators: `UniformClassification` (the benchmark workloads' data: features
uniform in [0, 1), uniform labels; the same numbers as `fedjax_sim.app.bench.workloads.make_data`)
and `FedProxSynthetic` (the Synthetic(alpha, beta) recipe of Li et al. 2020, drawn per client
with JAX's generator: the same distribution as `fedjax_sim.data.fedprox_synthetic`, not the
same numbers; sizes LogNormal(4, 2) + 50 capped at `max_count`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.data.federated import FederatedData


class Generator(Protocol):
    max_count: int
    feature_shape: tuple[int, ...]
    num_classes: int

    def rows(self, key: jax.Array, cid: jax.Array) -> tuple[jax.Array, jax.Array]: ...

    def count(self, key: jax.Array, cid: jax.Array) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class UniformClassification:
    """`x [per_client, input_dim]` uniform in [0, 1), `y` uniform in [0, num_classes)."""

    input_dim: int = 784
    num_classes: int = 10
    per_client: int = 20

    @property
    def max_count(self) -> int:
        return self.per_client

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return (self.input_dim,)

    def rows(self, key: jax.Array, cid: jax.Array) -> tuple[jax.Array, jax.Array]:
        kx, ky = jax.random.split(jax.random.fold_in(key, cid))
        x = jax.random.uniform(kx, (self.per_client, self.input_dim), jnp.float32)
        return x, jax.random.randint(ky, (self.per_client,), 0, self.num_classes, jnp.int32)

    def count(self, key: jax.Array, cid: jax.Array) -> jax.Array:
        del key, cid
        return jnp.int32(self.per_client)


@dataclasses.dataclass(frozen=True)
class FedProxSynthetic:
    """Synthetic(alpha, beta) (Li et al. 2020) per client: `u ~ N(0, alpha^2)`,
    `B ~ N(0, beta^2)`, `W ~ N(u, 1) [dim, classes]`, `b ~ N(u, 1)`, `v ~ N(B, 1) [dim]`,
    `x ~ N(v, diag(j^-1.2))`, `y = argmax(x W + b)`; `n = min(int(LogNormal(4, 2)) + 50,
    max_count)`."""

    alpha: float = 1.0
    beta: float = 1.0
    dim: int = 60
    num_classes: int = 10
    max_count: int = 200

    def __post_init__(self):
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(f"alpha and beta must be >= 0, got {self.alpha}, {self.beta}")
        if self.max_count < 1:
            raise ValueError(f"max_count must be >= 1, got {self.max_count}")

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return (self.dim,)

    def count(self, key: jax.Array, cid: jax.Array) -> jax.Array:
        z = jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, cid), 0))
        n = jnp.floor(jnp.exp(4.0 + 2.0 * z)) + 50.0
        return jnp.minimum(n, self.max_count).astype(jnp.int32)

    def rows(self, key: jax.Array, cid: jax.Array) -> tuple[jax.Array, jax.Array]:
        ks = jax.random.split(jax.random.fold_in(jax.random.fold_in(key, cid), 1), 6)
        d, k, n = self.dim, self.num_classes, self.max_count
        u = self.alpha * jax.random.normal(ks[0])
        shift = self.beta * jax.random.normal(ks[1])
        w = u + jax.random.normal(ks[2], (d, k))
        b = u + jax.random.normal(ks[3], (k,))
        v = shift + jax.random.normal(ks[4], (d,))
        std = jnp.arange(1, d + 1, dtype=jnp.float32) ** -0.6
        x = v + jax.random.normal(ks[5], (n, d)) * std
        y = jnp.argmax(x @ w + b, axis=-1).astype(jnp.int32)
        return x.astype(jnp.float32), y


@dataclasses.dataclass(frozen=True)
class Population:
    """`num_clients` clients whose data `generator` derives from `(seed, client id)`."""

    generator: Any
    num_clients: int
    seed: int = 0

    def __post_init__(self):
        if self.num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {self.num_clients}")
        if self.num_clients > np.iinfo(np.int32).max:
            raise ValueError(f"num_clients must fit int32, got {self.num_clients}")

    @property
    def max_count(self) -> int:
        return int(self.generator.max_count)

    @property
    def num_classes(self) -> int:
        return int(self.generator.num_classes)

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return tuple(self.generator.feature_shape)

    @property
    def key(self) -> jax.Array:
        return jax.random.key(self.seed)

    def rows(self, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`(x [K, N_max, ...], y [K, N_max, ...])` of clients `ids [K]` (jittable)."""
        key = self.key
        return jax.vmap(lambda i: self.generator.rows(key, i))(ids)

    def counts(self, ids: jax.Array) -> jax.Array:
        """`[K]` int32 counts of clients `ids [K]` (jittable)."""
        key = self.key
        return jax.vmap(lambda i: self.generator.count(key, i))(ids)

    def all_counts(self) -> jax.Array:
        """`[C]` counts of the whole population (4 bytes per client, on device)."""
        return _all_counts(self)

    def materialize(self) -> FederatedData:
        """The whole population as on-device `FederatedData` (small populations only)."""
        x, y = jax.jit(self.rows)(jnp.arange(self.num_clients, dtype=jnp.int32))
        return FederatedData(x=x, y=y, counts=self.all_counts(), num_classes=self.num_classes)


@functools.partial(jax.jit, static_argnums=0)
def _all_counts(pop: Population) -> jax.Array:
    return pop.counts(jnp.arange(pop.num_clients, dtype=jnp.int32))


__all__ = ["FedProxSynthetic", "Generator", "Population", "UniformClassification"]
