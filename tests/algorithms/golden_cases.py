"""Pinned behaviour of every registered algorithm (issue 18's equivalence test).

`CASES` builds each registered algorithm (several settings each) on a small float64
least-squares problem. `record_golden.py` ran every case with the implementations that
existed before the composable layer (commit in `golden/README.md`) and stored their params
and metrics per round in `golden/presets.npz`; `test_golden.py` runs the same cases with the
current code and compares. The spelling of a call may change with the vocabulary; the values
may not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sim import algorithms as A
from fedjax_sim.algorithms.aggregators import error_feedback
from fedjax_sim.algorithms.compression import TopK
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec, Stragglers
from fedjax_sim.algorithms.events import Aggregation, Arrivals, Events
from fedjax_sim.algorithms.schedules import diminishing, round_decay
from fedjax_sim.algorithms.similarity import similarity_graph
from fedjax_sim.data import least_squares
from fedjax_sim.models import linear_regression
from fedjax_sim.runtime.parallel import ClientMap

SIZES = np.array([12, 7, 20, 9, 15, 11])
C = SIZES.size
DIM = 4
ROUNDS = 4
ASYNC_ITERATIONS = 8
MAP = ClientMap("map", 2)
L3 = LocalSpec(steps=3, batch_size=4)
COH = CohortSpec(size=4)
CAT = Events(Arrivals.categorical(np.linspace(1.0, 3.0, C)), Aggregation.every(3))
BERN = Events(Arrivals.bernoulli(np.linspace(0.2, 0.6, C)), Aggregation.every(2), capacity=4)
CAT1 = Events(Arrivals.categorical(np.linspace(1.0, 3.0, C)), Aggregation.every(1))


def problem():
    return least_squares(num_clients=C, examples_per_client=SIZES, dim=DIM, seed=3)


def model():
    return linear_regression(DIM)


def init_params():
    return {"w": jnp.asarray(np.random.default_rng(7).normal(size=DIM), jnp.float64)}


def graph():
    msgs = np.random.default_rng(11).normal(size=(C, 5))
    return similarity_graph(msgs)


def _cases():
    loss = model().loss
    g = graph()
    return {
        "fedavg": lambda: A.fedavg(loss, client_optimizer=0.05, local=L3, cohort=COH),
        "fedavg_epochs_stragglers_map": lambda: A.fedavg(
            loss,
            client_optimizer=0.05,
            local=LocalSpec(epochs=1.5, batch_size=4, sampling="epoch"),
            cohort=CohortSpec(size=5, weighting="uniform"),
            stragglers=Stragglers(0.4, "drop"),
            client_map=MAP,
        ),
        "fedavg_bernoulli": lambda: A.fedavg(
            loss,
            client_optimizer=0.05,
            local=L3,
            cohort=CohortSpec(size=4, sampling="bernoulli", probability=0.4),
        ),
        "fedavg_proportional_schedule": lambda: A.fedavg(
            loss,
            client_optimizer=lambda t: optax.sgd(0.05 * 0.9**t),
            local=L3,
            cohort=CohortSpec(size=4, sampling="proportional"),
        ),
        "fedavg_ef_topk": lambda: A.fedavg(
            loss,
            client_optimizer=0.05,
            local=L3,
            cohort=COH,
            aggregator=error_feedback(TopK(k=2)),
            num_clients=C,
        ),
        "fedsgd": lambda: A.fedsgd(loss, server_optimizer=0.05, cohort=COH),
        "fedsgd_batch": lambda: A.fedsgd(loss, server_optimizer=0.05, batch_size=4, cohort=COH),
        "fedprox": lambda: A.fedprox(
            loss,
            mu=0.3,
            client_optimizer=0.05,
            local=LocalSpec(epochs=1.0, batch_size=4),
            cohort=COH,
            stragglers=Stragglers(0.5, "partial"),
        ),
        "fedopt_adam": lambda: A.fedopt(
            loss, server_optimizer=0.05, client_optimizer=0.05, local=L3
        ),
        "fedavgm": lambda: A.fedavgm(loss, server_optimizer=0.5, client_optimizer=0.05, local=L3),
        "fedadam": lambda: A.fedadam(loss, server_optimizer=0.05, client_optimizer=0.05, local=L3),
        "fedyogi": lambda: A.fedyogi(loss, server_optimizer=0.05, client_optimizer=0.05, local=L3),
        "fedadagrad": lambda: A.fedadagrad(
            loss, server_optimizer=0.05, client_optimizer=0.05, local=L3
        ),
        "fedadam_reddi": lambda: A.fedadam_reddi(
            loss,
            server_optimizer=0.05,
            client_optimizer=0.05,
            weight_decay=0.01,
            local=L3,
            cohort=COH,
        ),
        "fedmim": lambda: A.fedmim(loss, client_optimizer=0.05, local=L3, cohort=COH),
        "fedmim_decay": lambda: A.fedmim(
            loss,
            momentum=(0.3,),
            lookahead=(0.5,),
            client_optimizer=round_decay(0.05, 0.9),
            weight_decay=0.01,
            local=L3,
        ),
        "fedcm": lambda: A.fedcm(loss, momentum=0.75, client_optimizer=0.05, local=L3, cohort=COH),
        "fedcm_server_lr": lambda: A.fedcm(
            loss,
            momentum=0.75,
            client_optimizer=round_decay(0.05, 0.9),
            server_optimizer=0.7,
            local=L3,
        ),
        "scaffold": lambda: A.scaffold(
            loss, num_clients=C, client_optimizer=0.05, server_optimizer=0.8, local=L3, cohort=COH
        ),
        "scaffold_bernoulli_epochs": lambda: A.scaffold(
            loss,
            num_clients=C,
            client_optimizer=round_decay(0.05, 0.9),
            local=LocalSpec(epochs=1.0, batch_size=4),
            cohort=CohortSpec(size=4, sampling="bernoulli", probability=0.5),
            client_map=MAP,
        ),
        "feddyn": lambda: A.feddyn(
            loss, num_clients=C, regularization=0.2, client_optimizer=0.05, local=L3, cohort=COH
        ),
        "feddyn_bernoulli": lambda: A.feddyn(
            loss,
            num_clients=C,
            regularization=0.2,
            client_optimizer=0.05,
            weight_decay=0.01,
            local=L3,
            cohort=CohortSpec(sampling="bernoulli", probability=0.4),
        ),
        "fedsam": lambda: A.fedsam(loss, rho=0.05, client_optimizer=0.05, local=L3, cohort=COH),
        "mofedsam": lambda: A.mofedsam(
            loss, momentum=0.75, rho=0.05, client_optimizer=0.05, local=L3, cohort=COH
        ),
        "fp_fedavg": lambda: A.fp_fedavg(
            loss, client_optimizer=diminishing(0.2, 0.51), local=LocalSpec(steps=3, batch_size=4)
        ),
        "fp_fedprox": lambda: A.fp_fedprox(
            loss, client_optimizer=0.2, inner_steps=3, inner_lr=0.05, batch_size=4
        ),
        "fp_fedprox_exact": lambda: A.fp_fedprox(loss, client_optimizer=0.2, exact=True),
        "ef_fedavg": lambda: A.ef_fedavg(
            loss,
            num_clients=C,
            compression_fraction=0.5,
            client_optimizer=0.2,
            local=LocalSpec(steps=3, batch_size=4),
            cohort=CohortSpec(size=4, weighting="uniform"),
        ),
        "ef_fedprox": lambda: A.ef_fedprox(
            loss,
            num_clients=C,
            compression_fraction=0.5,
            client_optimizer=0.2,
            inner_steps=3,
            inner_lr=0.05,
            batch_size=4,
            cap_inner_lr=False,
        ),
        "fgdro_cvar": lambda: A.fgdro_cvar(
            loss,
            num_clients=C,
            k=2,
            client_optimizer=0.05,
            local=L3,
            cohort=CohortSpec(weighting="uniform"),
        ),
        "fgdro_cvar_cohort": lambda: A.fgdro_cvar(
            loss,
            num_clients=C,
            client_optimizer=0.05,
            threshold_lr=0.1,
            local=L3,
            cohort=CohortSpec(size=4, weighting="uniform"),
            client_map=MAP,
        ),
        "fgdro_kl": lambda: A.fgdro_kl(
            loss,
            num_clients=C,
            temperature=2.0,
            client_optimizer=0.05,
            local=L3,
            cohort=CohortSpec(weighting="uniform"),
        ),
        "fgdro_kl_linear": lambda: A.fgdro_kl(
            loss,
            num_clients=C,
            temperature=2.0,
            client_optimizer=0.05,
            log_domain=False,
            local=L3,
            cohort=CohortSpec(size=4, weighting="uniform"),
        ),
        "fgdro_kl_adam": lambda: A.fgdro_kl_adam(
            loss,
            num_clients=C,
            temperature=2.0,
            client_optimizer=0.01,
            eps=1e-3,
            local=L3,
            cohort=CohortSpec(weighting="uniform"),
        ),
        "local_adam": lambda: A.local_adam(
            loss,
            num_clients=C,
            client_optimizer=0.01,
            eps=1e-3,
            local=L3,
            cohort=CohortSpec(weighting="uniform"),
        ),
        "drfa": lambda: A.drfa(loss, num_clients=C, client_optimizer=0.05, dual_lr=0.1, local=L3),
        "drfa_partial": lambda: A.drfa(
            loss,
            num_clients=C,
            client_optimizer=0.05,
            dual_lr=0.1,
            dual_lr_decay=0.9,
            weight_floor=1e-3,
            local=L3,
            cohort=CohortSpec(size=3),
        ),
        "dr_dsgd": lambda: A.dr_dsgd(
            loss,
            temperature=5.0,
            client_optimizer=0.02,
            local=L3,
            cohort=CohortSpec(size=4, weighting="uniform"),
        ),
        "fedlps": lambda: A.fedlps(loss, beta=0.5, graph=g, client_optimizer=0.05, local=L3),
        "fedlps_global_cohort": lambda: A.fedlps(
            loss,
            beta=0.7,
            graph=g,
            client_optimizer=0.05,
            server_optimizer=0.8,
            local=LocalSpec(epochs=1.0, batch_size=4, sampling="epoch"),
            cohort=CohortSpec(size=3),
            stale="global",
        ),
        "area": lambda: A.area(loss, events=CAT, client_optimizer=0.05, local=L3),
        "area_bernoulli_paper": lambda: A.area(
            loss,
            events=BERN,
            client_optimizer=A.diminishing(0.05, 0.6),
            local=L3,
            init_mode="paper",
            read_after_aggregate=True,
            box=(-3.0, 3.0),
            weights=SIZES,
            client_scale=A.sample_size_scale(SIZES),
            client_map=MAP,
        ),
        "s_fedavg": lambda: A.s_fedavg(loss, events=CAT, client_optimizer=0.05, local=L3),
        "s_fedavg_cohort": lambda: A.s_fedavg(
            loss, events=BERN, cohort_size=3, client_optimizer=0.05, local=L3, box=(-3.0, 3.0)
        ),
        "as_fedavg": lambda: A.as_fedavg(loss, events=CAT, client_optimizer=0.05, local=L3),
        "as_fedavg_bernoulli": lambda: A.as_fedavg(
            loss,
            events=BERN,
            server_optimizer=0.7,
            client_optimizer=0.05,
            local=L3,
            read_after_aggregate=True,
        ),
        "fedbuff": lambda: A.fedbuff(loss, events=CAT, client_optimizer=0.05, local=L3),
        "fedbuff_hinge_bernoulli": lambda: A.fedbuff(
            loss,
            events=BERN,
            staleness="hinge",
            staleness_a=0.5,
            staleness_b=1.0,
            server_optimizer=0.8,
            client_optimizer=0.05,
            local=L3,
        ),
        "mifa": lambda: A.mifa(loss, events=CAT, client_optimizer=0.05, local=L3),
        "mifa_bernoulli": lambda: A.mifa(
            loss,
            events=BERN,
            server_optimizer=0.8,
            client_optimizer=0.05,
            local=L3,
            client_scale=A.sample_size_scale(SIZES),
        ),
        "fedasync": lambda: A.fedasync(loss, events=CAT1, client_optimizer=0.05, local=L3),
        "fedasync_bernoulli": lambda: A.fedasync(
            loss,
            events=Events(Arrivals.bernoulli(np.linspace(0.2, 0.6, C)), Aggregation.every(1)),
            mixing=0.6,
            staleness="sqrt",
            client_optimizer=0.05,
            local=L3,
            read_after_aggregate=False,
        ),
    }


ASYNC = ("area", "s_fedavg", "as_fedavg", "fedbuff", "mifa", "fedasync")


def is_async(case: str) -> bool:
    return case.split("_bernoulli")[0].split("_cohort")[0] in ASYNC or case.startswith(ASYNC)


def run_case(name: str, rounds: int | None = None):
    """`(final params leaves, {metric: [T, ...]})` of case `name` (float64 must be enabled)."""
    data = problem().data
    alg = _cases()[name]()
    key = jax.random.key(5)
    state = alg.init(init_params(), key)
    step = jax.jit(alg.step)
    if rounds is None:
        rounds = ASYNC_ITERATIONS if is_async(name) else ROUNDS
    rows = []
    for _ in range(rounds):
        state, metrics = step(state, data, key)
        rows.append(jax.tree.map(np.asarray, metrics))
    metrics = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    return [np.asarray(x) for x in jax.tree.leaves(state.params)], metrics


def case_names() -> list[str]:
    return list(_cases())
