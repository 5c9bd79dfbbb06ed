"""The asynchronous composer: client work (`client_work.ClientWork`) and a server rule on the
event engine (`fedjax_sim.algorithms.events`), composed into an `Algorithm` whose `step` is
one event iteration. Presets: AREA (`area`), AS-FedAvg, FedBuff, FedAsync (`fedbuff`),
MIFA (`mifa`); S-FedAvg (`sfedavg`) is a synchronous `compose` preset with the engine's
clocks. Spec:
`docs/specs/area_async.md`.

    work = ClientWork(loss_fn, client_optimizer=0.05, local=LocalSpec(steps=2))
    algorithm = compose_async(work, buffered(staleness_weight("sqrt"), 1.0, mean=True),
                              events=Events(Arrivals.poisson(rates), Aggregation.every(4)))

Pending-computation model (spec 2.3/2.5): client i holds r_i, the server model it last read,
and its pending result x_i = LU_i(r_i) (local training with the client optimizer of its read
iteration k_i). At its next event it delivers that result, reads the current server model and
starts again. x_i is a deterministic function of (r_i, k_i, client id, data): the local key is
`client_key(round_key(key, k_i, LOCAL), i)`. So it is computed when it is delivered (for the
firing slots only), and the state stores r_i, not x_i: the same trajectory as computing x_i
at the read, without an `[C, ...]` array of pending models and without the data in `init`
(`init_mode="compute"`: every client starts working on x_s0 at t = 0; `"paper"`: a client's
first delivery is its read model itself, AREA's x_i = y_i = x_s0).

An iteration (`step`): the engine draws the firing clients into `B` slots `ids [B]` (padding
id C) → their rows are gathered (`core.rows.gather_rows`) → each trains from r_i through
`ClientWork.train` (round = its read iteration; `box` and `client_scale` are the client
work's) → the server rule turns the deliveries into x_s (and its own state) → the firing
clients read x_s (before this iteration's aggregation, or after it with
`read_after_aggregate`; `core.rows.scatter_rows`) → the engine advances once. Cost follows the
firing clients, not C.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from fedjax_sim.algorithms import schedules
from fedjax_sim.algorithms.client_work import ClientWork
from fedjax_sim.algorithms.compose import preset
from fedjax_sim.algorithms.core import (
    COHORT,
    LOCAL,
    Algorithm,
    LocalSpec,
    LossFn,
    Params,
    client_key,
    payload_metrics,
    round_key,
    server_update,
)
from fedjax_sim.algorithms.events import (
    Aggregation,
    Arrivals,
    Events,
    EventState,
)
from fedjax_sim.algorithms.hooks import scaled
from fedjax_sim.algorithms.local_hook import LocalHook, chain
from fedjax_sim.algorithms.optimizers import ClientOptimizer
from fedjax_sim.algorithms.schedules import client_sgd
from fedjax_sim.core.checks import check_number, non_negative, positive
from fedjax_sim.core.rows import Rows, gather_rows, scatter_rows
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.runtime.parallel import ClientMap

Staleness = Literal["constant", "sqrt", "polynomial", "hinge"]
STALENESS = ("constant", "sqrt", "polynomial", "hinge")
INIT_MODES = ("compute", "paper")


# ------------------------------------------------------------------------------ helpers
def staleness_weight(kind: Staleness, a: Any = 0.5, b: Any = 4.0) -> Callable[[jax.Array], Any]:
    """s(tau): "constant" 1, "sqrt" 1/sqrt(1 + tau) (FedBuff, Nguyen et al. 2022),
    "polynomial" (1 + tau)^-a, "hinge" 1 for tau <= b else 1/(a (tau - b) + 1) (FedAsync's
    hinge, Xie et al. 2019); `tau [B]` -> `[B]`."""
    if kind not in STALENESS:
        raise ValueError(f"staleness weighting must be one of {STALENESS}, got {kind!r}")
    if kind in ("polynomial", "hinge"):
        positive("staleness exponent/slope staleness_a", a)
    if kind == "hinge":
        non_negative("hinge threshold staleness_b", b)

    def weight(tau: jax.Array) -> jax.Array:
        t = tau.astype(jax.dtypes.canonicalize_dtype(jnp.float64))
        if kind == "constant":
            return jnp.ones_like(t)
        if kind == "sqrt":
            return 1.0 / jnp.sqrt(1.0 + t)
        if kind == "polynomial":
            return (1.0 + t) ** (-a)
        return jnp.where(t <= b, 1.0, 1.0 / (a * (t - b) + 1.0))

    return weight


def client_weights(weights: Any, num_clients: int) -> np.ndarray:
    """`[C]` float64 non-negative weights normalised to sum 1 (None: uniform 1/C)."""
    if weights is None:
        return np.full(num_clients, 1.0 / num_clients)
    w = np.asarray(weights, np.float64)
    if w.shape != (num_clients,):
        raise ValueError(f"weights must have shape [{num_clients}], got {w.shape}")
    if not np.isfinite(w).all() or w.min() < 0 or w.sum() <= 0:
        raise ValueError("weights must be finite, >= 0 and not all 0")
    return w / w.sum()


def sample_size_scale(counts: Any) -> np.ndarray:
    """`[C]` s_i / S: spec 7.2's client scale, f_i = (s_i / S) fhat_i, so that sum_i f_i is
    the example-weighted objective and uniform (1/n) averaging minimises it."""
    c = np.asarray(counts, np.float64)
    if c.ndim != 1 or c.sum() <= 0:
        raise ValueError("counts must be a [C] array with a positive sum")
    return c / c.sum()


def diminishing(alpha0: float, power: float = 0.6) -> Callable[[jax.Array], Any]:
    """Step size alpha_k = alpha0 / (k + 1)^power indexed by the (read) iteration k, as a
    client optimizer (`client_optimizer=diminishing(...)`); spec 8.10 uses power 0.6."""
    return client_sgd(schedules.diminishing(alpha0, power))


def broadcast(params: Params, num: int) -> Params:
    """`[num, ...]` copies of a model (e.g. the stacked per-client read models at init)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num, *x.shape)), params)


