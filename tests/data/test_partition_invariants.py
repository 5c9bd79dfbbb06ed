"""Partitioners (NumPy reference and JAX device versions), size buckets and padding waste.

Expectations are derived independently: Dirichlet(alpha 1_C) moments, exact equal-split
sizes, brute-force optimal bucketings, NumPy re-implementations of the index layout.
"""

import importlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.data import buckets, jax_partition, pack, unpack

partition = importlib.import_module("fedjax_sim.data.partition")  # the module, not the function


def device(name, labels, num_clients, seed, **kw):
    key = jax.random.key(seed)
    return np.asarray(jax_partition.partition(name, key, labels, num_clients, **kw))


# ---------------------------------------------------------------- scale invariants (10^5 clients)
N_BIG, C_BIG = 400_000, 100_000
LABELS_BIG = np.random.default_rng(0).integers(0, 10, N_BIG).astype(np.int32)


@pytest.mark.parametrize(
    "name,kw",
    [
        ("iid", {}),
        ("dirichlet", {"alpha": 0.5}),
        ("shards", {"per_client": 2}),
        ("quantity_skew", {"sigma": 1.0, "min_size": 1}),
    ],
)
def test_device_partitioners_at_1e5_clients(name, kw):
    labels = jnp.asarray(LABELS_BIG)
    ids = device(name, labels, C_BIG, 3, **kw)
    assert ids.shape == (N_BIG,) and ids.dtype == np.int32
    assert ids.min() >= 0 and ids.max() < C_BIG
    counts = np.bincount(ids, minlength=C_BIG)
    if name == "iid":  # equal split: every client exactly N / C (a duplicate write would break it)
        np.testing.assert_array_equal(counts, N_BIG // C_BIG)
    if name == "shards":  # 2 shards of N / (2C) label-sorted examples: <= 2 labels per shard
        np.testing.assert_array_equal(counts, N_BIG // C_BIG)
        pairs = np.unique(ids.astype(np.int64) * 10 + LABELS_BIG)
        labels_per_client = np.bincount(pairs // 10, minlength=C_BIG)
        assert labels_per_client.max() <= 4 and (labels_per_client <= 2).mean() > 0.99
    if name == "quantity_skew":
        assert counts.min() >= 1 and counts.sum() == N_BIG
        assert counts.max() > 5 * np.median(counts)  # log-normal tail
    if name == "dirichlet":  # 4 examples per client on average: many clients stay empty
        assert (counts == 0).sum() > 100
    # reproducible from the key, different for another key
    np.testing.assert_array_equal(ids, device(name, labels, C_BIG, 3, **kw))
    assert (ids != device(name, labels, C_BIG, 4, **kw)).mean() > 0.5


@pytest.mark.parametrize("name", ["iid", "dirichlet", "shards", "quantity_skew"])
def test_numpy_partitioners_at_1e5_clients(name):
    kw = {"dirichlet": {"alpha": 0.5}, "shards": {"per_client": 2}}.get(name, {})
    ids = partition.partition(name, LABELS_BIG, C_BIG, 5, **kw)
    assert ids.shape == (N_BIG,) and ids.min() >= 0 and ids.max() < C_BIG
    if name in ("iid", "shards"):
        np.testing.assert_array_equal(np.bincount(ids, minlength=C_BIG), N_BIG // C_BIG)
    np.testing.assert_array_equal(ids, partition.partition(name, LABELS_BIG, C_BIG, 5, **kw))
    assert (ids != partition.partition(name, LABELS_BIG, C_BIG, 6, **kw)).mean() > 0.5


def test_random_order_is_a_permutation_grouped_by_label():
    labels = jnp.asarray(np.random.default_rng(1).integers(0, 7, 5000), jnp.int32)
    order, sorted_labels = jax.jit(lambda k, y: jax_partition._random_order(k, 5000, y, 7))(
        jax.random.key(0), labels
    )
    order, sorted_labels = np.asarray(order), np.asarray(sorted_labels)
    np.testing.assert_array_equal(np.sort(order), np.arange(5000))
    np.testing.assert_array_equal(sorted_labels, np.asarray(labels)[order])
    assert (np.diff(sorted_labels) >= 0).all()
    # inside a label the order is shuffled: not increasing, and position ~ uncorrelated
    first = order[sorted_labels == 0]
    assert abs(np.corrcoef(first, np.arange(first.size))[0, 1]) < 0.1


def test_feistel_is_a_bijection_and_inverts():
    keys = jax.random.bits(jax.random.key(2), (jax_partition.FEISTEL_ROUNDS,), jnp.uint32)
    x = jnp.arange(1 << 12, dtype=jnp.uint32)
    feistel = jax.jit(jax_partition._feistel, static_argnums=(2, 3))
    y = feistel(x, keys, 6, False)
    assert np.unique(np.asarray(y)).size == x.size and int(y.max()) < (1 << 12)
    np.testing.assert_array_equal(feistel(y, keys, 6, True), x)


LOG_GAMMA = jax.jit(jax_partition._log_gamma, static_argnums=(2,))  # alpha traced: one compile


@pytest.mark.parametrize("alpha", [0.01, 0.5, 3.0])
def test_log_gamma_moments(alpha):
    g = np.exp(np.asarray(LOG_GAMMA(jax.random.key(1), alpha, (200_000,)), float))
    assert np.isfinite(np.log(g[g > 0])).all() and not np.isnan(g).any()
    # Gamma(alpha, 1): mean alpha, variance alpha
    assert abs(g.mean() - alpha) < 5 * np.sqrt(alpha / g.size)
    if alpha >= 0.5:
        assert abs(g.var() - alpha) < 0.05 * alpha


# ---------------------------------------------------------------- Dirichlet statistics
@pytest.mark.parametrize("backend", ["numpy", "jax"])
@pytest.mark.parametrize("alpha", [0.1, 1.0, 10.0])
def test_dirichlet_proportions_match_alpha(backend, alpha):
    """Per-class client fractions q_{c,i} ~ Dir(alpha 1_C): E q = 1/C and
    Var q = (1/C)(1 - 1/C) / (C alpha + 1)."""
    k, c, per_class = 60, 20, 2000
    labels = np.repeat(np.arange(k, dtype=np.int32), per_class)
    if backend == "numpy":
        ids = partition.dirichlet(labels, c, 7, alpha=alpha)
    else:
        ids = device("dirichlet", jnp.asarray(labels), c, 7, alpha=alpha, num_classes=k)
    frac = np.zeros((k, c))
    np.add.at(frac, (labels, ids), 1.0 / per_class)
    np.testing.assert_allclose(frac.sum(1), 1.0)
    var_theory = (1 / c) * (1 - 1 / c) / (c * alpha + 1)
    var_emp = np.mean((frac - 1 / c) ** 2) * c / (c - 1)  # rows sum to 1: C-1 free entries
    assert var_emp == pytest.approx(var_theory, rel=0.3)


@pytest.mark.parametrize("backend", ["numpy", "jax"])
def test_dirichlet_tiny_alpha_no_nan(backend):
    k, c, per_class = 60, 20, 2000  # same shapes as above: no new compilation
    labels = np.repeat(np.arange(k, dtype=np.int32), per_class)
    if backend == "numpy":
        ids = partition.dirichlet(labels, c, 0, alpha=0.01)
    else:
        ids = device("dirichlet", jnp.asarray(labels), c, 0, alpha=0.01, num_classes=k)
    assert ids.min() >= 0 and ids.max() < c
    frac = np.zeros((k, c))
    np.add.at(frac, (labels, ids), 1 / per_class)
    # Dir(0.01 1_20) is nearly one-hot: E max_i q_i ~ 0.85 (an iid split gives ~0.06)
    assert frac.max(1).mean() > 0.7


# ---------------------------------------------------------------- validation
def test_more_clients_than_examples():
    labels = np.zeros(5, np.int32)
    with pytest.raises(ValueError, match="iid: 6 clients but only 5 examples"):
        partition.iid(labels, 6)
    with pytest.raises(ValueError, match="needs at least 12 examples"):
        partition.shards(labels, 6)
    with pytest.raises(ValueError, match="exceeds"):
        partition.quantity_skew(labels, 6)
    for name in ("iid", "shards", "quantity_skew"):
        with pytest.raises(ValueError, match="needs .* examples, got 5"):
            device(name, jnp.asarray(labels), 6, 0)
    # Dirichlet may leave clients empty: allowed (device version: see the 1e5-client test)
    assert partition.dirichlet(labels, 6, alpha=0.5).size == 5
    with pytest.raises(ValueError, match="empty dataset"):
        device("iid", jnp.zeros(0, jnp.int32), 2, 0)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        device("dirichlet", jnp.asarray([0, 1, 5], jnp.int32), 2, 0, num_classes=3)


# ---------------------------------------------------------------- layout, waste, buckets
def test_client_index_matches_pack_layout():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 9, 300).astype(np.int32)
    counts = np.bincount(ids, minlength=9)
    index = np.asarray(jax_partition.client_index(jnp.asarray(ids), 9, int(counts.max())))
    x = np.arange(300, dtype=np.int32)
    packed = pack(x, x, ids, 9)
    valid = np.arange(counts.max())[None] < counts[:, None]
    np.testing.assert_array_equal(np.where(valid, np.asarray(packed.x), -1), index)
    assert jax_partition.padding_waste(counts) == packed.padding_waste()
    assert jax_partition.padding_waste(counts) == int(9 * counts.max() - 300)


def brute_force_slots(counts, num_buckets):
    sizes = np.unique(counts)
    best = np.inf
    for k in range(1, num_buckets + 1):
        for cut in itertools.combinations(range(sizes.size - 1), k - 1):
            maxima = sizes[list(cut) + [sizes.size - 1]]
            best = min(best, maxima[np.searchsorted(maxima, counts)].sum())
    return best


@pytest.mark.parametrize("num_buckets", [1, 2, 3, 4])
def test_size_buckets_optimal(num_buckets):
    counts = np.random.default_rng(num_buckets).lognormal(2, 1, 60).astype(int) + 1
    counts = np.minimum(counts, 40)  # few distinct sizes: brute force is cheap
    b = buckets.size_buckets(counts, num_buckets)
    assert b.padded_rows == brute_force_slots(counts, num_buckets)
    assert b.waste == b.padded_rows - counts.sum()
    assert b.waste_unbucketed == counts.size * counts.max() - counts.sum()
    assert (b.max_counts[b.bucket_of_client] >= counts).all()
    assert b.max_counts.size <= num_buckets


def test_pack_buckets_round_trip_and_cut_waste():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 5, 3000).astype(np.int32)
    ids = partition.quantity_skew(labels, 50, 1, sigma=1.5)
    x = np.arange(3000, dtype=np.float32)[:, None]
    parts, b = buckets.pack_buckets(x, labels, ids, 50, 4, num_classes=5)
    assert b.waste < b.waste_unbucketed / 2
    assert sum(p.data.padding_waste() for p in parts) == b.waste
    seen = []
    for p in parts:
        xb, yb, local = unpack(p.data)
        np.testing.assert_array_equal(ids[xb[:, 0].astype(int)], p.clients[local])
        np.testing.assert_array_equal(labels[xb[:, 0].astype(int)], yb)
        seen.append(xb[:, 0])
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), x[:, 0])
