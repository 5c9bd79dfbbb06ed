"""`ClientMap`: how a per-client function is mapped over the cohort axis.

- `vmap`: one batched computation over all cohort clients. Fastest on GPU/TPU for small models.
- `map`: `lax.scan` over chunks of `batch_size` clients, each chunk vmapped. Bounds memory to
  `batch_size` model copies and is faster on CPU (see `../shared/notes/measured_facts.md`:
  vmap over 1000 MLP clients streams 1000 parameter copies through memory every step).
- `auto` (default): `vmap` on accelerators, `map` with `batch_size=8` on CPU.

`map_sum` fuses the aggregation into the map: the summands are accumulated chunk by chunk, so
a FedAvg round never materialises `[M, d]` client updates in `map` mode. All modes compute the
same per-client values; sums may differ in the last bits (summation order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

MapMode = Literal["auto", "vmap", "map"]
CPU_DEFAULT_BATCH = 8


@dataclasses.dataclass(frozen=True)
class ClientMap:
    """Maps a per-client function over the leading (cohort) axis of its arguments."""

    mode: MapMode = "auto"
    batch_size: int | None = None

    def __post_init__(self):
        if self.mode not in ("auto", "vmap", "map"):
            raise ValueError(f"client_map mode must be 'auto', 'vmap' or 'map', got {self.mode!r}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"client_map batch_size must be >= 1, got {self.batch_size}")

    def resolve(self, num: int) -> tuple[str, int]:
        """`(mode, chunk)` used for a cohort of `num` clients."""
        mode = self.mode
        if mode == "auto":
            mode = "map" if jax.default_backend() == "cpu" else "vmap"
        if mode == "vmap":
            return "vmap", num
        bs = self.batch_size or CPU_DEFAULT_BATCH
        return "map", max(1, min(bs, num))

    def map(self, fn: Callable[..., Any], *xs: Any) -> Any:
        """`[fn(*x_i) for i]`, stacked on axis 0."""
        num = _leading(xs)
        mode, bs = self.resolve(num)
        if mode == "vmap" or bs >= num:
            return jax.vmap(fn)(*xs)
        return lax.map(lambda args: fn(*args), xs, batch_size=bs)

    def map_sum(self, fn: Callable[..., tuple[Any, Any]], *xs: Any) -> tuple[Any, Any]:
        """For `fn(*x_i) -> (summand_i, out_i)`: `(sum_i summand_i, stacked out_i)`."""
        num = _leading(xs)
        mode, bs = self.resolve(num)
        vfn = jax.vmap(fn)
        if mode == "vmap" or bs >= num:
            summands, outs = vfn(*xs)
            return _sum0(summands), outs
        n_chunks, n_main = num // bs, (num // bs) * bs
        main = jax.tree.map(lambda a: a[:n_main].reshape(n_chunks, bs, *a.shape[1:]), xs)
        summand_shape, _ = jax.eval_shape(fn, *jax.tree.map(lambda a: a[0], xs))
        acc0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), summand_shape)

        def body(acc, chunk):
            summands, outs = vfn(*chunk)
            return jax.tree.map(jnp.add, acc, _sum0(summands)), outs

        acc, outs = lax.scan(body, acc0, main)
        outs = jax.tree.map(lambda a: a.reshape(n_main, *a.shape[2:]), outs)
        if n_main < num:
            rest = jax.tree.map(lambda a: a[n_main:], xs)
            summands, rest_outs = vfn(*rest)
            acc = jax.tree.map(jnp.add, acc, _sum0(summands))
            outs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), outs, rest_outs)
        return acc, outs


def _leading(xs: Any) -> int:
    leaves = jax.tree.leaves(xs)
    if not leaves:
        raise ValueError("client_map needs at least one mapped array argument")
    return int(leaves[0].shape[0])


def _sum0(tree: Any) -> Any:
    return jax.tree.map(lambda a: jnp.sum(a, axis=0), tree)
