"""Partitioners: every example exactly once, label statistics match theory, extremes work."""

import time

import numpy as np
import pytest

from fedjax_sim.data import dirichlet, iid, natural, partition, quantity_skew, shards
from fedjax_sim.data.partition import sample_dirichlet

LABELS = np.repeat(np.arange(10), 300)  # 3000 examples, 10 balanced classes


@pytest.mark.parametrize(
    "name, kw",
    [
        ("iid", {}),
        ("dirichlet", {"alpha": 0.3}),
        ("shards", {"per_client": 2}),
        ("quantity_skew", {"sigma": 1.5}),
    ],
)
def test_every_example_assigned_exactly_once(name, kw):
    ids = partition(name, LABELS, 50, 3, **kw)
    assert ids.shape == LABELS.shape and ids.min() >= 0 and ids.max() < 50
    # reproducible from the seed, different for another seed
    np.testing.assert_array_equal(ids, partition(name, LABELS, 50, 3, **kw))
    assert not np.array_equal(ids, partition(name, LABELS, 50, 4, **kw))


def test_iid_sizes_differ_by_at_most_one():
    sizes = np.bincount(iid(LABELS, 7, 0), minlength=7)
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == 3000


@pytest.mark.parametrize("alpha", [0.1, 1.0, 10.0])
def test_dirichlet_proportions_match_alpha(alpha):
    """Each class is split over C clients by q ~ Dir(alpha 1_C): the share q_ci of a client has
    mean 1/C and variance (1/C)(1 - 1/C)/(C alpha + 1)."""
    c = 20
    labels = np.repeat(np.arange(10), 2000)
    shares = []
    for seed in range(10):
        ids = dirichlet(labels, c, seed, alpha=alpha)
        counts = np.zeros((10, c))
        np.add.at(counts, (labels, ids), 1)
        shares.append(counts / 2000)
    shares = np.concatenate(shares)  # [100, C]
    expected_var = (1 / c) * (1 - 1 / c) / (c * alpha + 1)
    # sampling sd of a variance estimate from 2000 draws of a bounded variable; 25% is ~4 sd
    assert abs(shares.var() / expected_var - 1) < 0.25
    np.testing.assert_allclose(shares.mean(), 1 / c, rtol=1e-6)


@pytest.mark.parametrize("alpha", [0.01, 1e-3])
def test_dirichlet_tiny_alpha_is_stable(alpha):
    t0 = time.perf_counter()
    ids = dirichlet(LABELS, 100, 0, alpha=alpha)
    assert time.perf_counter() - t0 < 5
    assert ids.min() >= 0 and ids.max() < 100
    q = sample_dirichlet(np.random.default_rng(0), alpha, (1000, 100))
    assert np.isfinite(q).all()
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-12)
    # concentration: E[sum_i q_i^2] = (alpha + 1) / (C alpha + 1) for Dir(alpha 1_C)
    expected = (alpha + 1) / (100 * alpha + 1)
    assert abs(np.mean(np.sum(q**2, axis=-1)) - expected) < 0.05


def test_shards_give_each_client_at_most_k_labels():
    ids = shards(LABELS, 100, 0, per_client=2)
    sizes = np.bincount(ids, minlength=100)
    assert (sizes == 30).all()  # 200 shards of 15
    labels_per_client = [len(np.unique(LABELS[ids == i])) for i in range(100)]
    assert max(labels_per_client) <= 2
    with pytest.raises(ValueError, match="at least"):
        shards(LABELS[:10], 10, 0, per_client=2)


def test_quantity_skew_sizes():
    ids = quantity_skew(LABELS, 30, 0, sigma=2.0, min_size=5)
    sizes = np.bincount(ids, minlength=30)
    assert sizes.sum() == 3000 and sizes.min() >= 5
    assert sizes.max() / np.median(sizes) > 3  # heavy tail with sigma = 2
    flat = np.bincount(quantity_skew(LABELS, 30, 0, sigma=0.0), minlength=30)
    assert flat.max() - flat.min() <= 1


def test_natural_groups():
    ids, n = natural(np.array(["b", "a", "b", "c"]))
    assert n == 3 and ids.tolist() == [1, 0, 1, 2]


@pytest.mark.parametrize(
    "call",
    [
        lambda: partition("nope", LABELS, 3),
        lambda: dirichlet(LABELS, 3, alpha=0.0),
        lambda: iid(np.array([]), 3),
        lambda: iid(LABELS, 0),
        lambda: quantity_skew(LABELS[:5], 10, min_size=1),
    ],
)
def test_bad_partition_arguments(call):
    with pytest.raises(ValueError):
        call()
