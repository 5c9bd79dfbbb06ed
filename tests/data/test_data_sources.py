"""Data sources: idx files, tfds without TensorFlow, the user's arrays, the cache, validation."""

import gzip
import json
import os
import shutil
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds

from fedjax_sim import data
from fedjax_sim.data import cache, idx, tfds_source
from fedjax_sim.data.federated import unpack


def write_idx(path, array):
    """Independent idx writer: magic (0, 0, 0x08 = uint8, ndim), big-endian dims, data."""
    array = np.asarray(array, np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())


@pytest.fixture
def tiny_idx(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte.gz": rng.integers(0, 256, (120, 4, 5), dtype=np.uint8),
        "train-labels-idx1-ubyte.gz": np.arange(120) % 3,
        "t10k-images-idx3-ubyte.gz": rng.integers(0, 256, (30, 4, 5), dtype=np.uint8),
        "t10k-labels-idx1-ubyte.gz": np.arange(30) % 3,
    }
    for name, a in arrays.items():
        write_idx(tmp_path / name, a)
    return tmp_path, arrays


def rows_as_set(x):
    x = np.asarray(x).reshape(len(x), -1) if len(x) else np.zeros((0, 1))
    return x[np.lexsort(x.T[::-1])]


# ---------------------------------------------------------------- idx / Fashion-MNIST
def test_idx_loader_on_written_files(tiny_idx, tmp_path_factory):
    folder, arrays = tiny_idx
    cache_dir = tmp_path_factory.mktemp("cache")
    ds = data.load(
        "fashion_mnist", num_clients=4, partitioner="iid", data_dir=str(folder),
        cache_dir=str(cache_dir),
    )  # fmt: skip
    assert ds.num_classes == 3 and ds.feature_shape == (4, 5, 1)
    images = arrays["train-images-idx3-ubyte.gz"]
    x, y, _ = unpack(ds.train)
    xt, yt, _ = unpack(ds.train.replace(x=ds.train.x_test, y=ds.train.y_test,
                                        counts=ds.train.test_counts))  # fmt: skip
    both = np.concatenate([x, xt])
    assert both.shape[0] == 120 and np.asarray(ds.train.counts).sum() == 96  # ceil(0.8 * 30) x 4
    np.testing.assert_allclose(rows_as_set(both), rows_as_set(images[..., None] / 255.0), rtol=1e-6)
    np.testing.assert_array_equal(np.sort(np.concatenate([y, yt])), np.sort(np.arange(120) % 3))
    np.testing.assert_allclose(
        np.asarray(ds.test.x), arrays["t10k-images-idx3-ubyte.gz"][..., None] / 255.0, rtol=1e-6
    )
    # the reader rejects a file that is not idx
    bad = folder / "bad.gz"
    with gzip.open(bad, "wb") as f:
        f.write(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an idx file"):
        data.read_idx(str(bad))
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        data.load_fashion_mnist(data_dir=str(folder / "nowhere"))


@pytest.mark.skipif(
    not os.path.isdir(data.FASHION_MNIST_DIR),
    reason="Debian package dataset-fashion-mnist not installed (.ci/run installs it)",
)
def test_fashion_mnist_known_counts():
    x, y, x_test, y_test = idx.read_idx_dataset()
    assert x.shape == (60000, 28, 28, 1) and x_test.shape == (10000, 28, 28, 1)
    np.testing.assert_array_equal(np.bincount(y), np.full(10, 6000))
    np.testing.assert_array_equal(np.bincount(y_test), np.full(10, 1000))
    assert x.dtype == np.uint8 and x.mean() == pytest.approx(72.94, abs=0.01)


# ---------------------------------------------------------------- cache
def test_cache_round_trip_identical(tiny_idx, tmp_path_factory, monkeypatch):
    folder, _ = tiny_idx
    cache_dir = str(tmp_path_factory.mktemp("cache"))
    kw = dict(num_clients=5, partitioner="dirichlet", alpha=0.3, seed=2, data_dir=str(folder),
              cache_dir=cache_dir)  # fmt: skip
    first = data.load_fashion_mnist(**kw)
    assert len(os.listdir(cache_dir)) == 1
    calls = []
    monkeypatch.setattr(idx, "read_idx_dataset", lambda *a: calls.append(a))  # must not run
    second = data.load_fashion_mnist(**kw)
    assert calls == []
    for a, b in zip(
        [first.train.x, first.train.y, first.train.counts, first.train.x_test,
         first.train.test_counts, first.test.x, first.test.y],
        [second.train.x, second.train.y, second.train.counts, second.train.x_test,
         second.train.test_counts, second.test.x, second.test.y],
        strict=True,
    ):  # fmt: skip
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert second.num_classes == first.num_classes == 3
    # another seed or partition parameter is another entry (the key includes them)
    monkeypatch.undo()
    data.load_fashion_mnist(**{**kw, "seed": 3})
    data.load_fashion_mnist(**{**kw, "alpha": 0.4})
    assert len(os.listdir(cache_dir)) == 3
    assert cache.cache_key({"a": 1}) != cache.cache_key({"a": 2})


# ---------------------------------------------------------------- tfds without TensorFlow
class FedjaxSimTinyImages(tfds.core.GeneratorBasedBuilder):
    """A project-owned builder prepared in the array_record format by the test."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        # DatasetInfo built directly (dataset_info_from_configs fails for a plain module)
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Tensor(shape=(6, 6, 1), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=4),
                    "writer": tfds.features.Tensor(shape=(), dtype=np.int64),
                }
            ),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(0, 300), "test": self._generate_examples(1, 40)}

    def _generate_examples(self, seed, n):
        rng = np.random.default_rng(seed)
        for i in range(n):
            image = np.full((6, 6, 1), i % 256, np.uint8)
            image[2, 2, 0] = i // 256
            image[0, 0, 0] = rng.integers(0, 256)
            yield i, {"image": image, "label": i % 4, "writer": i % 7}


def example_ids(x):
    pixels = np.round(np.asarray(x) * 255).astype(int)
    return pixels[:, 1, 1, 0] + 256 * pixels[:, 2, 2, 0]


@pytest.fixture(scope="module")
def prepared_tfds(tmp_path_factory):
    root = tmp_path_factory.mktemp("tfds")
    FedjaxSimTinyImages(data_dir=str(root), file_format="array_record").download_and_prepare()
    return root


def test_tfds_own_builder_array_record(prepared_tfds, tmp_path):
    ds = data.load("tfds:fedjax_sim_tiny_images", num_clients=6, partitioner="iid",
                   data_dir=str(prepared_tfds), cache_dir=str(tmp_path))  # fmt: skip
    assert ds.num_classes == 4 and ds.feature_shape == (6, 6, 1)
    assert ds.test.size == 40 and ds.train.x.dtype == np.float32
    x, y, _ = unpack(ds.train)
    xt, yt, _ = unpack(ds.train.replace(x=ds.train.x_test, y=ds.train.y_test,
                                        counts=ds.train.test_counts))  # fmt: skip
    # example i: pixel (1, 1) = i % 256, (2, 2) = i // 256, label i % 4
    ids = example_ids(np.concatenate([x, xt]))
    np.testing.assert_array_equal(np.sort(ids), np.arange(300))
    np.testing.assert_array_equal(np.concatenate([y, yt]), ids % 4)


def test_tfds_builder_from_directory_and_natural_groups(prepared_tfds, tmp_path):
    # a dataset whose builder code is unknown here: read through builder_from_directory
    other = tmp_path / "data"
    shutil.copytree(prepared_tfds / "fedjax_sim_tiny_images", other / "someone_elses_data")
    ds = data.load("tfds:someone_elses_data", group_key="writer", data_dir=str(other),
                   use_cache=False)  # fmt: skip
    assert ds.train.num_clients == 7  # one client per writer
    counts = np.asarray(ds.train.counts) + np.asarray(ds.train.test_counts)
    np.testing.assert_array_equal(counts, np.bincount(np.arange(300) % 7))
    x, _, client = unpack(ds.train)
    np.testing.assert_array_equal(example_ids(x) % 7, client)


@pytest.mark.parametrize(
    "name,shape,classes",
    [("mnist", (28, 28, 1), 10), ("emnist", (28, 28, 1), 62), ("cifar10", (32, 32, 3), 10),
     ("tfds:cifar100", (32, 32, 3), 100)],
)  # fmt: skip
def test_tfds_catalogue_names_with_mock_data(name, shape, classes):
    with tfds.testing.mock_data(num_examples=50, policy=tfds.testing.MockPolicy.USE_CODE):
        ds = data.load(name, num_clients=5, partitioner="iid", use_cache=False)
    assert ds.feature_shape == shape and ds.num_classes == classes
    assert int(np.asarray(ds.train.counts).sum() + np.asarray(ds.train.test_counts).sum()) == 50
    assert ds.test.size == 50
    assert 0.0 <= float(ds.train.x.min()) and float(ds.train.x.max()) <= 1.0


def test_tfds_missing_data_fails_fast_with_instructions(tmp_path):
    start = time.perf_counter()
    with pytest.raises(data.DataNotPrepared) as err:
        data.load("mnist", data_dir=str(tmp_path))
    assert time.perf_counter() - start < 5.0  # no download attempt, no network retries
    message = str(err.value)
    assert "tfds build mnist" in message and "--file_format array_record" in message
    assert str(tmp_path) in message
    with pytest.raises(data.DataNotPrepared, match="no prepared version"):
        data.load("tfds:not_a_catalogue_dataset", data_dir=str(tmp_path))
    # prepared, but in TFRecord: says so and how to convert
    version = tmp_path / "legacy_set" / "1.0.0"
    version.mkdir(parents=True)
    (version / "dataset_info.json").write_text(json.dumps({"fileFormat": "tfrecord"}))
    with pytest.raises(data.DataNotPrepared, match="tfds convert_format"):
        data.load("tfds:legacy_set", data_dir=str(tmp_path))
    assert time.perf_counter() - start < 5.0
    assert tfds_source.prepared_dirs("legacy_set", str(tmp_path)) == [str(version)]


# ---------------------------------------------------------------- the user's arrays
def test_from_arrays_natural_ids_and_partitioned():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(90, 3)).astype(np.float32)
    y = rng.integers(0, 4, 90)
    writers = np.array(["ann", "bob", "cy"])[np.arange(90) % 3]
    ds = data.from_arrays(x, y, client_ids=writers, client_test_fraction=0.0)
    assert ds.train.num_clients == 3 and ds.num_classes == 4
    np.testing.assert_array_equal(np.asarray(ds.train.counts), [30, 30, 30])
    np.testing.assert_array_equal(np.asarray(ds.train.x[1, :30]), x[1::3])  # "bob", in order
    for backend in ("numpy", "jax"):
        ds = data.from_arrays(x, y, num_clients=9, partitioner="shards", per_client=2,
                              backend=backend)  # fmt: skip
        counts = np.asarray(ds.train.counts) + np.asarray(ds.train.test_counts)
        np.testing.assert_array_equal(counts, np.full(9, 10))
        train_x, _, _ = unpack(ds.train)
        test_x, _, _ = unpack(ds.train.replace(x=ds.train.x_test, y=ds.train.y_test,
                                               counts=ds.train.test_counts))  # fmt: skip
        np.testing.assert_array_equal(rows_as_set(np.concatenate([train_x, test_x])),
                                      rows_as_set(x))  # fmt: skip


def test_from_client_lists_keeps_each_client():
    rng = np.random.default_rng(1)
    sizes = [5, 0, 12, 3]
    clients = [(rng.normal(size=(n, 2)), rng.integers(0, 3, n)) for n in sizes]
    ds = data.from_client_lists(clients, client_test_fraction=0.25)
    train_n, test_n = np.asarray(ds.train.counts), np.asarray(ds.train.test_counts)
    np.testing.assert_array_equal(train_n + test_n, sizes)
    np.testing.assert_array_equal(train_n, np.ceil(np.array(sizes) * 0.75))
    for i, (xi, _) in enumerate(clients):
        got = np.concatenate([np.asarray(ds.train.x[i, : train_n[i]]),
                              np.asarray(ds.train.x_test[i, : test_n[i]])])  # fmt: skip
        np.testing.assert_allclose(rows_as_set(got), rows_as_set(xi.astype(got.dtype)))


def test_validation_errors_name_the_problem():
    x = np.zeros((10, 2), np.float32)
    y = np.arange(10) % 2
    with pytest.raises(ValueError, match="empty dataset"):
        data.from_arrays(np.zeros((0, 2)), np.zeros(0, int), num_clients=2)
    with pytest.raises(ValueError, match="empty dataset"):
        data.from_client_lists([(np.zeros((0, 2)), np.zeros(0, int))])
    with pytest.raises(ValueError, match=r"labels out of range.*\[0, 2\).*max 5"):
        data.from_arrays(x, np.r_[y[:-1], 5], num_clients=2, num_classes=2)
    with pytest.raises(ValueError, match="labels out of range.*min -1"):
        data.federate(x, np.r_[y[:-1], -1], num_clients=2)
    bad = x.copy()
    bad[7, 1] = np.nan
    with pytest.raises(ValueError, match="NaN/Inf features in 1 of 10 examples.*index 7"):
        data.from_arrays(bad, y, num_clients=2)
    with pytest.raises(ValueError, match="iid: 11 clients but only 10 examples"):
        data.from_arrays(x, y, num_clients=11, partitioner="iid")
    with pytest.raises(ValueError, match="needs .* examples, got 10"):
        data.from_arrays(x, y, num_clients=11, partitioner="iid", backend="jax")
    ok = data.from_arrays(x, y, num_clients=11, partitioner="dirichlet", alpha=0.5)
    assert (np.asarray(ok.train.counts) + np.asarray(ok.train.test_counts)).sum() == 10
    with pytest.raises(ValueError, match="x has 10 examples but y"):
        data.from_arrays(x, y[:9], num_clients=2)
    with pytest.raises(ValueError, match="one entry per example"):
        data.from_arrays(x, y, client_ids=np.zeros(3))
