"""`cnn(conv="slices")` (convolution as a matmul over shifted slices) is the same function
with the same parameters as the default `lax.conv` CNN."""

import jax
import numpy as np
import pytest

from fedjax_sim.data import Batch
from fedjax_sim.models import cnn


@pytest.mark.parametrize("kernel_size", [4, 5])
def test_slice_convolution_equals_lax_conv(kernel_size):
    kw = dict(channels=(4, 6), dense=16, kernel_size=kernel_size)
    ref = cnn((12, 12, 1), 10, **kw)
    fast = cnn((12, 12, 1), 10, conv="slices", **kw)
    params = ref.init(jax.random.key(0))
    assert jax.tree.map(np.shape, fast.init(jax.random.key(0))) == jax.tree.map(np.shape, params)
    x = jax.random.normal(jax.random.key(1), (5, 12, 12, 1))
    y = jax.random.randint(jax.random.key(2), (5,), 0, 10)
    np.testing.assert_allclose(fast.apply(params, x), ref.apply(params, x), atol=2e-6)
    batch = Batch(x, y, np.ones(5, np.float32))
    g_ref, g_fast = (jax.grad(m.loss)(params, batch) for m in (ref, fast))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6), g_fast, g_ref)
    with pytest.raises(ValueError, match="conv must be"):
        cnn((12, 12, 1), 10, conv="fft")
