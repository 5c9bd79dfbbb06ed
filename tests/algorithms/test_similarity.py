"""FedLPS' similarity graph: batched messages against per-client NumPy SVDs, graph sanity
(spec section 8, test 2), permutation equivariance and bad input."""

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms.similarity import (
    client_messages,
    graph_from_data,
    similarity_graph,
)
from fedjax_sim.data import FederatedData


def padded_clients(counts, dim, seed=0, garbage=99.0):
    """Clients with different means (so uncentred PCs differ) and junk in the padding rows."""
    rng = np.random.default_rng(seed)
    counts = np.asarray(counts)
    x = rng.normal(size=(len(counts), counts.max(), dim)) + 2 * rng.normal(
        size=(len(counts), 1, dim)
    )
    x[np.arange(counts.max())[None, :] >= counts[:, None]] = garbage
    return x, counts


def numpy_messages(x, counts):
    """Independent reference: top right singular vector of each X_i, sign by the mean."""
    out = np.zeros((len(counts), int(np.prod(x.shape[2:]))))
    for i, n in enumerate(counts):
        if n == 0:
            continue
        xi = x[i, :n].reshape(n, -1)
        v = np.linalg.svd(xi)[2][0]
        out[i] = v * np.sign(v @ xi.mean(axis=0))
    return out


@pytest.mark.parametrize(
    "method,dim", [("eigh", 6), ("subspace", 6), ("auto", 300)], ids=["eigh", "subspace", "auto"]
)
def test_messages_match_numpy_svd(x64, method, dim):
    x, counts = padded_clients([30, 5, 12, 0, 1, 25], dim)
    m = np.asarray(client_messages(jnp.asarray(x), counts, method=method, iterations=200))
    np.testing.assert_allclose(m, numpy_messages(x, counts), atol=1e-10)
    np.testing.assert_allclose(np.linalg.norm(m, axis=1), (counts > 0).astype(float), atol=1e-12)


def test_messages_float32_close_to_float64():
    x, counts = padded_clients([40, 7, 20], 10, seed=3)
    m = np.asarray(client_messages(jnp.asarray(x, jnp.float32), counts))
    np.testing.assert_allclose(m, numpy_messages(x, counts), atol=2e-5)


def test_message_sign_convention(x64):
    x, counts = padded_clients([20, 20], 5, seed=1, garbage=0.0)
    m = np.asarray(client_messages(jnp.asarray(np.stack([x[0], -x[0]])), counts))
    np.testing.assert_allclose(m[1], -m[0], atol=1e-12)  # same Gram, opposite mean
    # zero mean (rows come in +-pairs): the fallback orients by sum(m) >= 0
    sym = np.concatenate([x[1, :10], -x[1, :10]])[None]
    ms = np.asarray(client_messages(jnp.asarray(sym), np.array([20])))[0]
    assert ms.sum() > 0


def test_graph_weights_sane():
    rng = np.random.default_rng(0)
    g = similarity_graph(rng.normal(size=(7, 4)))
    a, p = g.adjacency, g.pair_weights
    np.testing.assert_array_equal(a, a.T)
    np.testing.assert_array_equal(np.diag(a), 0.0)
    assert (a >= 0).all() and (a[~np.eye(7, dtype=bool)] > 0).all()
    np.testing.assert_allclose(p.sum(), 1.0, rtol=1e-14)
    np.testing.assert_allclose(g.degrees, p.sum(axis=1), rtol=1e-14)
    np.testing.assert_allclose(g.row_normalised.sum(axis=1), 1.0, rtol=1e-14)
    # -ln of (1 - m_i.m_n) / 2 for the normalised messages, computed directly
    m = g.messages
    off = ~np.eye(7, dtype=bool)
    expected = -np.log((1 - (m @ m.T)[off]) / 2)
    np.testing.assert_allclose(a[off], expected, rtol=1e-10)
    np.testing.assert_allclose(g.laplacian.sum(axis=1), 0.0, atol=1e-12)


def test_graph_special_messages():
    e = np.eye(3)
    g = similarity_graph(e)  # orthogonal: mis = 1/2
    off = ~np.eye(3, dtype=bool)
    np.testing.assert_allclose(g.adjacency[off], np.log(2.0), rtol=1e-15)
    np.testing.assert_allclose(g.degrees, 1 / 3, rtol=1e-14)
    g = similarity_graph(np.stack([e[0], -e[0], e[1]]))  # opposite: mis = 1, A = 0
    assert g.adjacency[0, 1] == 0.0 and g.adjacency[0, 2] == pytest.approx(np.log(2))
    g = similarity_graph(np.stack([e[0], e[0], e[1]]), eps=1e-12)  # identical: clipped
    assert g.adjacency[0, 1] == pytest.approx(-np.log(1e-12), rel=1e-12)
    assert np.isfinite(g.adjacency).all()
    g = similarity_graph(3.0 * e)  # not unit norm: normalised first
    np.testing.assert_allclose(g.adjacency[off], np.log(2.0), rtol=1e-15)


def test_graph_permutation_equivariant(x64):
    x, counts = padded_clients([12, 30, 7, 19, 25], 6, seed=2)
    perm = np.array([3, 0, 4, 1, 2])
    data = FederatedData.create(x, np.zeros(x.shape[:2]), counts)
    data_p = FederatedData.create(x[perm], np.zeros(x.shape[:2]), counts[perm])
    g, gp = graph_from_data(data), graph_from_data(data_p)
    np.testing.assert_allclose(gp.pair_weights, g.pair_weights[np.ix_(perm, perm)], rtol=1e-10)
    np.testing.assert_allclose(gp.degrees, g.degrees[perm], rtol=1e-10)
    assert np.ptp(g.degrees) > 1e-3  # degrees are not all equal, so the check has teeth


def test_empty_clients_get_zero_weight(x64):
    x, counts = padded_clients([12, 0, 9, 15], 5)
    g = graph_from_data(FederatedData.create(x, np.zeros(x.shape[:2]), counts))
    assert g.degrees[1] == 0.0 and (g.adjacency[1] == 0).all() and (g.adjacency[:, 1] == 0).all()
    np.testing.assert_array_equal(g.row_normalised[1], 0.0)
    np.testing.assert_allclose(g.degrees.sum(), 1.0, rtol=1e-14)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="zero norm"):
        similarity_graph(np.array([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="NaN"):
        similarity_graph(np.array([[1.0, np.nan], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="shape"):
        similarity_graph(np.ones(3))
    with pytest.raises(ValueError, match="no positive edge"):
        similarity_graph(np.array([[1.0, 0.0]]))
    with pytest.raises(ValueError, match="no positive edge"):
        similarity_graph(np.array([[1.0, 0.0], [-1.0, 0.0]]))
    with pytest.raises(ValueError, match="eps"):
        similarity_graph(np.eye(2), eps=0.0)
    # a client with data but all-zero features has no message
    x, counts = padded_clients([5, 6, 7], 3)
    x[1] = 0.0
    with pytest.raises(ValueError, match=r"clients \[1\] have zero norm"):
        graph_from_data(FederatedData.create(x, np.zeros(x.shape[:2]), counts))
    with pytest.raises(ValueError, match="method"):
        client_messages(jnp.asarray(x), counts, method="svd")
    with pytest.raises(ValueError, match="counts"):
        client_messages(jnp.asarray(x), counts[:2])
