"""The local-step hook protocol (`LocalHook`, its phases `Prepare`, `Start`, `Direction`,
`Finish`, `Finalize`, what a hook sees: `HookContext`, `LocalOutcome`, `RoundSummary`) and
`chain`. The published hooks are in `hooks`.

A round of one hook, in its phases (shapes: M the cohort, C the clients):

    init_row / init_server   params -> one client's row / the server-side state (at init)
    prepare                  server, cohort, x_t, key -> broadcast, client inputs [M, ...]
    start                    ctx -> carry at local step 0                       (per client)
    direction                each local step: the direction the client optimizer applies
    finish                   ctx, outcome -> new row, summand, output, update   (per client)
    finalize                 server, summary, server_step -> server, x_{t+1}, metrics
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.core import (
    Cohort,
    Metrics,
    Params,
)


class HookContext(NamedTuple):
    """What a hook sees while one client trains.

    Attributes:
      anchor: x_t, the model the client started from (the broadcast global model).
      server: what the hook's `prepare` broadcast to the clients, or None.
      row: the client's per-client row of the hook, or None.
      client_input: the client's row of the hook's client inputs of the round (`prepare`).
      round: [] the round (asynchronous algorithms: the iteration at which it read x_t).
      lr: the client learning rate of that round (None for an optax client optimizer).
      client: [] the client id.
      key: the client's key of the round (its local training's).
    """

    anchor: Params
    server: Any
    row: Any
    client_input: Any
    round: jax.Array
    lr: Any
    client: jax.Array
    key: jax.Array


class LocalOutcome(NamedTuple):
    """One client's local training, as the hooks' `finish` sees it."""

    params: Params  # final local model x_i
    delta: Params  # x_i - x_t
    update: Params  # what the client sends so far: delta, or the previous hook's in a chain
    steps: jax.Array  # [] executed local steps K_i
    carry: Any  # the hook's final carry


class RoundSummary(NamedTuple):
    """The round as the hooks' `finalize` sees it.

    `mean`, `outputs` and `rows` are the hook's own: its summands' weighted mean, its stacked
    per-client outputs `[M, ...]` (rows of clients with weight 0 included) and its rows of all
    clients after the round `[C, ...]` (None when the rows are streamed, `state_rows="host"`).
    `contributed` tells whether anybody did."""

    params: Params  # x_t
    update: Params  # the aggregated update as it reaches this hook (the hooks before it
    #                 in the chain corrected it already); the pseudo-gradient is its negative
    cohort: Cohort  # ids [M], weights [M] (0: did not contribute), round, num_clients C
    mean: Any
    outputs: Any
    rows: Any
    local_steps: int  # static length of the local scan (K)
    lr: Any  # client learning rate of the round (None for an optax client optimizer)
    model: Params = None  # x_t whole, frozen leaves included (a partition's views leave
    #                       them out); a `finalize` may return frozen leaves to move them

    @property
    def contributed(self) -> jax.Array:
        """[] bool: somebody contributed (a weight > 0)."""
        return jnp.any(self.cohort.weights > 0)


ServerStep = Callable[[Params], Params]
"""`update -> x_{t+1}`: the rest of the round's server step from an update (the next hooks'
`finalize`s, then the server optimizer on the pseudo-gradient `-update`; x_t when nobody
contributed). A hook's `finalize` calls it exactly once."""


class Prepare(Protocol):
    def __call__(
        self, server: Any, cohort: Cohort, params: Params, key: jax.Array
    ) -> tuple[Any, Any]:
        """`(server state, cohort, x_t, key) -> (broadcast, client inputs [M, ...])` once per
        round on the server: what every client sees as `ctx.server` and the per-client inputs
        of the `core.Cohort` (row m is `ctx.client_input` of client `cohort.ids[m]`; e.g.
        FedLPS' anchors from every client's last model, DRFA's snapshot step, the Byzantine
        flags). `key` is the round's `round_key(key, round, EXTRA)`."""


class Start(Protocol):
    def __call__(self, ctx: HookContext) -> Any:
        """`ctx -> carry` at local step 0: the hook's state across the local steps (e.g.
        FGDRO's `(u_i, s)` from the client's row and the broadcast threshold)."""


class Direction(Protocol):
    def __call__(
        self,
        value_and_grad: Callable[[Params, Any], tuple[jax.Array, Params]],
        params: Params,
        batch: Any,
        carry: Any,
        ctx: HookContext,
    ) -> tuple[jax.Array, Params, Any]:
        """`(value_and_grad, w, batch, carry, ctx) -> (loss [], direction (params' shapes),
        carry)`: one local step's direction (the client optimizer applies it).
        `value_and_grad(w, batch) -> (loss, gradient)` is the gradient oracle of the hooks
        before this one in a `chain` (the loss's own first)."""


