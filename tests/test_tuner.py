"""Issue 36: the online hypergradient tuner (`fedjax_sim.run.tuner`) moves a 10x-too-small
learning rate up and a 10x-too-large one down, two tuners in one compiled vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import fedavg
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.data import least_squares
from fedjax_sim.data.federated import ArrayData
from fedjax_sim.models import linear_regression
from fedjax_sim.run.differentiate import central_loss
from fedjax_sim.run.tuner import TunerSpec, hypergradient_tuner

DIM = 4
MODEL = linear_regression(DIM)


def make(hp):
    return fedavg(
        MODEL.loss,
        client_optimizer=hp["client_lr"],
        server_optimizer=hp["server_lr"],
        local=LocalSpec(steps=5, batch_size=4),
        cohort=CohortSpec(size=4),
    )


def test_tuner_moves_too_small_lr_up_and_too_large_lr_down():
    """Least squares with Hessian eigenvalues in [0.09, 3.1]: a client lr of 0.05 is good, 0.005
    is 10x too small, 0.5 is 10x too large (a few local steps from divergence, 2 / 3.1)."""
    problem = least_squares(num_clients=8, examples_per_client=10, dim=DIM, seed=1)
    val = ArrayData(x=problem.data.x.reshape(-1, DIM), y=problem.data.y.reshape(-1))
    tuner = hypergradient_tuner(
        make, central_loss(MODEL, val), num_rounds=30, spec=TunerSpec(step_size=0.1)
    )
    # 0.005 is 10x too small, 0.5 10x too large, 5.0 diverges in its first round
    start = {"client_lr": jnp.array([0.005, 0.5, 5.0]), "server_lr": jnp.ones(3)}
    keys = jax.vmap(jax.random.key)(jnp.arange(3))
    result = tuner.many(start, MODEL.init(None), problem.data, keys)
    lr = np.asarray(result.trace["hparams"]["client_lr"] * result.trace["hparams"]["server_lr"])
    assert lr.shape == (3, 30)
    assert lr[0, 0] == pytest.approx(0.005) and lr[1, 0] == pytest.approx(0.5)
    # the effective step (client lr x server lr) moves by more than 2x toward the good range
    assert lr[0, -1] > 2 * 0.005 and lr[1, -1] < 0.5 / 2
    obj = np.asarray(result.trace["objective"])
    diverged = np.asarray(result.trace["diverged"])
    assert np.all(np.isfinite(obj[:2])) and not diverged[:2].any()
    # ... and the tuned runs end with a lower validation loss than they started with
    assert np.all(obj[:2, -5:].mean(axis=1) < obj[:2, 0])
    # the diverging start: its windows are undone and the values halved until it trains
    assert diverged[2, 0] and not diverged[2, -10:].any() and lr[2, -1] < 0.5
    assert np.isfinite(obj[2, -1]) and obj[2, -1] < obj[1, 0]
    assert np.all(np.isfinite(np.asarray(result.state.params["w"])))


def test_tuner_errors():
    obj = lambda state: jnp.sum(state.params["w"])  # noqa: E731
    with pytest.raises(ValueError, match="multiple of the tuner's window 4"):
        hypergradient_tuner(make, obj, num_rounds=10, spec=TunerSpec(window=4))
    with pytest.raises(ValueError, match="step_size must be > 0"):
        TunerSpec(step_size=0.0)
    with pytest.raises(ValueError, match="divergence must be > 1"):
        TunerSpec(divergence=0.5)
    with pytest.raises(ValueError, match="backoff must be > 1"):
        TunerSpec(backoff=1.0)
    with pytest.raises(ValueError, match="need 0 < lower < upper"):
        TunerSpec(lower=1.0, upper=0.5)
    tuner = hypergradient_tuner(make, obj, num_rounds=2)
    problem = least_squares(num_clients=4, examples_per_client=5, dim=DIM)
    with pytest.raises(ValueError, match="must be > 0"):
        tuner(
            {"client_lr": -0.1, "server_lr": 1.0}, MODEL.init(None), problem.data, jax.random.key(0)
        )
    with pytest.raises(ValueError, match="must be a real number"):
        tuner(
            {"client_lr": "0.1", "server_lr": 1.0},
            MODEL.init(None),
            problem.data,
            jax.random.key(0),
        )
