"""Built-in datasets that need no download, and the registry behind `fedjax-sim list`.

- `digits`: scikit-learn's bundled 8x8 digits (1797 examples), the default of `fedjax-sim run`.
- `fashion_mnist`: raw idx files, e.g. from Debian's `dataset-fashion-mnist` package
  (`apt-get install dataset-fashion-mnist`, files under /usr/share/datasets/fashion-mnist).
- `fedprox_synthetic`: Synthetic(alpha, beta) of the FedProx paper.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from fedjax_sim.data.federated import ArrayData, FederatedData, pack, with_client_test
from fedjax_sim.data.partition import partition
from fedjax_sim.data.synthetic import fedprox_synthetic, shifted_minority


class Dataset(NamedTuple):
    """A federated training set (with per-client test splits) and a central test set."""

    train: FederatedData
    test: ArrayData
    name: str

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return self.train.feature_shape


def split_clients(ids: np.ndarray, num_clients: int, test_fraction: float, seed: int) -> np.ndarray:
    """Marks each example train (True) or held-out client test (False): client i keeps
    `ceil((1 - f) n_i)` random examples for training (LEAF-style per-client split)."""
    if not 0 <= test_fraction < 1:
        raise ValueError(f"client_test_fraction must be in [0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed + 7919)
    sizes = np.bincount(ids, minlength=num_clients)
    order = np.lexsort((rng.uniform(size=ids.size), ids))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rank = np.empty(ids.size, np.int64)
    rank[order] = np.arange(ids.size) - starts[ids[order]]
    n_train = np.ceil(sizes * (1 - test_fraction)).astype(np.int64)
    return rank < n_train[ids]


def federate(
    x: np.ndarray,
    y: np.ndarray,
    *,
    num_clients: int,
    partitioner: str = "dirichlet",
    seed: int = 0,
    client_test_fraction: float = 0.2,
    central_test: ArrayData | None = None,
    num_classes: int = 0,
    name: str = "custom",
    **partition_kwargs: Any,
) -> Dataset:
    """Partitions a centralised dataset over clients and holds out a per-client test split.

    The central test set is `central_test` if given, else the union of the client test splits.
    """
    ids = partition(partitioner, y, num_clients, seed, **partition_kwargs)
    if (ids < 0).any():  # partitioners may drop examples (client id -1)
        kept = ids >= 0
        x, y, ids = x[kept], y[kept], ids[kept]
    is_train = split_clients(ids, num_clients, client_test_fraction, seed)
    train = pack(x[is_train], y[is_train], ids[is_train], num_clients, num_classes=num_classes)
    held = pack(x[~is_train], y[~is_train], ids[~is_train], num_clients, num_classes=num_classes)
    train = with_client_test(train, held)
    if central_test is None:
        central_test = ArrayData(x=x[~is_train], y=y[~is_train])
    return Dataset(train=train, test=central_test, name=name)


def load_digits(
    num_clients: int = 100,
    partitioner: str = "dirichlet",
    seed: int = 0,
    *,
    client_test_fraction: float = 0.2,
    **partition_kwargs: Any,
) -> Dataset:
    """scikit-learn's digits (1797 x 64 features in [0, 1], 10 classes), federated.

    Defaults: Dirichlet(0.5) label skew over 100 clients, 20% of each client held out; the
    central test set is the union of those held-out examples.
    """
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int32)
    if partitioner == "dirichlet":
        partition_kwargs.setdefault("alpha", 0.5)
    return federate(
        x,
        y,
        num_clients=num_clients,
        partitioner=partitioner,
        seed=seed,
        client_test_fraction=client_test_fraction,
        num_classes=10,
        name="digits",
        **partition_kwargs,
    )


FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


def read_idx(path: str) -> np.ndarray:
    """Reads an idx file (optionally gzipped): magic 0x0000TTNN, big-endian uint32 dims."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an idx file (bad magic {raw[:4]!r})")
    dtypes = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if raw[2] not in dtypes:
        raise ValueError(f"{path}: unknown idx element type 0x{raw[2]:02x}")
    ndim = raw[3]
    dims = np.frombuffer(raw, ">u4", count=ndim, offset=4).astype(np.int64)
    data = np.frombuffer(raw, dtypes[raw[2]], offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: expected {int(np.prod(dims))} values, found {data.size}")
    return data.reshape(dims)


def _find_idx(directory: str, stem: str) -> str:
    for name in (f"{stem}.gz", stem):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(
        f"Fashion-MNIST file {stem}[.gz] not found in {directory}. Install the Debian package "
        f"(`sudo apt-get install dataset-fashion-mnist`, files land in {FASHION_MNIST_DIR}) or "
        f"pass data_dir= pointing to the four idx files."
    )


def read_fashion_mnist(
    data_dir: str = FASHION_MNIST_DIR,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(x_train [60000,28,28,1] in [0,1], y_train, x_test, y_test)` from idx files."""
    parts = []
    for split in ("train", "t10k"):
        images = read_idx(_find_idx(data_dir, f"{split}-images-idx3-ubyte"))
        labels = read_idx(_find_idx(data_dir, f"{split}-labels-idx1-ubyte"))
        if images.shape[0] != labels.shape[0]:
            raise ValueError(f"{split}: {images.shape[0]} images but {labels.shape[0]} labels")
        parts += [(images[..., None] / 255.0).astype(np.float32), labels.astype(np.int32)]
    return parts[0], parts[1], parts[2], parts[3]


def load_fashion_mnist(
    num_clients: int = 100,
    partitioner: str = "dirichlet",
    seed: int = 0,
    *,
    data_dir: str = FASHION_MNIST_DIR,
    client_test_fraction: float = 0.2,
    **partition_kwargs: Any,
) -> Dataset:
    """Fashion-MNIST from idx files, federated; the central test set is the official 10k."""
    x, y, x_test, y_test = read_fashion_mnist(data_dir)
    if partitioner == "dirichlet":
        partition_kwargs.setdefault("alpha", 0.5)
    return federate(
        x,
        y,
        num_clients=num_clients,
        partitioner=partitioner,
        seed=seed,
        client_test_fraction=client_test_fraction,
        central_test=ArrayData(x=x_test, y=y_test),
        num_classes=10,
        name="fashion_mnist",
        **partition_kwargs,
    )


def load_fedprox_synthetic(
    num_clients: int = 30,
    partitioner: str = "natural",
    seed: int = 0,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    iid: bool = False,
) -> Dataset:
    """Synthetic(alpha, beta) (clients are the natural partition; `partitioner` is ignored)."""
    del partitioner
    train, test = fedprox_synthetic(alpha, beta, num_clients=num_clients, iid=iid, seed=seed)
    return Dataset(train=train, test=test, name="fedprox_synthetic")


def load_shifted_minority(
    num_clients: int = 10,
    partitioner: str = "natural",
    seed: int = 0,
    *,
    client_test_fraction: float = 0.2,
    **kwargs: Any,
) -> Dataset:
    """`synthetic.shifted_minority` (one client per group, natural split; `partitioner` is
    ignored), 20% of each client held out; the central test set pools those held-out rows."""
    del partitioner
    x, y, groups = shifted_minority(num_clients=num_clients, seed=seed, **kwargs)
    return federate(
        x,
        y,
        num_clients=num_clients,
        partitioner="natural",
        seed=seed,
        client_test_fraction=client_test_fraction,
        num_classes=int(kwargs.get("num_classes", 2)),
        name="shifted_minority",
        groups=groups,
    )


DATASETS: dict[str, Callable[..., Dataset]] = {
    "digits": load_digits,
    "fashion_mnist": load_fashion_mnist,
    "fedprox_synthetic": load_fedprox_synthetic,
    "shifted_minority": load_shifted_minority,
}


def load(name: str, **kwargs: Any) -> Dataset:
    """Loads a registered dataset by name."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose from {sorted(DATASETS)}")
    return DATASETS[name](**kwargs)
