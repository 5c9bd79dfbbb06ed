"""The paper's partitions (Beikmohammadi et al. 2024; spec 8.12): IID shards, Non-IID2,
Non-IID1, on labels with Fashion-MNIST's class sizes (6000 train / 1000 test per class)."""

import numpy as np
import pytest

from fedjax_sim.data.partition import PARTITIONERS, class_halves, iid_shards, one_class, partition


def labels(per_class, seed=0):
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(10), per_class))


@pytest.mark.parametrize("per_class", [6000, 1000])
def test_iid_shards_equal_sizes(per_class):
    y = labels(per_class)
    ids = iid_shards(y, 10, seed=3)
    assert np.all(np.bincount(ids, minlength=10) == per_class)  # 6000 train / 1000 test
    assert not np.array_equal(ids, iid_shards(y, 10, seed=4))


@pytest.mark.parametrize("per_class", [6000, 1000])
def test_one_class_per_client(per_class):
    y = labels(per_class)
    ids = one_class(y, 10)
    np.testing.assert_array_equal(ids, y)  # client i holds exactly class i, all of it


def test_class_halves_next_pairing():
    y = labels(6000)
    ids = class_halves(y, 10, seed=1)
    counts = np.zeros((10, 10), int)
    np.add.at(counts, (ids, y), 1)
    for i in range(10):  # half 0 of class i, half 1 of class i + 1
        expected = np.zeros(10, int)
        expected[i] = expected[(i + 1) % 10] = 3000
        np.testing.assert_array_equal(counts[i], expected)
    assert set(np.unique(ids)) == set(range(10))  # disjoint union covering the dataset


def test_class_halves_random_pairing_uses_every_chunk_once():
    y = labels(1000)
    ids = class_halves(y, 10, seed=2, pairing="random")
    counts = np.zeros((10, 10), int)
    np.add.at(counts, (ids, y), 1)
    assert np.all(counts.sum(1) == 1000)  # two chunks of 500 per client
    assert np.all(counts.sum(0) == 1000)
    assert set(np.unique(counts)) <= {0, 500, 1000}


def test_odd_class_sizes_and_registry():
    y = np.repeat(np.arange(10), 7)
    ids = partition("class_halves", y, 10, seed=0)
    assert np.all(np.bincount(ids, minlength=10) == 7)  # 3 (half 0) + 4 (half 1)
    for name in ("iid_shards", "one_class", "class_halves"):
        assert name in PARTITIONERS


def test_class_partitions_need_one_client_per_class():
    with pytest.raises(ValueError, match="num_clients == number of classes"):
        one_class(labels(10), 5)
    with pytest.raises(ValueError, match="pairing"):
        class_halves(labels(10), 10, pairing="sorted")
