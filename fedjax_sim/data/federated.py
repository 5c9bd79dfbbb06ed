"""Federated data containers: all clients stacked on a leading axis, padded to `N_max`.

`FederatedData` is a pytree (a `flax.struct.dataclass`) so it can be passed to jitted round
functions. Build it with `FederatedData.create(...)` (validated, host side) or with
`pack(x, y, client_ids, num_clients)`, which turns an assignment of examples to clients (what
every partitioner returns) into padded per-client arrays without a Python loop over clients.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

Array = Any


class ClientData(NamedTuple):
    """One client's padded data, as seen inside a per-client (mapped) function."""

    x: Array  # [N_max, *feature_shape]
    y: Array  # [N_max, *label_shape]
    count: Array  # [] int32, number of valid rows


class Batch(NamedTuple):
    """A minibatch with per-example weights (0 for padding), the input of every loss."""

    x: Array  # [B, *feature_shape]
    y: Array  # [B, *label_shape]
    mask: Array  # [B] float32, 1 for real examples, 0 for padding


@struct.dataclass
class ArrayData:
    """A plain (central) dataset, e.g. the pooled test set."""

    x: Array  # [N, *feature_shape]
    y: Array  # [N, *label_shape]

    @property
    def size(self) -> int:
        return int(self.x.shape[0])


@struct.dataclass
class FederatedData:
    """Per-client data stacked on axis 0 and padded to the largest client.

    Attributes:
      x: `[C, N_max, *feature_shape]` features; rows `>= counts[i]` are padding.
      y: `[C, N_max, *label_shape]` labels.
      counts: `[C]` int32, true number of examples of each client (0 allowed).
      x_test, y_test, test_counts: optional per-client test split, same layout.
      num_classes: number of label classes (static; 0 for regression).
    """

    x: Array
    y: Array
    counts: Array
    x_test: Array | None = None
    y_test: Array | None = None
    test_counts: Array | None = None
    num_classes: int = struct.field(pytree_node=False, default=0)

    # ---------------------------------------------------------------- construction
    @classmethod
    def create(
        cls,
        x: Array,
        y: Array,
        counts: Array,
        *,
        x_test: Array | None = None,
        y_test: Array | None = None,
        test_counts: Array | None = None,
        num_classes: int = 0,
    ) -> FederatedData:
        """Validates the arrays (host side) and moves them to the default device."""
        _validate_split("", x, y, counts, num_classes)
        if (x_test is None) != (y_test is None) or (x_test is None) != (test_counts is None):
            raise ValueError("x_test, y_test and test_counts must be given together")
        if x_test is not None:
            _validate_split("test_", x_test, y_test, test_counts, num_classes)
            if np.shape(x_test)[0] != np.shape(x)[0]:
                raise ValueError(
                    f"x_test has {np.shape(x_test)[0]} clients but x has {np.shape(x)[0]}"
                )
            x_test, y_test = jnp.asarray(x_test), jnp.asarray(y_test)
            test_counts = jnp.asarray(test_counts, jnp.int32)
        return cls(
            x=jnp.asarray(x),
            y=jnp.asarray(y),
            counts=jnp.asarray(counts, jnp.int32),
            x_test=x_test,
            y_test=y_test,
            test_counts=test_counts,
            num_classes=int(num_classes),
        )

    # ---------------------------------------------------------------- accessors
    @property
    def num_clients(self) -> int:
        return int(self.x.shape[0])

    @property
    def max_count(self) -> int:
        """N_max, the padded number of rows per client (static)."""
        return int(self.x.shape[1])

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[2:])

    @property
    def has_client_test(self) -> bool:
        return self.x_test is not None

    def client(self, i: Array) -> ClientData:
        """The training data of client `i` (a traced index is fine)."""
        return ClientData(self.x[i], self.y[i], self.counts[i])

    def client_test(self, i: Array) -> ClientData:
        return ClientData(self.x_test[i], self.y_test[i], self.test_counts[i])

    def padding_waste(self) -> int:
        """Number of padded rows, `sum_i (N_max - n_i)`."""
        return int(self.num_clients * self.max_count - int(np.sum(_host(self.counts))))

    def summary(self) -> dict[str, Any]:
        counts = _host(self.counts)
        return {
            "num_clients": self.num_clients,
            "num_examples": int(counts.sum()),
            "max_count": self.max_count,
            "min_count": int(counts.min()) if counts.size else 0,
            "mean_count": float(counts.mean()) if counts.size else 0.0,
            "empty_clients": int((counts == 0).sum()),
            "feature_shape": list(self.feature_shape),
            "num_classes": self.num_classes,
        }


