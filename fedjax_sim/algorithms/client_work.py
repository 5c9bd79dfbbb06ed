"""`ClientWork`: one client's local training with a chain of hooks (TFF's client work)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.core import (
    Cohort,
    LocalSpec,
    LossFn,
    Params,
    Stragglers,
    local_train,
    tree_sub,
)
from fedjax_sim.algorithms.local_hook import Chain, HookContext, LocalOutcome
from fedjax_sim.algorithms.optimizers import (
    ClientOptimizer,
    check_client_optimizer,
    client_lr_at,
    client_optimizer_at,
)
from fedjax_sim.algorithms.partition import PERSONAL_ROWS, TRAINABLE, Partition
from fedjax_sim.core.checks import is_concrete, non_negative
from fedjax_sim.core.rows import Rows, gather_rows
from fedjax_sim.data.federated import FederatedData, tree_size_bytes


class ClientResult(NamedTuple):
    """One client's local training (`ClientWork.train`); the last three keyed by hook name."""

    loss: jax.Array  # [] mean local training loss
    steps: jax.Array  # [] executed local steps
    params: Params  # x_i, the final local model (its trainable view with a partition)
    delta: Params  # x_i - x_t (trainable view)
    update: Params  # what the client sends (delta through the hooks' `finish`; shared view)
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
      partition: which parameters train and which travel (`partition.Partition`; None: all
        shared). The hooks, the client optimizer and the client's update see the trainable
        view (shared and personal leaves); the personal leaves are the client's row
        `rows["personal"]`; the update leaves the client as its shared view.
    """

    loss_fn: LossFn
    client_optimizer: ClientOptimizer = 0.1
    local: LocalSpec = LocalSpec()
    hook: Chain = Chain(())
    weight_decay: Any = 0.0
    stragglers: Stragglers = Stragglers()
    box: tuple[float, float] | None = None
    partition: Partition | None = None

    def __post_init__(self):
        check_client_optimizer(self.client_optimizer)
        non_negative("weight_decay", self.weight_decay)
        if not isinstance(self.hook, Chain):
            raise TypeError("ClientWork.hook must be chain(...) of LocalHook parts")
        if self.box is not None and not (len(self.box) == 2 and self.box[0] < self.box[1]):
            raise ValueError(f"box must be (lower, upper) with lower < upper, got {self.box}")
        if self.partition is not None and not isinstance(self.partition, Partition):
            raise TypeError(f"partition must be a partition.Partition, got {self.partition!r}")
        if self.partition is not None and PERSONAL_ROWS in {h.name for h in self.hook.hooks}:
            raise ValueError(f"hook name {PERSONAL_ROWS!r} is the partition's personal rows")

    # -- views of the params (identities without a partition)
    def trainable(self, params: Params) -> Params:
        """The leaves that train (shared and personal): what hooks and clients see."""
        p = self.partition
        return params if p is None else p.select(params, params, *TRAINABLE)

    def shared(self, tree: Params, params: Params) -> Params:
        """The shared view of `tree` (params' structure): what travels."""
        p = self.partition
        return tree if p is None else p.select(tree, params, "shared")

    def personal(self, params: Params) -> bool:
        """Whether some leaves of `params` are personal (clients keep them as rows)."""
        return self.partition is not None and self.partition.has(params, "personal")

    def fill(self, view: Params, like: Params, params: Params) -> Params:
        """`view` (e.g. the shared update) completed to `like`'s leaves with zeros (identity
        without a partition)."""
        p = self.partition
        return view if p is None else p.fill(view, like, params, jnp.zeros_like)

    def merge(self, params: Params, *views: Params) -> Params:
        """The full tree from views, missing leaves from `params` (identity without a
        partition: the first view)."""
        p = self.partition
        return views[0] if p is None else p.merge(params, *views, params)

    # -- state
    def init_rows(self, params: Params, num_clients: int) -> dict[str, Any]:
        """`{hook name: Rows [C, ...]}` of the hooks with per-client state (rows of the
        trainable view), and the personal leaves `"personal"` of a partition."""
        stack = lambda row: Rows(
            jax.tree.map(lambda r: jnp.broadcast_to(r, (num_clients, *jnp.shape(r))).copy(), row)
        )
        out = {}
        for h in self.hook.hooks:
            if h.init_row is not None:
                out[h.name] = stack(h.init_row(self.trainable(params)))
        if self.personal(params):
            out[PERSONAL_ROWS] = stack(self.partition.select(params, params, "personal"))
        return out

    def init_server(self, params: Params) -> dict[str, Any]:
        return {h.name: h.init_server(self.trainable(params)) for h in self.hook.hooks}

    def optimizer(self, round_: jax.Array) -> optax.GradientTransformation:
        opt = client_optimizer_at(self.client_optimizer, round_)
        if not (is_concrete(self.weight_decay) and float(self.weight_decay) == 0.0):
            opt = optax.chain(optax.add_decayed_weights(self.weight_decay), opt)
        if self.box is not None:
            opt = optax.chain(opt, box_projection(*self.box))
        return opt

    def lr(self, round_: jax.Array) -> Any:
        return client_lr_at(self.client_optimizer, round_)

    def prepare(
        self, server: dict[str, Any], cohort: Cohort, params: Params, key: jax.Array
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """`({hook name: broadcast}, {hook name: client inputs [M, ...]})` of the round: the
        hooks' `prepare` of their server-side states."""
        view = self.trainable(params)
        out = {h.name: h.prepare(server[h.name], cohort, view, key) for h in self.hook.hooks}
        return {n: b for n, (b, _) in out.items()}, {n: i for n, (_, i) in out.items()}

    def bytes_down(self, broadcast: dict[str, Any], inputs: dict[str, Any], cohort: int) -> float:
        """Bytes one client receives from the hooks: their broadcasts and its row of their
        client inputs (`[cohort, ...]`), from the shapes and dtypes, but the parts they do
        not send."""
        total = 0.0
        for h in self.hook.hooks:
            if "broadcast" not in h.not_sent:
                total += tree_size_bytes(broadcast[h.name])
            if "client_input" not in h.not_sent:
                total += tree_size_bytes(inputs[h.name]) / cohort
        return total

    def bytes_up(self, result: ClientResult) -> float:
        """Bytes one client sends to the hooks (its summands and outputs, but the parts they
        do not send) beyond its update, from the shapes and dtypes of `result`'s pytrees."""
        total = 0.0
        for h in self.hook.hooks:
            for part, tree in (("summand", result.summands), ("output", result.outputs)):
                if part not in h.not_sent:
                    total += tree_size_bytes(tree[h.name])
        return total

    def update_bytes(
        self, params: Params, ids: jax.Array, rows: dict[str, Any]
    ) -> jax.Array | None:
        """`[M]` bytes of each client's update where a hook declares them (`LocalHook.
        update_bytes`; `params`: x_t, `rows`: the state's per-client rows), else None (the
        update's shapes)."""
        for h in self.hook.hooks:
            if h.update_bytes is not None:
                row = gather_rows(rows[h.name], ids) if h.name in rows else None
                return h.update_bytes(self.trainable(params), ids, row)
        return None

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
        """Local training of `client` from `params`, the global model x_t, merged with the
        client's personal row (`key`: the client's key)."""
        optimizer = self.optimizer(round_) if optimizer is None else optimizer
        lr = self.lr(round_)
        hooks = self.hook.hooks
        loss_fn, global_params = self.loss_fn, params
        if self.partition is not None:
            personal = rows.get(PERSONAL_ROWS)
            start = params if personal is None else self.merge(params, personal)
            params = self.trainable(start)  # w_0: shared leaves of x_t, the client's personal
            frozen = self.partition.select(global_params, global_params, "frozen")
            merge = self.partition.merge
            loss_fn = lambda w, batch: self.loss_fn(merge(global_params, w, frozen), batch)
        ctxs = {
            h.name: HookContext(
                params,
                server[h.name],
                rows.get(h.name),
                client_input[h.name],
                round_,
                lr,
                client,
                key,
            )
            for h in hooks
        }  # `server` holds the hooks' broadcast values (`ClientWork.prepare`)
        client_data = data.client(client)
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
            loss_fn=loss_fn,
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
            outcome = LocalOutcome(result.params, delta, update, result.steps, carry)
            row, summand, output, update = h.finish(ctxs[h.name], outcome)
            if h.init_row is not None:
                new_rows[h.name] = row
            summands[h.name], outputs[h.name] = summand, output
        if self.personal(global_params):
            new_rows[PERSONAL_ROWS] = self.partition.select(
                result.params, global_params, "personal"
            )
        update = self.shared(update, global_params)
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
