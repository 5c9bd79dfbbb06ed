"""The paper's CNN (spec 8.13): 431,080 parameters, logits shape, PyTorch-default init."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from same_function import assert_same_function

from fedjax_sim.models import MODELS, count_params, lenet


def test_parameter_count_and_logits():
    model = lenet((28, 28, 1), 10)
    params = model.init(jax.random.key(0))
    assert count_params(params) == 431_080
    assert model.apply(params, jnp.zeros((3, 784))).shape == (3, 10)  # flat inputs reshaped
    assert MODELS["lenet"] is lenet


def test_pytorch_default_init_bounds():
    params = lenet((28, 28, 1), 10).init(jax.random.key(1))
    fan_in = {"Conv_0": 25, "Conv_1": 500, "Dense_0": 800, "Dense_1": 500}
    for layer, n in fan_in.items():
        bound = 1 / math.sqrt(n)
        for name in ("kernel", "bias"):
            w = np.asarray(params[layer][name])
            assert np.abs(w).max() <= bound
            if w.size > 1000:  # U(-b, b): variance b^2 / 3
                assert np.var(w) == pytest.approx(bound**2 / 3, rel=0.1)


def test_im2col_equals_xla_convolution():
    fast, ref = lenet((28, 28, 1), 10), lenet((28, 28, 1), 10, conv="xla")
    x = jax.random.uniform(jax.random.key(3), (4, 28, 28, 1))
    assert_same_function(fast, ref, fast.init(jax.random.key(2)), x)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="divisible by 4"):
        lenet((30, 30, 1), 10)
    with pytest.raises(ValueError, match="conv"):
        lenet((28, 28, 1), 10, conv="fft")
