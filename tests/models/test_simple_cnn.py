"""pfl-research's CIFAR CNN (`models.simple_cnn`): parameter count, im2col == lax convolutions
(values, gradients, forward-mode derivatives), and the same function as a PyTorch module
built like pfl's (dropout off) from the same weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
    params = fast.init(jax.random.key(2))
    x = jax.random.uniform(jax.random.key(3), (5, 12, 12, 3))
    np.testing.assert_allclose(fast.apply(params, x), ref.apply(params, x), atol=1e-5)
    g = jax.grad(lambda p, m: jnp.sum(m.apply(p, x) ** 2))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
        g(params, fast),
        g(params, ref),
    )
    tangent = jax.tree.map(lambda p: jnp.ones_like(p) * 0.01, params)
    jvp = [jax.jvp(lambda p, m=m: m.apply(p, x), (params,), (tangent,))[1] for m in (fast, ref)]
    np.testing.assert_allclose(jvp[0], jvp[1], rtol=1e-4, atol=1e-5)


def test_same_function_as_pfls_pytorch_module():
    torch = pytest.importorskip("torch")  # the 'peers' extra (installed on CI)
    model = simple_cnn((8, 8, 3), 5)
    p = jax.device_get(model.init(jax.random.key(4)))
    x = np.asarray(jax.random.uniform(jax.random.key(5), (3, 8, 8, 3)))
    nn = torch.nn
    net = nn.Sequential(  # pfl's simple_cnn without its two Dropout layers
        nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * 2 * 64, 128), nn.ReLU(), nn.Linear(128, 5),
    )  # fmt: skip
    t = lambda a: torch.from_numpy(np.array(a))  # a writable copy
    with torch.no_grad():
        for i, conv in enumerate((net[0], net[2])):
            conv.weight.copy_(t(p[f"Conv_{i}"]["kernel"].transpose(3, 2, 0, 1)))
            conv.bias.copy_(t(p[f"Conv_{i}"]["bias"]))
        # flax flattens (h, w, c), torch (c, h, w): permute the first dense layer's rows
        k = p["Dense_0"]["kernel"].reshape(2, 2, 64, 128).transpose(2, 0, 1, 3).reshape(256, 128)
        net[6].weight.copy_(t(k.T))
        net[6].bias.copy_(t(p["Dense_0"]["bias"]))
        net[8].weight.copy_(t(p["Dense_1"]["kernel"].T))
        net[8].bias.copy_(t(p["Dense_1"]["bias"]))
        want = net(t(x.transpose(0, 3, 1, 2))).numpy()
    np.testing.assert_allclose(model.apply(p, x), want, rtol=1e-4, atol=1e-5)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="even image sides"):
        simple_cnn((31, 31, 3), 10)
    with pytest.raises(ValueError, match="conv"):
        simple_cnn((32, 32, 3), 10, conv="fft")
