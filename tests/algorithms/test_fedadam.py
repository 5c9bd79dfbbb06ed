"""FedAdam without bias correction (Reddi et al. Alg. 2, the FedMIM paper's baseline) against
NumPy, and its difference from the registry's optax (bias-corrected) `fedadam`."""

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms import fedadam, fedadam_reddi
from fedjax_sim.algorithms.core import LocalSpec
from fedjax_sim.data import least_squares
from fedjax_sim.models import linear_regression


def test_fedadam_reddi_matches_numpy_and_differs_from_bias_corrected(x64):
    problem = least_squares(num_clients=3, examples_per_client=6, dim=2)
    model = linear_regression(2)
    local = LocalSpec(steps=1, sampling="full")
    key = jax.random.key(0)
    states = []
    for alg in [
        fedadam_reddi(
            model.loss,
            server_optimizer=0.1,
            b1=0.9,
            b2=0.99,
            eps=0.01,
            client_optimizer=0.1,
            local=local,
        ),
        fedadam(
            model.loss,
            server_optimizer=0.1,
            b1=0.9,
            b2=0.99,
            eps=0.01,
            client_optimizer=0.1,
            local=local,
        ),
    ]:
        state, step = alg.init({"w": jnp.zeros(2)}, key), jax.jit(alg.step)
        for _ in range(5):
            state, _ = step(state, problem.data, key)
        states.append(np.asarray(state.params["w"]))
    h, c, p = problem.hessians, problem.linear, problem.weights()
    w, m, v = np.zeros(2), np.zeros(2), np.zeros(2)
    for _ in range(5):
        delta = -0.1 * np.einsum("i,ij->j", p, np.einsum("ijk,k->ij", h, w) - c)
        m = 0.9 * m + 0.1 * delta
        v = 0.99 * v + 0.01 * delta**2
        w = w + 0.1 * m / (np.sqrt(v) + 0.01)
    np.testing.assert_allclose(states[0], w, rtol=1e-12)
    assert np.abs(states[0] - states[1]).max() > 1e-3
