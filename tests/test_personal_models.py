"""Personalized FL presets (`algorithms.personal_models`): Ditto, APFL, pFedMe and Per-FedAvg
(both variants) against independent float64 NumPy loops on least squares (global params and
personal rows, partial participation, full-batch local steps), the fine-tuning
`personalize` against NumPy gradient descent, edge cases, the hyper-parameter checks, and
every preset through `simulate` (and host rows through `simulate_streamed`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import EvalSpec, simulate
from fedjax_sim.algorithms import CohortSpec, LocalSpec, apfl, ditto, fedavg_ft, per_fedavg, pfedme
from fedjax_sim.data import least_squares
from fedjax_sim.data.store import ClientStore
from fedjax_sim.models import linear_regression
from fedjax_sim.run.streaming import AlgorithmCohorts, simulate_streamed

C, M, ROUNDS, STEPS, DIM = 8, 3, 4, 3, 3
LR = 0.05  # client learning rate (the paper's eta / beta)
W0 = np.array([0.2, -0.5, 1.0])
MODEL = linear_regression(DIM)
FULL = LocalSpec(steps=STEPS, sampling="full")
TOL = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture(scope="module")
def problem():
    return least_squares(num_clients=C, examples_per_client=np.arange(5, 5 + C), dim=DIM, seed=3)


def client_arrays(problem):
    """Client i's `(A_i [n_i, d], b_i [n_i])` in float64 (the float32 values the run uses)."""
    a, b = np.asarray(problem.data.x, np.float64), np.asarray(problem.data.y, np.float64)
    n = np.asarray(problem.data.counts)
    return [(a[i, : n[i]], b[i, : n[i]]) for i in range(C)]


def grad(ab, w, part=0, parts=1):
    """Gradient of `1/(2 |S|) ||A_S w - b_S||^2` on the rows `S = part::parts`."""
    a, b = ab[0][part::parts], ab[1][part::parts]
    return a.T @ (a @ w - b) / max(len(b), 1)


def hessian(ab, part=0, parts=1):
    a = ab[0][part::parts]
    return a.T @ a / max(len(a), 1)


def run(alg, problem, key, rounds=ROUNDS, dtype=None):
    """`rounds` jitted steps from W0; the final state and the reported cohorts."""
    state = alg.init({"w": jnp.asarray(W0, dtype)}, key)
    step = jax.jit(alg.step)
    cohorts = []
    for _ in range(rounds):
        state, metrics = step(state, problem.data, key)
        cohorts.append(np.asarray(metrics["cohort_ids"]))
    return state, cohorts


def numpy_rounds(cohorts, local, rows, weights, server_lr=1.0):
    """Server loop: each cohort client i runs `local(i, x, row_i) -> (w_i, row_i)`;
    `x <- x + server_lr * sum_i p_i (w_i - x) / sum_i p_i`."""
    x = W0.copy()
    for ids in cohorts:
        results = {i: local(i, x, rows[i]) for i in ids}
        p = np.array([weights[i] for i in ids], np.float64)
        mean = sum(pi * results[i][0] for pi, i in zip(p, ids, strict=True)) / p.sum()
        x = x + server_lr * (mean - x)
        for i in ids:
            rows[i] = results[i][1]
    return x, rows


def kw(**extra):
    return dict(
        client_optimizer=LR, local=FULL, cohort=CohortSpec(size=M), report_cohort=True, **extra
    )


# ------------------------------------------------------------------------------ Ditto
def numpy_ditto(data, cohorts, lam, eta_v, counts):
    def local(i, x, v):
        w = x.copy()
        for _ in range(STEPS):
            g, gv = grad(data[i], w), grad(data[i], v)
            w, v = w - LR * g, v - eta_v * (gv + lam * (v - x))
        return w, v

    return numpy_rounds(cohorts, local, [W0.copy() for _ in range(C)], counts)


