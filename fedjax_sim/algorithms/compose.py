"""The composable algorithm layer: an algorithm is client work (local training with a chain
of local-step hooks), an aggregator, a server optimizer and a cohort, composed into an
`Algorithm(init, step)`.

The parts follow optax (small pure parts, `chain`) and TensorFlow Federated's learning
templates (distributor, client work, aggregator, finalizer; aggregators that wrap an `inner`
one), plus two seams TFF does not have: per-client state rows (`[C, ...]`, gathered for the
cohort and scattered back) and hooks inside every local step.

    work = ClientWork(loss_fn, client_optimizer=0.1, local=LocalSpec(steps=10),
                      hook=chain(control_variates(num_clients=C)))
    algorithm = compose(work, aggregator=error_feedback(TopK(k=100)),
                        server_optimizer=optax.adam(0.01), cohort=CohortSpec(size=10))

A round (`step`): the cohort is drawn; each cohort client trains from the global model x_t
with the hooks (`ClientWork.train`), its update `Delta_i = x_i - x_t` is encoded by the
aggregator (compression, clipping, ...) and summed with the cohort weights (fused into the
client map: no `[M, d]` array in map mode); the aggregator reduces the sum to the update,
the hooks may correct it (`LocalHook.correct`), the server optimizer applies the
pseudo-gradient `-update`, and the hooks and the distributor finalize their server-side
state. Keys are those of `core` (`round_key(key, round, purpose)`, `client_key(., id)`), so
results do not depend on cohort order or on the client-map mode.

Hyper-parameters may be traced JAX scalars (so that an algorithm can be built inside a
`jax.vmap` over them): checks of numeric values (`fedjax_sim.core.checks`) run only on concrete
values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.flatten_util import ravel_pytree

from fedjax_sim.algorithms.compression import compress_tree, tree_payload_bytes
from fedjax_sim.algorithms.core import (
    COHORT,
    EXTRA,
    LOCAL,
    STRAGGLERS,
    UPLINK,
    Algorithm,
    CohortSpec,
    LocalSpec,
    LossFn,
    Metrics,
    Params,
    Stragglers,
    client_key,
    consistency,
    local_train,
    map_weighted_sum,
    mean_of_total,
    round_key,
    row_mask,
    server_update,
    tree_norm,
    tree_sq_norm,
    tree_sub,
)
from fedjax_sim.core.checks import is_concrete, non_negative, positive
from fedjax_sim.data.federated import FederatedData, tree_size_bytes
from fedjax_sim.data.store import is_rows
from fedjax_sim.runtime.parallel import ClientMap

# ------------------------------------------------------------------------------ optimizers
# float (SGD learning rate) | schedule (round -> learning rate) | optax transformation |
# callable round -> optax transformation
ClientOptimizer = Any
ServerOptimizer = Any  # float (SGD learning rate) | optax transformation


def client_optimizer_at(opt: ClientOptimizer, round_: jax.Array) -> optax.GradientTransformation:
    """The client optimizer of round `round_`: a float or a schedule's value is
    `optax.sgd(lr)`; a callable may also return an optax transformation (per-round
    optimizers)."""
    if isinstance(opt, optax.GradientTransformation):
        return opt
    if callable(opt):
        value = opt(round_)
        return value if isinstance(value, optax.GradientTransformation) else optax.sgd(value)
    return optax.sgd(opt)


def client_lr_at(opt: ClientOptimizer, round_: jax.Array) -> Any:
    """The learning rate of a float / schedule client optimizer at `round_`; None for an
    optax transformation (its learning rate is not known)."""
    if isinstance(opt, optax.GradientTransformation):
        return None
    if callable(opt):
        value = opt(round_)
        return None if isinstance(value, optax.GradientTransformation) else value
    return opt


def check_client_optimizer(opt: ClientOptimizer) -> None:
    """Validates a client optimizer where its value is concrete (round 0 of a schedule): a
    learning rate must be > 0 (to freeze the model, pass `optax.sgd(0.0)` explicitly)."""
    if isinstance(opt, optax.GradientTransformation):
        return
    if callable(opt):
        value = opt(jnp.int32(0))
        if isinstance(value, optax.GradientTransformation):
            return
        if isinstance(value, jax.Array) and value.ndim == 0:
            value = value if isinstance(value, jax.core.Tracer) else float(value)
        positive("client_optimizer (learning rate at round 0)", value)
        return
    positive("client_optimizer (learning rate)", opt)


def server_optimizer_from(opt: ServerOptimizer) -> optax.GradientTransformation:
    """A float is `optax.sgd(lr)` (lr 1 is plain averaging of the updates)."""
    if isinstance(opt, optax.GradientTransformation):
        return opt
    positive("server_optimizer (learning rate)", opt)
    return optax.sgd(opt)


# ------------------------------------------------------------------------------ hooks
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
    """

    anchor: Params
    server: Any
    row: Any
    client_input: Any
    round: jax.Array
    lr: Any
    client: jax.Array


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
      client_inputs: `(server, ids [M], params, key) -> [M, ...]` per-client inputs of a
        round computed on the server (e.g. FedLPS' anchors from every client's last model,
        DRFA's snapshot step); `key` is the round's `round_key(key, round, EXTRA)`.
      start: `ctx -> carry` at local step 0 (state carried across local steps).
      finish: `(ctx, outcome) -> (new row, summand, output)` after local training: the
        client's new row, a summand averaged over the cohort with the aggregation weights,
        and an output stacked `[M, ...]`.
      correct: `(server, summary) -> (server, update)` before the server step (e.g. FedDyn's
        `- h / alpha`).
      finalize: `(server, summary) -> (server, metrics)` after the server step.
      adjust: `(server, summary) -> params`: the global model after the server step and the
        `finalize`s (default `summary.new_params`; FedDyn's `x_{t+1} - h / alpha`).
      payload: `(params, server) -> (bytes up, bytes down)` per client beyond the model and
        its update (e.g. SCAFFOLD's control variates).
      broadcast: `server -> what the clients see as ctx.server` (computed once per round).
      send: `(ctx, outcome) -> the update the client sends` (default `outcome.delta`; in a
        chain each hook transforms the previous one's, e.g. FedNova's `Delta_i / tau_i`).
    """

    name: str
    direction: Callable[..., tuple[jax.Array, Params, Any]] = _plain_direction
    init_row: Callable[[Params], Any] | None = None
    init_server: Callable[[Params], Any] = _none
    client_inputs: Callable[[Any, jax.Array, Params, jax.Array], Any] = _none
    start: Callable[[HookContext], Any] = _none
    finish: Callable[[HookContext, LocalOutcome], tuple[Any, Any, Any]] = _no_finish
    correct: Callable[[Any, RoundSummary], tuple[Any, Params]] = _no_correct
    finalize: Callable[[Any, RoundSummary], tuple[Any, Metrics]] = _no_finalize
    adjust: Callable[[Any, RoundSummary], Params] = lambda server, summary: summary.new_params
    payload: Callable[[Params, Any], tuple[float, float]] = lambda params, server: (0.0, 0.0)
    broadcast: Callable[[Any], Any] = lambda server: server
    send: Callable[[HookContext, LocalOutcome], Params] = lambda ctx, outcome: outcome.delta


class Chain(NamedTuple):
    """Hooks applied in order: hook k's gradient oracle is hook k-1's direction."""

    hooks: tuple[LocalHook, ...]


def chain(*hooks: LocalHook) -> Chain:
    """Chains local-step hooks (optax's `chain` for the local step): the first hook sees the
    loss's gradient, each next one the previous hook's direction. Names must be distinct."""
    names = [h.name for h in hooks]
    if len(set(names)) != len(names):
        raise ValueError(f"hook names must be distinct, got {names}")
    for h in hooks:
        if not isinstance(h, LocalHook):
            raise TypeError(f"chain takes LocalHook parts, got {h!r}")
    return Chain(tuple(hooks))


# ------------------------------------------------------------------------------ client work
class ClientResult(NamedTuple):
    """One client's local training (`ClientWork.train`); the last three keyed by hook name."""

    loss: jax.Array  # [] mean local training loss
    steps: jax.Array  # [] executed local steps
    params: Params  # x_i, the final local model
    delta: Params  # x_i - x_t
    update: Params  # what the client sends (the hooks' `send` of delta)
    rows: dict[str, Any]  # new per-client rows
    summands: dict[str, Any]  # summands averaged over the cohort
    outputs: dict[str, Any]  # outputs stacked over the cohort


@dataclasses.dataclass(frozen=True, eq=False)
class ClientWork:
    """Local training of one client: `local` steps of `client_optimizer` on `loss_fn` with
    the directions of `hook` (a `chain` of local-step hooks).

    Attributes:
      loss_fn: `loss_fn(params, batch) -> scalar`, e.g. `model.loss`.
      client_optimizer: float (SGD learning rate), schedule of the round, optax
        transformation, or callable `round -> optax transformation`.
      local: local steps / epochs, batch size, minibatch sampling.
      hook: the chained local-step hooks (`chain()` is plain local SGD).
      weight_decay: `wd * x` added to the direction at the iterate
        (`optax.add_decayed_weights`, torch SGD's placement).
      stragglers: FedProx's systems heterogeneity (synchronous rounds only).
      box: optional `(lower, upper)`: project onto the box after every local step.
      attack: optional `attacks.Attack`: Byzantine clients poison their data or the update
        they send (the cohort-level ALIE is applied by `compose`).
    """

    loss_fn: LossFn
    client_optimizer: ClientOptimizer = 0.1
    local: LocalSpec = LocalSpec()
    hook: Chain = Chain(())
    weight_decay: Any = 0.0
    stragglers: Stragglers = Stragglers()
    box: tuple[float, float] | None = None
    attack: Any = None

    def __post_init__(self):
        check_client_optimizer(self.client_optimizer)
        non_negative("weight_decay", self.weight_decay)
        if not isinstance(self.hook, Chain):
            raise TypeError("ClientWork.hook must be chain(...) of LocalHook parts")
        if self.box is not None and not (len(self.box) == 2 and self.box[0] < self.box[1]):
            raise ValueError(f"box must be (lower, upper) with lower < upper, got {self.box}")

    # -- state
    def init_rows(self, params: Params, num_clients: int) -> dict[str, Any]:
        """`{hook name: rows [C, ...]}` of the hooks with per-client state."""
        out = {}
        for h in self.hook.hooks:
            if h.init_row is not None:
                row = h.init_row(params)
                out[h.name] = jax.tree.map(
                    lambda r: jnp.broadcast_to(r, (num_clients, *jnp.shape(r))).copy(), row
                )
        return out

    def init_server(self, params: Params) -> dict[str, Any]:
        return {h.name: h.init_server(params) for h in self.hook.hooks}

    def optimizer(self, round_: jax.Array) -> optax.GradientTransformation:
        opt = client_optimizer_at(self.client_optimizer, round_)
        if not (is_concrete(self.weight_decay) and float(self.weight_decay) == 0.0):
            opt = optax.chain(optax.add_decayed_weights(self.weight_decay), opt)
        if self.box is not None:
            opt = optax.chain(opt, box_projection(*self.box))
        return opt

    def lr(self, round_: jax.Array) -> Any:
        return client_lr_at(self.client_optimizer, round_)

    def broadcast(self, server: dict[str, Any]) -> dict[str, Any]:
        """What the clients see of the hooks' server-side states."""
        return {h.name: h.broadcast(server[h.name]) for h in self.hook.hooks}

    def client_inputs(
        self, server: dict[str, Any], ids: jax.Array, params: Params, key: jax.Array
    ) -> dict:
        return {h.name: h.client_inputs(server[h.name], ids, params, key) for h in self.hook.hooks}

    def payload(self, params: Params, server: dict[str, Any]) -> tuple[float, float]:
        up = down = 0.0
        for h in self.hook.hooks:
            u, d = h.payload(params, server[h.name])
            up, down = up + u, down + d
        return up, down

    # -- one client
    def train(
        self,
        params: Params,
        data: FederatedData,
        client: jax.Array,
        key: jax.Array,
        *,
        round_: jax.Array,
        server: dict[str, Any],
        rows: dict[str, Any],
        client_input: dict[str, Any],
        num_steps: jax.Array | None,
        optimizer: optax.GradientTransformation | None = None,
    ) -> ClientResult:
        """Local training of `client` from `params` (`key`: the client's key)."""
        optimizer = self.optimizer(round_) if optimizer is None else optimizer
        lr = self.lr(round_)
        hooks = self.hook.hooks
        ctxs = {
            h.name: HookContext(
                params, server[h.name], rows.get(h.name), client_input[h.name], round_, lr, client
            )
            for h in hooks
        }  # `server` holds the hooks' broadcast values (`ClientWork.broadcast`)
        client_data = data.client(client)
        byzantine = None
        if self.attack is not None:
            byzantine = self.attack.is_byzantine(client, round_, data.num_clients)
            client_data = self.attack.poison_data(client_data, byzantine)
        grad_fn = None
        if hooks:

            def grad_fn(value_and_grad, p, batch, carries):
                new = list(carries)
                oracle = value_and_grad
                for i, h in enumerate(hooks):

                    def next_oracle(q, b, h=h, i=i, inner=oracle):
                        loss, d, new[i] = h.direction(inner, q, b, carries[i], ctxs[h.name])
                        return loss, d

                    oracle = next_oracle
                loss, direction = oracle(p, batch)
                return loss, direction, tuple(new)

        result = local_train(
            params,
            client_data,
            key,
            loss_fn=self.loss_fn,
            optimizer=optimizer,
            max_steps=self.local.max_steps(data.max_count),
            num_steps=num_steps,
            batch_size=self.local.batch_size,
            sampling=self.local.sampling,
            grad_fn=grad_fn,
            aux=tuple(h.start(ctxs[h.name]) for h in hooks),
        )
        delta = tree_sub(result.params, params)
        new_rows, summands, outputs, update = {}, {}, {}, delta
        for h, carry in zip(hooks, result.aux or (), strict=True):
            outcome = LocalOutcome(result.params, delta, result.steps, carry)
            row, summand, output = h.finish(ctxs[h.name], outcome)
            if h.init_row is not None:
                new_rows[h.name] = row
            summands[h.name], outputs[h.name] = summand, output
            update = h.send(ctxs[h.name], outcome._replace(delta=update))
        if self.attack is not None:
            update = self.attack.poison_update(update, byzantine, key)
        return ClientResult(
            result.loss, result.steps, result.params, delta, update, new_rows, summands, outputs
        )


def box_projection(lower: float, upper: float) -> optax.GradientTransformation:
    """P_X for X = [lower, upper]^p after each local step: turns an update u at params z into
    `clip(z + u) - z` (chained after the client optimizer)."""

    def update(updates, state, params):
        if params is None:
            raise ValueError("box_projection needs the params")
        new = jax.tree.map(lambda u, z: jnp.clip(z + u, lower, upper) - z, updates, params)
        return new, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# ------------------------------------------------------------------------------ aggregators
class Aggregator(NamedTuple):
    """How the cohort's updates become the server's update (TFF's aggregation factories,
    wrapping an `inner` aggregator, plus per-client memory).

    Attributes:
      init: `(params, num_clients) -> (server state, {name: per-client rows [C, ...]})`.
      encode: `(update, rows, key, server) -> (sent, new rows)`: one client's transform
        before sending (compression, clipping, noise...), inside the client map; `rows` is
        the client's row of each named memory.
      reduce: `(server, total, weight, stacked, weights, key) -> (update, server, metrics)`:
        from `total = sum_i w_i sent_i` and `weight = sum_i w_i` (and, when `stacked`, the
        sent updates `[M, ...]` with their weights `[M]`) to the server's update.
      payload: `params -> bytes one client sends`.
      stacked: whether `reduce` needs the `[M, ...]` sent updates (robust aggregators);
        otherwise the sum is fused into the client map and `[M, d]` never exists.
    """

    init: Callable[[Params, int], tuple[Any, dict[str, Any]]]
    encode: Callable[[Params, dict[str, Any], jax.Array, Any], tuple[Params, dict[str, Any]]]
    reduce: Callable[..., tuple[Params, Any, Metrics]]
    payload: Callable[[Params], float]
    stacked: bool = False


@struct.dataclass
class AggregatorState:
    """The aggregator's server state and its named per-client memories `{name: [C, ...]}`."""

    server: Any
    rows: dict[str, Any]


def mean() -> Aggregator:
    """The weighted mean `sum_i w_i Delta_i / sum_i w_i` (FedAvg's aggregation)."""
    return Aggregator(
        init=lambda params, num_clients: (None, {}),
        encode=lambda update, rows, key, server: (update, rows),
        reduce=lambda server, total, weight, stacked, weights, key: (
            mean_of_total(total, weight),
            server,
            {},
        ),
        payload=lambda params: float(tree_size_bytes(params)),
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
                name: jax.tree.map(
                    lambda r: jnp.zeros((num_clients, *jnp.shape(r)), jnp.result_type(r)),
                    init_row(params),
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


# ------------------------------------------------------------------------------ distributors
class DistributorSummary(NamedTuple):
    """The round as the distributor's `finalize` sees it."""

    params: Params  # x_t
    new_params: Params  # x_{t+1}
    update: Params
    ids: jax.Array
    weights: jax.Array
    hook_means: dict[str, Any]  # the hooks' weighted `mean`s, by hook name
    round: jax.Array


class Distributor(NamedTuple):
    """Who takes part in a round (TFF's distributor, with state).

    Attributes:
      init: `num_clients -> state`.
      sample: `(state, key, counts [C], round) -> (ids [M], weights [M])`.
      downloads: `(ids, weights) -> []` number of clients that receive the model.
      finalize: `(state, summary, data, key) -> (state, metrics)` after the round (`key` the
        step's key); its `bytes_up` / `bytes_down` are added to the round's (the
        distributor's own traffic, e.g. DRFA's loss queries).
      distinct: whether the ids of a round are distinct (per-client state needs it).
      uploads: `(ids, weights) -> []` number of clients that train and send (the
        `participants` metric; default those with weight > 0; DRFA's full participation:
        all, lam_i = 0 included).
    """

    init: Callable[[int], Any]
    sample: Callable[[Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
    downloads: Callable[[jax.Array, jax.Array], jax.Array]
    finalize: Callable[..., tuple[Any, Metrics]] = lambda state, summary, data, key: (state, {})
    distinct: bool = True
    uploads: Callable[[jax.Array, jax.Array], jax.Array] = lambda ids, weights: jnp.sum(weights > 0)


def cohort_distributor(spec: CohortSpec) -> Distributor:
    """The stateless `CohortSpec` (uniform / proportional / Bernoulli, weighting) as a
    distributor."""
    return Distributor(
        init=_none,
        sample=lambda state, key, counts, round_: spec.sample(key, counts),
        downloads=spec.downloads,
        distinct=spec.sampling != "proportional",
    )


def forced_cohorts(ids: Any, weights: Any = None, *, counts_weighting: bool = True) -> Distributor:
    """Round t's cohort is row `t mod T` of `ids [T, M]` (for controlled experiments); its
    weights are row t of `weights [T, M]`, or the clients' example counts (`counts_weighting`)
    or 1 (clients without data get 0)."""
    ids = jnp.asarray(ids, jnp.int32)
    if ids.ndim != 2:
        raise ValueError(f"forced cohort ids must have shape [T, M], got {ids.shape}")
    if weights is not None:
        weights = jnp.asarray(weights)
        if weights.shape != ids.shape:
            raise ValueError(f"weights must have the shape of ids {ids.shape}, got {weights.shape}")

    def sample(state, key, counts, round_):
        row = ids[round_ % ids.shape[0]]
        n = counts[row].astype(jax.dtypes.canonicalize_dtype(jnp.float64))
        if weights is not None:
            w = jnp.where(n > 0, weights[round_ % ids.shape[0]].astype(n.dtype), 0.0)
        else:
            w = n if counts_weighting else (n > 0).astype(n.dtype)
        return row, w

    distinct = all(len(set(r)) == len(r) for r in ids.tolist())
    return Distributor(
        init=_none,
        sample=sample,
        downloads=lambda i, w: jnp.int32(i.shape[0]),
        distinct=distinct,
    )


def as_distributor(cohort: CohortSpec | Distributor) -> Distributor:
    return cohort if isinstance(cohort, Distributor) else cohort_distributor(cohort)


# ------------------------------------------------------------------------------ compose
@struct.dataclass
class FederatedState:
    """State of a composed algorithm.

    Attributes:
      params: x_t, the global model.
      opt_state: the server optimizer's state.
      round: [] int32 rounds done.
      rows: `{hook name: [C, ...]}` per-client rows of the hooks.
      hooks: `{hook name: server-side state}` of the hooks.
      aggregator: the aggregator's server state and named per-client memories.
      cohort: the distributor's state (None for a `CohortSpec`).
    """

    params: Params
    opt_state: Any
    round: jax.Array
    rows: Any = None
    hooks: Any = None
    aggregator: Any = None
    cohort: Any = None


def gather_rows(rows: Any, ids: jax.Array) -> Any:
    """Cohort rows `rows[ids]` of per-client state `[C, ...]` (or streamed `CohortRows`)."""
    return jax.tree.map(lambda r: r.gather(ids) if is_rows(r) else r[ids], rows, is_leaf=is_rows)


def scatter_rows(rows: Any, ids: jax.Array, keep: jax.Array, new: Any) -> Any:
    """Writes the new cohort rows of clients with `keep [M]` back into `[C, ...]` (or
    streamed `CohortRows`; others keep theirs; a client drawn twice keeps one of its new
    rows)."""

    def write(r, n):
        if is_rows(r):
            return r.scatter(ids, keep, n)
        k = keep.reshape(-1, *([1] * (n.ndim - 1)))
        return r.at[ids].set(jnp.where(k, n, r[ids]))

    return jax.tree.map(write, rows, new, is_leaf=is_rows)


def streamed_rows(rows: Any) -> bool:
    """Whether per-client state is streamed `CohortRows` (only the chunk's clients on
    device): population statistics over the rows are then not available."""
    return any(is_rows(r) for r in jax.tree.leaves(rows, is_leaf=is_rows))


def _check_rows(rows: Any, num_clients: int, what: str) -> None:
    for leaf in jax.tree.leaves(rows, is_leaf=is_rows):
        c = leaf.num_clients if is_rows(leaf) else leaf.shape[0]
        if c != num_clients:
            raise ValueError(
                f"{what} was built for num_clients={c} but the data has "
                f"{num_clients} clients; build the algorithm with num_clients=data.num_clients"
            )


def compose(
    work: ClientWork,
    *,
    num_clients: int | None = None,
    aggregator: Aggregator | None = None,
    server_optimizer: ServerOptimizer = 1.0,
    cohort: CohortSpec | Distributor = CohortSpec(),
    client_map: ClientMap = ClientMap(),
    report_cohort: bool = False,
    report_sent: bool = False,
) -> Algorithm:
    """A synchronous federated algorithm from its parts.

    Args:
      work: the client work (local training with its hooks).
      num_clients: C, needed when a hook or the aggregator keeps per-client rows.
      aggregator: from the cohort's updates to the server update (default `mean()`).
      server_optimizer: optax transformation applied to the pseudo-gradient `-update`
        (a float is SGD with that learning rate; 1.0 is plain averaging).
      cohort: a `CohortSpec` or a `Distributor` (stateful sampling, forced cohorts).
      client_map: how the cohort is mapped (vmap / chunked lax.map / sharded).
      report_cohort: also report the round's `cohort_ids [M]`, `cohort_weights [M]` and the
        local steps each cohort client executed, `cohort_steps [M]`.
      report_sent: also report `sent [M, d]`: what each cohort client sent over the network
        (its update after the aggregator's encode, i.e. compressed, clipped or poisoned by
        an attack), flattened in `jax.flatten_util.ravel_pytree(params)` order; rows of
        clients with weight 0 are reported too. With `mean()` the weighted mean of the rows
        is the round's update.

    Metrics: `train_loss`, `participants`, `stragglers`, `local_steps`, `update_norm`,
    `consistency` (FedMIM's C_t), `bytes_up`, `bytes_down`, `uplink_memory_rms` (aggregators
    with per-client memory), and the hooks' and the distributor's own.
    """
    aggregator = aggregator or mean()
    server_opt = server_optimizer_from(server_optimizer)
    distributor = as_distributor(cohort)
    needs_rows = any(h.init_row is not None for h in work.hook.hooks)
    if needs_rows and not distributor.distinct:
        raise ValueError(
            "hooks with per-client state need distinct cohort ids: use "
            "CohortSpec(sampling='uniform' or 'bernoulli'), not 'proportional'"
        )
    if num_clients is not None and not (isinstance(num_clients, int) and num_clients >= 1):
        raise ValueError(f"num_clients must be an int >= 1, got {num_clients!r}")
    hooks = work.hook.hooks
    uniform_work = work.local.epochs is None and work.stragglers.fraction == 0.0
    cohort_attack = work.attack is not None and work.attack.cohort_level
    stack_sent = aggregator.stacked or cohort_attack or report_sent

    def init(params: Params, key: jax.Array) -> FederatedState:
        del key
        rows, (agg_server, agg_rows) = {}, aggregator.init(params, num_clients or 1)
        if needs_rows or agg_rows:
            if num_clients is None:
                raise ValueError("this algorithm keeps per-client state: give num_clients=C")
            rows = work.init_rows(params, num_clients)
        return FederatedState(
            params=params,
            opt_state=server_opt.init(params),
            round=jnp.int32(0),
            rows=rows,
            hooks=work.init_server(params),
            aggregator=AggregatorState(agg_server, agg_rows),
            cohort=distributor.init(num_clients),
        )

    def step(state: FederatedState, data: FederatedData, key: jax.Array):
        _check_rows(state.rows, data.num_clients, "the hooks' per-client state")
        _check_rows(state.aggregator.rows, data.num_clients, "the aggregator's per-client memory")
        x, t = state.params, state.round
        ids, weights = distributor.sample(state.cohort, round_key(key, t, COHORT), data.counts, t)
        counts = data.counts[ids]
        num_steps = work.local.num_steps(counts)
        num_steps, weights, is_straggler = work.stragglers.apply(
            round_key(key, t, STRAGGLERS), ids, counts, num_steps, weights, work.local
        )
        optimizer = work.optimizer(t)
        local_key = round_key(key, t, LOCAL)
        uplink_key = round_key(key, t, UPLINK)
        agg_server, agg_rows = state.aggregator.server, state.aggregator.rows
        cohort_rows = gather_rows(state.rows, ids)
        cohort_agg_rows = gather_rows(agg_rows, ids)
        inputs = work.client_inputs(state.hooks, ids, x, round_key(key, t, EXTRA))
        broadcast = work.broadcast(state.hooks)

        def client_fn(cid, steps, rows, agg_row, client_input):
            res = work.train(
                x,
                data,
                cid,
                client_key(local_key, cid),
                round_=t,
                server=broadcast,
                rows=rows,
                client_input=client_input,
                num_steps=None if uniform_work else steps,
                optimizer=optimizer,
            )
            sent, agg_row = aggregator.encode(
                res.update, agg_row, client_key(uplink_key, cid), agg_server
            )
            summand = (sent, res.loss, tree_sq_norm(res.delta), res.summands)
            stacked = sent if stack_sent else None
            return summand, (res.steps, res.rows, agg_row, res.outputs, stacked)

        total, total_weight, outs = map_weighted_sum(
            client_fn,
            ids,
            weights,
            num_steps,
            cohort_rows,
            cohort_agg_rows,
            inputs,
            client_map=client_map,
        )
        total_sent, others = total[0], total[1:]
        train_loss, mean_sq_norm, hook_means = mean_of_total(others, total_weight)
        local_steps, new_rows, new_agg_rows, outputs, stacked = outs
        if cohort_attack:  # ALIE: Byzantine rows replaced from the cohort's sent updates
            byzantine = jax.vmap(lambda c: work.attack.is_byzantine(c, t, data.num_clients))(ids)
            stacked = work.attack.poison_cohort(stacked, byzantine, weights)
            total_sent = jax.tree.map(
                lambda x: jnp.tensordot(weights.astype(x.dtype), x, axes=1), stacked
            )
        update, agg_server, agg_metrics = aggregator.reduce(
            agg_server,
            total_sent,
            total_weight,
            stacked if aggregator.stacked else None,
            weights,
            uplink_key,
        )
        contributed = total_weight > 0
        part = weights > 0
        rows = dict(state.rows)
        changes = {}
        for name, new in new_rows.items():
            old = cohort_rows[name]
            kept = jax.tree.map(
                lambda n, o: jnp.where(part.reshape(-1, *([1] * (n.ndim - 1))), n, o), new, old
            )
            changes[name] = jax.tree.map(lambda n, o: jnp.sum(n - o, axis=0), kept, old)
            rows[name] = scatter_rows(state.rows[name], ids, part, new)
        streamed = streamed_rows(state.rows)
        max_steps = work.local.max_steps(data.max_count)
        lr = work.lr(t)

        def summary(h, new_params, upd):
            return RoundSummary(
                params=x,
                new_params=new_params,
                update=upd,
                ids=ids,
                weights=weights,
                contributed=contributed,
                mean=hook_means[h.name],
                outputs=outputs[h.name],
                rows=None if streamed else rows.get(h.name),
                row_change=changes.get(h.name),
                num_clients=data.num_clients,
                local_steps=max_steps,
                lr=lr,
                round=t,
            )

        mean_update = update  # what the cohort sent, before the hooks' corrections
        servers = dict(state.hooks)
        for h in hooks:
            servers[h.name], update = h.correct(servers[h.name], summary(h, None, update))
        params, opt_state = server_update(x, update, server_opt, state.opt_state, contributed)
        metrics: Metrics = {}
        for h in hooks:
            servers[h.name], m = h.finalize(servers[h.name], summary(h, params, update))
            metrics.update(m)
        for h in hooks:
            params = h.adjust(servers[h.name], summary(h, params, update))
        cohort_state, cohort_metrics = distributor.finalize(
            state.cohort,
            DistributorSummary(x, params, update, ids, weights, hook_means, t),
            data,
            key,
        )
        agg_rows = scatter_rows(agg_rows, ids, part, new_agg_rows)
        participants = distributor.uploads(ids, weights)
        cohort_up = cohort_metrics.pop("bytes_up", 0.0)
        cohort_down = cohort_metrics.pop("bytes_down", 0.0)
        up, down = work.payload(x, state.hooks)
        size = float(tree_size_bytes(x))
        metrics = {
            "train_loss": train_loss,
            "participants": participants,
            "stragglers": jnp.sum(is_straggler),
            "local_steps": jnp.sum(jnp.where(part, local_steps, 0)) / jnp.maximum(jnp.sum(part), 1),
            "update_norm": tree_norm(mean_update),
            "consistency": consistency(mean_sq_norm, mean_update),
            "bytes_up": participants.astype(jnp.float32) * (aggregator.payload(x) + up) + cohort_up,
            "bytes_down": distributor.downloads(ids, weights).astype(jnp.float32) * (size + down)
            + cohort_down,
            **agg_metrics,
            **metrics,
            **cohort_metrics,
        }
        if jax.tree.leaves(agg_rows) and not streamed_rows(agg_rows):
            # RMS over clients of the memory norms ||e_i|| (all C rows: not when streamed)
            metrics["uplink_memory_rms"] = tree_norm(agg_rows) / jnp.sqrt(data.num_clients)
        if report_cohort:
            metrics.update(cohort_ids=ids, cohort_weights=weights, cohort_steps=local_steps)
        if report_sent:
            metrics["sent"] = jax.vmap(lambda row: ravel_pytree(row)[0])(stacked)
        new_state = FederatedState(
            params=params,
            opt_state=opt_state,
            round=t + 1,
            rows=rows,
            hooks=servers,
            aggregator=AggregatorState(agg_server, agg_rows),
            cohort=cohort_state,
        )
        return new_state, metrics

    def rows(state: FederatedState) -> FederatedState:
        agg = state.aggregator
        return row_mask(state, False).replace(
            rows=row_mask(state.rows, True),
            aggregator=AggregatorState(row_mask(agg.server, False), row_mask(agg.rows, True)),
        )

    return Algorithm(init, step, rows)


# ------------------------------------------------------------------------------ presets
@dataclasses.dataclass(frozen=True)
class Options:
    """The parts every synchronous preset accepts besides its own hyper-parameters (see
    `compose` and `ClientWork`; presets may change the defaults)."""

    client_optimizer: ClientOptimizer = 0.1
    server_optimizer: ServerOptimizer = 1.0
    local: LocalSpec = LocalSpec()
    cohort: CohortSpec | Distributor = CohortSpec()
    aggregator: Aggregator | None = None
    weight_decay: Any = 0.0
    stragglers: Stragglers = Stragglers()
    num_clients: int | None = None
    client_map: ClientMap = ClientMap()
    report_cohort: bool = False
    report_sent: bool = False
    attack: Any = None


def preset(
    fixed: tuple[str, ...] = (), *, options_class: type = Options, **defaults: Any
) -> Callable[[Callable[..., Algorithm]], Callable[..., Algorithm]]:
    """Declares a preset `name(loss_fn, *, own hyper-parameters, options)` with the
    `options_class` defaults (`Options`: synchronous; `asynchronous.AsyncOptions`) changed by
    `defaults`; the options named in `fixed` are set by the preset itself and refused from
    callers. The decorated function receives its own keyword arguments plus `options`; its
    signature (for `help`, the CLI and `fedjax-sim list`) shows the accepted options as
    keyword-only parameters."""
    import functools
    import inspect

    option_names = tuple(f.name for f in dataclasses.fields(options_class))
    unknown = (set(defaults) | set(fixed)) - set(option_names)
    if unknown:
        raise TypeError(f"unknown preset option defaults {sorted(unknown)}")

    def wrap(fn: Callable[..., Algorithm]) -> Callable[..., Algorithm]:
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.name != "options"]
        own_names = {p.name for p in own}
        base = options_class(**defaults)
        extra = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=getattr(base, name))
            for name in option_names
            if name not in own_names and name not in fixed
        ]
        accepted = own_names - {"loss_fn"} | {p.name for p in extra}

        @functools.wraps(fn)
        def factory(loss_fn: LossFn, **kwargs: Any) -> Algorithm:
            bad = set(kwargs) - accepted
            if bad:
                raise TypeError(
                    f"{fn.__name__}() got unexpected keyword arguments {sorted(bad)}; it "
                    f"takes {sorted(accepted)}"
                )
            # an option the preset also names (e.g. a required num_clients) goes to both
            opts = {k: v for k, v in kwargs.items() if k in option_names}
            own_kwargs = {k: v for k, v in kwargs.items() if k in own_names}
            return fn(loss_fn, options=dataclasses.replace(base, **opts), **own_kwargs)

        factory.__signature__ = sig.replace(parameters=own + extra)
        factory.defaults = base
        return factory

    return wrap


def option_names(factory: Callable[..., Algorithm]) -> tuple[str, ...]:
    """The common options a preset (or a `functools.partial` of one) takes besides its own
    hyper-parameters (empty for a plain factory)."""
    base = getattr(factory, "defaults", None) or getattr(
        getattr(factory, "func", None), "defaults", None
    )
    if base is None:
        return ()
    return tuple(f.name for f in dataclasses.fields(base))


def synchronous(loss_fn: LossFn, options: Options, *hooks: LocalHook) -> Algorithm:
    """`compose` of the chained `hooks` with the `options` of a preset."""
    o = options
    work = ClientWork(
        loss_fn,
        client_optimizer=o.client_optimizer,
        local=o.local,
        hook=chain(*hooks),
        weight_decay=o.weight_decay,
        stragglers=o.stragglers,
        attack=o.attack,
    )
    return compose(
        work,
        num_clients=o.num_clients,
        aggregator=o.aggregator,
        server_optimizer=o.server_optimizer,
        cohort=o.cohort,
        client_map=o.client_map,
        report_cohort=o.report_cohort,
        report_sent=o.report_sent,
    )
