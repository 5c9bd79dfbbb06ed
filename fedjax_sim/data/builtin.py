"""The dataset registry behind `load(name)` and `fedjax-sim list`, and the small built-ins.

- `digits`: scikit-learn's bundled 8x8 digits (1797 examples), the default of `fedjax-sim run`.
- `fashion_mnist`: raw idx files (`fedjax_sim.data.idx`), e.g. Debian's
  `dataset-fashion-mnist` (`apt-get install dataset-fashion-mnist`).
- `shakespeare`: per-speaker next-character prediction (`fedjax_sim.data.shakespeare`).
- `mnist`, `emnist`, `cifar10`, `cifar100` and `tfds:<any catalogue name>`: tfds data prepared
  on disk in array_record format, read without TensorFlow (`fedjax_sim.data.tfds_source`).
- `fedprox_synthetic`: Synthetic(alpha, beta) of the FedProx paper.
- `markov_tokens`: a synthetic next-token task, one Markov chain per client (`--model
  transformer`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from fedjax_sim.data.dataset import Dataset, federate, split_clients
from fedjax_sim.data.idx import FASHION_MNIST_DIR, load_fashion_mnist, read_fashion_mnist, read_idx
from fedjax_sim.data.shakespeare import load_shakespeare
from fedjax_sim.data.synthetic import fedprox_synthetic, markov_tokens, shifted_minority
from fedjax_sim.data.tfds_source import load_tfds

__all__ = [
    "DATASETS",
    "FASHION_MNIST_DIR",
    "Dataset",
    "federate",
    "is_registered",
    "load",
    "load_digits",
    "load_fashion_mnist",
    "load_fedprox_synthetic",
    "load_markov_tokens",
    "load_shifted_minority",
    "read_fashion_mnist",
    "read_idx",
    "split_clients",
]


def load_digits(
    num_clients: int = 100,
    partitioner: str = "dirichlet",
    seed: int = 0,
    *,
    client_test_fraction: float = 0.2,
    backend: str = "numpy",
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
        backend=backend,
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


def load_markov_tokens(
    num_clients: int = 20,
    partitioner: str = "natural",
    seed: int = 0,
    **kwargs: Any,
) -> Dataset:
    """`synthetic.markov_tokens`, a federated next-token task (one Markov chain per client,
    natural split; `partitioner` is ignored): 64 windows of 32 tokens over 32 tokens per
    client by default (`kwargs`: its other arguments), a quarter held out."""
    del partitioner
    kwargs = {"examples_per_client": 64, "vocab_size": 32, "seq_len": 32, **kwargs}
    train, test = markov_tokens(num_clients=num_clients, seed=seed, **kwargs)
    return Dataset(train=train, test=test, name="markov_tokens")


def _tfds_entry(name: str, doc: str) -> Callable[..., Dataset]:
    fn = partial(load_tfds, name)
    fn.__doc__ = doc
    return fn


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
    "shakespeare": load_shakespeare,
    "mnist": _tfds_entry("mnist", "MNIST via tfds (array_record on disk, no TensorFlow)."),
    "emnist": _tfds_entry(
        "emnist/byclass", "EMNIST byclass (62 classes) via tfds (array_record, no TensorFlow)."
    ),
    "cifar10": _tfds_entry("cifar10", "CIFAR-10 via tfds (array_record on disk, no TensorFlow)."),
    "cifar100": _tfds_entry(
        "cifar100", "CIFAR-100 via tfds (array_record on disk, no TensorFlow)."
    ),
    "shifted_minority": load_shifted_minority,
    "markov_tokens": load_markov_tokens,
}
TFDS_PREFIX = "tfds:"
"""`load("tfds:<name>")` reads any prepared tfds catalogue dataset, e.g. `tfds:emnist/letters`."""


def is_registered(name: str) -> bool:
    """True for a registered name or `tfds:<name>`."""
    return name in DATASETS or (name.startswith(TFDS_PREFIX) and len(name) > len(TFDS_PREFIX))


def needs_tfds(name: str) -> bool:
    """True for a dataset read with tensorflow-datasets (the `tfds` extra)."""
    return is_registered(name) and (
        name.startswith(TFDS_PREFIX) or getattr(DATASETS.get(name), "func", None) is load_tfds
    )


def load(name: str, **kwargs: Any) -> Dataset:
    """Loads a registered dataset by name (`fedjax-sim list` shows them), or `tfds:<name>`."""
    if name.startswith(TFDS_PREFIX) and len(name) > len(TFDS_PREFIX):
        return load_tfds(name[len(TFDS_PREFIX) :], **kwargs)
    if name not in DATASETS:
        raise ValueError(
            f"unknown dataset {name!r}; choose from {sorted(DATASETS)} or tfds:<catalogue name>"
        )
    return DATASETS[name](**kwargs)