@pytest.mark.parametrize("lam", [0.5, 0.0])
def test_ditto_matches_numpy(problem, x64, lam):
    alg = ditto(MODEL.loss, num_clients=C, lam=lam, personal_lr=0.03, **kw())
    key = jax.random.key(1)
    state, cohorts = run(alg, problem, key)
    data, counts = client_arrays(problem), np.asarray(problem.data.counts)
    x, v = numpy_ditto(data, cohorts, lam, 0.03, counts)
    np.testing.assert_allclose(state.params["w"], x, **TOL)
    np.testing.assert_allclose(state.rows["personal_proximal"]["w"], np.stack(v), **TOL)
    never = sorted(set(range(C)) - set(np.concatenate(cohorts)))
    assert never  # rows of clients never sampled exist and keep x_0
    np.testing.assert_array_equal(state.rows["personal_proximal"]["w"][never[0]], W0)
    ids = jnp.array([5, 0, 2])
    personal = jax.jit(alg.personalize)(state, problem.data, ids, key)
    np.testing.assert_array_equal(personal["w"], state.rows["personal_proximal"]["w"][ids])
    if lam == 0.0:  # pure local training: 3 GD steps on f_i per participation, from x_0
        for i in range(C):
            u = W0.copy()
            for _ in range(STEPS * sum(int(i in ids) for ids in cohorts)):
                u = u - 0.03 * grad(data[i], u)
            np.testing.assert_allclose(state.rows["personal_proximal"]["w"][i], u, **TOL)


# ------------------------------------------------------------------------------ APFL
@pytest.mark.parametrize("adaptive", [False, True])
def test_apfl_matches_numpy(problem, x64, adaptive):
    mixing, eta_v, eta_a = 0.3, 0.04, 0.5
    alg = apfl(
        MODEL.loss,
        num_clients=C,
        mixing=mixing,
        personal_lr=eta_v,
        adaptive=adaptive,
        mixing_lr=eta_a,
        **kw(),
    )
    key = jax.random.key(2)
    state, cohorts = run(alg, problem, key)
    data = client_arrays(problem)

    def local(i, x, row):
        (v, a), w = row, x.copy()
        for _ in range(STEPS):
            gm = grad(data[i], a * v + (1 - a) * w)
            new_v = v - eta_v * a * gm
            if adaptive:
                a = float(np.clip(a - eta_a * (v - w) @ gm, 0.0, 1.0))
            w, v = w - LR * grad(data[i], w), new_v
        return w, (v, a)

    rows = [(W0.copy(), mixing) for _ in range(C)]
    x, rows = numpy_rounds(cohorts, local, rows, np.asarray(problem.data.counts))
    got = state.rows["personal_mixture"]
    np.testing.assert_allclose(state.params["w"], x, **TOL)
    np.testing.assert_allclose(got["model"]["w"], np.stack([r[0] for r in rows]), **TOL)
    np.testing.assert_allclose(got["mixing"], [r[1] for r in rows], **TOL)
    if adaptive:
        assert len(set(np.round(np.asarray(got["mixing"]), 12))) > 2  # per-client alphas moved
    personal = jax.jit(alg.personalize)(state, problem.data, jnp.arange(C), key)
    expect = np.stack([a * v + (1 - a) * x for v, a in rows])
    np.testing.assert_allclose(personal["w"], expect, **TOL)


def test_apfl_mixing_zero_personalizes_to_the_global_model(problem, x64):
    """(With float32 params under x64: the float64 alpha row keeps the models' dtype.)"""
    alg = apfl(MODEL.loss, num_clients=C, mixing=0.0, **kw())
    key = jax.random.key(3)
    state, _ = run(alg, problem, key, rounds=2, dtype=jnp.float32)
    assert state.rows["personal_mixture"]["model"]["w"].dtype == jnp.float32
    personal = jax.jit(alg.personalize)(state, problem.data, jnp.arange(C), key)
    np.testing.assert_array_equal(personal["w"], np.broadcast_to(state.params["w"], (C, DIM)))


