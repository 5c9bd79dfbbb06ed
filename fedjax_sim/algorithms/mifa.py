"""MIFA: Memory-augmented Impatient Federated Averaging, asynchronous form.

Gu et al., "Fast Federated Learning in the Presence of Arbitrary Device Unavailability"
(NeurIPS 2021). Spec: `docs/specs/area_async.md` Section 2.5 (its event-model form). A
preset of `asynchronous.compose_async` with the rule `memory`.

The server keeps a memory G_i of the latest update of every client (initialised to 0). At an
event client i delivers G_i <- r_i - x_i (x_i = LU_i(r_i), r_i the model it read), then reads
the current x_s. At each aggregation x_s <- x_s - eta_g (1/n) sum_{i=1..n} G_i over ALL
clients (eta_g = `server_optimizer`, 1 in the spec), stale entries included, so a stored
update is re-applied at every aggregation until it is refreshed (about n/buffer_size times
with aggregation every buffer_size deliveries).

Implementation note: sum_i G_i is maintained incrementally (memory_sum += G_new - G_old for
the firing clients), so an iteration costs O(firing clients), not O(C). In float32 the
incremental sum drifts by round-off from the exact sum over the memory.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.asynchronous import (
    AsyncOptions,
    Deliveries,
    ServerRule,
    async_preset,
    asynchronous,
    broadcast,
    masked_sum,
    server_step,
)
from fedjax_sim.algorithms.core import Algorithm, LossFn, Params
from fedjax_sim.core.rows import Rows, gather_rows, scatter_rows


class Memory(NamedTuple):
    """MIFA's server state: G_i `[C, ...]`, their sum and the server optimizer's state."""

    memory: Rows
    memory_sum: Params
    opt_state: Any = None


def memory(server: Any) -> ServerRule:
    """MIFA's rule: `G_i <- r_i - x_i` for the delivering clients; at an aggregation
    `x_s <- x_s - (eta_g / n) sum_i G_i` (`server`: eta_g, or an optax transformation on the
    pseudo-gradient `(1/n) sum_i G_i`)."""
    step = server_step(server)

    def apply(state: Memory, x, d: Deliveries):
        updates = jax.tree.map(jnp.subtract, d.start, d.results)  # G_i = r_i - x_i
        change = jax.tree.map(jnp.subtract, updates, gather_rows(state.memory, d.ids))
        total = jax.tree.map(
            jnp.add, state.memory_sum, masked_sum(change, d.active.astype(jnp.float32))
        )
        coef = lambda eta: -(eta / d.num_clients)  # noqa: E731
        x, opt_state = step.apply(d.aggregate, x, total, coef, state.opt_state)
        return x, Memory(scatter_rows(state.memory, d.ids, d.active, updates), total, opt_state)

    def init(params, c):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return Memory(Rows(broadcast(zeros, c)), zeros, step.init(params))

    return ServerRule(init, apply)


@async_preset()
def mifa(loss_fn: LossFn, *, options: AsyncOptions) -> Algorithm:
    """MIFA: x_s <- x_s - eta_g * mean_i G_i over the memory of all clients at aggregation."""
    return asynchronous(loss_fn, options, memory(options.server_optimizer))
