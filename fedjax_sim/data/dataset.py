"""`Dataset` (federated train + central test), validation, and federating the user's arrays.

- `federate(x, y, num_clients=, partitioner=)`: partition a centralised dataset (NumPy
  reference partitioners, or `backend="jax"` for the device partitioners) and hold out a
  per-client test split.
- `from_arrays(x, y, client_ids=...)`: the user's arrays with their own (natural) client ids,
  or partitioned like `federate` when `client_ids` is None.
- `from_client_lists([(x_1, y_1), ...])`: one array pair per client.
Every entry point validates the examples first (`check_examples`) with errors that name the
problem: empty dataset, mismatched lengths, NaN/Inf features, labels out of range.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import numpy as np

from fedjax_sim.data import jax_partition
from fedjax_sim.data.federated import ArrayData, FederatedData, pack, with_client_test
from fedjax_sim.data.partition import partition

Backend = Literal["numpy", "jax"]


class Dataset(NamedTuple):
    """A federated training set (with per-client test splits), a central test set and, when
    some clients are held out (`data.unseen.held_out`), the unseen clients."""

    train: FederatedData
    test: ArrayData
    name: str
    unseen: FederatedData | None = None

    @property
    def num_classes(self) -> int:
        return self.train.num_classes

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return self.train.feature_shape


def check_examples(x: np.ndarray, y: np.ndarray, num_classes: int | None = None) -> int:
    """Validates centralised examples `x [N, ...]`, `y [N, ...]`; returns the number of
    classes (`num_classes`, or max label + 1 for integer labels when None; 0 = regression)."""
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim == 0 or x.shape[0] == 0:
        raise ValueError(f"empty dataset: x has no examples (shape {x.shape})")
    if y.ndim == 0 or y.shape[0] != x.shape[0]:
        raise ValueError(f"x has {x.shape[0]} examples but y has shape {y.shape}")
    if np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.complexfloating):
        bad = ~np.isfinite(x.reshape(x.shape[0], -1)).all(axis=1)
        if bad.any():
            raise ValueError(
                f"x has NaN/Inf features in {int(bad.sum())} of {x.shape[0]} examples "
                f"(first at index {int(np.argmax(bad))})"
            )
    elif not (np.issubdtype(x.dtype, np.integer) or x.dtype == bool):
        raise ValueError(f"x must be numeric, got dtype {x.dtype}")
    if np.issubdtype(y.dtype, np.integer):
        lo, hi = int(y.min()), int(y.max())
        if num_classes is None:
            num_classes = hi + 1
        if lo < 0 or (num_classes and hi >= num_classes):
            raise ValueError(
                f"labels out of range: expected integers in [0, {num_classes}), "
                f"got min {lo}, max {hi}"
            )
        return int(num_classes)
    if not np.issubdtype(y.dtype, np.floating):
        raise ValueError(f"y must be integer class labels or float targets, got {y.dtype}")
    if not np.isfinite(y).all():
        raise ValueError(f"y has {int((~np.isfinite(y)).sum())} NaN/Inf targets")
    if num_classes:
        raise ValueError(f"num_classes={num_classes} needs integer labels, got dtype {y.dtype}")
    return 0


def split_clients(
    ids: np.ndarray,
    num_clients: int,
    test_fraction: float,
    seed: int,
    *,
    sequential: bool = False,
) -> np.ndarray:
    """Marks each example train (True) or held-out client test (False): client i keeps
    `ceil((1 - f) n_i)` of its examples for training, chosen at random (LEAF-style per-client
    split) or, with `sequential=True`, its first ones in order (for overlapping text windows:
    no test window shares characters with a training window except at the boundary)."""
    if not 0 <= test_fraction < 1:
        raise ValueError(f"client_test_fraction must be in [0, 1), got {test_fraction}")
    sizes = np.bincount(ids, minlength=num_clients)
    if sequential:
        order = np.argsort(ids, kind="stable")
    else:
        rng = np.random.default_rng(seed + 7919)
        order = np.lexsort((rng.uniform(size=ids.size), ids))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rank = np.empty(ids.size, np.int64)
    rank[order] = np.arange(ids.size) - starts[ids[order]]
    n_train = np.ceil(sizes * (1 - test_fraction)).astype(np.int64)
    return rank < n_train[ids]


def federate_ids(
    x: np.ndarray,
    y: np.ndarray,
    ids: np.ndarray,
    num_clients: int,
    *,
    seed: int = 0,
    client_test_fraction: float = 0.2,
    central_test: ArrayData | None = None,
    num_classes: int = 0,
    name: str = "custom",
    sequential_split: bool = False,
) -> Dataset:
    """Packs examples already assigned to clients (`ids [N]`) into a `Dataset`.

    The central test set is `central_test` if given, else the union of the client test splits.
    Examples with client id -1 (dropped by a partitioner, e.g. `imbalanced_dirichlet`) are
    skipped.
    """
    ids = np.asarray(ids)
    if ids.size and ids.min() < -1:
        raise ValueError(f"client ids must be in [-1, {num_clients}), got {ids.min()}")
    if (ids < 0).any():
        kept = ids >= 0
        x, y, ids = x[kept], y[kept], ids[kept]
    is_train = split_clients(
        ids, num_clients, client_test_fraction, seed, sequential=sequential_split
    )
    train = pack(x[is_train], y[is_train], ids[is_train], num_clients, num_classes=num_classes)
    held = pack(x[~is_train], y[~is_train], ids[~is_train], num_clients, num_classes=num_classes)
    train = with_client_test(train, held)
    if central_test is None:
        central_test = ArrayData(x=x[~is_train], y=y[~is_train])
    return Dataset(train=train, test=central_test, name=name)


def assign_clients(
    y: np.ndarray,
    num_clients: int,
    partitioner: str,
    seed: int,
    backend: Backend = "numpy",
    **partition_kwargs: Any,
) -> np.ndarray:
    """Client id of every example with a registered partitioner (NumPy reference or JAX)."""
    if backend == "numpy":
        return np.asarray(partition(partitioner, y, num_clients, seed, **partition_kwargs))
    if backend == "jax":
        key = jax.random.key(seed)
        return np.asarray(
            jax_partition.partition(partitioner, key, y, num_clients, **partition_kwargs)
        )
    raise ValueError(f"backend must be 'numpy' or 'jax', got {backend!r}")


def federate(
    x: np.ndarray,
    y: np.ndarray,
    *,
    num_clients: int,
    partitioner: str = "dirichlet",
    seed: int = 0,
    client_test_fraction: float = 0.2,
    central_test: ArrayData | None = None,
    num_classes: int | None = None,
    name: str = "custom",
    backend: Backend = "numpy",
    **partition_kwargs: Any,
) -> Dataset:
    """Validates, partitions a centralised dataset over clients and holds out a per-client
    test split (`num_classes=None` infers max label + 1 for integer labels)."""
    x, y = np.asarray(x), np.asarray(y)
    num_classes = check_examples(x, y, num_classes)
    if central_test is not None:
        check_examples(central_test.x, central_test.y, num_classes)
    ids = assign_clients(y, num_clients, partitioner, seed, backend, **partition_kwargs)
    return federate_ids(
        x,
        y,
        ids,
        num_clients,
        seed=seed,
        client_test_fraction=client_test_fraction,
        central_test=central_test,
        num_classes=num_classes,
        name=name,
    )


def from_arrays(
    x: np.ndarray,
    y: np.ndarray,
    client_ids: np.ndarray | Sequence[Any] | None = None,
    *,
    num_clients: int | None = None,
    partitioner: str = "iid",
    seed: int = 0,
    client_test_fraction: float = 0.2,
    num_classes: int | None = None,
    test: tuple[np.ndarray, np.ndarray] | ArrayData | None = None,
    name: str = "custom",
    backend: Backend = "numpy",
    **partition_kwargs: Any,
) -> Dataset:
    """The user's own arrays as a `Dataset`.

    With `client_ids [N]` (any sortable values: writer ids, speaker names, ...) each distinct
    id is one client (clients numbered in sorted id order); otherwise `num_clients` and a
    registered `partitioner` split the examples. `test` is an optional central test set
    (default: the union of the per-client held-out splits).
    """
    x, y = np.asarray(x), np.asarray(y)
    num_classes = check_examples(x, y, num_classes)
    central = None
    if test is not None:
        tx, ty = (test.x, test.y) if isinstance(test, ArrayData) else test
        check_examples(tx, ty, num_classes)
        central = ArrayData(x=np.asarray(tx), y=np.asarray(ty))
    if client_ids is None:
        if num_clients is None:
            raise ValueError("give client_ids (one per example) or num_clients and a partitioner")
        ids = assign_clients(y, num_clients, partitioner, seed, backend, **partition_kwargs)
    else:
        groups = np.asarray(client_ids)
        if groups.shape != (x.shape[0],):
            raise ValueError(
                f"client_ids must have one entry per example, shape [{x.shape[0]}], "
                f"got {groups.shape}"
            )
        _, ids = np.unique(groups, return_inverse=True)
        ids = ids.astype(np.int32)
        num_clients = int(ids.max()) + 1
    return federate_ids(
        x,
        y,
        ids,
        num_clients,
        seed=seed,
        client_test_fraction=client_test_fraction,
        central_test=central,
        num_classes=num_classes,
        name=name,
    )


def from_client_lists(
    clients: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    seed: int = 0,
    client_test_fraction: float = 0.2,
    num_classes: int | None = None,
    test: tuple[np.ndarray, np.ndarray] | ArrayData | None = None,
    name: str = "custom",
) -> Dataset:
    """One `(x_i [n_i, ...], y_i [n_i, ...])` pair per client (n_i = 0 allowed); client i of
    the result is `clients[i]`."""
    if len(clients) == 0:
        raise ValueError("from_client_lists needs at least one client, got an empty list")
    xs, ys = [], []
    for i, pair in enumerate(clients):
        if len(pair) != 2:
            raise ValueError(f"client {i}: expected an (x, y) pair, got {len(pair)} items")
        xi, yi = np.asarray(pair[0]), np.asarray(pair[1])
        if xi.ndim == 0 or yi.ndim == 0 or xi.shape[0] != yi.shape[0]:
            raise ValueError(f"client {i}: x has shape {xi.shape} but y has shape {yi.shape}")
        if xs and (xi.shape[1:] != xs[0].shape[1:] or yi.shape[1:] != ys[0].shape[1:]):
            raise ValueError(
                f"client {i}: feature/label shape {xi.shape[1:]}/{yi.shape[1:]} differs from "
                f"client 0's {xs[0].shape[1:]}/{ys[0].shape[1:]}"
            )
        xs.append(xi)
        ys.append(yi)
    sizes = np.array([a.shape[0] for a in xs])
    ids = np.repeat(np.arange(len(clients), dtype=np.int32), sizes)
    x, y = np.concatenate(xs), np.concatenate(ys)
    num_classes = check_examples(x, y, num_classes)
    central = None
    if test is not None:
        tx, ty = (test.x, test.y) if isinstance(test, ArrayData) else test
        check_examples(tx, ty, num_classes)
        central = ArrayData(x=np.asarray(tx), y=np.asarray(ty))
    return federate_ids(
        x,
        y,
        ids,
        len(clients),
        seed=seed,
        client_test_fraction=client_test_fraction,
        central_test=central,
        num_classes=num_classes,
        name=name,
    )
