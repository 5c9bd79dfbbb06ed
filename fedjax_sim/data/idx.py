"""Fashion-MNIST (or any MNIST-layout dataset) from raw idx files, with no download.

Debian's `dataset-fashion-mnist` package installs the four files under
/usr/share/datasets/fashion-mnist (`apt-get install dataset-fashion-mnist`); any other
directory holding `{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]` works via `data_dir=`
(MNIST's original files have the same layout). The idx format: magic `0x0000TTNN` (TT element
type, NN number of dims), big-endian uint32 dims, then the data.
"""

from __future__ import annotations

import gzip
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.data import cache
from fedjax_sim.data.dataset import Backend, Dataset, federate
from fedjax_sim.data.federated import ArrayData

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
IDX_STEMS = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


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
    if len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path}: truncated idx header ({len(raw)} bytes for {ndim} dims)")
    dims = np.frombuffer(raw, ">u4", count=ndim, offset=4).astype(np.int64)
    data = np.frombuffer(raw, dtypes[raw[2]], offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: expected {int(np.prod(dims))} values, found {data.size}")
    return data.reshape(dims)


def find_idx(directory: str, stem: str) -> str:
    """Path of idx file `stem` in `directory` (`stem`, `stem.gz`, or upstream's `a-b.idxN-...`)."""
    dotted = stem.replace("-idx", ".idx")
    for name in (f"{stem}.gz", stem, f"{dotted}.gz", dotted):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(
        f"idx file {stem}[.gz] not found in {directory!r}. For Fashion-MNIST install the "
        f"Debian package (`sudo apt-get install dataset-fashion-mnist`, files land in "
        f"{FASHION_MNIST_DIR}) or pass data_dir= pointing to a folder with the four files "
        f"{', '.join(IDX_STEMS.values())} (optionally .gz)."
    )


def idx_files(data_dir: str) -> dict[str, str]:
    return {key: find_idx(data_dir, stem) for key, stem in IDX_STEMS.items()}


def read_idx_dataset(
    data_dir: str = FASHION_MNIST_DIR,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(x_train [N,H,W,1] uint8, y_train int32, x_test, y_test)` from an idx folder."""
    files = idx_files(data_dir)
    parts = []
    for split in ("train", "test"):
        images = read_idx(files[f"{split}_images"])
        labels = read_idx(files[f"{split}_labels"])
        if images.ndim != 3:
            raise ValueError(f"{files[f'{split}_images']}: expected [N, H, W], got {images.shape}")
        if images.shape[0] != labels.shape[0]:
            raise ValueError(f"{split}: {images.shape[0]} images but {labels.shape[0]} labels")
        parts += [images[..., None], labels.astype(np.int32)]
    return parts[0], parts[1], parts[2], parts[3]


def read_fashion_mnist(
    data_dir: str = FASHION_MNIST_DIR,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(x_train [60000,28,28,1] in [0,1], y_train, x_test, y_test)` from idx files."""
    x, y, x_test, y_test = read_idx_dataset(data_dir)
    return (x / 255.0).astype(np.float32), y, (x_test / 255.0).astype(np.float32), y_test


@jax.jit
def _unit(a: jax.Array) -> jax.Array:
    return a.astype(jnp.float32) / 255.0


def to_unit_float(dataset: Dataset) -> Dataset:
    """uint8 pixel arrays -> float32 in [0, 1], converted on device (within 1 ulp of
    `(x / 255.0).astype(float32)`: XLA divides via a reciprocal); other arrays are kept."""

    def conv(a):
        return _unit(jnp.asarray(a)) if a is not None and a.dtype == np.uint8 else a

    train = dataset.train.replace(x=conv(dataset.train.x), x_test=conv(dataset.train.x_test))
    test = ArrayData(x=conv(dataset.test.x), y=dataset.test.y)
    return Dataset(train=train, test=test, name=dataset.name)


def load_fashion_mnist(
    num_clients: int = 100,
    partitioner: str = "dirichlet",
    seed: int = 0,
    *,
    data_dir: str = FASHION_MNIST_DIR,
    client_test_fraction: float = 0.2,
    backend: Backend = "numpy",
    cache_dir: str | None = None,
    use_cache: bool = True,
    **partition_kwargs: Any,
) -> Dataset:
    """Fashion-MNIST from idx files (Debian package or data_dir=), federated and cached.

    The central test set is the official 10k; pixels are float32 in [0, 1]; default partition
    Dirichlet(0.5) over 100 clients."""
    if partitioner == "dirichlet":
        partition_kwargs.setdefault("alpha", 0.5)
    files = idx_files(data_dir)
    spec = {
        "name": "fashion_mnist",
        "source": cache.file_fingerprint(sorted(files.values())),
        "num_clients": num_clients,
        "partitioner": partitioner,
        "partition_kwargs": partition_kwargs,
        "seed": seed,
        "client_test_fraction": client_test_fraction,
        "backend": backend,
    }

    def build() -> Dataset:
        x, y, x_test, y_test = read_idx_dataset(data_dir)
        return federate(
            x,
            y,
            num_clients=num_clients,
            partitioner=partitioner,
            seed=seed,
            client_test_fraction=client_test_fraction,
            central_test=ArrayData(x=x_test, y=y_test),
            num_classes=None,  # max label + 1 (10 for Fashion-MNIST)
            name="fashion_mnist",
            backend=backend,
            **partition_kwargs,
        )

    raw = cache.cached(spec, build, cache_dir=cache_dir, enabled=use_cache)
    return to_unit_float(raw)