def masked_sum(values: Params, coef: jax.Array) -> Params:
    """`sum_b coef_b values_b` over the slot axis of `[B, ...]` leaves; slots with coef 0
    contribute exactly 0 (also if their values are not finite)."""

    def red(v):
        c = coef.astype(v.dtype)
        keep = (c != 0).reshape((-1,) + (1,) * (v.ndim - 1))
        return jnp.tensordot(c, jnp.where(keep, v, 0), axes=1)

    return jax.tree.map(red, values)


def apply_at(aggregate: jax.Array, params: Params, direction: Params, scale: Any = 1.0) -> Params:
    """`x + scale * direction` if `aggregate` else x (the server step of a buffered rule)."""
    return jax.tree.map(
        lambda x, b: jnp.where(aggregate, x + (scale * b).astype(x.dtype), x), params, direction
    )


class ServerStep(NamedTuple):
    """The server step of a gradient-type asynchronous rule (`server_step`)."""

    init: Callable[[Params], Any]  # params -> optimizer state (None for a float eta_g)
    # (aggregate, x, direction, coef, state) -> (x, state): x + coef(eta_g) direction
    apply: Callable[..., tuple[Params, Any]]


def server_step(opt: Any) -> ServerStep:
    """A float eta_g: `x + coef(eta_g) * direction` at an aggregation (the rules' own
    arithmetic); an optax transformation: applied, at an aggregation only, to the
    pseudo-gradient `-coef(1) * direction` (as `compose`'s server optimizer), its state kept
    across aggregations."""
    if isinstance(opt, optax.GradientTransformation):

        def apply(aggregate, x, direction, coef, state):
            update = jax.tree.map(lambda b: coef(1.0) * b, direction)
            return server_update(x, update, opt, state, aggregate)

        return ServerStep(opt.init, apply)
    positive("server_optimizer (eta_g)", opt)
    return ServerStep(
        lambda params: None,
        lambda aggregate, x, direction, coef, state: (
            apply_at(aggregate, x, direction, coef(opt)),
            state,
        ),
    )


def project(params: Params, box: tuple[float, float] | None) -> Params:
    """P_X of the initial model for the box X = [lower, upper]^p (identity without a box)."""
    return params if box is None else jax.tree.map(lambda x: jnp.clip(x, *box), params)


def check_clients(events: Events, num_clients: int) -> None:
    if num_clients != events.num_clients:
        raise ValueError(
            f"the data has {num_clients} clients but the events model has {events.num_clients}"
        )


