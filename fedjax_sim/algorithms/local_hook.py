"""The local-step hook protocol (`LocalHook`, what a hook sees: `HookContext`,
`LocalOutcome`, `RoundSummary`) and `chain`. The published hooks are in `hooks`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from fedjax_sim.algorithms.core import (
    Cohort,
    Metrics,
    Params,
)


class HookContext(NamedTuple):
    """What a hook sees while one client trains.

    Attributes:
      anchor: x_t, the model the client started from (the broadcast global model).
      server: the hook's server-side state (broadcast to the client), or None.
      row: the client's per-client row of the hook, or None.
      client_input: the hook's per-client input of the round (`LocalHook.client_inputs`).
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
    steps: jax.Array  # [] executed local steps K_i
    carry: Any  # the hook's final carry


class RoundSummary(NamedTuple):
    """The round as the hooks' `correct` / `finalize` and the distributor see it.

    `mean`, `outputs`, `rows` and `row_change` are the hook's own (its summands' weighted
    mean, its stacked per-client outputs `[M, ...]`, its rows of all clients after the round
    `[C, ...]`, None when the rows are streamed (`state_rows="host"`), and the sum over
    contributing clients of `new row - old row`)."""

    params: Params  # x_t
    new_params: Params | None  # x_{t+1} (None in `correct`, which runs before the server step)
    update: Params  # the aggregated update (the pseudo-gradient is its negative)
    ids: jax.Array  # [M] cohort ids
    weights: jax.Array  # [M] aggregation weights (0: did not contribute)
    contributed: jax.Array  # [] bool: total weight > 0
    mean: Any
    outputs: Any
    rows: Any
    row_change: Any
    num_clients: int
    local_steps: int  # static length of the local scan (K)
    lr: Any  # client learning rate of the round (None for an optax client optimizer)
    round: jax.Array


def _none(*_: Any) -> None:
    return None


def _no_finish(ctx: HookContext, outcome: LocalOutcome) -> tuple[Any, Any, Any]:
    return ctx.row, None, None


def _no_correct(server: Any, summary: RoundSummary) -> tuple[Any, Params]:
    return server, summary.update


def _no_finalize(server: Any, summary: RoundSummary) -> tuple[Any, Metrics]:
    return server, {}


def _plain_direction(value_and_grad, params, batch, carry, ctx):
    loss, grads = value_and_grad(params, batch)
    return loss, grads, carry


@dataclasses.dataclass(frozen=True)
class LocalHook:
    """A local-step hook and the per-client and server-side state it needs.

    Attributes:
      name: key of the hook's state in `FederatedState.rows` / `.hooks`.
      direction: `(value_and_grad, params, batch, carry, ctx) -> (loss, direction, carry)`:
        the local step's direction (the client optimizer applies it). `value_and_grad` is the
        gradient oracle of the hooks before this one in a `chain` (the loss's own first).
      init_row: `params -> row` of one client (None: no per-client state); rows of all C
        clients are stacked `[C, ...]` at `init`.
      init_server: `params -> server-side state` broadcast to the clients (None: none).
      client_inputs: `(server, cohort, params, key) -> [M, ...]` per-client inputs of a
        round computed on the server for the `core.Cohort` (e.g. FedLPS' anchors from every
        client's last model, DRFA's snapshot step); `key` is the round's
        `round_key(key, round, EXTRA)`.
      start: `ctx -> carry` at local step 0 (state carried across local steps).
      finish: `(ctx, outcome) -> (new row, summand, output)` after local training: the
        client's new row, a summand averaged over the cohort with the aggregation weights,
        and an output stacked `[M, ...]`.
      correct: `(server, summary) -> (server, update)` before the server step (e.g. FedDyn's
        `- h / alpha`).
      finalize: `(server, summary) -> (server, metrics)` after the server step.
      adjust: `(server, summary) -> params`: the global model after the server step and the
        `finalize`s (default `summary.new_params`; FedDyn's `x_{t+1} - h / alpha`).
      not_sent: the parts of a round the simulation moves but the protocol does not send,
        because their receiver recomputes them (`"broadcast"`, `"client_input"`, `"summand"`,
        `"output"`; e.g. FedLPS' output, the client's final model `x_t + Delta_i`). Every
        other part is counted in `bytes_up` (summand, output: per client) and `bytes_down`
        (broadcast, client input: per client), from its shapes and dtypes.
      broadcast: `server -> what the clients see as ctx.server` (computed once per round).
      send: `(ctx, outcome) -> the update the client sends` (default `outcome.delta`; in a
        chain each hook transforms the previous one's, e.g. FedNova's `Delta_i / tau_i`).
    """

    name: str
    direction: Callable[..., tuple[jax.Array, Params, Any]] = _plain_direction
    init_row: Callable[[Params], Any] | None = None
    init_server: Callable[[Params], Any] = _none
    client_inputs: Callable[[Any, Cohort, Params, jax.Array], Any] = _none
    start: Callable[[HookContext], Any] = _none
    finish: Callable[[HookContext, LocalOutcome], tuple[Any, Any, Any]] = _no_finish
    correct: Callable[[Any, RoundSummary], tuple[Any, Params]] = _no_correct
    finalize: Callable[[Any, RoundSummary], tuple[Any, Metrics]] = _no_finalize
    adjust: Callable[[Any, RoundSummary], Params] = lambda server, summary: summary.new_params
    not_sent: tuple[str, ...] = ()
    broadcast: Callable[[Any], Any] = lambda server: server
    send: Callable[[HookContext, LocalOutcome], Params] = lambda ctx, outcome: outcome.delta


class Chain(NamedTuple):
    """Hooks applied in order: hook k's gradient oracle is hook k-1's direction."""

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
    return Chain(tuple(hooks))
