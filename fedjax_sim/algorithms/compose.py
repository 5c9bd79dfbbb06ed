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
client map: no `[M, d]` array in map mode); the aggregator reduces the sum to the update;
the hooks' `finalize`s wrap the server optimizer, which applies the pseudo-gradient
`-update` (a hook may correct the update before it, move the model after it and update its
server-side state); the distributor finalizes its own state. Keys are those of `core`
(`round_key(key, round, purpose)`, `client_key(., id)`), so results do not depend on cohort
order or on the client-map mode.

Hyper-parameters may be traced JAX scalars (so that an algorithm can be built inside a
`jax.vmap` over them): checks of numeric values (`fedjax_sim.core.checks`) run only on concrete
values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.flatten_util import ravel_pytree

from fedjax_sim.algorithms.aggregators import (
    Aggregator,
    AggregatorState,
    mean,
)
from fedjax_sim.algorithms.attacks import byzantine, colluding
from fedjax_sim.algorithms.client_work import ClientWork
from fedjax_sim.algorithms.core import (
    COHORT,
    DEVICES,
    EXTRA,
    LOCAL,
    STRAGGLERS,
    UPLINK,
    Algorithm,
    Cohort,
    CohortSpec,
    LocalSpec,
    LossFn,
    Metrics,
    Params,
    Stragglers,
    client_key,
    consistency,
    map_weighted_sum,
    mean_of_total,
    round_key,
    server_update,
    tree_norm,
    tree_sq_norm,
)
from fedjax_sim.algorithms.device_model import DeviceModel
from fedjax_sim.algorithms.distributors import Distributor, DistributorSummary, as_distributor
from fedjax_sim.algorithms.local_hook import LocalHook, RoundSummary, chain
from fedjax_sim.algorithms.optimizers import ClientOptimizer, ServerOptimizer, server_optimizer_from
from fedjax_sim.algorithms.partition import PERSONAL_ROWS, Partition
from fedjax_sim.core.rows import check_rows, gather_rows, scatter_rows, streamed_rows
from fedjax_sim.data.federated import FederatedData, tree_size_bytes
from fedjax_sim.runtime.parallel import ClientMap


@struct.dataclass
class FederatedState:
    """State of a composed algorithm.

    Attributes:
      params: x_t, the global model.
      opt_state: the server optimizer's state.
      round: [] int32 rounds done.
      rows: `{hook name: Rows [C, ...]}` per-client rows of the hooks.
      hooks: `{hook name: server-side state}` of the hooks.
      aggregator: the aggregator's server state and named per-client memories (`Rows`).
      cohort: the distributor's state (None for a `CohortSpec`).
      clock: `[]` virtual seconds elapsed under a `device_model` (None without one).
    """

    params: Params
    opt_state: Any
    round: jax.Array
    rows: Any = None
    hooks: Any = None
    aggregator: Any = None
    cohort: Any = None
    clock: Any = None


