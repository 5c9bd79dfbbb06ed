"""Compressors (Assumption 3, spec 8.3), payload bytes, and error-feedback memory (spec 8.4)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import compression as C
from fedjax_sim.algorithms import fedavg
from fedjax_sim.algorithms.aggregators import error_feedback


def vec(seed, d=200):
    return jax.random.normal(jax.random.key(seed), (d,))


@pytest.mark.parametrize("k", [1, 7, 50, 200])
def test_top_k_keeps_exactly_the_k_largest(k):
    v = vec(0)
    q = np.asarray(C.TopK(k=k)(v))
    v = np.asarray(v)
    kept = np.flatnonzero(q)
    assert kept.size == k
    np.testing.assert_array_equal(q[kept], v[kept])
    assert np.abs(v[kept]).min() >= np.abs(np.delete(v, kept)).max(initial=0)
    assert np.sum((q - v) ** 2) <= (1 - k / v.size) * np.sum(v**2) + 1e-6


def test_top_k_ties_are_deterministic_lower_index_first():
    v = jnp.array([1.0, -2.0, 2.0, 0.5, -2.0, 2.0])
    q = np.asarray(C.TopK(k=2)(v))
    np.testing.assert_array_equal(q, [0, -2.0, 2.0, 0, 0, 0])  # exactly k despite 4 ties
    assert np.array_equal(q, np.asarray(jax.jit(C.TopK(k=2))(v)))


def test_top_k_paper_size():
    top = C.TopK(fraction=0.01)
    assert top.num_kept(431_080) == 4310
    assert top.delta(431_080) == pytest.approx(4310 / 431_080)
    assert top.payload_bytes(431_080, 4) == 4310 * 8  # values + int32 indices


def test_scaled_sign_error_identity():
    v = np.asarray(vec(1, 64))
    q = np.asarray(C.ScaledSign()(jnp.asarray(v)))
    err = np.sum((q - v) ** 2)
    np.testing.assert_allclose(err, np.sum(v**2) - np.sum(np.abs(v)) ** 2 / v.size, rtol=1e-5)
    assert err <= (1 - 1 / v.size) * np.sum(v**2)
    assert C.ScaledSign().payload_bytes(64, 4) == 8 + 4


def test_random_k_exact_count_and_expected_contraction():
    d, k = 50, 10
    v = vec(2, d)
    keys = jax.random.split(jax.random.key(3), 1000)
    for scaled in (False, True):
        q = jax.jit(jax.vmap(lambda key: C.RandomK(k=k, scaled=scaled)(v, key)))(keys)
        assert np.all(np.count_nonzero(np.asarray(q), axis=1) == k)
        err = float(jnp.mean(jnp.sum((q - v) ** 2, axis=1)) / jnp.sum(v**2))
        expected = 1 - k / d if not scaled else d / k - 1
        assert err == pytest.approx(expected, rel=0.05)
        if scaled:  # unbiased: E||mean - v||^2 = omega ||v||^2 / 1000, omega = 4
            assert float(jnp.linalg.norm(jnp.mean(q, 0) - v) / jnp.linalg.norm(v)) < 0.1


def test_qsgd_unbiased_and_scaled_version_contractive():
    d = 64
    v = vec(4, d)
    keys = jax.random.split(jax.random.key(5), 1000)
    unscaled = jax.jit(jax.vmap(lambda key: C.QSGD(levels=2, scaled=False)(v, key)))(keys)
    # unbiased: E||mean - v||^2 <= omega ||v||^2 / 1000 with omega = 4
    assert float(jnp.linalg.norm(jnp.mean(unscaled, 0) - v) / jnp.linalg.norm(v)) < 0.1
    q = C.QSGD(levels=2)
    scaled = jax.jit(jax.vmap(lambda key: q(v, key)))(keys)
    err = float(jnp.mean(jnp.sum((scaled - v) ** 2, axis=1)) / jnp.sum(v**2))
    assert err <= 1 - q.delta(d) + 0.01
    assert q.delta(d) == pytest.approx(1 / (1 + min(d / 4, math.sqrt(d) / 2)))
    assert q.payload_bytes(d, 4) == math.ceil(d * 3 / 8) + 4
    np.testing.assert_array_equal(q(jnp.zeros(d), keys[0]), np.zeros(d))  # no 0/0


def test_compress_tree_is_global_across_leaves():
    tree = {"a": jnp.array([1.0, -5.0]), "b": jnp.array([[3.0, 0.1], [-4.0, 2.0]])}
    out = C.compress_tree(C.TopK(k=2), tree, jax.random.key(0))
    np.testing.assert_array_equal(out["a"], [0.0, -5.0])
    np.testing.assert_array_equal(out["b"], [[0.0, 0.0], [-4.0, 0.0]])
    assert C.tree_payload_bytes(C.TopK(k=2), tree) == 2 * 8


@pytest.mark.parametrize("compressor", [C.TopK(k=3), C.ScaledSign(), C.Identity()])
def test_error_memory_identity(compressor):
    """e^{k+1} = u - Q(u); ||e^{k+1}||^2 <= (1 - delta)||u||^2; with top-k q + e == u exactly."""
    ef = error_feedback(compressor)
    params = {"w": jnp.zeros(20), "b": jnp.zeros(())}
    server, rows = ef.init(params, 4)
    memory = rows["error_feedback"]
    assert memory["w"].shape == (4, 20) and memory["b"].shape == (4,)
    e = {"w": vec(6, 20) * 0.3, "b": jnp.float32(0.7)}
    delta = {"w": vec(7, 20), "b": jnp.float32(-1.0)}
    q, new_rows = ef.encode(delta, {"error_feedback": e}, jax.random.key(0), server)
    e_new = new_rows["error_feedback"]
    u = jax.tree.map(jnp.add, delta, e)
    flat = lambda t: np.concatenate([np.ravel(t["b"]), np.ravel(t["w"])])
    assert np.sum(flat(e_new) ** 2) <= (1 - compressor.delta(21)) * np.sum(flat(u) ** 2) + 1e-6
    if not isinstance(compressor, C.ScaledSign):
        np.testing.assert_array_equal(flat(q) + flat(e_new), flat(u))
    if isinstance(compressor, C.Identity):
        assert not np.any(flat(e_new))


def test_bad_compressors_raise():
    with pytest.raises(ValueError, match="exactly one"):
        C.TopK()
    with pytest.raises(ValueError, match="k must"):
        C.TopK(k=0)
    with pytest.raises(ValueError, match="fraction"):
        C.RandomK(fraction=1.5)
    with pytest.raises(ValueError, match="levels"):
        C.QSGD(levels=0)
    with pytest.raises(ValueError, match="num_clients"):
        fedavg(lambda p, b: 0.0, aggregator=error_feedback(C.Identity()), num_clients=0)
    with pytest.raises(ValueError, match="unknown compressor"):
        C.make("gzip")
