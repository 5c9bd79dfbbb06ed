"""FedAvg and its server-optimizer family (FedSGD, FedAvgM, FedAdam, FedYogi, FedAdagrad).

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data"
(AISTATS 2017); Reddi et al., "Adaptive Federated Optimization" (ICLR 2021).

Round t: sample a cohort S_t; each client runs local training from x_t with the client
optimizer and returns `Delta_i = x_i - x_t`; the server forms the weighted mean
`Delta = sum_i w_i Delta_i / sum_i w_i` and applies its optax optimizer to the
pseudo-gradient `-Delta`. With `server_optimizer=optax.sgd(1.0)` this is plain FedAvg
`x_{t+1} = sum_i w_i x_i / sum_i w_i`.

Note on Reddi et al.: their FedAdam uses Adam without bias correction and epsilon (tau)
outside the square root; `optax.adam(lr, b1, b2, eps)` is bias-corrected. Both are
available: pass any optax transformation as `server_optimizer`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_sim.algorithms.core import (
    COHORT,
    LOCAL,
    STRAGGLERS,
    UPLINK,
    Algorithm,
    ClientOptimizer,
    CohortSpec,
    GradFn,
    LocalSpec,
    LossFn,
    Params,
    Stragglers,
    client_key,
    client_optimizer_for_round,
    consistency,
    local_train,
    map_cohort,
    payload_metrics,
    round_key,
    server_optimizer_from,
    server_update,
    tree_norm,
    tree_sq_norm,
    tree_sub,
)
from fedjax_sim.compression import Uplink
from fedjax_sim.data.federated import FederatedData, tree_size_bytes
from fedjax_sim.parallel import ClientMap


@struct.dataclass
class ServerState:
    """State of the FedAvg family: global params, server optimizer state, round counter, and
    the per-client memory of the uplink (e.g. error-feedback errors `[C, ...]`; None without
    an uplink or for a stateless one)."""

    params: Params
    opt_state: Any
    round: jax.Array  # [] int32
    uplink: Any = None


def local_update_round(
    loss_fn: LossFn,
    *,
    client_optimizer: ClientOptimizer,
    server_optimizer: float | optax.GradientTransformation,
    local: LocalSpec,
    cohort: CohortSpec,
    stragglers: Stragglers,
    client_map: ClientMap,
    make_grad_fn: Callable[[Params], GradFn] | None = None,
    make_round_grad_fn: Callable[[Params, jax.Array], GradFn] | None = None,
    uplink: Uplink | None = None,
) -> Algorithm:
    """The FedAvg-type round shared by FedAvg, FedProx and friends: local training with an
    optional gradient hook `make_grad_fn(global_params)` (or `make_round_grad_fn(global_params,
    round)` for round-dependent hooks, e.g. a proximal weight following a step-size schedule),
    weighted mean of deltas, server optimizer. Algorithms without per-client state build on
    this. With an `uplink` (`fedjax_sim.compression.ErrorFeedback` / `Compressed`), each
    client sends `uplink.apply(Delta_i, memory_i)` instead of `Delta_i`; the memory of all C
    clients lives in `state.uplink` and only clients that send (weight > 0) update theirs;
    `bytes_up` counts the compressed payload."""
    if make_grad_fn is not None and make_round_grad_fn is not None:
        raise ValueError("give at most one of make_grad_fn and make_round_grad_fn")
    server_opt = server_optimizer_from(server_optimizer)
    client_optimizer_for_round(client_optimizer, jnp.int32(0))  # validate eagerly

    def init(params: Params, key: jax.Array) -> ServerState:
        del key
        return ServerState(
            params=params,
            opt_state=server_opt.init(params),
            round=jnp.int32(0),
            uplink=uplink.init(params) if uplink is not None else None,
        )

    def step(state: ServerState, data: FederatedData, key: jax.Array):
        idx, weights = cohort.sample(round_key(key, state.round, COHORT), data.counts)
        counts = data.counts[idx]
        num_steps = local.num_steps(counts)
        num_steps, weights, is_straggler = stragglers.apply(
            round_key(key, state.round, STRAGGLERS), idx, counts, num_steps, weights, local
        )
        uniform_work = local.epochs is None and stragglers.fraction == 0.0
        optimizer = client_optimizer_for_round(client_optimizer, state.round)
        grad_fn = make_grad_fn(state.params) if make_grad_fn else None
        if make_round_grad_fn is not None:
            grad_fn = make_round_grad_fn(state.params, state.round)
        local_key = round_key(key, state.round, LOCAL)
        uplink_key = round_key(key, state.round, UPLINK)
        memory = _gather_memory(state.uplink, idx, data.num_clients)

        def client_fn(cid, steps, mem):
            result = local_train(
                state.params,
                data.client(cid),
                client_key(local_key, cid),
                loss_fn=loss_fn,
                optimizer=optimizer,
                max_steps=local.max_steps(data.max_count),
                num_steps=None if uniform_work else steps,
                batch_size=local.batch_size,
                sampling=local.sampling,
                grad_fn=grad_fn,
            )
            delta = tree_sub(result.params, state.params)
            sent = delta
            if uplink is not None:
                sent, mem = uplink.apply(delta, mem, client_key(uplink_key, cid))
            return (sent, result.loss, tree_sq_norm(delta)), (result.steps, mem)

        out = map_cohort(client_fn, idx, weights, num_steps, memory, client_map=client_map)
        mean_delta, train_loss, mean_sq_norm = out.mean
        local_steps, new_memory = out.outputs
        contributed = out.total_weight > 0
        params, opt_state = server_update(
            state.params, mean_delta, server_opt, state.opt_state, apply=contributed
        )
        participants = jnp.sum(weights > 0)
        metrics = {
            "train_loss": train_loss,
            "participants": participants,
            "stragglers": jnp.sum(is_straggler),
            "local_steps": jnp.sum(jnp.where(weights > 0, local_steps, 0))
            / jnp.maximum(participants, 1),
            "update_norm": tree_norm(mean_delta),
            "consistency": consistency(mean_sq_norm, mean_delta),
            **payload_metrics(
                state.params,
                participants,
                cohort.downloads(idx, weights),
                up_models=1.0 if uplink is None else _upload_models(uplink, state.params),
            ),
        }
        memory = _scatter_memory(state.uplink, idx, weights > 0, new_memory)
        if jax.tree.leaves(memory):  # RMS over clients of the memory norms ||e_i||
            metrics["uplink_memory_rms"] = tree_norm(memory) / jnp.sqrt(data.num_clients)
        new_state = ServerState(
            params=params, opt_state=opt_state, round=state.round + 1, uplink=memory
        )
        return new_state, metrics

    return Algorithm(init, step)


def _upload_models(uplink: Uplink, params: Params) -> float:
    """Uplink payload in units of the full-precision model size."""
    return uplink.payload_bytes(params) / tree_size_bytes(params)


def _gather_memory(memory: Any, idx: jax.Array, num_clients: int) -> Any:
    """Cohort rows `memory[idx]` of per-client memory `[C, ...]` (None stays None)."""
    for leaf in jax.tree.leaves(memory):
        if leaf.shape[0] != num_clients:
            raise ValueError(
                f"uplink memory has {leaf.shape[0]} clients but the data has {num_clients}; "
                "build the uplink with num_clients=data.num_clients"
            )
    return jax.tree.map(lambda m: m[idx], memory)


def _scatter_memory(memory: Any, idx: jax.Array, sent: jax.Array, new: Any) -> Any:
    """Writes the new memory of cohort clients that sent (`sent [M]`) back into `[C, ...]`.
    A cohort drawn with replacement (proportional sampling) may hold a client twice; one of
    its two new memories is then kept."""

    def write(m, n):
        keep = sent.reshape(-1, *([1] * (n.ndim - 1)))
        return m.at[idx].set(jnp.where(keep, n, m[idx]))

    return jax.tree.map(write, memory, new)


def fedavg(
    loss_fn: LossFn,
    *,
    client_optimizer: ClientOptimizer = 0.1,
    server_optimizer: float | optax.GradientTransformation = 1.0,
    local: LocalSpec = LocalSpec(),
    cohort: CohortSpec = CohortSpec(),
    stragglers: Stragglers = Stragglers(policy="drop"),
    client_map: ClientMap = ClientMap(),
    uplink: Uplink | None = None,
) -> Algorithm:
    """FedAvg with an optax client optimizer and an optax server optimizer.

    Args:
      loss_fn: `loss_fn(params, batch)`, e.g. `model.loss`.
      client_optimizer: local optimizer (a float is SGD's learning rate; a callable maps the
        round counter to an optimizer for per-round decay).
      server_optimizer: applied to the pseudo-gradient `-mean(Delta_i)`; 1.0 = averaging.
      local: local work per round. cohort: participation and weighting.
      stragglers: FedProx-style stragglers; FedAvg drops them (Li et al. 2020).
      client_map: how the cohort is mapped (vmap / lax.map).
      uplink: optional upload transform, e.g. `ErrorFeedback(TopK(fraction=0.01), C)`
        (EF-FedAvg) from `fedjax_sim.compression`.
    """
    return local_update_round(
        loss_fn,
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        local=local,
        cohort=cohort,
        stragglers=stragglers,
        client_map=client_map,
        uplink=uplink,
    )


def fedsgd(
    loss_fn: LossFn,
    *,
    learning_rate: float = 0.1,
    server_optimizer: optax.GradientTransformation | None = None,
    batch_size: int | None = None,
    cohort: CohortSpec = CohortSpec(),
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """FedSGD: one gradient per client per round (full client batch unless `batch_size`),
    averaged and applied by the server (SGD with `learning_rate` unless `server_optimizer`)."""
    local = (
        LocalSpec(steps=1, sampling="full")
        if batch_size is None
        else LocalSpec(steps=1, batch_size=batch_size)
    )
    return fedavg(
        loss_fn,
        client_optimizer=optax.sgd(1.0),  # the delta is exactly -grad
        server_optimizer=server_optimizer or optax.sgd(learning_rate),
        local=local,
        cohort=cohort,
        client_map=client_map,
    )


def server_optimizer(
    name: str,
    learning_rate: float,
    *,
    momentum: float = 0.9,
    b1: float = 0.9,
    b2: float = 0.99,
    eps: float = 1e-3,
) -> optax.GradientTransformation:
    """Server optimizers of Reddi et al. by name: sgd, momentum (FedAvgM), adam (FedAdam),
    yogi (FedYogi), adagrad (FedAdagrad). `eps` is their tau (adaptivity)."""
    if name == "sgd":
        return optax.sgd(learning_rate)
    if name == "momentum":
        return optax.sgd(learning_rate, momentum=momentum)
    if name == "adam":
        return optax.adam(learning_rate, b1=b1, b2=b2, eps=eps)
    if name == "yogi":
        return optax.yogi(learning_rate, b1=b1, b2=b2, eps=eps)
    if name == "adagrad":
        return optax.adagrad(learning_rate, eps=eps)
    raise ValueError(f"unknown server optimizer {name!r}; choose sgd|momentum|adam|yogi|adagrad")


def fedopt(
    loss_fn: LossFn,
    *,
    server: str = "adam",
    server_lr: float = 0.01,
    momentum: float = 0.9,
    b1: float = 0.9,
    b2: float = 0.99,
    eps: float = 1e-3,
    client_optimizer: ClientOptimizer = 0.1,
    local: LocalSpec = LocalSpec(),
    cohort: CohortSpec = CohortSpec(),
    stragglers: Stragglers = Stragglers(policy="drop"),
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """FedOpt (Reddi et al. 2021): FedAvg with a named server optimizer (see
    `server_optimizer`); `fedavgm`, `fedadam`, `fedyogi`, `fedadagrad` are its presets."""
    return fedavg(
        loss_fn,
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer(
            server, server_lr, momentum=momentum, b1=b1, b2=b2, eps=eps
        ),
        local=local,
        cohort=cohort,
        stragglers=stragglers,
        client_map=client_map,
    )


fedavgm = functools.partial(fedopt, server="momentum")
fedadam = functools.partial(fedopt, server="adam")
fedyogi = functools.partial(fedopt, server="yogi")
fedadagrad = functools.partial(fedopt, server="adagrad")
