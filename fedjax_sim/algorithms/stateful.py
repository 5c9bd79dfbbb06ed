"""The FedAvg-type round for algorithms with per-client state (SCAFFOLD, FedDyn, ...).

Per-client state lives for ALL C clients stacked on axis 0 (`[C, ...]` leaves). A round
gathers the cohort's rows with `state[idx]`, runs `local_train` for each cohort client with a
gradient hook built from its row, computes each client's new row, and writes back only the
rows of clients that contributed (weight > 0) with `.at[idx].set(...)`. The cost of a round is
O(M d) for a cohort of M clients, plus the O(C) cohort draw every sampler has: under
`lax.scan` (or `jit` with the state donated) XLA updates the `[C, d]` buffers in place
(`benchmarks/per_client_state.py` measures this).

Cohort ids must be distinct (uniform or Bernoulli sampling): a client drawn twice by
"proportional" sampling would have its state change counted twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.core import (
    COHORT,
    LOCAL,
    ClientOptimizer,
    CohortSpec,
    GradFn,
    LocalSpec,
    LossFn,
    Metrics,
    Params,
    client_key,
    client_optimizer_for_round,
    consistency,
    local_train,
    map_cohort,
    payload_metrics,
    round_key,
    tree_norm,
    tree_sq_norm,
    tree_sub,
)
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.parallel import ClientMap

ClientState = Any  # pytree with leaves [C, ...]
# update_client(row_i, delta_i, steps_i) -> new row_i  (delta_i = x_{i,K} - x_t)
UpdateClient = Callable[[Any, Params, jax.Array], Any]


class ClientStateRound(NamedTuple):
    mean_delta: Params  # weighted mean of Delta_i = x_{i,K} - x_t over the cohort
    client_state: ClientState  # [C, ...], only contributing cohort rows changed
    state_change_sum: Any  # sum over contributing clients of (new row - old row)
    contributed: jax.Array  # [] bool: total weight > 0 (False: empty round)
    metrics: Metrics


def check_cohort(cohort: CohortSpec) -> None:
    if cohort.sampling == "proportional":
        raise ValueError(
            "algorithms with per-client state need distinct cohort ids: use "
            "CohortSpec(sampling='uniform' or 'bernoulli'), not 'proportional'"
        )


def check_client_state(client_state: ClientState, data: FederatedData) -> None:
    num = jax.tree.leaves(client_state)[0].shape[0]
    if num != data.num_clients:
        raise ValueError(
            f"the per-client state was initialised for num_clients={num}, but the data has "
            f"{data.num_clients} clients"
        )


def client_state_round(
    params: Params,
    client_state: ClientState,
    data: FederatedData,
    key: jax.Array,
    round_: jax.Array,
    *,
    loss_fn: LossFn,
    client_optimizer: ClientOptimizer,
    local: LocalSpec,
    cohort: CohortSpec,
    client_map: ClientMap,
    make_grad_fn: Callable[[Any], GradFn],
    update_client: UpdateClient,
    up_models: float = 1.0,
    down_models: float = 1.0,
) -> ClientStateRound:
    """One round of local training from `params` with per-client state.

    Args:
      params: the broadcast global model x_t.
      client_state: `[C, ...]` per-client state of all clients.
      data, key, round_: the round's data, run key and round counter (keys as everywhere:
        `round_key(key, round, COHORT | LOCAL)`, per client `client_key(.., client_id)`).
      make_grad_fn: `row_i -> grad_fn` local-step hook of a client with state row `row_i`.
      update_client: `(row_i, Delta_i, steps_i) -> new row_i` after local training.
      up_models / down_models: model-sized vectors sent per client (payload metrics).

    Metrics: `train_loss`, `participants`, `local_steps`, `update_norm`, `consistency`
    (the paper's C_t), `bytes_up`, `bytes_down`.
    """
    check_client_state(client_state, data)
    idx, weights = cohort.sample(round_key(key, round_, COHORT), data.counts)  # [M], [M]
    num_steps = local.num_steps(data.counts[idx])
    optimizer = client_optimizer_for_round(client_optimizer, round_)
    local_key = round_key(key, round_, LOCAL)
    rows = jax.tree.map(lambda s: s[idx], client_state)  # [M, ...]

    def client_fn(cid, steps, row):
        result = local_train(
            params,
            data.client(cid),
            client_key(local_key, cid),
            loss_fn=loss_fn,
            optimizer=optimizer,
            max_steps=local.max_steps(data.max_count),
            num_steps=None if local.epochs is None else steps,
            batch_size=local.batch_size,
            sampling=local.sampling,
            grad_fn=make_grad_fn(row),
        )
        delta = tree_sub(result.params, params)
        new_row = update_client(row, delta, result.steps)
        return (delta, result.loss, tree_sq_norm(delta)), (new_row, result.steps)

    out = map_cohort(client_fn, idx, weights, num_steps, rows, client_map=client_map)
    mean_delta, train_loss, mean_sq_norm = out.mean
    new_rows, steps = out.outputs
    part = weights > 0  # [M]

    def keep(new, old):
        return jnp.where(part.reshape(-1, *([1] * (new.ndim - 1))), new, old)

    new_rows = jax.tree.map(keep, new_rows, rows)
    change_sum = jax.tree.map(lambda n, o: jnp.sum(n - o, axis=0), new_rows, rows)
    client_state = jax.tree.map(lambda s, r: s.at[idx].set(r), client_state, new_rows)
    participants = jnp.sum(part)
    metrics = {
        "train_loss": train_loss,
        "participants": participants,
        "local_steps": jnp.sum(jnp.where(part, steps, 0)) / jnp.maximum(participants, 1),
        "update_norm": tree_norm(mean_delta),
        "consistency": consistency(mean_sq_norm, mean_delta),
        **payload_metrics(
            params, participants, cohort.downloads(idx, weights), up_models, down_models
        ),
    }
    return ClientStateRound(mean_delta, client_state, change_sum, out.total_weight > 0, metrics)
