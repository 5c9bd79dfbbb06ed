"""AREA: Asynchronous Exact Averaging (Algorithms 1 and 2).

Iakovidou and Kim, "Asynchronous Federated Stochastic Optimization for Heterogeneous
Objectives Under Arbitrary Delays". Spec: `../shared/specs/area_async.md` (Sections 2.1-2.4,
3.3).

Server: x_s, u_s (u_s = 0 initially). Client i keeps y_i, the last model it sent. At an event
of client i it delivers its pending model x_i as the residual m_i = x_i - y_i, the server adds
w_i m_i to u_s (w_i = 1/n), and the client reads the CURRENT x_s (before any aggregation) and
computes its next x_i = LU_i(x_s) (K projected SGD steps). When the aggregation rule fires,
x_s <- x_s + u_s and u_s <- 0. Invariant: x_s + u_s = sum_i w_i y_i after every iteration, so
after an aggregation x_s is the exact average of the latest models of ALL clients.

One `step` is one event iteration of the engine in `fedjax_sim.events` (categorical mode: the
paper's iterate form (2)-(4) exactly; bernoulli mode: several clients may fire at once, which
equals any sequential order of the same events with no aggregation in between).

Options (spec 3.3 / 7.6):
- `init_mode="compute"` (RECOMMENDED): y_i = x_s0 and x_i = LU_i(x_s0) (every client starts
  working at t = 0); `"paper"`: x_i = y_i = x_s0 (each client's first message is 0).
- `read_after_aggregate=True`: replies carry x_s after this iteration's aggregation (cleaner
  synchronous limit; departs from Algorithm 1).
- constant step size (float) or a schedule of the read iteration (`diminishing(alpha0,
  power)`): the client uses alpha_k of the iteration at which it read x_s, as in Algorithm 1
  where alpha is sent with x_s.
- `box=(lo, hi)`: P_X onto a box after every local step (x_s0 is projected at init).
- `weights`: server weights w_i (default 1/n; spec 7.2's option w_i = s_i/S);
  `client_scale`: f_i = s_i fhat_i (spec 7.2's RECOMMENDED resolution, s_i = counts/S).

Implementation notes (not deviations): the pending x_i is computed when it is delivered, from
the stored read model r_i with the key and step size of the read (`async_common`), so the
state holds r_i and y_i (2 model copies per client, like Algorithm 2's x_i and y_i).
K > 1 is outside the paper's theory (spec 2.4).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import struct

from fedjax_sim.algorithms.async_common import (
    LocalWork,
    broadcast,
    check_data,
    client_weights,
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
from fedjax_sim.events import Events, EventState, set_rows, take_rows
from fedjax_sim.parallel import ClientMap

INIT_MODES = ("compute", "paper")


@struct.dataclass
class AREAState:
    """AREA's state.

    Attributes:
      params: x_s, the server model.
      residual: u_s, the weighted residuals received since the last aggregation.
      read: `[C, ...]` r_i, the server model each client last read (its work is LU_i(r_i)).
      memory: `[C, ...]` y_i, the last model each client delivered.
      computed: `[C]` bool; False while client i's pending model is r_i itself ("paper" init).
      events: the event engine's bookkeeping (iteration, time, versions, reads).
    """

    params: Params
    residual: Params
    read: Params
    memory: Params
    computed: jax.Array
    events: EventState

    @property
    def round(self) -> jax.Array:
        """Event iterations done (the `round` counter of `simulate`)."""
        return self.events.k


def area(
    loss_fn: LossFn,
    *,
    events: Events | None = None,
    num_clients: int | None = None,
    firing_probability: float = 0.1,
    delta: int = 4,
    capacity: int | str | None = "auto",
    client_optimizer: ClientOptimizer = 0.1,
    local: LocalSpec = LocalSpec(steps=1),
    init_mode: Literal["compute", "paper"] = "compute",
    read_after_aggregate: bool = False,
    box: tuple[float, float] | None = None,
    weights: Any = None,
    client_scale: Any = None,
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """AREA (Asynchronous Exact Averaging), one event iteration per `step`.

    Args:
      loss_fn: `loss_fn(params, batch)`, e.g. `model.loss`.
      events: the event model (`fedjax_sim.events.Events`). If None: Bernoulli
        (`firing_probability`) arrivals for `num_clients` clients, aggregation every `delta`
        deliveries, `capacity` slots.
      client_optimizer: alpha (float), an optax transformation, or a callable of the read
        iteration (`diminishing(alpha0, power)`).
      local: K local steps (default 1, minibatch 32 with replacement; "full": exact grads).
      init_mode: "compute" or "paper" (see the module docstring).
      read_after_aggregate: reply with x_s after this iteration's aggregation.
      box: optional (lower, upper) box X for the projection P_X.
      weights: server weights w_i `[C]` (normalised; default 1/n).
      client_scale: optional `[C]` factors s_i, f_i = s_i * loss (spec 7.2).
      client_map: how the firing slots are mapped.
    """
    ev = make_events(events, num_clients, firing_probability, delta, capacity)
    if init_mode not in INIT_MODES:
        raise ValueError(f"init_mode must be one of {INIT_MODES}, got {init_mode!r}")
    c = ev.num_clients
    w = client_weights(weights, c)
    work = LocalWork(loss_fn, client_optimizer, local, box, client_scale, client_map)

    def init(params: Params, key: jax.Array) -> AREAState:
        if box is not None:
            params = jax.tree.map(lambda x: jnp.clip(x, *box), params)
        return AREAState(
            params=params,
            residual=jax.tree.map(jnp.zeros_like, params),
            read=broadcast(params, c),
            memory=broadcast(params, c),
            computed=jnp.full((c,), init_mode == "compute"),
            events=ev.init(key),
        )

    def step(state: AREAState, data: FederatedData, key: jax.Array):
        check_data(ev, data)
        tick = ev.draw(state.events, round_key(key, state.events.k, COHORT))
        ids, act = tick.ids, tick.active
        safe = jnp.minimum(ids, c - 1)
        start = gather(state.read, ids)
        results, losses = work(data, ids, start, take_rows(state.events.read_iteration, ids), key)
        if init_mode == "paper":
            done = take_rows(state.computed, ids)
            results = jax.tree.map(
                lambda x, r: jnp.where(done.reshape((-1,) + (1,) * (x.ndim - 1)), x, r),
                results,
                start,
            )
        # 1) deliveries: u_s += sum_i w_i (x_i - y_i); y_i <- x_i
        old = gather(state.memory, ids)
        coef = jnp.where(act, jnp.asarray(w)[safe], 0.0)
        diffs = jax.tree.map(jnp.subtract, results, old)
        residual = jax.tree.map(jnp.add, state.residual, masked_sum(diffs, coef))
        memory = scatter(state.memory, ids, act, results)
        # 3) aggregation (decided by the rule; computed before the replies for the option)
        agg = tick.aggregate
        params = jax.tree.map(lambda x, u: jnp.where(agg, x + u, x), state.params, residual)
        residual = jax.tree.map(lambda u: jnp.where(agg, jnp.zeros_like(u), u), residual)
        # 2) replies: firing clients read x_s (before the aggregation unless the option)
        reply = params if read_after_aggregate else state.params
        read = scatter(state.read, ids, act, broadcast(reply, ids.shape[0]))
        computed = set_rows(state.computed, ids, act, jnp.ones(ids.shape, bool))
        new_events = ev.advance(state.events, tick, read_after_aggregate=read_after_aggregate)
        metrics = {
            "train_loss": loss_metric(losses, act),
            **tick_payload(ev, tick, state.params),
        }
        new_state = AREAState(
            params=params,
            residual=residual,
            read=read,
            memory=memory,
            computed=computed,
            events=new_events,
        )
        return new_state, metrics

    return Algorithm(init, step)