# ------------------------------------------------------------------------------ pFedMe
def test_pfedme_matches_numpy(problem, x64):
    lam, eta_p, inner, beta = 2.0, 0.05, 3, 0.7
    alg = pfedme(
        MODEL.loss,
        num_clients=C,
        lam=lam,
        personal_lr=eta_p,
        inner_steps=inner,
        server_optimizer=beta,
        **{**kw(), "cohort": CohortSpec(size=M, weighting="uniform")},
    )
    key = jax.random.key(4)
    state, cohorts = run(alg, problem, key)
    data = client_arrays(problem)

    def local(i, x, row):
        w, theta = x.copy(), x.copy()
        for _ in range(STEPS):
            for _ in range(inner):
                theta = theta - eta_p * (grad(data[i], theta) + lam * (theta - w))
            w = w - LR * lam * (w - theta)
        return w, theta

    x, rows = numpy_rounds(
        cohorts, local, [W0.copy() for _ in range(C)], np.ones(C), server_lr=beta
    )
    np.testing.assert_allclose(state.params["w"], x, **TOL)
    np.testing.assert_allclose(state.rows["moreau_envelope"]["w"], np.stack(rows), **TOL)
    ids = jnp.array([7, 1])
    personal = jax.jit(alg.personalize)(state, problem.data, ids, key)
    np.testing.assert_allclose(personal["w"], np.stack(rows)[np.asarray(ids)], **TOL)


# ------------------------------------------------------------------------------ Per-FedAvg
@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_per_fedavg_matches_numpy(problem, x64, variant):
    alpha, adapt = 0.1, 2
    alg = per_fedavg(MODEL.loss, inner_lr=alpha, variant=variant, adapt_steps=adapt, **kw())
    key = jax.random.key(5)
    state, cohorts = run(alg, problem, key)
    data = client_arrays(problem)
    parts = 2 if variant == "fo" else 3

    def local(i, x, row):
        w = x.copy()
        for _ in range(STEPS):
            adapted = w - alpha * grad(data[i], w, 0, parts)
            d = grad(data[i], adapted, 1, parts)
            if variant == "hf":
                d = d - alpha * hessian(data[i], 2, parts) @ d
            w = w - LR * d
        return w, row

    x, _ = numpy_rounds(cohorts, local, [None] * C, np.asarray(problem.data.counts))
    np.testing.assert_allclose(state.params["w"], x, **TOL)
    # personal models: `adapt_steps` full-batch steps of size alpha from the global model
    ids = jnp.array([3, 6])
    personal = jax.jit(alg.personalize)(state, problem.data, ids, key)
    for k, i in enumerate(np.asarray(ids)):
        u = x.copy()
        for _ in range(adapt):
            u = u - alpha * grad(data[i], u)
        np.testing.assert_allclose(personal["w"][k], u, **TOL)


# ------------------------------------------------------------------------------ FedAvg-FT
def test_fedavg_ft_personalize_is_k_local_steps_from_the_global_model(problem, x64):
    key = jax.random.key(6)
    data = client_arrays(problem)
    ids = jnp.array([4, 0, 7])
    alg = fedavg_ft(MODEL.loss, finetune_steps=4, finetune_lr=0.07, **kw())
    state, _ = run(alg, problem, key, rounds=2)
    x = np.asarray(state.params["w"])
    personal = jax.jit(alg.personalize)(state, problem.data, ids, key)
    for k, i in enumerate(np.asarray(ids)):
        u = x.copy()
        for _ in range(4):
            u = u - 0.07 * grad(data[i], u)
        np.testing.assert_allclose(personal["w"][k], u, **TOL)
    # finetune_lr None: the client learning rate; minibatches: deterministic given the key
    sgd = fedavg_ft(MODEL.loss, finetune_steps=3, client_optimizer=0.07, local=LocalSpec(3, 2))
    personalize = jax.jit(sgd.personalize)
    a = personalize(state, problem.data, ids, key)["w"]
    b = personalize(state, problem.data, ids, key)["w"]
    c = personalize(state, problem.data, ids, jax.random.key(7))["w"]
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    assert not np.allclose(a, personal["w"])  # 2-example minibatches, not full batches


