"""Per-round lr decay and the two weight-decay placements."""

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms import client_sgd, fedavg, round_decay
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.data import least_squares
from fedjax_sim.models import linear_regression


def test_round_decay_values(x64):
    sched = round_decay(0.1, 0.998)
    rounds = np.array([0, 1, 7, 500])
    np.testing.assert_allclose(
        [float(sched(jnp.int32(t))) for t in rounds], 0.1 * 0.998**rounds, rtol=1e-15
    )


def test_optax_weight_decay_equals_l2_in_the_loss_for_sgd(x64):
    """For SGD, `add_decayed_weights(wd)` at the iterate is the gradient of wd/2 ||x||^2."""
    problem = least_squares(num_clients=6, examples_per_client=7, dim=3, seed=1)
    model = linear_regression(3)
    kw = dict(local=LocalSpec(steps=3, batch_size=3), cohort=CohortSpec(size=3))
    key, sched, out = jax.random.key(1), round_decay(0.1, 0.9), []
    for loss, opt in [
        (model.loss, client_sgd(sched, 0.05)),
        (model.with_l2(0.05).loss, client_sgd(sched)),
    ]:
        alg = fedavg(loss, client_optimizer=opt, **kw)
        state, step = alg.init({"w": jnp.ones(3)}, key), jax.jit(alg.step)
        for _ in range(4):
            state, _ = step(state, problem.data, key)
        out.append(np.asarray(state.params["w"]))
    np.testing.assert_allclose(out[0], out[1], rtol=1e-12)