def _host(x: Array) -> np.ndarray:
    """NumPy value of a (possibly multi-process, sharded) array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _validate_split(prefix: str, x: Array, y: Array, counts: Array, num_classes: int) -> None:
    """Host-side checks with errors that name the offending field."""
    x_shape, y_shape, c_shape = np.shape(x), np.shape(y), np.shape(counts)
    if len(x_shape) < 2:
        raise ValueError(f"{prefix}x must have shape [C, N_max, ...], got {x_shape}")
    if len(y_shape) < 2:
        raise ValueError(f"{prefix}y must have shape [C, N_max, ...], got {y_shape}")
    if len(c_shape) != 1:
        raise ValueError(f"{prefix}counts must have shape [C], got {c_shape}")
    if not (x_shape[0] == y_shape[0] == c_shape[0]):
        raise ValueError(
            f"mismatched leading (client) dimension: {prefix}x {x_shape[0]}, "
            f"{prefix}y {y_shape[0]}, {prefix}counts {c_shape[0]}"
        )
    if x_shape[1] != y_shape[1]:
        raise ValueError(
            f"mismatched N_max: {prefix}x has {x_shape[1]} rows per client, {prefix}y {y_shape[1]}"
        )
    counts_np = np.asarray(counts)
    if not np.issubdtype(counts_np.dtype, np.integer):
        raise ValueError(f"{prefix}counts must be integers, got dtype {counts_np.dtype}")
    if counts_np.size and counts_np.min() < 0:
        raise ValueError(f"{prefix}counts has negative entries (min {counts_np.min()})")
    if counts_np.size and counts_np.max() > x_shape[1]:
        raise ValueError(
            f"{prefix}counts exceeds N_max: max count {counts_np.max()} > {x_shape[1]} rows"
        )
    x_np = np.asarray(x)
    if np.issubdtype(x_np.dtype, np.floating) and not np.isfinite(x_np).all():
        raise ValueError(f"{prefix}x has non-finite (NaN/Inf) features")
    y_np = np.asarray(y)
    if np.issubdtype(y_np.dtype, np.floating) and not np.isfinite(y_np).all():
        raise ValueError(f"{prefix}y has non-finite (NaN/Inf) labels")
    if num_classes and np.issubdtype(y_np.dtype, np.integer) and y_np.size:
        valid = np.arange(x_shape[1])[None, :] < counts_np[:, None]
        labels = y_np[valid] if y_np.ndim == 2 else y_np
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise ValueError(
                f"{prefix}y has labels outside [0, {num_classes}): "
                f"min {labels.min()}, max {labels.max()}"
            )


def pack(
    x: Array,
    y: Array,
    client_ids: Array,
    num_clients: int,
    *,
    num_classes: int | None = None,
    max_count: int | None = None,
) -> FederatedData:
    """Packs examples into padded per-client arrays.

    Args:
      x: `[N, *feature_shape]` examples. y: `[N, *label_shape]`.
      client_ids: `[N]` int in `[-1, num_clients)`, the client of every example (what
        partitioners return); -1 drops an example, anything else out of range is an error.
      num_clients: C.
      num_classes: labels are checked to lie in `[0, num_classes)`. `None` (default): integer
        labels must be >= 0 and `max label + 1` is used; `0`: regression (no check).
      max_count: optional N_max (defaults to the largest client).

    Returns:
      `FederatedData` where client i holds its examples in their original order.
    """
    x, y = np.asarray(x), np.asarray(y)
    raw_ids = np.asarray(client_ids)
    if raw_ids.size and not np.issubdtype(raw_ids.dtype, np.integer):
        raise ValueError(f"client_ids must be integers, got dtype {raw_ids.dtype}")
    client_ids = raw_ids.astype(np.int64)
    if client_ids.shape != (x.shape[0],):
        raise ValueError(f"client_ids must have shape [{x.shape[0]}], got {client_ids.shape}")
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"x has {x.shape[0]} examples but y has {y.shape[0]}")
    if not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    if client_ids.size and client_ids.max() >= num_clients:
        raise ValueError(f"client_ids has id {client_ids.max()} >= num_clients={num_clients}")
    if client_ids.size and client_ids.min() < -1:
        raise ValueError(
            f"client_ids has id {client_ids.min()}; ids must be in [-1, {num_clients}) "
            "(-1 drops an example)"
        )
    if num_classes is None:
        num_classes = 0
        if np.issubdtype(y.dtype, np.integer) and y.size:
            if y.min() < 0:
                raise ValueError(f"y has negative labels (min {y.min()})")
            num_classes = int(y.max()) + 1
    keep = client_ids >= 0
    ids = client_ids[keep]
    order = np.argsort(ids, kind="stable")  # examples grouped by client, original order kept
    sorted_ids = ids[order]
    counts = np.bincount(sorted_ids, minlength=num_clients).astype(np.int32)
    n_max = int(counts.max()) if counts.size and max_count is None else int(max_count or 0)
    if counts.size and counts.max() > n_max:
        raise ValueError(f"max_count={n_max} is smaller than the largest client ({counts.max()})")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rows = np.arange(sorted_ids.size) - starts[sorted_ids]  # position within the client
    src = np.flatnonzero(keep)[order]
    xp = np.zeros((num_clients, max(n_max, 1)) + x.shape[1:], x.dtype)
    yp = np.zeros((num_clients, max(n_max, 1)) + y.shape[1:], y.dtype)
    xp[sorted_ids, rows] = x[src]
    yp[sorted_ids, rows] = y[src]
    return FederatedData.create(xp, yp, counts, num_classes=num_classes)


def with_client_test(train: FederatedData, test: FederatedData) -> FederatedData:
    """Attaches `test` (same clients) as the per-client test split of `train`."""
    if test.num_clients != train.num_clients:
        raise ValueError(
            f"test split has {test.num_clients} clients, train has {train.num_clients}"
        )
    return train.replace(x_test=test.x, y_test=test.y, test_counts=test.counts)


def unpack(data: FederatedData) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of `pack`: `(x [N,...], y [N,...], client_ids [N])` of all valid rows."""
    counts = np.asarray(data.counts)
    valid = np.arange(data.max_count)[None, :] < counts[:, None]
    ids = np.broadcast_to(np.arange(data.num_clients)[:, None], valid.shape)[valid]
    return np.asarray(data.x)[valid], np.asarray(data.y)[valid], ids


def tree_size_bytes(tree: Any) -> int:
    """Bytes of all array leaves of a pytree (a model's payload size)."""
    return int(
        sum(np.prod(np.shape(a)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))
    )
