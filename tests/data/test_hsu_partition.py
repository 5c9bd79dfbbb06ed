"""The FedLPS paper's partition (Hsu et al. class mix x log-normal sizes) and the unseen
test-client dataset builder."""

import numpy as np
import pytest

from fedjax_sim.data.partition import PARTITIONERS, hsu, lognormal_sizes
from fedjax_sim.data.unseen import federate_unseen, split_pool, standardize


def client_class_counts(ids, labels, num_clients, num_classes):
    counts = np.zeros((num_clients, num_classes), np.int64)
    np.add.at(counts, (ids, labels), 1)
    return counts


def test_balanced_is_exact():
    labels = np.repeat(np.arange(10), 200)[np.random.default_rng(0).permutation(2000)]
    ids = hsu(labels, 20, seed=1)
    np.testing.assert_array_equal(client_class_counts(ids, labels, 20, 10), 10)


@pytest.mark.parametrize("a,b", [(0.0, 1.0), (10.0, 0.0), (10.0, 1.0), (100.0, 1.0)])
def test_assignment_sizes_and_determinism(a, b):
    labels = np.random.default_rng(2).integers(0, 10, 3000)
    ids = hsu(labels, 40, seed=3, class_imbalance=a, data_imbalance=b)
    assert ids.shape == labels.shape and ids.min() >= 0 and ids.max() < 40  # all assigned once
    sizes = np.bincount(ids, minlength=40)
    target = lognormal_sizes(3000, 40, b, np.random.default_rng(3))  # same first draw
    assert np.abs(sizes - target).max() <= 5  # within ~K/2 of the log-normal sizes
    np.testing.assert_array_equal(ids, hsu(labels, 40, seed=3, class_imbalance=a, data_imbalance=b))
    assert (ids != hsu(labels, 40, seed=4, class_imbalance=a, data_imbalance=b)).any()


def test_no_class_imbalance_keeps_global_mix_per_client():
    labels = np.repeat(np.arange(5), [300, 500, 200, 600, 400])
    ids = hsu(labels, 30, seed=0, data_imbalance=1.0)
    counts = client_class_counts(ids, labels, 30, 5)
    freq = np.bincount(labels) / labels.size
    assert np.abs(counts - counts.sum(1, keepdims=True) * freq).max() <= 1.0 + 1e-9
    assert np.ptp(counts.sum(1)) > 50  # and sizes really differ


def test_class_skew_grows_with_a():
    labels = np.repeat(np.arange(10), 500)
    share = []
    for a in (0.0, 1.0, 10.0, 100.0):
        counts = client_class_counts(hsu(labels, 50, seed=0, class_imbalance=a), labels, 50, 10)
        share.append(np.mean(counts.max(1) / counts.sum(1)))
    assert share[0] == pytest.approx(0.1)
    assert all(x < y for x, y in zip(share, share[1:], strict=False)), share
    assert share[-1] > 0.8  # Dir(0.01): nearly one class per client


def test_lognormal_sizes_parameter():
    sizes = lognormal_sizes(2_000_000, 2000, 0.8, 0)
    assert sizes.sum() == 2_000_000
    assert np.std(np.log(sizes)) == pytest.approx(0.8, rel=0.05)
    np.testing.assert_array_equal(np.sort(lognormal_sizes(103, 10, 0.0)), [10] * 7 + [11] * 3)


def test_bad_input():
    labels = np.zeros(10, np.int32)
    with pytest.raises(ValueError, match="class imbalance"):
        hsu(labels, 2, class_imbalance=-1.0)
    with pytest.raises(ValueError, match="data imbalance"):
        hsu(labels, 2, data_imbalance=-0.5)
    with pytest.raises(ValueError, match="num_clients"):
        lognormal_sizes(10, 0, 1.0)
    assert PARTITIONERS["hsu"] is hsu


def test_federate_unseen_protocol():
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, size=(1000, 6)).astype(np.float32)
    y = np.repeat(np.arange(5), 200)
    xtr, ytr, xte, yte = split_pool(x, y, test_fraction=0.2, seed=0)
    assert len(yte) == 200 and len(ytr) == 800
    ds = federate_unseen(xtr, ytr, xte, yte, num_clients=10, num_classes=5, seed=0)
    train = ds.train
    valid = np.arange(train.max_count)[None, :] < np.asarray(train.counts)[:, None]
    feats = np.asarray(train.x)[valid]
    np.testing.assert_allclose(feats.mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(feats.std(0), 1.0, atol=1e-4)
    # balanced default: train clients and unseen test clients each hold the same number of
    # every class (up to 1 where the class total does not divide by C)
    for ys, cs in [(train.y, train.counts), (train.y_test, train.test_counts)]:
        ys, cs = np.asarray(ys), np.asarray(cs)
        mask = np.arange(ys.shape[1])[None, :] < cs[:, None]
        per = np.stack([np.bincount(ys[i][mask[i]], minlength=5) for i in range(10)])
        assert np.ptp(per, axis=0).max() <= 1 and per.min() >= 3
    assert ds.test.size == int(np.sum(train.test_counts)) == 200  # union of the test clients
    _, xte_std = standardize(xtr, xte)
    np.testing.assert_allclose(np.sort(np.asarray(ds.test.x), axis=0), np.sort(xte_std, axis=0))