def _round_bytes_up(per_client: Any, reported: jax.Array, participants: jax.Array) -> jax.Array:
    """The round's `bytes_up`: `participants` x one client's bytes, or the sum of the `[N]`
    per-client bytes over the reporting slots."""
    if jnp.ndim(per_client) == 0:
        return participants.astype(jnp.float32) * per_client
    return jnp.sum(jnp.where(reported, per_client, 0.0))


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
    device_model: DeviceModel | None = None,
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
        a Byzantine client; ALIE's colluding rows are replaced inside its aggregator's
        `reduce`, after this), flattened in `jax.flatten_util.ravel_pytree(params)` order; rows of
        clients with weight 0 are reported too. With `mean()` the weighted mean of the rows
        is the round's update.
      device_model: device profiles and the virtual clock (`device_model.DeviceModel`:
        availability, deadline, over-selection); adds the metrics `round_time`,
        `virtual_time`, `unavailable`, `late`, `dropouts`. None: no clock (the default).

    Metrics: `train_loss`, `participants`, `stragglers`, `local_steps`, `update_norm`,
    `consistency` (FedMIM's C_t), `bytes_up`, `bytes_down`, `uplink_memory_rms` (aggregators
    with per-client memory), and the hooks' and the distributor's own.
    """
    aggregator = aggregator or mean()
    server_opt = server_optimizer_from(server_optimizer)
    distributor = as_distributor(cohort)
    keep = None  # clients a round keeps under over-selection (None: all drawn)
    if device_model is not None and device_model.over_selection > 1:
        if not (isinstance(cohort, CohortSpec) and cohort.size is not None):
            raise ValueError("over_selection needs a CohortSpec with a cohort size M")
        if cohort.sampling == "bernoulli":
            raise ValueError("over_selection needs uniform or proportional cohort sampling")
        keep = cohort.size
        cohort = dataclasses.replace(cohort, size=device_model.selection_size(keep))
        distributor = as_distributor(cohort)
    aware = device_model is not None and device_model.cohort == "available"
    if aware and not (
        isinstance(cohort, CohortSpec)
        and cohort.size is not None
        and cohort.sampling in ("uniform", "proportional")
    ):
        raise ValueError(
            "cohort='available' needs a CohortSpec with a cohort size M and uniform or "
            "proportional sampling"
        )
    drawn_spec = cohort  # the drawn cohort's spec (ceil(f M) under over-selection)
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
    if device_model is not None and device_model.late == "partial":
        uniform_work = False
    stack_sent = aggregator.stacked or report_sent

    personal = work.partition is not None

    def init(params: Params, key: jax.Array) -> FederatedState:
        del key
        shared = work.shared(params, params)
        rows, (agg_server, agg_rows) = {}, aggregator.init(shared, num_clients or 1)
        personal_rows = work.personal(params)
        if personal_rows and not distributor.distinct:
            raise ValueError(
                "personal parameters are per-client rows and need distinct cohort ids: use "
                "CohortSpec(sampling='uniform' or 'bernoulli'), not 'proportional'"
            )
        if needs_rows or agg_rows or personal_rows:
            if num_clients is None:
                raise ValueError("this algorithm keeps per-client state: give num_clients=C")
            rows = work.init_rows(params, num_clients)
        return FederatedState(
            params=params,
            opt_state=server_opt.init(shared),
            round=jnp.int32(0),
            rows=rows,
            hooks=work.init_server(params),
            aggregator=AggregatorState(agg_server, agg_rows),
            cohort=distributor.init(num_clients),
            clock=None if device_model is None else device_model.init(),
        )

    def step(state: FederatedState, data: FederatedData, key: jax.Array):
        check_rows(state.rows, data.num_clients, "the hooks' per-client state")
        check_rows(state.aggregator.rows, data.num_clients, "the aggregator's per-client memory")
        x, t = state.params, state.round
        x_view, x_shared = work.trainable(x), work.shared(x, x)  # hooks' view, what travels
        if aware:
            ids, weights = device_model.available_cohort(
                state.clock, round_key(key, t, COHORT), drawn_spec, data.counts
            )
        else:
            ids, weights = distributor.sample(
                state.cohort, round_key(key, t, COHORT), data.counts, t
            )
        counts = data.counts[ids]
        num_steps = work.local.num_steps(counts)
        num_steps, weights, is_straggler = work.stragglers.apply(
            round_key(key, t, STRAGGLERS), ids, counts, num_steps, weights, work.local
        )
        optimizer = work.optimizer(t)
        local_key = round_key(key, t, LOCAL)
        uplink_key = round_key(key, t, UPLINK)
        agg_server, agg_rows = state.aggregator.server, state.aggregator.rows
        # bytes one client sends, from the shapes of what it sends (at trace time): its update
        # and the hooks' other parts
        uplink = {}

        def client_fn_for(broadcast):
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
                sent_bytes = (
                    aggregator.payload(x_shared) if aggregator.payload else tree_size_bytes(sent)
                )
                uplink["update"], uplink["other"] = sent_bytes, work.bytes_up(res)
                summand = (sent, res.loss, tree_sq_norm(work.shared(res.delta, x)), res.summands)
                stacked = sent if stack_sent else None
                return summand, (res.steps, res.rows, agg_row, res.outputs, stacked)

            return client_fn

        def client_bytes(ids, weights, num_steps):
            """`(bytes one client receives, bytes each sends)` this round (`upload_bytes`),
            from the shapes and dtypes of what it receives and sends: the hooks' `prepare`
            and one client's work traced by `jax.eval_shape` (nothing of it runs)."""
            sizes = {}

            def one(ids, weights, num_steps):
                cohort = Cohort(ids, weights, t, data.num_clients)
                broadcast, inputs = work.prepare(state.hooks, cohort, x, round_key(key, t, EXTRA))
                sizes["down"] = float(tree_size_bytes(x_shared)) + work.bytes_down(
                    broadcast, inputs, ids.shape[0]
                )
                first = lambda tree: jax.tree.map(lambda a: a[0], tree)
                client_fn_for(broadcast)(
                    ids[0],
                    num_steps[0],
                    first(gather_rows(state.rows, ids[:1])),
                    first(gather_rows(state.aggregator.rows, ids[:1])),
                    first(inputs),
                )

            jax.eval_shape(one, ids, weights, num_steps)
            return sizes["down"], upload_bytes(ids)

        def upload_bytes(ids):
            """Bytes each client of `ids [N]` sends: `[N]` where a hook sizes its update
            (`LocalHook.update_bytes`) and the aggregator has no wire format of its own,
            else one number for all."""
            sized = None if aggregator.payload else work.update_bytes(x, ids, state.rows)
            if sized is None:
                return uplink["update"] + uplink["other"]
            return sized.astype(jnp.float32) + jnp.float32(uplink["other"])

        clock, device_metrics, downloads = state.clock, {}, None
        if device_model is not None:
            bytes_down, bytes_up = client_bytes(ids, weights, num_steps)
            plan = device_model.plan(
                state.clock,
                round_key(key, t, DEVICES),
                ids,
                weights,
                num_steps,
                keep=ids.shape[0] if keep is None else keep,
                bytes_down=bytes_down,
                bytes_up=bytes_up,
                round_trips=aggregator.round_trips,
            )
            ids, is_straggler = ids[plan.slots], is_straggler[plan.slots]
            weights, num_steps = plan.weights, plan.num_steps
            clock, device_metrics, downloads = plan.clock, plan.metrics, plan.downloads
        cohort_rows = gather_rows(state.rows, ids)
        cohort_agg_rows = gather_rows(agg_rows, ids)
        cohort = Cohort(ids, weights, t, data.num_clients)
        broadcast, inputs = work.prepare(state.hooks, cohort, x, round_key(key, t, EXTRA))

        total, total_weight, outs = map_weighted_sum(
            client_fn_for(broadcast),
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
        update, agg_server, agg_metrics = aggregator.reduce(
            agg_server,
            total_sent,
            total_weight,
            stacked if aggregator.stacked else None,
            cohort,
            uplink_key,
        )
        contributed = total_weight > 0
        part = weights > 0
        rows = dict(state.rows)
        for name, new in new_rows.items():
            rows[name] = scatter_rows(state.rows[name], ids, part, new)
        streamed = streamed_rows(state.rows)
        max_steps = work.local.max_steps(data.max_count)
        lr = work.lr(t)
        mean_update = update  # what the cohort sent, before the hooks' corrections
        servers = dict(state.hooks)
        hook_metrics: dict[str, Metrics] = {}
        applied = {}  # the update the server optimizer applies, and its new state

        def finalize(k: int, upd: Params) -> Params:
            """Hook k's `finalize` around the hooks after it and the server optimizer."""
            if k == len(hooks):
                if applied:
                    raise ValueError("a hook's finalize called server_step more than once")
                upd = work.shared(upd, x)
                new_shared, applied["opt_state"] = server_update(
                    x_shared, upd, server_opt, state.opt_state, contributed
                )
                applied["update"] = upd
                return work.trainable(work.merge(x, new_shared))
            h = hooks[k]
            summary = RoundSummary(
                params=x_view,
                update=upd,
                cohort=cohort,
                mean=hook_means[h.name],
                outputs=outputs[h.name],
                rows=None if streamed or h.name not in rows else rows[h.name].value,
                local_steps=max_steps,
                lr=lr,
                model=x,
            )
            servers[h.name], new_params, hook_metrics[h.name] = h.finalize(
                servers[h.name], summary, lambda u: finalize(k + 1, u)
            )
            return new_params

        # the hooks see the trainable view: the personal leaves of the update are zeros
        params = work.merge(x, finalize(0, work.fill(update, x_view, x)))
        if not applied:
            raise ValueError("a hook's finalize must call server_step (once)")
        opt_state, update = applied["opt_state"], applied["update"]
        metrics: Metrics = {}
        for h in hooks:
            metrics.update(hook_metrics[h.name])
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
        down = float(tree_size_bytes(x_shared)) + work.bytes_down(broadcast, inputs, ids.shape[0])
        if downloads is None:
            downloads = distributor.downloads(ids, weights)
        metrics = {
            "train_loss": train_loss,
            "participants": participants,
            "stragglers": jnp.sum(is_straggler),
            "local_steps": jnp.sum(jnp.where(part, local_steps, 0)) / jnp.maximum(jnp.sum(part), 1),
            "update_norm": tree_norm(mean_update),
            "consistency": consistency(mean_sq_norm, mean_update),
            "bytes_up": _round_bytes_up(upload_bytes(ids), part, participants) + cohort_up,
            "bytes_down": downloads.astype(jnp.float32) * down + cohort_down,
            **agg_metrics,
            **metrics,
            **cohort_metrics,
            **device_metrics,
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
            clock=clock,
        )
        return new_state, metrics

    def personalize(state: FederatedState, data: FederatedData, ids: jax.Array, key: jax.Array):
        """The clients' models: the global model with their personal rows."""
        del data, key
        x = state.params
        stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (ids.shape[0], *a.shape)), x)
        if not work.personal(x):
            return stacked
        return work.partition.merge(x, gather_rows(state.rows[PERSONAL_ROWS], ids), stacked)

    return Algorithm(init, step, personalize if personal else None)


