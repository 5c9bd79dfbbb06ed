"""IFCA (`algorithms.clustered`): an independent float64 NumPy loop on least squares with
planted clusters (the K server models and every cohort client's cluster estimate over several
rounds with cohorts), K = 1 is FedAvg exactly, recovery of well-separated planted clusters,
`personalize` and the global model, the refusals, and the drivers (simulate with central and
personal evaluation, the sweep engine, streamed rows)."""

import json

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
        b = np.einsum("nd,nd->n", a, spread * PLANTED[owner % K]) + noise * rng.normal(
            size=owner.size
        )
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


def test_simulate_personal_eval_uses_each_clients_cluster():
    data = planted(seed=1, spread=2.0)
    key = jax.random.key(0)
    alg = ifca(MODEL.loss, clusters=K, cluster_init=init_fn, **kw(client_optimizer=0.2))
    history, state = simulate(
        alg,
        data,
        key,
        num_rounds=20,
        model=MODEL,
        evaluation=EvalSpec(every=10, personal=True),
        progress=False,
        return_state=True,
    )
    last = history.evals[-1]
    # the personal models are the clusters' (planted) models; the global one fits one cluster
    assert last["personal_loss_mean"] < 0.05 < last["client_loss_mean"]
    assert np.asarray(history.metric("cluster_sizes")).shape == (20, K)
    assert np.asarray(history.metric("cluster_sizes")).sum(axis=1).tolist() == [M] * 20


def test_unseen_clients_adapt_from_the_largest_cluster():
    """Unseen clients' k local steps start from the declared global model (the largest
    cluster), not from the stacked `[K, ...]` models: `simulate(unseen=...)` equals
    `evaluate_unseen` on the state with that model as its params."""
    from fedjax_sim.data.unseen import held_out
    from fedjax_sim.run.evaluation import evaluate_unseen

    train, unseen = held_out(planted(seed=2), 3, 0)
    key = jax.random.key(5)
    alg = ifca(MODEL.loss, clusters=K, cluster_init=init_fn, **kw())
    spec = EvalSpec(every=3, central=False, clients=False, unseen_steps=2, unseen_lr=0.1)
    history, state = simulate(
        alg, train, key, num_rounds=3, model=MODEL, evaluation=spec, unseen=unseen,
        progress=False, return_state=True,
    )  # fmt: skip
    start = state.replace(params=largest_cluster(state))
    expected = evaluate_unseen(MODEL, start, unseen, key, steps=2, lr=0.1,
                               batch_size=spec.unseen_batch_size)  # fmt: skip
    np.testing.assert_allclose(
        history.evals[-1]["unseen_loss_mean"], float(expected["unseen_loss_mean"]), rtol=1e-6
    )


# ------------------------------------------------------------------------------ drivers
@pytest.fixture(scope="module")
def digits():
    from fedjax_sim.data import load_digits
    from fedjax_sim.models import mlp

    ds = load_digits(num_clients=12)
    return ds, mlp(ds.feature_shape, 10, hidden=(8,))


def _digits_ifca(model, **extra):
    return ifca(
        model.loss,
        clusters=2,
        client_optimizer=0.1,
        local=LocalSpec(steps=2, batch_size=8),
        cohort=CohortSpec(size=4),
        **extra,
    )


