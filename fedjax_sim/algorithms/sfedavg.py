"""S-FedAvg: synchronous FedAvg with simulated wall-clock time (the AREA paper's reference).

McMahan et al. (AISTATS 2017), as used by Iakovidou and Kim. Spec:
`docs/specs/area_async.md` Sections 2.5 and 7.4.

Each round samples cohort_size clients uniformly without replacement (`cohort_size=None`:
all n), each runs LU_i(x_s; alpha, K), and the server waits for all of them:
x_s <- x_s + eta_g (1/|S|) sum_{i in S} (x_i - x_s) (uniform weights; eta_g =
`server_optimizer`, 1: the model average). The round's wall time is the largest completion
time in the cohort; with memoryless clocks a client's completion is its first arrival after
the round starts: Exp(lambda_i) in categorical mode, Geometric(p_i) * dt in bernoulli mode
(`Events.completion_times`). Availability windows are not applied (documented deviation: a
synchronous round waits for its cohort).

A synchronous preset: `compose` with the distributor `clocked_cohort` (which keeps the
simulated time) and the asynchronous presets' options (`AsyncOptions`; the event model gives
the clocks), so that spec 7.2's client scale f_i = s_i fhat_i (`hooks.scaled`) and the box
apply as for the asynchronous methods.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms import cohorts
from fedjax_sim.algorithms.asynchronous import (
    AsyncOptions,
    async_preset,
    check_clients,
    project,
)
from fedjax_sim.algorithms.compose import compose
from fedjax_sim.algorithms.core import EXTRA, Algorithm, LossFn, round_key
from fedjax_sim.algorithms.distributors import Distributor
from fedjax_sim.algorithms.events import Events


def clocked_cohort(events: Events, size: int) -> Distributor:
    """`size` clients uniformly without replacement per round (weights 1); the state is the
    simulated time t, advanced by the round's slowest completion time (metrics `t`,
    `round_time`, `fired`)."""
    c = events.num_clients

    def sample(t, key, counts, round_):
        check_clients(events, counts.shape[0])
        ids = cohorts.uniform(key, c, size)
        return ids, jnp.ones(ids.shape, t.dtype)

    def finalize(t, s, data, key):
        duration = jnp.max(events.completion_times(round_key(key, s.round, EXTRA), s.ids))
        t = t + duration
        return t, {"t": t, "round_time": duration, "fired": jnp.int32(size)}

    return Distributor(
        init=lambda num_clients: jnp.zeros((), jax.dtypes.canonicalize_dtype(jnp.float64)),
        sample=sample,
        downloads=lambda ids, weights: jnp.int32(size),
        finalize=finalize,
    )


@async_preset(fixed=("buffer_size", "capacity", "read_after_aggregate"))
def s_fedavg(
    loss_fn: LossFn, *, cohort_size: int | None = None, options: AsyncOptions
) -> Algorithm:
    """S-FedAvg: one synchronous round per `step`; the round lasts until its slowest client
    completes (time in metrics["t"]). `events` gives the client clocks (only
    `completion_times` is used); `cohort_size` clients per round (None: all);
    `server_optimizer` a float eta_g or an optax transformation (as in `compose`)."""
    events = options.event_model()
    c = events.num_clients
    if cohort_size is not None and not 1 <= cohort_size <= c:
        raise ValueError(f"cohort_size must be in [1, {c}], got {cohort_size}")
    alg = compose(
        options.client_work(loss_fn, c),
        server_optimizer=options.server_optimizer,
        cohort=clocked_cohort(events, c if cohort_size is None else int(cohort_size)),
        client_map=options.client_map,
    )
    return alg._replace(init=lambda params, key: alg.init(project(params, options.box), key))
