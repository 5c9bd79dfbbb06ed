"""FedDyn against an independent NumPy implementation (partial participation, per-client h_i)
and its exactness on heterogeneous quadratics."""

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms import feddyn
from fedjax_sim.algorithms.core import COHORT, CohortSpec, LocalSpec, round_key
from fedjax_sim.data import least_squares
from fedjax_sim.models import linear_regression

MODEL = linear_regression(3)


def numpy_feddyn(problem, w0, cohorts, lr, steps, alpha):
    """Acar et al. with full-batch local gradients, uniform 1/S mean."""
    h, lin = problem.hessians, problem.linear
    num, dim = lin.shape
    x, hs, hi = np.array(w0, np.float64), np.zeros(dim), np.zeros((num, dim))
    for ids in cohorts:
        thetas = []
        for i in ids:
            th = x.copy()
            for _ in range(steps):
                th = th - lr * (h[i] @ th - lin[i] - hi[i] + alpha * (th - x))
            hi[i] = hi[i] - alpha * (th - x)
            thetas.append(th)
        hs = hs - alpha * sum(th - x for th in thetas) / num
        x = np.mean(thetas, axis=0) - hs / alpha
    return x, hs, hi


def test_feddyn_matches_numpy_partial_participation(x64):
    problem = least_squares(num_clients=9, examples_per_client=np.arange(5, 14), dim=3, seed=8)
    cohort = CohortSpec(size=4, weighting="uniform")
    key, rounds, steps, alpha = jax.random.key(2), 8, 5, 0.3
    alg = feddyn(
        MODEL.loss,
        num_clients=9,
        regularization=alpha,
        client_optimizer=0.05,
        local=LocalSpec(steps=steps, sampling="full"),
        cohort=cohort,
    )
    state = alg.init({"w": jnp.array([1.0, 0.0, -1.0])}, key)
    step = jax.jit(alg.step)
    for _ in range(rounds):
        state, _ = step(state, problem.data, key)
    cohorts = [
        np.asarray(cohort.sample(round_key(key, jnp.int32(t), COHORT), problem.data.counts)[0])
        for t in range(rounds)
    ]
    x, hs, hi = numpy_feddyn(problem, [1.0, 0.0, -1.0], cohorts, 0.05, steps, alpha)
    np.testing.assert_allclose(state.params["w"], x, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(state.hooks["dynamic_regularizer"]["w"], hs, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(state.rows["dynamic_regularizer"]["w"], hi, rtol=1e-10, atol=1e-12)
    assert np.abs(hi).max() > 1e-2  # the per-client states are really in use


def test_feddyn_full_participation_reaches_optimum(x64):
    """FedDyn's fixed point with full participation is the optimum of (1/C) sum_i f_i (Acar
    et al., Sec. 3), unlike FedAvg's with K > 1 (see test_fedavg)."""
    problem = least_squares(num_clients=5, examples_per_client=20, dim=3, heterogeneity=2.0)
    alg = feddyn(
        MODEL.loss,
        num_clients=5,
        regularization=0.5,
        client_optimizer=0.05,
        local=LocalSpec(steps=5, sampling="full"),
    )
    key = jax.random.key(0)
    run = jax.jit(
        lambda s: jax.lax.scan(lambda s, _: alg.step(s, problem.data, key), s, length=600)
    )
    state, _ = run(alg.init({"w": jnp.zeros(3)}, key))
    np.testing.assert_allclose(state.params["w"], problem.optimum(), atol=1e-8)
