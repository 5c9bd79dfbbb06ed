"""FedAvg / FedSGD / FedOpt against independent NumPy references and closed forms."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_sim.algorithms import fedavg, fedavgm, fedprox, fedsgd
from fedjax_sim.algorithms.core import COHORT, CohortSpec, LocalSpec, round_key
from fedjax_sim.data import least_squares, pack
from fedjax_sim.models import linear_regression
from fedjax_sim.runtime.parallel import ClientMap

FULL = LocalSpec(steps=1, sampling="full")


def run(alg, params, data, rounds, key=None):
    key = jax.random.key(0) if key is None else key
    state = alg.init(params, key)
    step = jax.jit(alg.step)
    for _ in range(rounds):
        state, metrics = step(state, data, key)
    return state, metrics


def numpy_fedavg(problem, w0, rounds, *, lr, steps, server_lr=1.0, mu=0.0, cohorts=None):
    """Independent reference: full-batch GD on f_i + mu/2||w - w_t||^2, count-weighted mean."""
    h, c = problem.hessians, problem.linear
    counts = np.asarray(problem.data.counts, np.float64)
    w = np.array(w0, np.float64)
    for t in range(rounds):
        ids = np.arange(len(counts)) if cohorts is None else cohorts[t]
        deltas = []
        for i in ids:
            x = w.copy()
            for _ in range(steps):
                x = x - lr * (h[i] @ x - c[i] + mu * (x - w))
            deltas.append(x - w)
        weights = counts[ids]
        w = w + server_lr * np.tensordot(weights / weights.sum(), np.array(deltas), axes=1)
    return w


@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_fedavg_fedprox_match_numpy_full_participation(x64, mu):
    problem = least_squares(num_clients=6, examples_per_client=[5, 9, 12, 7, 20, 3], dim=4)
    model = linear_regression(4)
    w0 = jnp.array([0.3, -0.2, 0.1, 0.5])
    local = LocalSpec(steps=5, sampling="full")
    alg = fedprox(model.loss, mu=mu, client_optimizer=0.05, server_optimizer=0.7, local=local)
    state, _ = run(alg, {"w": w0}, problem.data, rounds=8)
    expected = numpy_fedavg(problem, w0, 8, lr=0.05, steps=5, server_lr=0.7, mu=mu)
    np.testing.assert_allclose(state.params["w"], expected, rtol=1e-10, atol=1e-12)


def test_fedavg_partial_participation_matches_numpy(x64):
    problem = least_squares(num_clients=10, examples_per_client=8, dim=3, seed=3)
    model = linear_regression(3)
    cohort = CohortSpec(size=4)
    key = jax.random.key(5)
    w0 = jnp.zeros(3)
    alg = fedavg(
        model.loss, client_optimizer=0.1, local=LocalSpec(steps=3, sampling="full"), cohort=cohort
    )
    state, _ = run(alg, {"w": w0}, problem.data, rounds=6, key=key)
    cohorts = [
        np.asarray(cohort.sample(round_key(key, jnp.int32(t), COHORT), problem.data.counts)[0])
        for t in range(6)
    ]
    assert all(len(set(c)) == 4 for c in cohorts)
    expected = numpy_fedavg(problem, w0, 6, lr=0.1, steps=3, cohorts=cohorts)
    np.testing.assert_allclose(state.params["w"], expected, rtol=1e-10)


def test_fedavg_float32_close_to_float64_reference():
    problem = least_squares(num_clients=5, examples_per_client=10, dim=4, seed=1)
    model = linear_regression(4)
    alg = fedavg(model.loss, client_optimizer=0.05, local=LocalSpec(steps=4, sampling="full"))
    state, _ = run(alg, {"w": jnp.zeros(4)}, problem.data, rounds=10)
    expected = numpy_fedavg(problem, np.zeros(4), 10, lr=0.05, steps=4)
    np.testing.assert_allclose(state.params["w"], expected, rtol=1e-5, atol=1e-6)


def test_fedprox_mu0_equals_fedavg_bitwise():
    """Stochastic minibatches, partial participation, epochs mode: identical trajectories."""
    problem = least_squares(num_clients=12, examples_per_client=np.arange(3, 15), dim=3)
    model = linear_regression(3)
    kw = dict(
        client_optimizer=0.05, local=LocalSpec(epochs=2, batch_size=4), cohort=CohortSpec(size=5)
    )
    s_avg, _ = run(fedavg(model.loss, **kw), {"w": jnp.ones(3)}, problem.data, 5)
    s_prox, _ = run(fedprox(model.loss, mu=0.0, **kw), {"w": jnp.ones(3)}, problem.data, 5)
    np.testing.assert_array_equal(s_avg.params["w"], s_prox.params["w"])


def test_one_client_one_step_is_sgd(x64):
    problem = least_squares(num_clients=1, examples_per_client=7, dim=3)
    model = linear_regression(3)
    w0 = jnp.array([1.0, -1.0, 0.5])
    state, _ = run(fedavg(model.loss, client_optimizer=0.3, local=FULL), {"w": w0}, problem.data, 1)
    grad = problem.hessians[0] @ np.asarray(w0) - problem.linear[0]
    np.testing.assert_allclose(state.params["w"], np.asarray(w0) - 0.3 * grad, rtol=1e-12)


def test_one_local_step_full_batch_is_gradient_descent(x64):
    """FedAvg(1 full-batch step, all clients) = GD on sum_i (n_i/N) f_i; so is FedSGD."""
    problem = least_squares(num_clients=7, examples_per_client=np.arange(2, 9), dim=4)
    model = linear_regression(4)
    p = problem.weights()
    hess = np.einsum("i,ijk->jk", p, problem.hessians)
    lin = np.einsum("i,ij->j", p, problem.linear)
    w = np.zeros(4)
    for _ in range(15):
        w = w - 0.1 * (hess @ w - lin)
    s_avg, _ = run(
        fedavg(model.loss, client_optimizer=0.1, local=FULL), {"w": jnp.zeros(4)}, problem.data, 15
    )
    s_sgd, _ = run(fedsgd(model.loss, server_optimizer=0.1), {"w": jnp.zeros(4)}, problem.data, 15)
    np.testing.assert_allclose(s_avg.params["w"], w, rtol=1e-10)
    np.testing.assert_allclose(s_sgd.params["w"], w, rtol=1e-10)


def test_fedavg_converges_to_biased_fixed_point_with_local_steps(x64):
    """Heterogeneous clients, K=5 local steps: FedAvg's limit is the closed-form fixed point
    [sum p_i (I - M_i)]^-1 sum p_i (I - M_i) w_i*, not the optimum (client drift)."""
    problem = least_squares(num_clients=5, examples_per_client=30, dim=3, heterogeneity=2.0)
    model = linear_regression(3)
    lr, k = 0.2, 5
    alg = fedavg(model.loss, client_optimizer=lr, local=LocalSpec(steps=k, sampling="full"))
    state, _ = run(alg, {"w": jnp.zeros(3)}, problem.data, 400)
    w = np.asarray(state.params["w"])
    fixed = problem.fedavg_fixed_point(lr, k)
    opt = problem.optimum()
    np.testing.assert_allclose(w, fixed, atol=1e-9)
    assert np.linalg.norm(fixed - opt) > 1e-2  # the bias is real, not round-off
    # K = 1 removes the bias: the fixed point is then the optimum
    np.testing.assert_allclose(problem.fedavg_fixed_point(lr, 1), opt, atol=1e-10)


def test_fedavg_identical_clients_reach_optimum(x64):
    problem = least_squares(num_clients=4, examples_per_client=25, dim=3, identical=True)
    model = linear_regression(3)
    alg = fedavg(model.loss, client_optimizer=0.2, local=LocalSpec(steps=5, sampling="full"))
    state, _ = run(alg, {"w": jnp.zeros(3)}, problem.data, 300)
    np.testing.assert_allclose(state.params["w"], problem.optimum(), atol=1e-9)


def test_fedavgm_matches_numpy_server_momentum(x64):
    problem = least_squares(num_clients=4, examples_per_client=10, dim=2)
    model = linear_regression(2)
    alg = fedavgm(
        model.loss,
        server_optimizer=0.5,
        momentum=0.8,
        client_optimizer=0.1,
        local=LocalSpec(steps=2, sampling="full"),
    )
    state, _ = run(alg, {"w": jnp.zeros(2)}, problem.data, 6)
    h, c, p = problem.hessians, problem.linear, problem.weights()
    w, buf = np.zeros(2), np.zeros(2)
    for _ in range(6):
        delta = np.zeros(2)
        for i in range(4):
            x = w.copy()
            for _ in range(2):
                x = x - 0.1 * (h[i] @ x - c[i])
            delta += p[i] * (x - w)
        buf = 0.8 * buf + (-delta)  # optax trace on the pseudo-gradient
        w = w - 0.5 * buf
    np.testing.assert_allclose(state.params["w"], w, rtol=1e-10)


def test_fedadam_with_optax_adam_matches_manual(x64):
    problem = least_squares(num_clients=3, examples_per_client=6, dim=2)
    model = linear_regression(2)
    alg = fedavg(
        model.loss,
        server_optimizer=optax.adam(0.1, b1=0.9, b2=0.99, eps=1e-3),
        client_optimizer=0.1,
        local=FULL,
    )
    state, _ = run(alg, {"w": jnp.zeros(2)}, problem.data, 4)
    h, c, p = problem.hessians, problem.linear, problem.weights()
    w, m, v = np.zeros(2), np.zeros(2), np.zeros(2)
    for t in range(1, 5):
        g = np.einsum("i,ij->j", p, np.einsum("ijk,k->ij", h, w) - c) * 0.1  # -Delta
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g**2
        w = w - 0.1 * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.99**t)) + 1e-3)
    np.testing.assert_allclose(state.params["w"], w, rtol=1e-9)


def test_jit_nojit_vmap_map_equal():
    problem = least_squares(num_clients=9, examples_per_client=np.arange(4, 13), dim=3)
    model = linear_regression(3)
    kw = dict(
        client_optimizer=0.05, local=LocalSpec(steps=4, batch_size=3), cohort=CohortSpec(size=7)
    )
    key = jax.random.key(1)
    outs = []
    for cmap, jit in [
        (ClientMap("vmap"), True),
        (ClientMap("map", 3), True),
        (ClientMap("vmap"), False),
        (ClientMap("map", 2), False),
    ]:
        alg = fedavg(model.loss, client_map=cmap, **kw)
        state = alg.init({"w": jnp.ones(3)}, key)
        step = jax.jit(alg.step) if jit else alg.step
        for _ in range(3):
            state, _ = step(state, problem.data, key)
        outs.append(np.asarray(state.params["w"]))
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=1e-6, atol=1e-7)


def test_empty_clients_contribute_nothing():
    problem = least_squares(num_clients=5, examples_per_client=[6, 0, 8, 0, 5], dim=3)
    model = linear_regression(3)
    alg = fedavg(model.loss, client_optimizer=0.1, local=LocalSpec(steps=3, batch_size=2))
    state, metrics = run(alg, {"w": jnp.ones(3)}, problem.data, 3)
    assert np.all(np.isfinite(state.params["w"]))
    assert int(metrics["participants"]) == 3
    # same as the data without the empty clients (client ids/keys kept by id)
    keep = np.array([0, 2, 4])
    sub = problem.data.replace(
        counts=jnp.where(jnp.isin(jnp.arange(5), keep), problem.data.counts, 0)
    )
    state2, _ = run(alg, {"w": jnp.ones(3)}, sub, 3)
    np.testing.assert_array_equal(state.params["w"], state2.params["w"])


def test_all_empty_cohort_is_a_noop():
    x = np.zeros((3, 4, 2), np.float32)
    data = pack(x.reshape(-1, 2), np.zeros(12, np.float32), np.full(12, -1), 3)
    model = linear_regression(2)
    alg = fedavg(model.loss, server_optimizer=optax.adam(0.1))
    state, metrics = run(alg, {"w": jnp.ones(2)}, data, 2)
    np.testing.assert_array_equal(state.params["w"], np.ones(2))
    assert int(metrics["participants"]) == 0
