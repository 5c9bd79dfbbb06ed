"""Aggregators: how the cohort's updates become the server's update (TFF's aggregation
factories), and the wrappers around an `inner` one (compression, error feedback, clipping)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from fedjax_sim.algorithms.compression import compress_tree, tree_payload_bytes
from fedjax_sim.algorithms.core import (
    Metrics,
    Params,
    mean_of_total,
    tree_norm,
)
from fedjax_sim.core.checks import positive
from fedjax_sim.core.rows import Rows


class Aggregator(NamedTuple):
    """How the cohort's updates become the server's update (TFF's aggregation factories,
    wrapping an `inner` aggregator, plus per-client memory).

    Attributes:
      init: `(params, num_clients) -> (server state, {name: Rows [C, ...]})` (per-client
        memories declared as `core.rows.Rows`).
      encode: `(update, rows, key, server) -> (sent, new rows)`: one client's transform
        before sending (compression, clipping, noise...), inside the client map; `rows` is
        the client's row of each named memory.
      reduce: `(server, total, weight, stacked, cohort, key) -> (update, server, metrics)`:
        from `total = sum_i w_i sent_i` and `weight = sum_i w_i` (and, when `stacked`, the
        sent updates `[M, ...]`; `cohort`: the round's `core.Cohort`, ids and weights `[M]`)
        to the server's update.
      payload: `params -> bytes one client sends` where the wire format differs from the
        sent pytree (compression, DP's clipped bit); None: the sent update's own size (its
        shapes and dtypes).
      stacked: whether `reduce` needs the `[M, ...]` sent updates (robust aggregators);
        otherwise the sum is fused into the client map and `[M, d]` never exists.
      round_trips: server round trips of the upload protocol (1: one message; secure
        aggregation's 4); the virtual clock adds `round_trip_latency` per extra one.
      private: `reduce` is differentially private (`privacy.dp_mean`: noise and a
        denominator fixed by the expected cohort); wrappers keep their inner one's.
    """

    init: Callable[[Params, int], tuple[Any, dict[str, Any]]]
    encode: Callable[[Params, dict[str, Any], jax.Array, Any], tuple[Params, dict[str, Any]]]
    reduce: Callable[..., tuple[Params, Any, Metrics]]
    payload: Callable[[Params], float] | None = None
    stacked: bool = False
    round_trips: int = 1
    private: bool = False


@struct.dataclass
class AggregatorState:
    """The aggregator's server state and its named per-client memories `{name: Rows}`."""

    server: Any
    rows: dict[str, Any]


def mean() -> Aggregator:
    """The weighted mean `sum_i w_i Delta_i / sum_i w_i` (FedAvg's aggregation)."""
    return Aggregator(
        init=lambda params, num_clients: (None, {}),
        encode=lambda update, rows, key, server: (update, rows),
        reduce=lambda server, total, weight, stacked, cohort, key: (
            mean_of_total(total, weight),
            server,
            {},
        ),
    )


def wrap(
    inner: Aggregator,
    encode: Callable[[Params, Any, jax.Array], tuple[Params, Any]],
    *,
    name: str | None = None,
    init_row: Callable[[Params], Any] | None = None,
    payload: Callable[[Params], float] | None = None,
) -> Aggregator:
    """An aggregator that transforms each client's update with `encode(update, row, key) ->
    (update, row)` before `inner` (TFF's wrapping factories). With `init_row`, the wrapper
    keeps a per-client memory named `name` (zeros shaped like `init_row(params)`; `row` is
    None otherwise); the inner aggregator gets `fold_in(key, 1)`."""
    if init_row is not None and not name:
        raise ValueError("an aggregator with per-client memory needs a name")

    def init(params, num_clients):
        server, rows = inner.init(params, num_clients)
        if init_row is not None:
            if name in rows:
                raise ValueError(f"two aggregator memories are named {name!r}")
            rows = {
                **rows,
                name: Rows(
                    jax.tree.map(
                        lambda r: jnp.zeros((num_clients, *jnp.shape(r)), jnp.result_type(r)),
                        init_row(params),
                    )
                ),
            }
        return server, rows

    def enc(update, rows, key, server):
        own = rows.get(name) if init_row is not None else None
        update, own = encode(update, own, key)
        inner_rows = {k: v for k, v in rows.items() if k != name or init_row is None}
        sent, inner_rows = inner.encode(update, inner_rows, jax.random.fold_in(key, 1), server)
        if init_row is not None:
            inner_rows = {**inner_rows, name: own}
        return sent, inner_rows

    return Aggregator(
        init=init,
        encode=enc,
        reduce=inner.reduce,
        payload=payload or inner.payload,
        stacked=inner.stacked,
        round_trips=inner.round_trips,
        private=inner.private,
    )


def compressed(compressor: Any, inner: Aggregator | None = None) -> Aggregator:
    """Each client sends `Q(Delta_i)` (no memory; FedPAQ-style), then `inner` (mean)."""
    inner = inner or mean()
    return wrap(
        inner,
        lambda u, row, key: (compress_tree(compressor, u, key), row),
        payload=lambda params: float(tree_payload_bytes(compressor, params)),
    )


def error_feedback(compressor: Any, inner: Aggregator | None = None) -> Aggregator:
    """Error feedback (Beikmohammadi et al. 2024, Alg. 2; Karimireddy et al. 2019): per-client
    memory `e_i` (0 at init; `state.aggregator.rows["error_feedback"]`), `u = Delta_i + e_i`,
    send `Q(u)`, keep `e_i <- u - Q(u)`; clients that do not contribute keep their memory.
    Then `inner` (mean)."""
    inner = inner or mean()

    def encode(update, memory, key):
        u = jax.tree.map(jnp.add, update, memory)
        q = compress_tree(compressor, u, key)
        return q, jax.tree.map(jnp.subtract, u, q)

    return wrap(
        inner,
        encode,
        name="error_feedback",
        init_row=lambda params: params,
        payload=lambda params: float(tree_payload_bytes(compressor, params)),
    )


def clipped(max_norm: Any, inner: Aggregator | None = None) -> Aggregator:
    """Each client's update scaled to L2 norm at most `max_norm` (global norm over all
    leaves), then `inner` (mean): `Delta_i min(1, C / ||Delta_i||)`."""
    positive("clip norm", max_norm)
    inner = inner or mean()

    def encode(update, row, key):
        norm = tree_norm(update)
        scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, jnp.finfo(norm.dtype).tiny))
        return jax.tree.map(lambda x: (x * scale).astype(x.dtype), update), row

    return wrap(inner, encode)
