"""FederatedData validation, pack/unpack, per-client test splits and synthetic problems."""

import numpy as np
import pytest

from fedjax_sim.data import (
    FederatedData,
    fedprox_synthetic,
    least_squares,
    load_digits,
    pack,
    unpack,
)
from fedjax_sim.data.builtin import read_idx, split_clients


def _arrays(c=3, n=4, d=2):
    x = np.random.default_rng(0).normal(size=(c, n, d)).astype(np.float32)
    y = np.zeros((c, n), np.int32)
    return x, y, np.array([4, 2, 0], np.int32)[:c]


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda x, y, c: (x[:2], y, c), "leading"),
        (lambda x, y, c: (x, y, np.array([5, 1, 0])), "counts exceeds"),
        (lambda x, y, c: (x, y, np.array([-1, 1, 0])), "negative"),
        (lambda x, y, c: (np.where(x > 1, np.nan, x), y, c), "non-finite"),
        (lambda x, y, c: (x, y[:, :3], c), "N_max"),
        (lambda x, y, c: (x, y, c.astype(np.float32)), "integers"),
        (lambda x, y, c: (x[0, :, 0], y, c), "x must have shape"),
    ],
)
def test_validation_names_the_problem(mutate, field):
    x, y, c = mutate(*_arrays())
    with pytest.raises(ValueError, match=field):
        FederatedData.create(x, y, c, num_classes=3)


def test_labels_out_of_range_rejected():
    x, y, c = _arrays()
    y[0, 1] = 7
    with pytest.raises(ValueError, match="labels outside"):
        FederatedData.create(x, y, c, num_classes=3)
    y[0, 1] = 0
    y[2, 3] = 7  # padding row: ignored
    FederatedData.create(x, y, c, num_classes=3)


def test_pack_unpack_round_trip_keeps_every_example_once():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(50, 3)).astype(np.float32)
    y = rng.integers(0, 5, 50).astype(np.int32)
    ids = rng.integers(0, 7, 50)
    data = pack(x, y, ids, 7, num_classes=5)
    np.testing.assert_array_equal(np.asarray(data.counts), np.bincount(ids, minlength=7))
    xu, yu, idu = unpack(data)
    order = np.argsort(ids, kind="stable")
    np.testing.assert_array_equal(xu, x[order])
    np.testing.assert_array_equal(yu, y[order])
    np.testing.assert_array_equal(idu, ids[order])
    assert data.padding_waste() == 7 * data.max_count - 50


def test_pack_drops_negative_ids_and_checks_range():
    x = np.arange(6, dtype=np.float32)[:, None]
    data = pack(x, np.zeros(6), np.array([0, -1, 1, 0, -1, 1]), 2)
    assert np.asarray(data.counts).tolist() == [2, 2]
    with pytest.raises(ValueError, match="num_clients"):
        pack(x, np.zeros(6), np.array([0, 1, 2, 0, 0, 0]), 2)


def test_split_clients_holds_out_fraction_per_client():
    ids = np.repeat(np.arange(4), [10, 1, 5, 0])
    is_train = split_clients(ids, 4, 0.2, seed=0)
    per_client = np.bincount(ids[is_train], minlength=4)
    np.testing.assert_array_equal(per_client, [8, 1, 4, 0])  # ceil(0.8 n_i)


def test_digits_dataset_defaults():
    ds = load_digits()
    s = ds.train.summary()
    assert s["num_clients"] == 100 and s["num_classes"] == 10
    total = s["num_examples"] + int(np.asarray(ds.train.test_counts).sum())
    assert total == 1797  # every example is in exactly one client split
    assert ds.test.size == int(np.asarray(ds.train.test_counts).sum())
    assert float(np.asarray(ds.train.x).max()) <= 1.0


def test_fedprox_synthetic_recipe():
    train, test = fedprox_synthetic(1.0, 1.0, num_clients=10, seed=0)
    n_train = np.asarray(train.counts)
    n_test = np.asarray(train.test_counts)
    sizes = n_train + n_test
    assert sizes.min() >= 50  # n_k = int(LogNormal(4, 2)) + 50
    np.testing.assert_array_equal(n_train, (sizes * 0.9).astype(int))
    assert train.feature_shape == (60,) and train.num_classes == 10
    # x ~ N(v_k, diag(j^-1.2)): within-client variance of feature j follows j^-1.2
    big = int(np.argmax(n_train))
    xb = np.asarray(train.x[big, : n_train[big]], np.float64)
    var = xb.var(axis=0)
    expected = np.arange(1, 61) ** -1.2
    assert np.median(np.abs(var / expected - 1)) < 0.25
    assert test.x.shape[0] == n_test.sum()


def test_fedprox_synthetic_iid_shares_one_model():
    train, _ = fedprox_synthetic(0.0, 0.0, num_clients=5, iid=True, seed=1)
    # with beta = 0 every client has mean 0, so the pooled label distribution is common
    assert train.num_classes == 10 and np.asarray(train.counts).min() > 0


def test_least_squares_closed_forms(x64):
    problem = least_squares(num_clients=4, examples_per_client=[5, 0, 7, 9], dim=3)
    a = np.asarray(problem.data.x, np.float64)
    b = np.asarray(problem.data.y, np.float64)
    valid = np.arange(a.shape[1])[None] < np.asarray(problem.data.counts)[:, None]
    opt = problem.optimum()
    np.testing.assert_allclose(opt, np.linalg.lstsq(a[valid], b[valid], rcond=None)[0], rtol=1e-9)


def test_read_idx_round_trip(tmp_path):
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    raw = bytes([0, 0, 0x08, 3]) + np.array(arr.shape, ">u4").tobytes() + arr.tobytes()
    path = tmp_path / "t-idx3-ubyte"
    path.write_bytes(raw)
    np.testing.assert_array_equal(read_idx(str(path)), arr)
    path.write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an idx"):
        read_idx(str(path))
