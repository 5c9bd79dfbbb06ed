"""pfl-research's CIFAR CNN (`models.simple_cnn`): parameter count, im2col == lax convolutions
(values, gradients, forward-mode derivatives). The same function as a PyTorch module built
like pfl's (dropout off) from the same weights: `tests/bench/test_baselines.py`."""

import jax
import jax.numpy as jnp
import pytest
from same_function import assert_same_function

from fedjax_sim.models import MODELS, count_params, simple_cnn
from fedjax_sim.models.simple_cnn import conv_macs


def test_parameter_count_and_macs():
    model = simple_cnn((32, 32, 3), 10)
    params = model.init(jax.random.key(0))
    # conv 3*9*32 + 32, conv 32*9*64 + 64, dense 14*14*64*128 + 128, output 128*10 + 10
    assert count_params(params) == 896 + 18_496 + 1_605_760 + 1_290 == 1_626_442
    assert model.apply(params, jnp.zeros((2, 3072))).shape == (2, 10)  # flat inputs
    assert MODELS["simple_cnn"] is simple_cnn
    assert conv_macs((32, 32, 3), 10) == [30 * 30 * 27 * 32, 28 * 28 * 288 * 64, 12544 * 128, 1280]


def test_im2col_equals_lax_convolution_forward_and_backward():
    fast, ref = simple_cnn((12, 12, 3), 4), simple_cnn((12, 12, 3), 4, conv="xla")
    x = jax.random.uniform(jax.random.key(3), (5, 12, 12, 3))
    assert_same_function(fast, ref, fast.init(jax.random.key(2)), x)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="even image sides"):
        simple_cnn((31, 31, 3), 10)
    with pytest.raises(ValueError, match="conv"):
        simple_cnn((32, 32, 3), 10, conv="fft")