# ------------------------------------------------------------------------------ composer
class Deliveries(NamedTuple):
    """One iteration's firing slots as a server rule sees them (`B` slots).

    Attributes:
      ids: `[B]` int32 client of each slot (C: padding).
      active: `[B]` bool, the slot's client delivers now.
      start: `[B, ...]` r_i, the model each slot's client had read.
      results: `[B, ...]` x_i = LU_i(r_i), its delivered model.
      tau: `[B]` int32 staleness in server versions (0 for inactive slots).
      aggregate: `[]` bool, the server aggregates in this iteration.
      buffered: `[]` int32 deliveries since the last aggregation, this iteration's included.
      num_clients: C (static).
    """

    ids: jax.Array
    active: jax.Array
    start: Params
    results: Params
    tau: jax.Array
    aggregate: jax.Array
    buffered: jax.Array
    num_clients: int


class ServerRule(NamedTuple):
    """What the server does with the deliveries (the asynchronous aggregator).

    Attributes:
      init: `(x_s0, C) -> state` of the rule (memories, buffers; per-client memories
        `[C, ...]` declared as `core.rows.Rows`).
      apply: `(state, x_s, deliveries) -> (new x_s, new state)`.
      check: `events -> None`, raises if the rule needs another event model.
    """

    init: Callable[[Params, int], Any]
    apply: Callable[[Any, Params, Deliveries], tuple[Params, Any]]
    check: Callable[[Events], None] = lambda events: None


@struct.dataclass
class AsyncState:
    """State of a composed asynchronous algorithm.

    Attributes:
      params: x_s, the server model.
      read: `Rows [C, ...]` r_i, the server model each client last read (its work is
        LU_i(r_i)).
      rule: the server rule's state.
      events: the event engine's bookkeeping (iteration, time, versions, reads).
      computed: `Rows [C]` bool (`init_mode="paper"`, else None): False while client i's
        pending model is r_i itself.
    """

    params: Params
    read: Rows
    rule: Any
    events: EventState
    computed: Rows | None = None

    @property
    def round(self) -> jax.Array:
        """Event iterations done (the `round` counter of `simulate`)."""
        return self.events.k


_PLAIN = {f.name: f.default for f in dataclasses.fields(LocalHook)}


def train_slots(
    work: ClientWork,
    data: FederatedData,
    ids: jax.Array,
    start: Params,
    read_iteration: jax.Array,
    key: jax.Array,
    client_map: ClientMap,
) -> tuple[Params, jax.Array]:
    """`(x_i [B, ...], mean local loss [B])` of each slot's client trained from `start [B,
    ...]` through `work.train`, with the client optimizer and key of its read iteration `[B]`
    (padding slots train client C - 1 and are masked by the caller)."""
    none = {h.name: None for h in work.hook.hooks}

    def client_fn(cid, params, k_read):
        res = work.train(
            params,
            data,
            cid,
            client_key(round_key(key, k_read, LOCAL), cid),
            round_=k_read,
            server=none,
            rows={},
            client_input=none,
            num_steps=work.local.num_steps(data.counts[cid]),
        )
        return res.params, res.loss

    safe = jnp.minimum(ids, data.num_clients - 1)
    return client_map.map(client_fn, safe, start, read_iteration)