class Finish(Protocol):
    def __call__(self, ctx: HookContext, outcome: LocalOutcome) -> tuple[Any, Any, Any, Params]:
        """`(ctx, outcome) -> (new row, summand, output, update)` after local training: the
        client's new row (ignored without `init_row`), a summand averaged over the cohort with
        the aggregation weights (`RoundSummary.mean`), an output stacked `[M, ...]`
        (`RoundSummary.outputs`) and the update the client sends (`outcome.update`, or e.g.
        FedNova's `Delta_i / tau_i`, a Byzantine client's poisoned one; the next hook of a
        chain sees it as its `outcome.update`)."""


class Finalize(Protocol):
    def __call__(
        self, server: Any, summary: RoundSummary, server_step: ServerStep
    ) -> tuple[Any, Params, Metrics]:
        """`(server state, summary, server_step) -> (server state, x_{t+1}, metrics)`: the
        hook's part of the server step, around the rest of it: it may correct the update
        before `server_step` (FedDyn's h, FedNova's tau_eff), update its state and move the
        model after it (FedDyn's `x_{t+1} - h / a`). Hooks earlier in a chain wrap later ones."""


def _init_server(params: Params) -> None:
    return None


def _prepare(server: Any, cohort: Cohort, params: Params, key: jax.Array) -> tuple[Any, Any]:
    return server, None


def _start(ctx: HookContext) -> None:
    return None


def _direction(value_and_grad, params, batch, carry, ctx):
    loss, grads = value_and_grad(params, batch)
    return loss, grads, carry


def _finish(ctx: HookContext, outcome: LocalOutcome) -> tuple[Any, Any, Any, Params]:
    return ctx.row, None, None, outcome.update


def _finalize(
    server: Any, summary: RoundSummary, server_step: ServerStep
) -> tuple[Any, Params, Metrics]:
    return server, server_step(summary.update), {}


@dataclasses.dataclass(frozen=True)
class LocalHook:
    """A local-step hook: its phases and the per-client and server-side state they keep.

    Attributes:
      name: key of the hook's state in `FederatedState.rows` / `.hooks`.
      direction: `Direction`, the local step's direction.
      init_row: `params -> row` of one client (None: no per-client state); rows of all C
        clients are stacked `[C, ...]` at `init`.
      init_server: `params -> server-side state` (default None).
      prepare: `Prepare`, the round's broadcast and client inputs (default: the server state
        itself, no client inputs).
      start: `Start`, the carry at local step 0 (default None).
      finish: `Finish`, after local training (default: the row kept, no summand, no output,
        the update passed on).
      finalize: `Finalize`, around the server step (default: the update passed on).
      not_sent: the parts of a round the simulation moves but the protocol does not send,
        because their receiver recomputes them (`"broadcast"`, `"client_input"`, `"summand"`,
        `"output"`; e.g. FedLPS' output, the client's final model `x_t + Delta_i`). Every
        other part is counted in `bytes_up` (summand, output: per client) and `bytes_down`
        (broadcast, client input: per client), from its shapes and dtypes.
      update_bytes: `(view, ids [M], rows) -> [M]`, the bytes of each client's update on the
        wire where a client sends less than the update's shapes (HetLoRA's and FLoRA's rank-r_i
        clients send r_i of the r padded ranks); `view`: the trainable view of x_t, `rows`:
        the hook's rows of those clients (None without). Default None: the shapes. It counts
        the plain upload only; an aggregator's own wire format (`Aggregator.payload`) wins.
        At most one hook of a chain declares it.
    """

    name: str
    direction: Direction = _direction
    init_row: Callable[[Params], Any] | None = None
    init_server: Callable[[Params], Any] = _init_server
    prepare: Prepare = _prepare
    start: Start = _start
    finish: Finish = _finish
    finalize: Finalize = _finalize
    not_sent: tuple[str, ...] = ()
    update_bytes: Callable[[Params, jax.Array, Any], jax.Array] | None = None


class Chain(NamedTuple):
    """Hooks applied in order: hook k's gradient oracle is hook k-1's direction, its
    `finish` sees hook k-1's update, and its `finalize` runs inside hook k-1's."""

    hooks: tuple[LocalHook, ...]


PARTS = ("broadcast", "client_input", "summand", "output")  # what a hook may send


def chain(*hooks: LocalHook) -> Chain:
    """Chains local-step hooks (optax's `chain` for the local step): the first hook sees the
    loss's gradient, each next one the previous hook's direction. Names must be distinct."""
    names = [h.name for h in hooks]
    if len(set(names)) != len(names):
        raise ValueError(f"hook names must be distinct, got {names}")
    for h in hooks:
        if not isinstance(h, LocalHook):
            raise TypeError(f"chain takes LocalHook parts, got {h!r}")
        if set(h.not_sent) - set(PARTS):
            raise ValueError(f"hook {h.name!r}: not_sent names parts of {PARTS}, got {h.not_sent}")
    sized = [h.name for h in hooks if h.update_bytes is not None]
    if len(sized) > 1:
        raise ValueError(f"at most one hook may declare update_bytes, got {sized}")
    return Chain(tuple(hooks))
