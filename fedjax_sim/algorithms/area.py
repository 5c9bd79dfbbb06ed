"""AREA: Asynchronous Exact Averaging (Algorithms 1 and 2).

Iakovidou and Kim, "Asynchronous Federated Stochastic Optimization for Heterogeneous
Objectives Under Arbitrary Delays". Spec: `docs/specs/area_async.md` (Sections 2.1-2.4,
3.3).

Server: x_s, u_s (u_s = 0 initially). Client i keeps y_i, the last model it sent. At an event
of client i it delivers its pending model x_i as the residual m_i = x_i - y_i, the server adds
w_i m_i to u_s (w_i = 1/n), and the client reads the CURRENT x_s (before any aggregation) and
computes its next x_i = LU_i(x_s) (K projected SGD steps). When the aggregation rule fires,
x_s <- x_s + u_s and u_s <- 0. Invariant: x_s + u_s = sum_i w_i y_i after every iteration, so
after an aggregation x_s is the exact average of the latest models of ALL clients.

One `step` is one event iteration of the engine in `fedjax_sim.algorithms.events`
(categorical mode: the paper's iterate form (2)-(4) exactly; bernoulli mode: several clients
may fire at once, which equals any sequential order of the same events with no aggregation in
between). A preset of `asynchronous.compose_async` with the rule `exact_averaging`.

Options (spec 3.3 / 7.6), besides `asynchronous.AsyncOptions`:
- `init_mode="compute"` (RECOMMENDED): y_i = x_s0 and x_i = LU_i(x_s0) (every client starts
  working at t = 0); `"paper"`: x_i = y_i = x_s0 (each client's first message is 0).
- `weights`: server weights w_i (default 1/n; spec 7.2's option w_i = s_i/S);
  `client_scale`: f_i = s_i fhat_i (spec 7.2's RECOMMENDED resolution, s_i = counts/S).
- `read_after_aggregate=True`: replies carry x_s after this iteration's aggregation (cleaner
  synchronous limit; departs from Algorithm 1); a schedule client optimizer
  (`diminishing(alpha0, power)`) uses alpha_k of the read iteration, as in Algorithm 1.

Implementation note (not a deviation): the pending x_i is computed when it is delivered, from
the stored read model r_i (`asynchronous`), so the state holds r_i and y_i (2 model copies per
client, like Algorithm 2's x_i and y_i). K > 1 is outside the paper's theory (spec 2.4).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms.asynchronous import (
    AsyncOptions,
    Deliveries,
    ServerRule,
    apply_at,
    async_preset,
    asynchronous,
    broadcast,
    client_weights,
    masked_sum,
)
from fedjax_sim.algorithms.core import Algorithm, LossFn, Params
from fedjax_sim.core.rows import Rows, gather_rows, scatter_rows


class Residual(NamedTuple):
    """AREA's server state: u_s and the clients' last delivered models y_i `[C, ...]`."""

    residual: Params
    memory: Rows


def exact_averaging(weights: np.ndarray) -> ServerRule:
    """AREA's rule with server weights `w [C]` (summing to 1): `u_s += sum_i w_i (x_i - y_i)`,
    `y_i <- x_i` for the delivering clients; at an aggregation `x_s <- x_s + u_s`, `u_s <- 0`."""

    def apply(state: Residual, x, d: Deliveries):
        coef = jnp.where(d.active, gather_rows(jnp.asarray(weights), d.ids), 0.0)
        diffs = jax.tree.map(jnp.subtract, d.results, gather_rows(state.memory, d.ids))
        residual = jax.tree.map(jnp.add, state.residual, masked_sum(diffs, coef))
        memory = scatter_rows(state.memory, d.ids, d.active, d.results)
        x = apply_at(d.aggregate, x, residual)
        residual = jax.tree.map(lambda u: jnp.where(d.aggregate, jnp.zeros_like(u), u), residual)
        return x, Residual(residual, memory)

    def init(params, c):
        return Residual(jax.tree.map(jnp.zeros_like, params), Rows(broadcast(params, c)))

    return ServerRule(init, apply)


@async_preset(fixed=("server_optimizer",))
def area(
    loss_fn: LossFn,
    *,
    init_mode: Literal["compute", "paper"] = "compute",
    weights: Any = None,
    options: AsyncOptions,
) -> Algorithm:
    """AREA (Asynchronous Exact Averaging), one event iteration per `step`; `weights` are the
    server weights w_i `[C]` (normalised; default 1/n), `init_mode` "compute" or "paper"."""
    events = options.event_model()
    rule = exact_averaging(client_weights(weights, events.num_clients))
    return asynchronous(loss_fn, options, rule, init_mode=init_mode)