# ------------------------------------------------------------------------------ checks
@pytest.mark.parametrize(
    "factory, kwargs, name",
    [
        (ditto, dict(num_clients=C, lam=-1.0), "lam"),
        (ditto, dict(num_clients=C, lam=float("nan")), "lam"),
        (ditto, dict(num_clients=C, personal_lr=float("inf")), "personal_lr"),
        (apfl, dict(num_clients=C, mixing=1.5), "mixing"),
        (apfl, dict(num_clients=C, mixing=-0.1), "mixing"),
        (apfl, dict(num_clients=C, adaptive=True, mixing_lr=0.0), "mixing_lr"),
        (pfedme, dict(num_clients=C, lam=-2.0), "lam"),
        (pfedme, dict(num_clients=C, personal_lr=float("nan")), "personal_lr"),
        (pfedme, dict(num_clients=C, inner_steps=0), "inner_steps"),
        (per_fedavg, dict(inner_lr=-0.1), "inner_lr"),
        (per_fedavg, dict(inner_lr=float("inf")), "inner_lr"),
        (per_fedavg, dict(variant="so"), "variant"),
        (per_fedavg, dict(adapt_steps=-1), "adapt_steps"),
        (fedavg_ft, dict(finetune_steps=1.5), "finetune_steps"),
        (fedavg_ft, dict(finetune_lr=-0.01), "finetune_lr"),
    ],
)
def test_bad_hyperparameters_are_refused_at_construction(factory, kwargs, name):
    with pytest.raises(ValueError, match=name):
        factory(MODEL.loss, **kwargs)


def test_default_step_sizes_need_a_client_learning_rate():
    import optax

    with pytest.raises(ValueError, match="personal_lr=None takes the client learning rate"):
        ditto(MODEL.loss, num_clients=C, client_optimizer=optax.adam(0.1))
    with pytest.raises(ValueError, match="finetune_lr"):
        fedavg_ft(MODEL.loss, client_optimizer=optax.adam(0.1))
    ditto(MODEL.loss, num_clients=C, personal_lr=0.1, client_optimizer=optax.adam(0.1))


# ------------------------------------------------------------------------------ drivers
SMALL = dict(local=LocalSpec(steps=2, batch_size=6), cohort=CohortSpec(size=M))
PRESETS = {
    "ditto": lambda: ditto(MODEL.loss, num_clients=C, **SMALL),
    "apfl": lambda: apfl(MODEL.loss, num_clients=C, adaptive=True, **SMALL),
    "pfedme": lambda: pfedme(MODEL.loss, num_clients=C, inner_steps=2, **SMALL),
    "per_fedavg": lambda: per_fedavg(MODEL.loss, variant="hf", **SMALL),
    "fedavg_ft": lambda: fedavg_ft(MODEL.loss, **SMALL),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_runs_through_simulate(problem, name):
    alg = PRESETS[name]()
    key = jax.random.key(8)
    hist, state = simulate(
        alg,
        problem.data,
        key,
        model=MODEL,
        num_rounds=2,
        evaluation=EvalSpec(every=2, central=False, clients=False),
        progress=False,
        return_state=True,
    )
    assert hist.num_rounds == 2 and np.isfinite(hist.metric("train_loss")).all()
    personal = jax.jit(alg.personalize)(state, problem.data, jnp.array([1, 2]), key)
    assert personal["w"].shape == (2, DIM) and np.isfinite(personal["w"]).all()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_host_rows_equal_device_rows(problem, name):
    """Every preset streamed with `state_rows="host"` (Ditto's, pFedMe's personal models and
    APFL's model and mixing scalar per client stay on the host; Per-FedAvg and FedAvg-FT have
    no rows: streamed with device rows, and host rows refused): the same final state and
    personal models as `simulate`."""
    alg = PRESETS[name]()
    rows = "device" if name in ("per_fedavg", "fedavg_ft") else "host"
    key = jax.random.key(9)
    common = dict(model=MODEL, num_rounds=3, progress=False, return_state=True)
    evaluation = EvalSpec(every=2, central=False, clients=False)
    _, on_device = simulate(alg, problem.data, key, evaluation=evaluation, **common)
    store = ClientStore.from_federated(problem.data)
    plan = AlgorithmCohorts(SMALL["cohort"], store.counts)
    _, on_host = simulate_streamed(
        alg,
        store,
        key,
        plan=plan,
        state_rows=rows,
        evaluation=evaluation,
        **common,
    )
    for a, b in zip(jax.tree.leaves(on_device), jax.tree.leaves(on_host), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ids = jnp.arange(C)
    np.testing.assert_array_equal(
        jax.jit(alg.personalize)(on_device, problem.data, ids, key)["w"],
        jax.jit(alg.personalize)(on_host, problem.data, ids, key)["w"],
    )
    if rows == "device":
        with pytest.raises(ValueError, match="keeps no per-client rows"):
            simulate_streamed(alg, store, key, plan=plan, state_rows="host", **common)
