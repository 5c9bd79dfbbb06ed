"""Two models that must compute the same function (e.g. im2col vs `lax` convolutions)."""

import jax
import jax.numpy as jnp
import numpy as np


def assert_same_function(fast, ref, params, x, atol=1e-5, rtol=1e-4):
    """Equal logits, equal gradients of a scalar of them, equal forward-mode derivatives."""
    np.testing.assert_allclose(fast.apply(params, x), ref.apply(params, x), atol=atol)
    g = jax.grad(lambda p, m: jnp.sum(m.apply(p, x) ** 2))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol),
        g(params, fast),
        g(params, ref),
    )
    tangent = jax.tree.map(lambda p: jnp.full_like(p, 0.01), params)
    jvp = [jax.jvp(lambda p, m=m: m.apply(p, x), (params,), (tangent,))[1] for m in (fast, ref)]
    np.testing.assert_allclose(jvp[0], jvp[1], rtol=rtol, atol=atol)
