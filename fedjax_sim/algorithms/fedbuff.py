"""Buffered asynchronous FedAvg family: AS-FedAvg, FedBuff and FedAsync.

- AS-FedAvg (asynchronous FedAvg / asynchronous SGD, e.g. Koloskova et al. 2022): deltas are
  summed in a buffer and applied at aggregation, x_s <- x_s + eta_g * buf; no staleness
  weighting. Delta = 1 applies every update on arrival.
- FedBuff (Nguyen et al., AISTATS 2022): buf += s(tau_i) Delta_i; at aggregation
  x_s <- x_s + eta_g * buf / cnt, cnt = number of buffered deliveries (= Delta in categorical
  mode). s(tau) = 1/sqrt(1 + tau) by default; constant, polynomial (1+tau)^-a and hinge too.
- FedAsync (Xie et al. 2019): each arrival is mixed in at once,
  x_s <- (1 - beta s(tau)) x_s + beta s(tau) x_i (needs aggregation every delivery).

Spec: `../shared/specs/area_async.md` Section 2.5 (standard definitions, not from the AREA
paper) in the pending-computation event model: client i holds r_i, the server model it last
read, and delivers Delta_i = x_i - r_i with x_i = LU_i(r_i) (K local steps); tau_i is the
staleness of the delivered work in server versions.

Deviations, documented: FedAsync's optional proximal term in local training is not included
(plain local SGD, as the spec defines it); in bernoulli mode several arrivals of one iteration
are mixed in sequentially in client-id order and share the version they were measured against.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import struct

from fedjax_sim.algorithms.async_common import (
    LocalWork,
    Staleness,
    broadcast,
    check_data,
    gather,
    loss_metric,
    make_events,
    masked_sum,
    scatter,
    staleness_weight,
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
class BufferState:
    """State of AS-FedAvg / FedBuff / FedAsync.

    Attributes:
      params: x_s, the server model.
      buffer: the (weighted) deltas received since the last aggregation (zeros for FedAsync).
      read: `[C, ...]` r_i, the server model each client last read.
      events: the event engine's bookkeeping.
    """

    params: Params
    buffer: Params
    read: Params
    events: EventState

    @property
    def round(self) -> jax.Array:
        return self.events.k


def _buffered(
    loss_fn: LossFn,
    *,
    kind: Literal["sum", "mean", "mix"],
    weight_fn,
    server_lr: float,
    mixing: float,
    events: Events | None,
    num_clients: int | None,
    firing_probability: float,
    delta: int,
    capacity: Any,
    client_optimizer: ClientOptimizer,
    local: LocalSpec,
    read_after_aggregate: bool,
    box: tuple[float, float] | None,
    client_scale: Any,
    client_map: ClientMap,
) -> Algorithm:
    ev = make_events(events, num_clients, firing_probability, delta, capacity)
    if not server_lr > 0:
        raise ValueError(f"server learning rate eta_g must be > 0, got {server_lr}")
    if kind == "mix":
        if not 0 < mixing <= 1:
            raise ValueError(f"FedAsync mixing beta must be in (0, 1], got {mixing}")
        if ev.aggregation.rule != "count" or ev.aggregation.delta != 1:
            raise ValueError("FedAsync applies every arrival: use Aggregation.every(1) (delta=1)")
    c = ev.num_clients
    work = LocalWork(loss_fn, client_optimizer, local, box, client_scale, client_map)

    def init(params: Params, key: jax.Array) -> BufferState:
        if box is not None:
            params = jax.tree.map(lambda x: jnp.clip(x, *box), params)
        return BufferState(
            params=params,
            buffer=jax.tree.map(jnp.zeros_like, params),
            read=broadcast(params, c),
            events=ev.init(key),
        )

    def step(state: BufferState, data: FederatedData, key: jax.Array):
        check_data(ev, data)
        tick = ev.draw(state.events, round_key(key, state.events.k, COHORT))
        ids, act = tick.ids, tick.active
        start = gather(state.read, ids)
        results, losses = work(data, ids, start, take_rows(state.events.read_iteration, ids), key)
        agg = tick.aggregate
        s = jnp.where(act, weight_fn(tick.tau), 0.0)
        if kind == "mix":
            # sequential mixing of the arrivals in slot order, in closed form:
            # x <- prod_b (1 - a_b) x + sum_b a_b prod_{l > b} (1 - a_l) x_b
            a = mixing * s
            keep = 1.0 - a
            suffix = jnp.cumprod(keep[::-1])[::-1]
            after = jnp.concatenate([suffix[1:], jnp.ones((1,), suffix.dtype)])
            coef = a * after
            mixed = masked_sum(results, coef)
            params = jax.tree.map(
                lambda x, m: (suffix[0] * x).astype(x.dtype) + m, state.params, mixed
            )
            buffer = state.buffer
        else:
            deltas = jax.tree.map(jnp.subtract, results, start)
            buffer = jax.tree.map(jnp.add, state.buffer, masked_sum(deltas, s))
            if kind == "sum":
                scale = server_lr
            else:
                buffered = state.events.count + jnp.sum(act)
                scale = server_lr / jnp.maximum(buffered, 1)
            params = jax.tree.map(
                lambda x, b: jnp.where(agg, x + (scale * b).astype(x.dtype), x),
                state.params,
                buffer,
            )
            buffer = jax.tree.map(lambda b: jnp.where(agg, jnp.zeros_like(b), b), buffer)
        reply = params if read_after_aggregate else state.params
        read = scatter(state.read, ids, act, broadcast(reply, ids.shape[0]))
        new_events = ev.advance(state.events, tick, read_after_aggregate=read_after_aggregate)
        metrics = {
            "train_loss": loss_metric(losses, act),
            **tick_payload(ev, tick, state.params),
        }
        return BufferState(params, buffer, read, new_events), metrics

    return Algorithm(init, step)


def as_fedavg(
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
    """AS-FedAvg: asynchronous FedAvg, x_s <- x_s + eta_g * sum of buffered deltas.

    Arguments as for `area`; `server_lr` is eta_g (1 in the spec)."""
    return _buffered(
        loss_fn,
        kind="sum",
        weight_fn=staleness_weight("constant"),
        server_lr=server_lr,
        mixing=1.0,
        events=events,
        num_clients=num_clients,
        firing_probability=firing_probability,
        delta=delta,
        capacity=capacity,
        client_optimizer=client_optimizer,
        local=local,
        read_after_aggregate=read_after_aggregate,
        box=box,
        client_scale=client_scale,
        client_map=client_map,
    )


def fedbuff(
    loss_fn: LossFn,
    *,
    events: Events | None = None,
    num_clients: int | None = None,
    firing_probability: float = 0.1,
    delta: int = 4,
    capacity: int | str | None = "auto",
    staleness: Staleness = "sqrt",
    staleness_a: float = 0.5,
    staleness_b: float = 4.0,
    server_lr: float = 1.0,
    client_optimizer: ClientOptimizer = 0.1,
    local: LocalSpec = LocalSpec(steps=1),
    read_after_aggregate: bool = False,
    box: tuple[float, float] | None = None,
    client_scale: Any = None,
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """FedBuff: staleness-weighted buffer, x_s <- x_s + eta_g * buf / (buffered deliveries).

    `staleness`: "sqrt" 1/sqrt(1+tau) (default), "constant", "polynomial" (1+tau)^-a,
    "hinge" (1 up to b, then 1/(a(tau-b)+1)); `staleness_a`/`staleness_b` are a and b."""
    return _buffered(
        loss_fn,
        kind="mean",
        weight_fn=staleness_weight(staleness, staleness_a, staleness_b),
        server_lr=server_lr,
        mixing=1.0,
        events=events,
        num_clients=num_clients,
        firing_probability=firing_probability,
        delta=delta,
        capacity=capacity,
        client_optimizer=client_optimizer,
        local=local,
        read_after_aggregate=read_after_aggregate,
        box=box,
        client_scale=client_scale,
        client_map=client_map,
    )


def fedasync(
    loss_fn: LossFn,
    *,
    events: Events | None = None,
    num_clients: int | None = None,
    firing_probability: float = 0.1,
    capacity: int | str | None = "auto",
    mixing: float = 0.5,
    staleness: Staleness = "polynomial",
    staleness_a: float = 0.5,
    staleness_b: float = 4.0,
    client_optimizer: ClientOptimizer = 0.1,
    local: LocalSpec = LocalSpec(steps=1),
    read_after_aggregate: bool = True,
    box: tuple[float, float] | None = None,
    client_scale: Any = None,
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """FedAsync: x_s <- (1 - beta s(tau)) x_s + beta s(tau) x_i at every arrival.

    `mixing` is beta; `staleness` as for `fedbuff` (default polynomial with a = 0.5). The events
    model must aggregate every delivery (`Aggregation.every(1)`, the default here). By default
    the client then reads the mixed model (Xie et al.'s scheduler hands out the latest model)."""
    return _buffered(
        loss_fn,
        kind="mix",
        weight_fn=staleness_weight(staleness, staleness_a, staleness_b),
        server_lr=1.0,
        mixing=mixing,
        events=events,
        num_clients=num_clients,
        firing_probability=firing_probability,
        delta=1,
        capacity=capacity,
        client_optimizer=client_optimizer,
        local=local,
        read_after_aggregate=read_after_aggregate,
        box=box,
        client_scale=client_scale,
        client_map=client_map,
    )
