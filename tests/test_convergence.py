"""Paper-table metrics: pooled accuracy over (unseen) clients, rounds to target, speed-up."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.data import ArrayData, pack
from fedjax_sim.models import logistic_regression
from fedjax_sim.run.convergence import pooled_accuracy, rounds_to_target, speedup
from fedjax_sim.run.simulate import evaluate_central


def test_pooled_accuracy_is_size_weighted_client_mean():
    rng = np.random.default_rng(0)
    sizes = np.array([5, 17, 0, 9, 30])
    owner = np.repeat(np.arange(5), sizes)
    x = rng.normal(size=(owner.size, 3)).astype(np.float32)
    y = rng.integers(0, 4, owner.size).astype(np.int32)
    data = pack(x, y, owner, 5, num_classes=4)
    model = logistic_regression((3,), 4)
    params = model.init(jax.random.key(0))
    pooled, per_client = pooled_accuracy(model, params, data.x, data.y, data.counts)
    pred = np.asarray(jnp.argmax(model.apply(params, jnp.asarray(x)), -1))
    correct = (pred == y).astype(float)
    expected_clients = np.array([correct[owner == i].mean() if sizes[i] else 0.0 for i in range(5)])
    np.testing.assert_allclose(per_client, expected_clients, rtol=1e-6)
    np.testing.assert_allclose(pooled, np.sum(sizes / sizes.sum() * expected_clients), rtol=1e-6)
    central = evaluate_central(model, params, ArrayData(x=x, y=y))["test_accuracy"]
    np.testing.assert_allclose(pooled, central, rtol=1e-6)
    assert 0.05 < float(pooled) < 0.95  # a random model: not trivially 0 or 1


def test_rounds_to_target_and_speedup():
    rounds = np.array([0, 1, 2, 3, 4, 5])
    acc = np.array([0.1, 0.5, 0.74, 0.76, 0.73, 0.8])
    assert rounds_to_target(rounds, acc, 0.75) == 3  # first crossing, not the last
    assert rounds_to_target(rounds, acc, 0.9) is None
    assert rounds_to_target([10, 20, 30], [0.2, 0.3, 0.3], 0.3) == 20
    assert speedup(80, 50) == pytest.approx(1.6)
    assert speedup(None, 50) is None and speedup(80, None) is None
    with pytest.raises(ValueError, match="increasing"):
        rounds_to_target([0, 2, 1], [0.1, 0.2, 0.3], 0.2)
    with pytest.raises(ValueError, match="equal-length"):
        rounds_to_target([0, 1], [0.1], 0.2)
