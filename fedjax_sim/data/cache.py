"""On-disk cache of converted, partitioned datasets (padded per-client arrays as .npy files).

The first load of a source (idx files, a tfds dataset, Shakespeare's plays) converts and
partitions it; `cached(spec, build)` stores the resulting `Dataset` under
`<cache_dir>/<name>-<key>/` (one .npy per array + meta.json, written to a temporary folder and
renamed, so an interrupted write never leaves a half entry). `key` hashes `spec`: the source
(file paths, sizes, mtimes or tfds version), the partitioner and its parameters, the number of
clients, the seed, the test fraction and the format version. Later loads read the arrays back
with no parsing and no partitioning.

Cache directory: `cache_dir=` argument, else `$FEDJAX_SIM_CACHE`, else `~/.cache/fedjax_sim`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.data.dataset import Dataset
from fedjax_sim.data.federated import ArrayData, FederatedData

FORMAT_VERSION = 1
_TRAIN_FIELDS = ("x", "y", "counts", "x_test", "y_test", "test_counts")


def default_cache_dir() -> str:
    return os.environ.get("FEDJAX_SIM_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "fedjax_sim"
    )


def cache_key(spec: dict[str, Any]) -> str:
    """Stable hash of a JSON-able description of a dataset build."""
    text = json.dumps({"format": FORMAT_VERSION, **spec}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def file_fingerprint(paths: list[str]) -> list[tuple[str, int, int]]:
    """(absolute path, size, mtime in ns) of each file: part of a cache key."""
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((os.path.abspath(p), st.st_size, st.st_mtime_ns))
    return out


def entry_path(spec: dict[str, Any], cache_dir: str | None = None) -> str:
    name = str(spec.get("name", "dataset")).replace("/", "_")
    return os.path.join(cache_dir or default_cache_dir(), f"{name}-{cache_key(spec)}")


def save(dataset: Dataset, path: str, spec: dict[str, Any]) -> None:
    """Writes `dataset` to folder `path` atomically (temporary folder + rename)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        train = dataset.train
        for field in _TRAIN_FIELDS:
            value = getattr(train, field)
            if value is not None:
                np.save(os.path.join(tmp, f"train_{field}.npy"), np.asarray(value))
        np.save(os.path.join(tmp, "test_x.npy"), np.asarray(dataset.test.x))
        np.save(os.path.join(tmp, "test_y.npy"), np.asarray(dataset.test.y))
        meta = {"name": dataset.name, "num_classes": train.num_classes, "spec": spec}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, default=repr)
        if os.path.exists(path):  # a concurrent writer won: keep theirs
            shutil.rmtree(tmp)
            return
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read(file: str) -> jax.Array:
    return jnp.asarray(np.load(file, mmap_mode="r"))  # one copy: page cache -> device


def load(path: str) -> Dataset | None:
    """Reads a cached `Dataset`, or None when `path` holds no complete entry."""
    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        return None
    with open(meta_path) as f:
        meta = json.load(f)
    arrays = {}
    for field in _TRAIN_FIELDS:
        file = os.path.join(path, f"train_{field}.npy")
        arrays[field] = _read(file) if os.path.exists(file) else None
    # built from already validated arrays: no re-validation (keeps cached loads fast)
    train = FederatedData(**arrays, num_classes=int(meta["num_classes"]))
    test = ArrayData(
        x=_read(os.path.join(path, "test_x.npy")), y=_read(os.path.join(path, "test_y.npy"))
    )
    return Dataset(train=train, test=test, name=meta["name"])


def cached(
    spec: dict[str, Any],
    build: Callable[[], Dataset],
    *,
    cache_dir: str | None = None,
    enabled: bool = True,
) -> Dataset:
    """`build()` once, then the cached copy for the same `spec`."""
    if not enabled:
        return build()
    path = entry_path(spec, cache_dir)
    hit = load(path)
    if hit is not None:
        return hit
    dataset = build()
    save(dataset, path, spec)
    return dataset
