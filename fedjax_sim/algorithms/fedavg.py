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
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.parallel import ClientMap


@struct.dataclass
class ServerState:
    """State of the FedAvg family: global params, server optimizer state, round counter."""

    params: Params
    opt_state: Any
    round: jax.Array  # [] int32


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
) -> Algorithm:
    """The FedAvg-type round shared by FedAvg, FedProx and friends: local training with an
    optional gradient hook `make_grad_fn(global_params)`, weighted mean of deltas, server
    optimizer. Algorithms without per-client state build on this."""
    server_opt = server_optimizer_from(server_optimizer)
    client_optimizer_for_round(client_optimizer, jnp.int32(0))  # validate eagerly

    def init(params: Params, key: jax.Array) -> ServerState:
        del key
        return ServerState(params=params, opt_state=server_opt.init(params), round=jnp.int32(0))

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
        local_key = round_key(key, state.round, LOCAL)

        def client_fn(cid, steps):
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
            return (delta, result.loss, tree_sq_norm(delta)), result.steps

        out = map_cohort(client_fn, idx, weights, num_steps, client_map=client_map)
        mean_delta, train_loss, mean_sq_norm = out.mean
        contributed = out.total_weight > 0
        params, opt_state = server_update(
            state.params, mean_delta, server_opt, state.opt_state, apply=contributed
        )
        participants = jnp.sum(weights > 0)
        metrics = {
            "train_loss": train_loss,
            "participants": participants,
            "stragglers": jnp.sum(is_straggler),
            "local_steps": jnp.sum(jnp.where(weights > 0, out.outputs, 0))
            / jnp.maximum(participants, 1),
            "update_norm": tree_norm(mean_delta),
            "consistency": consistency(mean_sq_norm, mean_delta),
            **payload_metrics(state.params, participants, cohort.downloads(idx, weights)),
        }
        return ServerState(params=params, opt_state=opt_state, round=state.round + 1), metrics

    return Algorithm(init, step)


def fedavg(
    loss_fn: LossFn,
    *,
    client_optimizer: ClientOptimizer = 0.1,
    server_optimizer: float | optax.GradientTransformation = 1.0,
    local: LocalSpec = LocalSpec(),
    cohort: CohortSpec = CohortSpec(),
    stragglers: Stragglers = Stragglers(policy="drop"),
    client_map: ClientMap = ClientMap(),
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
    """
    return local_update_round(
        loss_fn,
        client_optimizer=client_optimizer,
        server_optimizer=server_optimizer,
        local=local,
        cohort=cohort,
        stragglers=stragglers,
        client_map=client_map,
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
