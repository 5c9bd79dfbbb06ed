"""FedSAM and MoFedSAM (= FedCM with SAM gradients) against independent NumPy
implementations on heterogeneous quadratics, with per-round lr decay."""

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms import fedavg, fedsam, mofedsam, round_decay
from fedjax_sim.algorithms.core import LocalSpec
from fedjax_sim.data import least_squares
from fedjax_sim.models import linear_regression

MODEL = linear_regression(3)
LOCAL = LocalSpec(steps=4, sampling="full")


def run(alg, w0, data, rounds):
    key = jax.random.key(0)
    state, step = alg.init({"w": jnp.asarray(w0)}, key), jax.jit(alg.step)
    for _ in range(rounds):
        state, _ = step(state, data, key)
    return state


def sam_grad(h, c, x, rho):
    g = h @ x - c
    return h @ (x + rho * g / np.linalg.norm(g)) - c


def numpy_mofedsam(problem, w0, rounds, lr, steps, alpha, rho):
    """FedCM (Xu et al.) with SAM gradients, full participation, count-weighted mean;
    alpha = 1 is FedSAM."""
    h, lin, p = problem.hessians, problem.linear, problem.weights()
    x, d = np.array(w0, np.float64), np.zeros(lin.shape[1])
    for t in range(rounds):
        eta, delta = lr(t), np.zeros_like(x)
        for i in range(len(p)):
            y = x.copy()
            for _ in range(steps):
                y = y - eta * (alpha * sam_grad(h[i], lin[i], y, rho) + (1 - alpha) * d)
            delta += p[i] * (y - x)
        x, d = x + delta, -delta / (eta * steps)
    return x


def test_fedsam_and_mofedsam_match_numpy(x64):
    problem = least_squares(num_clients=5, examples_per_client=[6, 9, 4, 12, 7], dim=3, seed=3)
    w0, sched = [0.5, -0.5, 2.0], round_decay(0.1, 0.9)
    lr = lambda t: 0.1 * 0.9**t
    sam = run(fedsam(MODEL.loss, rho=0.2, client_optimizer=sched, local=LOCAL), w0, problem.data, 5)
    np.testing.assert_allclose(
        sam.params["w"], numpy_mofedsam(problem, w0, 5, lr, 4, 1.0, 0.2), rtol=1e-11
    )
    mo = run(
        mofedsam(MODEL.loss, momentum=0.7, rho=0.2, client_optimizer=sched, local=LOCAL),
        w0,
        problem.data,
        5,
    )
    np.testing.assert_allclose(
        mo.params["w"], numpy_mofedsam(problem, w0, 5, lr, 4, 0.3, 0.2), rtol=1e-11
    )
    # the perturbation matters: rho = 0.2 is not FedAvg
    avg = run(fedavg(MODEL.loss, client_optimizer=0.1, local=LOCAL), w0, problem.data, 1)
    one = run(fedsam(MODEL.loss, rho=0.2, client_optimizer=0.1, local=LOCAL), w0, problem.data, 1)
    assert np.abs(np.asarray(avg.params["w"]) - np.asarray(one.params["w"])).max() > 1e-3