def compose_async(
    work: ClientWork,
    rule: ServerRule,
    *,
    events: Events,
    client_map: ClientMap = ClientMap(),
    read_after_aggregate: bool = False,
    init_mode: Literal["compute", "paper"] = "compute",
) -> Algorithm:
    """An asynchronous algorithm from its parts, one event iteration per `step`.

    Args:
      work: the client work; its hooks must be local-step ones (no per-client or server
        state: `proximal`, `sam`, `tilted`, `scaled`), no stragglers.
      rule: the server rule (`buffered`, `mixed`, `area.exact_averaging`, `mifa.memory`).
      events: the event model (arrivals, aggregation rule, availability, capacity).
      client_map: how the firing slots are mapped (`ClientMap(mesh=...)` shards them).
      read_after_aggregate: the firing clients read x_s after this iteration's aggregation.
      init_mode: "compute" or "paper" (see the module docstring).

    Metrics: `train_loss` (mean over the firing clients), the engine's (`t`, `fired`,
    `overflow`, `lost`, `aggregated`, staleness means, maxima, histograms), `bytes_up`,
    `bytes_down` (one model each way per firing client).
    """
    if init_mode not in INIT_MODES:
        raise ValueError(f"init_mode must be one of {INIT_MODES}, got {init_mode!r}")
    for h in work.hook.hooks:
        if h.init_row is not None or any(
            getattr(h, n) is not _PLAIN[n] for n in ("init_server", "finalize")
        ):
            raise ValueError(f"hook {h.name!r} keeps state between rounds: not asynchronous")
    if work.stragglers.fraction:
        raise ValueError("stragglers are a synchronous option; asynchronous clients are late")
    rule.check(events)
    c = events.num_clients
    paper = init_mode == "paper"
    if paper and events.concurrency is not None:
        raise ValueError("init_mode='paper' assumes every client trains: no concurrency cap")

    def init(params: Params, key: jax.Array) -> AsyncState:
        params = project(params, work.box)
        return AsyncState(
            params=params,
            read=Rows(broadcast(params, c)),
            rule=rule.init(params, c),
            events=events.init(key),
            computed=Rows(jnp.zeros((c,), bool)) if paper else None,
        )

    def step(state: AsyncState, data: FederatedData, key: jax.Array):
        check_clients(events, data.num_clients)
        tick = events.draw(state.events, round_key(key, state.events.k, COHORT))
        ids, act = tick.ids, tick.active
        start = gather_rows(state.read, ids)
        k_read = gather_rows(state.events.read_iteration, ids)
        results, losses = train_slots(work, data, ids, start, k_read, key, client_map)
        computed = state.computed
        if paper:
            done = gather_rows(computed, ids)
            results = jax.tree.map(
                lambda x, r: jnp.where(done.reshape((-1,) + (1,) * (x.ndim - 1)), x, r),
                results,
                start,
            )
            computed = scatter_rows(computed, ids, act, jnp.ones(ids.shape, bool))
        buffered = state.events.count + jnp.sum(act)
        deliveries = Deliveries(ids, act, start, results, tick.tau, tick.aggregate, buffered, c)
        params, rule_state = rule.apply(state.rule, state.params, deliveries)
        reply = params if read_after_aggregate else state.params
        # the clients that start training read the reply (without a concurrency cap: the
        # delivering ones, which restart at once)
        read = scatter_rows(state.read, tick.starts, tick.started, broadcast(reply, ids.shape[0]))
        new_events = events.advance(state.events, tick, read_after_aggregate=read_after_aggregate)
        fired = jnp.sum(act)
        metrics = {
            "train_loss": jnp.sum(jnp.where(act, losses, 0.0)) / jnp.maximum(fired, 1),
            **events.metrics(tick),
            **payload_metrics(state.params, fired, fired),
        }
        return AsyncState(params, read, rule_state, new_events, computed), metrics

    return Algorithm(init, step)


# ------------------------------------------------------------------------------ rules
class Buffer(NamedTuple):
    """State of a buffered rule: the buffered deltas and the server optimizer's state."""

    buffer: Params
    opt_state: Any


def buffered(staleness: Callable[[jax.Array], Any], server: Any, *, mean: bool) -> ServerRule:
    """A buffer of staleness-weighted deltas `buf += s(tau_i) (x_i - r_i)`, applied at an
    aggregation as `x_s <- x_s + eta_g buf` (AS-FedAvg, s = 1) or `x_s <- x_s + eta_g buf /
    cnt` with cnt the buffered deliveries (`mean`, FedBuff); then emptied. `server`: eta_g
    (a float) or an optax transformation on the pseudo-gradient `-buf` (`-buf / cnt`)."""
    step = server_step(server)

    def apply(state: Buffer, x, d: Deliveries):
        s = jnp.where(d.active, staleness(d.tau), 0.0)
        deltas = jax.tree.map(jnp.subtract, d.results, d.start)
        buf = jax.tree.map(jnp.add, state.buffer, masked_sum(deltas, s))
        coef = (lambda eta: eta / jnp.maximum(d.buffered, 1)) if mean else (lambda eta: eta)
        x, opt_state = step.apply(d.aggregate, x, buf, coef, state.opt_state)
        buf = jax.tree.map(lambda b: jnp.where(d.aggregate, jnp.zeros_like(b), b), buf)
        return x, Buffer(buf, opt_state)

    return ServerRule(
        lambda params, c: Buffer(jax.tree.map(jnp.zeros_like, params), step.init(params)), apply
    )


