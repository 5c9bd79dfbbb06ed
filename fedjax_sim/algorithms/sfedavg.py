"""S-FedAvg: synchronous FedAvg with simulated wall-clock time (the AREA paper's reference).

McMahan et al. (AISTATS 2017), as used by Iakovidou and Kim. Spec:
`../shared/specs/area_async.md` Sections 2.5 and 7.4.

Each round samples Delta clients uniformly without replacement (`cohort_size=None`: all n),
each runs LU_i(x_s; alpha, K), and the server waits for all of them:
x_s <- (1/Delta) sum_{i in S} x_i (uniform weights, server step 1). The round's wall time is
the largest completion time in the cohort; with memoryless clocks a client's completion is its
first arrival after the round starts: Exp(lambda_i) in categorical mode, Geometric(p_i) * dt in
bernoulli mode (`Events.completion_times`). Availability windows are not applied (documented
deviation: a synchronous round waits for its cohort).

The round reuses the asynchronous local work (`async_common.LocalWork`, i.e. `local_train`) so
that spec 7.2's per-client scale f_i = s_i fhat_i applies as for the asynchronous methods.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from fedjax_sim.algorithms.async_common import (
    LocalWork,
    broadcast,
    check_data,
    loss_metric,
    make_events,
    masked_sum,
)
from fedjax_sim.algorithms.core import (
    COHORT,
    EXTRA,
    Algorithm,
    ClientOptimizer,
    LocalSpec,
    LossFn,
    Params,
    payload_metrics,
    round_key,
)
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.events import Events, sample_cohort
from fedjax_sim.parallel import ClientMap


@struct.dataclass
class SyncState:
    """S-FedAvg's state: server model, round counter, simulated time."""

    params: Params
    round: jax.Array  # [] int32
    t: jax.Array  # [] float


def s_fedavg(
    loss_fn: LossFn,
    *,
    events: Events | None = None,
    num_clients: int | None = None,
    firing_probability: float = 0.1,
    cohort_size: int | None = None,
    client_optimizer: ClientOptimizer = 0.1,
    local: LocalSpec = LocalSpec(steps=1),
    box: tuple[float, float] | None = None,
    client_scale: Any = None,
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """S-FedAvg: one synchronous round per `step`; the round lasts until its slowest client
    completes (time in metrics["t"]). Other arguments as for `area`.

    Args:
      events: the client clocks (only `completion_times` is used); None: Bernoulli
        (`firing_probability`) for `num_clients` clients.
      cohort_size: Delta clients per round, uniform without replacement (None: all).
    """
    ev = make_events(events, num_clients, firing_probability, 1, None)
    c = ev.num_clients
    if cohort_size is not None and not 1 <= cohort_size <= c:
        raise ValueError(f"cohort_size (Delta) must be in [1, {c}], got {cohort_size}")
    size = c if cohort_size is None else int(cohort_size)
    work = LocalWork(loss_fn, client_optimizer, local, box, client_scale, client_map)

    def init(params: Params, key: jax.Array) -> SyncState:
        del key
        if box is not None:
            params = jax.tree.map(lambda x: jnp.clip(x, *box), params)
        ftype = jax.dtypes.canonicalize_dtype(jnp.float64)
        return SyncState(params=params, round=jnp.int32(0), t=jnp.zeros((), ftype))

    def step(state: SyncState, data: FederatedData, key: jax.Array):
        check_data(ev, data)
        ids = sample_cohort(round_key(key, state.round, COHORT), c, size)
        rounds = jnp.full(ids.shape, state.round)
        results, losses = work(data, ids, broadcast(state.params, size), rounds, key)
        ones = jnp.full(ids.shape, 1.0 / size)
        params = jax.tree.map(
            lambda x, m: m.astype(x.dtype), state.params, masked_sum(results, ones)
        )
        duration = jnp.max(ev.completion_times(round_key(key, state.round, EXTRA), ids))
        t = state.t + duration
        active = jnp.ones(ids.shape, bool)
        metrics = {
            "train_loss": loss_metric(losses, active),
            "t": t,
            "round_time": duration,
            "fired": jnp.int32(size),
            **payload_metrics(state.params, jnp.int32(size), jnp.int32(size)),
        }
        return SyncState(params=params, round=state.round + 1, t=t), metrics

    return Algorithm(init, step)
