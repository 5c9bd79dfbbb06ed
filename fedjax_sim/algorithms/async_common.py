"""Machinery shared by the asynchronous algorithms (AREA, AS-FedAvg, FedBuff, MIFA, FedAsync)
and the timed synchronous reference S-FedAvg. Spec: `../shared/specs/area_async.md`.

Pending-computation model (spec 2.3/2.5): client i holds r_i, the server model it last read,
and its pending result x_i = LU_i(r_i) (K local steps with the step size of its read
iteration). At its next event it delivers that result, reads the current server model and
starts again. x_i is a deterministic function of (r_i, read iteration, client id, data): the
local key is `client_key(round_key(key, read_iteration, LOCAL), i)`. So it is computed when
it is delivered (for the firing slots only), and the state stores r_i, not x_i. This is the
same trajectory as computing x_i at the read, without an `[C, ...]` array of pending models
and without needing the data in `init` ("compute" initialisation: every client starts working
on x_s0 at t = 0).

Per-client state is stacked on axis 0 for all C clients; the firing clients of an iteration
are the `B` slots `tick.ids` of the event engine (`fedjax_sim.events`), gathered with
`gather` and written back with `scatter` (padding slots carry id C and are dropped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sim import schedules
from fedjax_sim.algorithms.core import (
    LOCAL,
    ClientOptimizer,
    LocalSpec,
    LossFn,
    Params,
    client_key,
    client_optimizer_for_round,
    local_train,
    payload_metrics,
    round_key,
    tree_scale,
)
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.events import Aggregation, Arrivals, Events, Tick, set_rows, take_rows
from fedjax_sim.parallel import ClientMap
from fedjax_sim.schedules import client_sgd

Staleness = Literal["constant", "sqrt", "polynomial", "hinge"]
STALENESS = ("constant", "sqrt", "polynomial", "hinge")


def make_events(
    events: Events | None,
    num_clients: int | None,
    firing_probability: float,
    delta: int,
    capacity: int | str | None,
) -> Events:
    """`events` if given, else Bernoulli(`firing_probability`) arrivals for `num_clients`
    clients with aggregation every `delta` deliveries (the CLI's simple form)."""
    if events is not None:
        return events
    if num_clients is None:
        raise ValueError("asynchronous algorithms need events=Events(...) or num_clients=C")
    arrivals = Arrivals.bernoulli(firing_probability, num_clients=num_clients)
    return Events(arrivals, Aggregation.every(delta), capacity=capacity)


def check_data(events: Events, data: FederatedData) -> None:
    if data.num_clients != events.num_clients:
        raise ValueError(
            f"the data has {data.num_clients} clients but the events model has {events.num_clients}"
        )


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


def box_projection(lower: float, upper: float) -> optax.GradientTransformation:
    """P_X for X = [lower, upper]^p after each local step: turns an update u at params z into
    `clip(z + u) - z` (chained after the client optimizer)."""

    def update(updates, state, params):
        if params is None:
            raise ValueError("box_projection needs the params")
        new = jax.tree.map(lambda u, z: jnp.clip(z + u, lower, upper) - z, updates, params)
        return new, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def check_box(box: tuple[float, float] | None) -> None:
    if box is not None and not (len(box) == 2 and box[0] < box[1]):
        raise ValueError(f"box must be (lower, upper) with lower < upper, got {box}")


def staleness_weight(kind: Staleness, a: float = 0.5, b: float = 4.0):
    """s(tau): "constant" 1, "sqrt" 1/sqrt(1 + tau) (FedBuff), "polynomial" (1 + tau)^-a,
    "hinge" 1 for tau <= b else 1/(a (tau - b) + 1) (FedAsync's hinge)."""
    if kind not in STALENESS:
        raise ValueError(f"staleness weighting must be one of {STALENESS}, got {kind!r}")
    if kind in ("polynomial", "hinge") and not a > 0:
        raise ValueError(f"staleness exponent/slope a must be > 0, got {a}")
    if kind == "hinge" and b < 0:
        raise ValueError(f"hinge threshold b must be >= 0, got {b}")

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


# ------------------------------------------------------------------------------ slots
def gather(tree: Params, ids: jax.Array) -> Params:
    """Rows `ids [B]` of a stacked `[C, ...]` tree (padding id C reads row C - 1); see
    `events.take_rows` for why this is not plain indexing."""
    return jax.tree.map(lambda a: take_rows(a, ids), tree)


def scatter(tree: Params, ids: jax.Array, active: jax.Array, values: Params) -> Params:
    """Writes rows `values [B, ...]` of the active slots into the stacked `[C, ...]` tree."""
    return jax.tree.map(lambda a, v: set_rows(a, ids, active, v), tree, values)


def broadcast(params: Params, num: int) -> Params:
    """`[num, ...]` copies of a model (e.g. the stacked per-client read models at init)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num, *x.shape)), params)


def masked_sum(values: Params, coef: jax.Array) -> Params:
    """`sum_b coef_b values_b` over the slot axis; slots with coef 0 contribute exactly 0
    (also if their values are not finite)."""

    def red(v):
        c = coef.astype(v.dtype)
        keep = (c != 0).reshape((-1,) + (1,) * (v.ndim - 1))
        return jnp.tensordot(c, jnp.where(keep, v, 0), axes=1)

    return jax.tree.map(red, values)


@dataclasses.dataclass(frozen=True, eq=False)
class LocalWork:
    """LU_i: the local work of the firing slots, through the foundation's `local_train`.

    Attributes:
      loss_fn: `loss_fn(params, batch)` (fhat_i on client i's data).
      client_optimizer: float alpha (SGD), optax transformation, or callable of the read
        iteration k (step-size schedules such as `diminishing`).
      local: K local steps, batch size, minibatch sampling ("full": exact gradients).
      box: optional (lower, upper): project onto the box after every local step.
      client_scale: optional `[C]` factors s_i (f_i = s_i fhat_i; spec 7.2).
      client_map: how the slots are mapped (vmap / lax.map).
    """

    loss_fn: LossFn
    client_optimizer: ClientOptimizer
    local: LocalSpec
    box: tuple[float, float] | None = None
    client_scale: np.ndarray | None = None
    client_map: ClientMap = ClientMap()

    def __post_init__(self):
        client_optimizer_for_round(self.client_optimizer, jnp.int32(0))  # validate eagerly
        check_box(self.box)
        if self.client_scale is not None:
            s = np.asarray(self.client_scale)
            if s.ndim != 1 or not np.isfinite(s).all() or s.min() < 0:
                raise ValueError("client_scale must be a [C] array of finite values >= 0")

    def __call__(
        self,
        data: FederatedData,
        ids: jax.Array,
        start: Params,
        read_iteration: jax.Array,
        key: jax.Array,
    ) -> tuple[Params, jax.Array]:
        """Results `[B, ...]` of K local steps of each slot's client from `start [B, ...]`,
        with the step size and key of its read iteration `[B]`; and the mean local loss
        `[B]`."""
        c = data.num_clients
        if self.client_scale is not None and np.shape(self.client_scale) != (c,):
            raise ValueError(
                f"client_scale must have shape [{c}], got {np.shape(self.client_scale)}"
            )
        safe = jnp.minimum(ids, c - 1)
        max_steps = self.local.max_steps(data.max_count)
        scale = None if self.client_scale is None else jnp.asarray(self.client_scale)

        def client_fn(cid, params, k_read):
            optimizer = client_optimizer_for_round(self.client_optimizer, k_read)
            if self.box is not None:
                optimizer = optax.chain(optimizer, box_projection(*self.box))
            grad_fn = None
            if scale is not None:
                s = scale[cid]

                def grad_fn(value_and_grad, p, batch, aux):
                    loss, grads = value_and_grad(p, batch)
                    return loss * s, tree_scale(grads, s.astype(loss.dtype)), aux

            client = data.client(cid)
            result = local_train(
                params,
                client,
                client_key(round_key(key, k_read, LOCAL), cid),
                loss_fn=self.loss_fn,
                optimizer=optimizer,
                max_steps=max_steps,
                num_steps=self.local.num_steps(client.count),
                batch_size=self.local.batch_size,
                sampling=self.local.sampling,
                grad_fn=grad_fn,
            )
            return result.params, result.loss

        return self.client_map.map(client_fn, safe, start, read_iteration)


def loss_metric(losses: jax.Array, active: jax.Array) -> jax.Array:
    """Mean local training loss over the active slots (0 if none)."""
    n = jnp.maximum(jnp.sum(active), 1)
    return jnp.sum(jnp.where(active, losses, 0.0)) / n


def tick_payload(events: Events, tick: Tick, params: Params) -> dict[str, jax.Array]:
    """Event metrics plus bytes: every active client uploads one model-sized message and
    downloads the server model."""
    fired = jnp.sum(tick.active)
    return {**events.metrics(tick), **payload_metrics(params, fired, fired)}