# ------------------------------------------------------------------------------ presets
@dataclasses.dataclass(frozen=True)
class Options:
    """The parts every synchronous preset accepts besides its own hyper-parameters (see
    `compose` and `ClientWork`; presets may change the defaults). `hooks`: local-step hooks
    chained ahead of the preset's own (they see the loss's gradient and the client's own
    update first, and their `finalize` wraps the preset's; e.g. a LoRA rank rule,
    `lora.with_rule`)."""

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
    partition: Partition | None = None
    device_model: DeviceModel | None = None
    hooks: tuple[LocalHook, ...] = ()


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


def synchronous(
    loss_fn: LossFn, options: Options, *hooks: LocalHook, work: type[ClientWork] = ClientWork
) -> Algorithm:
    """`compose` of the chained `options.hooks` and `hooks` with the `options` of a preset
    (an `attack` is the `attacks.byzantine` hook last in the chain, or ALIE's
    `attacks.colluding` aggregator around the preset's); `work`: the client work's class
    (IFCA's `ClusteredWork`)."""
    o = options
    hooks = (*o.hooks, *hooks)
    aggregator = o.aggregator
    if o.attack is not None and o.attack.cohort_level:
        aggregator = colluding(o.attack, aggregator)
    elif o.attack is not None:
        hooks = (*hooks, byzantine(o.attack))
    client_work = work(
        loss_fn,
        client_optimizer=o.client_optimizer,
        local=o.local,
        hook=chain(*hooks),
        weight_decay=o.weight_decay,
        stragglers=o.stragglers,
        partition=o.partition,
    )
    return compose(
        client_work,
        num_clients=o.num_clients,
        aggregator=aggregator,
        server_optimizer=o.server_optimizer,
        cohort=o.cohort,
        client_map=o.client_map,
        report_cohort=o.report_cohort,
        report_sent=o.report_sent,
        device_model=o.device_model,
    )