def mixed(mixing: Any, staleness: Callable[[jax.Array], Any]) -> ServerRule:
    """FedAsync's mixing (Xie et al. 2019): every arrival at once, `x_s <- (1 - a) x_s + a
    x_i` with `a = beta s(tau_i)`; several arrivals of one iteration in slot (client-id)
    order, in closed form `x <- prod_b (1 - a_b) x + sum_b a_b prod_{l > b} (1 - a_l) x_b`.
    Needs aggregation every delivery. No state."""
    check_number("FedAsync mixing (beta)", mixing, lambda v: 0 < v <= 1, "in (0, 1]")

    def check(events: Events):
        if events.aggregation.rule != "count" or events.aggregation.delta != 1:
            raise ValueError(
                "FedAsync applies every arrival: use Aggregation.every(1) (buffer_size=1)"
            )

    def apply(state, x, d: Deliveries):
        a = mixing * jnp.where(d.active, staleness(d.tau), 0.0)
        suffix = jnp.cumprod((1.0 - a)[::-1])[::-1]
        after = jnp.concatenate([suffix[1:], jnp.ones((1,), suffix.dtype)])
        mixed_in = masked_sum(d.results, a * after)
        x = jax.tree.map(lambda x, m: (suffix[0] * x).astype(x.dtype) + m, x, mixed_in)
        return x, state

    return ServerRule(lambda params, c: None, apply, check)


# ------------------------------------------------------------------------------ presets
@dataclasses.dataclass(frozen=True)
class AsyncOptions:
    """The parts every asynchronous preset accepts besides its own hyper-parameters.

    Attributes:
      events: the event model (`fedjax_sim.algorithms.events.Events`). If None: Bernoulli
        (`firing_probability`) arrivals for `num_clients` clients, aggregation every
        `buffer_size` deliveries, `capacity` slots.
      server_optimizer: eta_g, the server's SGD learning rate (a float), or an optax
        transformation on the pseudo-gradient at each aggregation (AS-FedAvg, FedBuff, MIFA).
      client_optimizer: float alpha (SGD), schedule of the read iteration
        (`diminishing(alpha0, power)`), optax transformation, or callable of it.
      local: K local steps (default 1, minibatch 32 with replacement; "full": exact grads).
      read_after_aggregate: the firing clients read x_s after this iteration's aggregation.
      box: optional (lower, upper) box X: P_X after every local step and of x_s0.
      client_scale: optional `[C]` factors s_i, f_i = s_i * loss (spec 7.2; `hooks.scaled`).
      client_map: how the firing slots are mapped.
    """

    events: Events | None = None
    num_clients: int | None = None
    firing_probability: float = 0.1
    buffer_size: int = 4
    capacity: int | Literal["auto"] | None = "auto"
    server_optimizer: Any = 1.0
    client_optimizer: ClientOptimizer = 0.1
    local: LocalSpec = LocalSpec(steps=1)
    read_after_aggregate: bool = False
    box: tuple[float, float] | None = None
    client_scale: Any = None
    client_map: ClientMap = ClientMap()

    def event_model(self) -> Events:
        if self.events is not None:
            return self.events
        if self.num_clients is None:
            raise ValueError("asynchronous algorithms need events=Events(...) or num_clients=C")
        arrivals = Arrivals.bernoulli(self.firing_probability, num_clients=self.num_clients)
        return Events(arrivals, Aggregation.every(self.buffer_size), capacity=self.capacity)

    def client_work(self, loss_fn: LossFn, num_clients: int) -> ClientWork:
        hooks = ()
        if self.client_scale is not None:
            if np.shape(self.client_scale) != (num_clients,):
                raise ValueError(f"client_scale must have shape [{num_clients}]")
            hooks = (scaled(self.client_scale),)
        return ClientWork(
            loss_fn,
            client_optimizer=self.client_optimizer,
            local=self.local,
            hook=chain(*hooks),
            box=self.box,
        )


# `compose.preset` over the asynchronous options
async_preset = functools.partial(preset, options_class=AsyncOptions)


def asynchronous(
    loss_fn: LossFn,
    options: AsyncOptions,
    rule: ServerRule,
    *,
    init_mode: Literal["compute", "paper"] = "compute",
) -> Algorithm:
    """`compose_async` of `rule` with the `options` of a preset."""
    events = options.event_model()
    return compose_async(
        options.client_work(loss_fn, events.num_clients),
        rule,
        events=events,
        client_map=options.client_map,
        read_after_aggregate=options.read_after_aggregate,
        init_mode=init_mode,
    )
