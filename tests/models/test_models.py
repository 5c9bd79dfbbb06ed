"""Models: parameter counts, masked losses, evaluation sums."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_sim.data import Batch
from fedjax_sim.models import Model, build, cnn, count_params, linear_regression, mlp


def test_mlp_2nn_parameter_count():
    params = mlp((28, 28, 1), 10, hidden=(200, 200)).init(jax.random.key(0))
    assert count_params(params) == 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10


def test_masked_loss_ignores_padding_and_empty_batch_is_zero():
    model = build("logistic", (4,), 3)
    params = model.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, 4))
    y = jnp.array([0, 1, 2, 0, 1])
    mask = jnp.array([1.0, 1.0, 1.0, 0.0, 0.0])
    logits = model.apply(params, x[:3])
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, y[:3]).mean()
    np.testing.assert_allclose(model.loss(params, Batch(x, y, mask)), expected, rtol=1e-6)
    empty = model.loss(params, Batch(x, y, jnp.zeros(5)))
    assert float(empty) == 0.0
    g = jax.grad(model.loss)(params, Batch(x, y, jnp.zeros(5)))
    assert all(np.all(np.asarray(leaf) == 0) for leaf in jax.tree.leaves(g))


def test_l2_penalty_added():
    model = linear_regression(2, l2=0.1)
    params = {"w": jnp.array([1.0, 2.0])}
    batch = Batch(jnp.zeros((1, 2)), jnp.zeros(1), jnp.ones(1))
    np.testing.assert_allclose(model.loss(params, batch), 0.5 * 0.1 * 5.0, rtol=1e-6)


def test_evaluate_sums():
    model = build("mlp", (8,), 4, hidden=(5,))
    params = model.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(2), (6, 8))
    y = jnp.array([0, 1, 2, 3, 0, 1])
    mask = jnp.array([1, 1, 1, 1, 0, 0.0])
    out = model.evaluate(params, Batch(x, y, mask))
    pred = np.argmax(np.asarray(model.apply(params, x)), -1)
    assert float(out["count"]) == 4
    assert float(out["correct"]) == float((pred[:4] == np.asarray(y[:4])).sum())


def test_cnn_accepts_flat_and_image_inputs():
    flat = cnn((64,), 10, channels=(4,), dense=8)
    img = cnn((8, 8, 1), 10, channels=(4,), dense=8)
    p = flat.init(jax.random.key(0))
    x = jnp.ones((2, 64))
    np.testing.assert_allclose(flat.apply(p, x), img.apply(p, x.reshape(2, 8, 8, 1)), rtol=1e-6)
    with pytest.raises(ValueError, match="square image"):
        cnn((10,), 10)


def test_model_validation():
    with pytest.raises(ValueError):
        Model(init=lambda k: {}, apply=lambda p, x: x, loss_kind="hinge")
    with pytest.raises(ValueError):
        build("perceiver", (3,), 2)  # not registered
