"""MIFA: Memory-augmented Impatient Federated Averaging, asynchronous form.

Gu et al., "Fast Federated Learning in the Presence of Arbitrary Device Unavailability"
(NeurIPS 2021). Spec: `../shared/specs/area_async.md` Section 2.5 (its event-model form).

The server keeps a memory G_i of the latest update of every client (initialised to 0). At an
event client i delivers G_i <- r_i - x_i (x_i = LU_i(r_i), r_i the model it read), then reads
the current x_s. At each aggregation x_s <- x_s - eta_g (1/n) sum_{i=1..n} G_i over ALL
clients, stale entries included, so a stored update is re-applied at every aggregation until
it is refreshed (about n/Delta times with aggregation every Delta deliveries).

Implementation note: sum_i G_i is maintained incrementally (memory_sum += G_new - G_old for
the firing clients), so an iteration costs O(firing clients), not O(C). In float32 the
incremental sum drifts by round-off from the exact sum over the memory.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from fedjax_sim.algorithms.async_common import (
    LocalWork,
    broadcast,
    check_data,
    gather,
    loss_metric,
    make_events,
    masked_sum,
    scatter,
    tick_payload,
)
from fedjax_sim.algorithms.core import (
    COHORT,
    Algorithm,
    ClientOptimizer,
    LocalSpec,
    LossFn,
    Params,
    round_key,
)
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.events import Events, EventState, take_rows
from fedjax_sim.parallel import ClientMap


@struct.dataclass
class MIFAState:
    """MIFA's state.

    Attributes:
      params: x_s, the server model.
      memory: `[C, ...]` G_i, the latest update (r_i - x_i) of every client.
      memory_sum: sum_i G_i.
      read: `[C, ...]` r_i, the server model each client last read.
      events: the event engine's bookkeeping.
    """

    params: Params
    memory: Params
    memory_sum: Params
    read: Params
    events: EventState

    @property
    def round(self) -> jax.Array:
        return self.events.k


def mifa(
    loss_fn: LossFn,
    *,
    events: Events | None = None,
    num_clients: int | None = None,
    firing_probability: float = 0.1,
    delta: int = 4,
    capacity: int | str | None = "auto",
    server_lr: float = 1.0,
    client_optimizer: ClientOptimizer = 0.1,
    local: LocalSpec = LocalSpec(steps=1),
    read_after_aggregate: bool = False,
    box: tuple[float, float] | None = None,
    client_scale: Any = None,
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """MIFA: x_s <- x_s - eta_g * mean_i G_i over the memory of all clients at aggregation.

    Arguments as for `area`; `server_lr` is eta_g (1 in the spec)."""
    ev = make_events(events, num_clients, firing_probability, delta, capacity)
    if not server_lr > 0:
        raise ValueError(f"server learning rate eta_g must be > 0, got {server_lr}")
    c = ev.num_clients
    work = LocalWork(loss_fn, client_optimizer, local, box, client_scale, client_map)

    def init(params: Params, key: jax.Array) -> MIFAState:
        if box is not None:
            params = jax.tree.map(lambda x: jnp.clip(x, *box), params)
        zeros = jax.tree.map(jnp.zeros_like, params)
        return MIFAState(
            params=params,
            memory=broadcast(zeros, c),
            memory_sum=zeros,
            read=broadcast(params, c),
            events=ev.init(key),
        )

    def step(state: MIFAState, data: FederatedData, key: jax.Array):
        check_data(ev, data)
        tick = ev.draw(state.events, round_key(key, state.events.k, COHORT))
        ids, act = tick.ids, tick.active
        start = gather(state.read, ids)
        results, losses = work(data, ids, start, take_rows(state.events.read_iteration, ids), key)
        updates = jax.tree.map(jnp.subtract, start, results)  # G_i = r_i - x_i
        old = gather(state.memory, ids)
        change = jax.tree.map(jnp.subtract, updates, old)
        memory_sum = jax.tree.map(
            jnp.add, state.memory_sum, masked_sum(change, act.astype(jnp.float32))
        )
        memory = scatter(state.memory, ids, act, updates)
        agg = tick.aggregate
        params = jax.tree.map(
            lambda x, g: jnp.where(agg, x - (server_lr / c) * g, x), state.params, memory_sum
        )
        reply = params if read_after_aggregate else state.params
        read = scatter(state.read, ids, act, broadcast(reply, ids.shape[0]))
        new_events = ev.advance(state.events, tick, read_after_aggregate=read_after_aggregate)
        metrics = {
            "train_loss": loss_metric(losses, act),
            **tick_payload(ev, tick, state.params),
        }
        return MIFAState(params, memory, memory_sum, read, new_events), metrics

    return Algorithm(init, step)