def test_sweep_run_r_equals_the_single_run(digits):
    from fedjax_sim.run.sweep import sweep

    ds, model = digits
    alg = _digits_ifca(model)
    kw_ = dict(model=model, num_rounds=3, test=ds.test, evaluation=EvalSpec(every=2))
    result = sweep(lambda hp: alg, ds.train, seeds=[5, 6], progress=False, **kw_)
    for run_ in result.runs:
        single = simulate(alg, ds.train, jax.random.key(run_.seed), progress=False, **kw_)
        swept = result.histories[run_.index]
        for k in single.metrics:
            np.testing.assert_allclose(swept.metric(k), single.metric(k), rtol=1e-5, atol=1e-6)
        for e1, e2 in zip(swept.evals, single.evals, strict=True):
            assert set(e1) == set(e2) and "test_accuracy" in e1
            for k in e1:  # central evaluation of the largest cluster's model
                np.testing.assert_allclose(e1[k], e2[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_streamed_equals_on_device(digits):
    from fedjax_sim.data.store import ClientStore
    from fedjax_sim.run.streaming import AlgorithmCohorts, simulate_streamed

    ds, model = digits
    alg = _digits_ifca(model)
    key = jax.random.key(3)
    kw_ = dict(model=model, num_rounds=3, test=ds.test, progress=False, return_state=True)
    h1, s1 = simulate(alg, ds.train, key, evaluation=EvalSpec(every=3, clients=False), **kw_)
    store = ClientStore.from_federated(ds.train)
    plan = AlgorithmCohorts(CohortSpec(size=4), store.counts)
    spec = EvalSpec(every=3, clients=False)
    h2, s2 = simulate_streamed(alg, store, key, plan=plan, evaluation=spec, **kw_)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(h1.evals[-1]["test_accuracy"], h2.evals[-1]["test_accuracy"])
    # IFCA keeps no per-client rows: nothing for state_rows="host" to stream
    with pytest.raises(ValueError, match="no per-client rows"):
        simulate_streamed(alg, store, key, plan=plan, state_rows="host", evaluation=spec, **kw_)


MESH_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
from fedjax_sim import EvalSpec, simulate
from fedjax_sim.algorithms import CohortSpec, LocalSpec, ifca
from fedjax_sim.data import least_squares
from fedjax_sim.models import linear_regression
from fedjax_sim.runtime.parallel import ClientMap, client_mesh

data = least_squares(num_clients=16, examples_per_client=np.arange(3, 19), dim=3, seed=2).data
model = linear_regression(3)
init = lambda key: {"w": jax.random.normal(key, (3,))}
mesh = client_mesh(4)
out = {}
for name, cmap, m in (("plain", ClientMap("vmap"), None),
                      ("sharded", ClientMap("vmap", mesh=mesh), mesh)):
    alg = ifca(model.loss, clusters=3, cluster_init=init, client_optimizer=0.05,
               local=LocalSpec(epochs=2, batch_size=4), cohort=CohortSpec(size=10),
               client_map=cmap)
    _, state = simulate(alg, data, jax.random.key(0), num_rounds=4, model=model, mesh=m,
                        evaluation=EvalSpec(every=4), progress=False, return_state=True)
    out[name] = np.asarray(state.params["w"])
np.savez(sys.argv[1], **out)
"""


def test_mesh_of_4_devices_equals_1_device(script_npz):
    r = script_npz(MESH_SCRIPT)
    assert r["plain"].shape == (3, 3)
    np.testing.assert_allclose(r["sharded"], r["plain"], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("clusters", [0, -1, 2.0, True, "3"])
def test_bad_clusters_are_refused(clusters):
    with pytest.raises(ValueError, match="clusters must be an int >= 1"):
        ifca(MODEL.loss, clusters=clusters)


def test_robust_and_dp_aggregators_are_refused():
    from fedjax_sim.algorithms.privacy import dp_mean

    with pytest.raises(ValueError, match="robust aggregators"):
        ifca(MODEL.loss, aggregator=median())
    pytest.importorskip("jax_privacy")
    for agg in (dp_mean(1.0, 1.0, 4.0), clipped(1.0, dp_mean(1.0, 1.0, 4.0))):
        with pytest.raises(ValueError, match="DP aggregation"):
            ifca(MODEL.loss, aggregator=agg)


def test_partition_and_attack_are_refused():
    for option in ("partition", "attack"):
        with pytest.raises(TypeError, match="unexpected keyword"):
            ifca(MODEL.loss, **{option: None})


def test_clipped_aggregator_applies_per_client_and_counts_one_models_bytes(x64):
    data = planted()
    key = jax.random.key(4)
    alg = ifca(MODEL.loss, clusters=K, cluster_init=init_fn, aggregator=clipped(1e-3), **kw())
    state = alg.init({"w": jnp.asarray(W0)}, key)
    new, metrics = jax.jit(alg.step)(state, data, key)
    moved = np.linalg.norm(np.asarray(new.params["w"] - state.params["w"]), axis=1)
    assert np.all(moved <= 1e-3 * (1 + 1e-9))  # a cluster mean of clipped updates
    # one model's update (3 float64) and the cluster index (int32)
    assert float(metrics["bytes_up"]) == M * (3 * 8 + 4)


# ------------------------------------------------------------------------------ CLI
@pytest.mark.parametrize(
    "value, message",
    [("0", "--clusters must be"), ("1.5", "--clusters"), ("x", "--clusters")],
)
def test_cli_bad_clusters_exit_2_in_one_line(capsys, value, message):
    from fedjax_sim.app.cli import main

    assert main(["run", "--algorithm", "ifca", "--clusters", value]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--algorithm", "fedavg", "--clusters", "3"], "--clusters is not used by fedavg"),
        (["--algorithm", "ifca", "--aggregator", "median"], "IFCA refuses robust aggregators"),
    ],
)
def test_cli_refusals_exit_2_in_one_line(capsys, args, message):
    from fedjax_sim.app.cli import main

    assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_ifca_end_to_end(tmp_path, capsys):
    from fedjax_sim.app.cli import main

    args = ["run", "--algorithm", "ifca", "--clusters", "3", "--model", "logistic"]
    args += ["--num-clients", "10", "--cohort-size", "4", "--rounds", "2", "--eval-every", "2"]
    args += ["--client-map", "vmap", "--personal-eval", "--no-progress", "--out", str(tmp_path)]
    assert main(args) == 0
    hist = json.loads((tmp_path / "history.json").read_text())
    final = hist["eval"][-1]
    assert np.isfinite(final["test_accuracy"]) and np.isfinite(final["personal_accuracy_mean"])


def test_cli_sweep_runs_ifca(tmp_path):
    from fedjax_sim.app.cli import main

    args = ["sweep", "--algorithm", "ifca", "--clusters", "2", "--model", "logistic"]
    args += ["--num-clients", "10", "--cohort-size", "4", "--rounds", "2", "--eval-every", "2"]
    args += ["--seeds", "2", "--grid", "client_lr=0.05,0.1", "--no-progress"]
    assert main([*args, "--out", str(tmp_path)]) == 0


def test_gradients_through_rounds_are_refused():
    """The objectives of `differentiable_run` and the tuner read one model, `state.params`:
    IFCA's K stacked models are refused (one line, while tracing) rather than misread."""
    from fedjax_sim.run.differentiate import clients_loss, differentiable_run
    from fedjax_sim.run.tuner import hypergradient_tuner

    data = planted()
    make = lambda hp: ifca(MODEL.loss, **kw(client_optimizer=hp["client_lr"]))  # noqa: E731
    objective = clients_loss(MODEL, data.x_test, data.y_test, data.test_counts)
    args = ({"client_lr": 0.1}, {"w": jnp.asarray(W0)}, data, jax.random.key(1))
    with pytest.raises(ValueError, match="declares its global model"):
        differentiable_run(make, objective, num_rounds=2).value(*args)
    with pytest.raises(ValueError, match="declares its global model"):
        hypergradient_tuner(make, objective, num_rounds=2)(*args)
