"""Federated data with *unseen* test clients (the FedLPS paper's evaluation protocol).

Buttaci & Calafiore (spec docs/specs/fedlps_local_perturbation.md, section 4): a pool is
split ~80:20 into a training and a test set, and **each** is partitioned into C clients by the
same procedure (an independent draw). Training clients learn the model; the C test clients
are unseen clients used only for evaluation. Features are standardised per feature with
training-set statistics (A7).

`federate_unseen` returns a `Dataset` whose `train` carries the unseen test clients in its
per-client test slot (`x_test`, `y_test`, `test_counts`; test client i is *not* training client
i's held-out data) and whose central `test` set is the union of all test clients, so its
accuracy is the paper's pooled metric `sum_i (N_i / N) acc_i` (see
`fedjax_sim.run.convergence.pooled_accuracy`).

`held_out` splits a federated dataset's clients into trained ones and unseen ones for the
evaluation of personalization (issue 37, `simulate(unseen=...)`): an unseen client adapts on
its training rows (k local steps from the global model) and is evaluated on its test split.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from fedjax_sim.data.builtin import Dataset
from fedjax_sim.data.federated import ArrayData, FederatedData, pack, with_client_test
from fedjax_sim.data.partition import partition


def standardize(x_train: np.ndarray, *others: np.ndarray) -> tuple[np.ndarray, ...]:
    """`(x - mu) / sigma` per feature with the training set's mean and std (std 0 -> 1)."""
    x_train = np.asarray(x_train, np.float32)
    mu = x_train.mean(axis=0, dtype=np.float64)
    sigma = x_train.std(axis=0, dtype=np.float64)
    sigma = np.where(sigma > 0, sigma, 1.0)
    scale = lambda x: ((np.asarray(x, np.float64) - mu) / sigma).astype(np.float32)
    return (scale(x_train), *(scale(x) for x in others))


def split_pool(
    x: np.ndarray,
    y: np.ndarray,
    *,
    test_fraction: float = 0.2,
    max_examples: int | None = None,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Fixed random train/test split of a pool (optionally a random subsample of it first):
    `(x_train, y_train, x_test, y_test)`."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    n = len(y)
    if max_examples is not None and not 2 <= max_examples:
        raise ValueError(f"max_examples must be >= 2, got {max_examples}")
    order = np.random.default_rng(seed + 104729).permutation(n)[: max_examples or n]
    n_test = max(1, int(round(test_fraction * order.size)))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def federate_unseen(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    num_clients: int,
    partitioner: str = "hsu",
    seed: int = 0,
    standardise: bool = True,
    num_classes: int = 0,
    name: str = "custom",
    **partition_kwargs: Any,
) -> Dataset:
    """Partitions the training and the test set each into `num_clients` clients (same
    partitioner and arguments, seeds `seed` and `seed + 1`); see the module docstring."""
    if standardise:
        x_train, x_test = standardize(x_train, x_test)
    train_ids = partition(partitioner, y_train, num_clients, seed, **partition_kwargs)
    test_ids = partition(partitioner, y_test, num_clients, seed + 1, **partition_kwargs)
    train = pack(x_train, y_train, train_ids, num_clients, num_classes=num_classes)
    test = pack(x_test, y_test, test_ids, num_clients, num_classes=num_classes)
    kept = test_ids >= 0
    return Dataset(
        train=with_client_test(train, test),
        test=ArrayData(x=x_test[kept], y=y_test[kept]),
        name=name,
    )


def held_out(data: FederatedData, num: int, seed: int = 0) -> tuple[FederatedData, FederatedData]:
    """`(trained, unseen)`: `num` of the clients drawn at random (`seed`) held out as unseen
    clients, the others (in their order) to train on; both keep every per-client split."""
    c = data.num_clients
    if isinstance(num, bool) or not isinstance(num, (int, np.integer)) or not 1 <= num < c:
        raise ValueError(f"unseen clients must be an int in [1, {c - 1}], got {num!r}")
    chosen = np.zeros(c, bool)
    chosen[np.random.default_rng(seed + 7919).permutation(c)[:num]] = True

    def rows(ids: np.ndarray) -> FederatedData:
        return jax.tree.map(lambda a: a[ids], data)

    return rows(np.flatnonzero(~chosen)), rows(np.flatnonzero(chosen))
