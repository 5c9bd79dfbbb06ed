"""Client stores outside device memory, and the cohort view the algorithms read.

- `HostStore`: a generic host-side pytree of `[C, ...]` arrays (numpy in RAM, or `np.memmap`
  files on disk) with `gather(ids)` / `scatter(ids, rows)` of whole client rows. It holds a
  population's data, and the per-client state rows of a streamed run with
  `state_rows="host"` (control variates, duals, memories; `fedjax_sim.run.streaming`).
- `RecordRows`: read-only client rows in one array_record file (a record per client),
  the same `gather(ids)`; `write_client_store(..., file_format="array_record")` writes it.
- `ClientStore`: a population's training data in a `HostStore` (`x [C, N_max, ...]`,
  `y [C, N_max, ...]`) plus the `[C]` counts (kept in RAM: 4 bytes per client) and an
  on-device `decode` of the gathered features (e.g. uint8 pixels to float32).
- `CohortData`: a `FederatedData` whose `x`/`y` hold only one round's cohort rows `[M, ...]`
  (sorted by client id, `slot_ids [M]`) while `counts` is the population's `[C]`;
  `client(cid)` takes the real client id and finds its row. An algorithm that only reads
  client data through `data.client(cid)`, `data.counts`, `data.num_clients` and
  `data.max_count` runs on it unchanged and computes bit for bit what it computes on the
  whole on-device population (the keys use real ids), as long as every id it reads is in
  the cohort (`fedjax_sim.run.streaming` draws the ids with the algorithm's own sampler).

On-disk layout of a store directory: `store.json` (`{"num_clients", "leaves": {name:
{"shape", "dtype"}}, "meta": {...}}`) and one raw C-order file `<name>.bin` per leaf, or
(`"format": "array_record"` in `store.json`) one `rows.array_record` file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from fedjax_sim.data.federated import ClientData, FederatedData

Array = Any
STORE_META = "store.json"
RECORDS = "rows.array_record"


# ------------------------------------------------------------------------------ host store
def _check_ids(ids: np.ndarray, num_clients: int) -> np.ndarray:
    ids = np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"client ids must be integers, got {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_clients):
        raise ValueError(
            f"client ids must be in [0, {num_clients}), got [{ids.min()}, {ids.max()}]"
        )
    return ids.astype(np.int64)


def _read_info(path: str) -> dict[str, Any]:
    meta_file = os.path.join(path, STORE_META)
    if not os.path.exists(meta_file):
        raise FileNotFoundError(f"no client store at {path!r} (missing {STORE_META})")
    with open(meta_file) as f:
        return json.load(f)


def _prefix(path: str, c: int, num_clients: int | None) -> int:
    if num_clients is None:
        return c
    if not 1 <= num_clients <= c:
        raise ValueError(f"the store at {path!r} has {c} clients, asked for {num_clients}")
    return num_clients


class HostStore:
    """A dict of `[C, ...]` host arrays (numpy or `np.memmap`) indexed by client id.

    `gather(ids)` returns `{name: [len(ids), ...]}` copies (ids are read in sorted order for
    disk locality); `scatter(ids, rows)` writes rows back (in place; a memmap opened with
    `mode="r+"` writes through to disk). The rows of a store on disk (`create` / `open`) are
    read and written with `pread` / `pwrite` on its files, not through the mapping: mapped
    pages count in the process's resident set, and the kernel maps whole read-ahead windows
    around every touched row (measured: 150 rows of 9.6 kB gathered through the mapping of a
    fresh 964 MB file added 211 MB of resident memory).
    """

    def __init__(self, arrays: dict[str, np.ndarray], path: str | None = None):
        if not arrays:
            raise ValueError("a HostStore needs at least one array")
        sizes = {name: int(np.shape(a)[0]) for name, a in arrays.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"store arrays disagree on the number of clients: {sizes}")
        self.arrays = dict(arrays)
        self.path = path

    @property
    def num_clients(self) -> int:
        return int(next(iter(self.arrays.values())).shape[0])

    @property
    def row_bytes(self) -> int:
        """Bytes of one client's row over all arrays."""
        return int(sum(a.itemsize * int(np.prod(a.shape[1:])) for a in self.arrays.values()))

    @property
    def on_disk(self) -> bool:
        return any(isinstance(a, np.memmap) for a in self.arrays.values())

    @property
    def names(self) -> list[str]:
        return list(self.arrays)

    def shape(self, name: str) -> tuple[int, ...]:
        """`[C, ...]` shape of array `name`."""
        return tuple(self.arrays[name].shape)

    def _check_ids(self, ids: np.ndarray) -> np.ndarray:
        return _check_ids(ids, self.num_clients)

    def gather(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """`{name: a[ids]}` for `ids [K]` (any order; read sorted, returned in `ids` order).
        Rows of read-only on-disk arrays are read with `os.pread` into fresh buffers rather
        than through the mapping: mapped pages would count in the process's resident set
        (and the kernel maps 64 kB around every touched row)."""
        ids = self._check_ids(ids).reshape(-1)
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        out = {}
        for name, a in self.arrays.items():
            if self._on_file(a):
                rows = self._pread(name, a, sorted_ids)
            else:
                rows = np.take(a, sorted_ids, axis=0)
            if not np.array_equal(order, np.arange(order.size)):
                back = np.empty_like(rows)
                back[order] = rows
                rows = back
            out[name] = rows
        return out

    def _on_file(self, a: np.ndarray) -> bool:
        """Whether `a` is this store's file, shared with the mapping (not copy-on-write)."""
        return self.path is not None and isinstance(a, np.memmap) and a.mode != "c"

    @staticmethod
    def _runs(sorted_ids: np.ndarray) -> list[tuple[int, int]]:
        """`(start, end)` positions of the runs of consecutive ids in `sorted_ids`."""
        breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
        starts = np.concatenate([[0], breaks])
        ends = np.concatenate([breaks, [sorted_ids.size]])
        return list(zip(starts.tolist(), ends.tolist(), strict=True))

    def _pread(self, name: str, a: np.memmap, sorted_ids: np.ndarray) -> np.ndarray:
        """Rows `a[sorted_ids]` read from the file, one `pread` per run of consecutive ids."""
        row = a.itemsize * int(np.prod(a.shape[1:]))
        out = np.empty((sorted_ids.size, *a.shape[1:]), a.dtype)
        buf = out.reshape(-1).view(np.uint8)
        fd = os.open(os.path.join(self.path, f"{name}.bin"), os.O_RDONLY)
        try:
            for s, e in self._runs(sorted_ids):
                view = memoryview(buf[s * row : e * row])
                got = os.preadv(fd, [view], int(sorted_ids[s]) * row)
                if got != (e - s) * row:
                    raise OSError(f"short read from {name}.bin: {got} of {(e - s) * row} bytes")
        finally:
            os.close(fd)
        return out

    def scatter(self, ids: np.ndarray, rows: dict[str, np.ndarray]) -> None:
        """`a[ids] = rows[name]` for every array (a duplicated id keeps its last row)."""
        ids = self._check_ids(ids).reshape(-1)
        if set(rows) != set(self.arrays):
            raise ValueError(f"scatter needs rows for {sorted(self.arrays)}, got {sorted(rows)}")
        for name, a in self.arrays.items():
            r = np.asarray(rows[name])
            if r.shape != (ids.size, *a.shape[1:]):
                raise ValueError(
                    f"rows[{name!r}] has shape {r.shape}, expected {(ids.size, *a.shape[1:])}"
                )
            if self._on_file(a):
                self._pwrite(name, a, ids, r)
            else:
                a[ids] = r.astype(a.dtype, copy=False)

    def _pwrite(self, name: str, a: np.memmap, ids: np.ndarray, rows: np.ndarray) -> None:
        """`a[ids] = rows` written to the file (the last row of a duplicated id), one
        `pwrite` per run of consecutive ids."""
        if ids.size == 0:
            return
        last = ids.size - 1 - np.unique(ids[::-1], return_index=True)[1]  # sorted ids
        sorted_ids = ids[last]
        rows = np.ascontiguousarray(rows[last].astype(a.dtype, copy=False))
        row = a.itemsize * int(np.prod(a.shape[1:]))
        buf = rows.reshape(-1).view(np.uint8)
        fd = os.open(os.path.join(self.path, f"{name}.bin"), os.O_WRONLY)
        try:
            for s, e in self._runs(sorted_ids):
                view = memoryview(buf[s * row : e * row])
                done = os.pwritev(fd, [view], int(sorted_ids[s]) * row)
                if done != (e - s) * row:
                    raise OSError(f"short write to {name}.bin: {done} of {(e - s) * row} bytes")
        finally:
            os.close(fd)

    def flush(self) -> None:
        for a in self.arrays.values():
            if isinstance(a, np.memmap):
                a.flush()

    # ---------------------------------------------------------------- disk
    @classmethod
    def create(
        cls,
        path: str,
        num_clients: int,
        rows: dict[str, tuple[tuple[int, ...], Any]],
        meta: dict[str, Any] | None = None,
    ) -> HostStore:
        """A new on-disk store: `rows = {name: (row_shape, dtype)}`; files are created
        sparse (zero) at their full size, then filled with `scatter` or `write_rows`."""
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        os.makedirs(path, exist_ok=True)
        leaves = {}
        arrays = {}
        for name, (shape, dtype) in rows.items():
            dtype = np.dtype(dtype)
            full = (num_clients, *shape)
            file = os.path.join(path, f"{name}.bin")
            with open(file, "wb") as f:
                f.truncate(int(np.prod(full)) * dtype.itemsize)
            arrays[name] = np.memmap(file, dtype=dtype, mode="r+", shape=full)
            leaves[name] = {"shape": list(shape), "dtype": dtype.str}
        with open(os.path.join(path, STORE_META), "w") as f:
            json.dump({"num_clients": num_clients, "leaves": leaves, "meta": meta or {}}, f)
        return cls(arrays, path)

    @classmethod
    def open(cls, path: str, mode: str = "r", num_clients: int | None = None) -> HostStore:
        """Opens a store written by `create` (memory-mapped, read-only by default); with
        `num_clients`, only its first `num_clients` clients (a smaller population)."""
        info = _read_info(path)
        c = _prefix(path, int(info["num_clients"]), num_clients)
        arrays = {
            name: np.memmap(
                os.path.join(path, f"{name}.bin"),
                dtype=np.dtype(leaf["dtype"]),
                mode=mode,
                shape=(c, *leaf["shape"]),
            )
            for name, leaf in info["leaves"].items()
        }
        store = cls(arrays, path)
        store.meta = info.get("meta", {})
        return store

    def write_rows(self, start: int, rows: dict[str, np.ndarray]) -> None:
        """Writes a contiguous block of rows `[start, start + K)` with plain file writes
        (no dirty mapped pages, so the writer's RSS stays at one block)."""
        for name, a in self.arrays.items():
            r = np.ascontiguousarray(np.asarray(rows[name], a.dtype))
            if self.path is None or not isinstance(a, np.memmap):
                a[start : start + r.shape[0]] = r
                continue
            row = a.itemsize * int(np.prod(a.shape[1:]))
            with open(os.path.join(self.path, f"{name}.bin"), "r+b") as f:
                f.seek(start * row)
                f.write(r.reshape(-1).view(np.uint8))  # the buffer itself, no bytes copy


# ------------------------------------------------------------------------------ array_record
class RecordRows:
    """Read-only client rows in one array_record file (`rows.array_record` beside
    `store.json`, whose `"format"` is `"array_record"`): record i holds client i's row of
    every leaf, raw C-order bytes in leaf order. `gather(ids)` is one
    `ArrayRecordReader.read(ids)` (array_record's parallel random reads); the same
    interface as a read-only `HostStore` for a `ClientStore`."""

    def __init__(self, path: str, leaves: dict[str, tuple[tuple[int, ...], Any]], c: int):
        from array_record.python.array_record_module import ArrayRecordReader

        self.path, self.num_clients = path, c
        self.leaves = {n: (tuple(shape), np.dtype(dtype)) for n, (shape, dtype) in leaves.items()}
        self.reader = ArrayRecordReader(os.path.join(path, RECORDS), "readahead_buffer_size:0")

    @property
    def names(self) -> list[str]:
        return list(self.leaves)

    @property
    def row_bytes(self) -> int:
        return int(sum(d.itemsize * int(np.prod(s)) for s, d in self.leaves.values()))

    on_disk = True

    def shape(self, name: str) -> tuple[int, ...]:
        return (self.num_clients, *self.leaves[name][0])

    def gather(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """`{name: rows [len(ids), ...]}` of clients `ids` (any order, duplicates allowed)."""
        ids = _check_ids(ids, self.num_clients).reshape(-1)
        raw = self.reader.read([int(i) for i in ids]) if ids.size else []
        buf = np.frombuffer(b"".join(raw), np.uint8).reshape(ids.size, self.row_bytes)
        out, offset = {}, 0
        for name, (shape, dtype) in self.leaves.items():
            size = dtype.itemsize * int(np.prod(shape))
            part = np.ascontiguousarray(buf[:, offset : offset + size])
            out[name] = part.view(dtype).reshape(ids.size, *shape)
            offset += size
        return out

    @classmethod
    def open(cls, path: str, num_clients: int | None = None) -> RecordRows:
        info = _read_info(path)
        c = _prefix(path, int(info["num_clients"]), num_clients)
        leaves = {n: (leaf["shape"], leaf["dtype"]) for n, leaf in info["leaves"].items()}
        rows = cls(path, leaves, c)
        rows.meta = info.get("meta", {})
        return rows


# ------------------------------------------------------------------------------ decoding
@dataclasses.dataclass(frozen=True)
class Dequantize:
    """On-device decode of stored features: `x.astype(dtype) * scale` (e.g. uint8 pixels
    with `scale=1/255`). Hashable, so compiled rounds are cached per decode."""

    scale: float = 1.0 / 255.0
    dtype: str = "float32"

    def __call__(self, x: jax.Array) -> jax.Array:
        return x.astype(self.dtype) * jnp.asarray(self.scale, self.dtype)


def identity(x: jax.Array) -> jax.Array:
    return x


# ------------------------------------------------------------------------------ client store
@dataclasses.dataclass
class ClientStore:
    """A population's training data outside device memory.

    Attributes:
      rows: a `HostStore` (or read-only `RecordRows`) with arrays `x [C, N_max, ...]` and
        `y [C, N_max, ...]`.
      counts: `[C]` int32 examples per client (host RAM).
      num_classes: label classes (0 for regression).
      decode: jittable map applied on device to the gathered `x` rows (default identity).
    """

    rows: HostStore | RecordRows
    counts: np.ndarray
    num_classes: int = 0
    decode: Callable[[jax.Array], jax.Array] = identity

    def __post_init__(self):
        if set(self.rows.names) != {"x", "y"}:
            raise ValueError(f"a ClientStore needs arrays x and y, got {sorted(self.rows.names)}")
        self.counts = np.asarray(self.counts, np.int32)
        if self.counts.shape != (self.rows.num_clients,):
            raise ValueError(
                f"counts must have shape [{self.rows.num_clients}], got {self.counts.shape}"
            )
        n_max = self.max_count
        if self.counts.size and (self.counts.min() < 0 or self.counts.max() > n_max):
            raise ValueError(f"counts must be in [0, N_max={n_max}]")

    @property
    def num_clients(self) -> int:
        return self.rows.num_clients

    @property
    def max_count(self) -> int:
        return int(self.rows.shape("x")[1])

    @property
    def row_bytes(self) -> int:
        return self.rows.row_bytes

    @classmethod
    def from_federated(
        cls, data: FederatedData, decode: Callable[[jax.Array], jax.Array] = identity
    ) -> ClientStore:
        """An in-RAM store holding a copy of `data`'s training split."""
        rows = HostStore({"x": np.asarray(data.x), "y": np.asarray(data.y)})
        return cls(rows, np.asarray(data.counts), data.num_classes, decode)

    @classmethod
    def open(
        cls,
        path: str,
        decode: Callable[[jax.Array], jax.Array] | None = None,
        num_clients: int | None = None,
    ) -> ClientStore:
        """Opens an on-disk store written by `write_client_store` (memory-mapped raw files,
        or array_record); with `num_clients`, its first `num_clients` clients."""
        if _read_info(path).get("format") == "array_record":
            store = RecordRows.open(path, num_clients)
        else:
            store = HostStore.open(path, num_clients=num_clients)
        counts = np.load(os.path.join(path, "counts.npy"))[: store.num_clients]
        meta = getattr(store, "meta", {})
        if decode is None:
            scale = meta.get("dequantize")
            decode = Dequantize(float(scale)) if scale else identity
        return cls(store, counts, int(meta.get("num_classes", 0)), decode)

    def to_federated(self) -> FederatedData:
        """The whole population on device (decoded), for comparisons with `simulate`."""
        rows = self.rows.gather(np.arange(self.num_clients))
        return FederatedData(
            x=self.decode(jnp.asarray(rows["x"])),
            y=jnp.asarray(rows["y"]),
            counts=jnp.asarray(self.counts),
            num_classes=self.num_classes,
        )


def write_client_store(
    path: str,
    num_clients: int,
    max_count: int,
    feature_shape: tuple[int, ...],
    fill: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]],
    *,
    x_dtype: Any = np.uint8,
    y_dtype: Any = np.int32,
    label_shape: tuple[int, ...] = (),
    num_classes: int = 0,
    dequantize: float | None = None,
    block: int = 4096,
    progress: bool = True,
    file_format: Literal["raw", "array_record"] = "raw",
) -> ClientStore:
    """Writes a population to disk block by block: `fill(ids [K]) -> (x [K, N_max, ...],
    y [K, N_max, ...], counts [K])`. Peak memory is one block. `file_format`: one raw
    memory-mapped file per array, or one array_record file with a record per client
    (`RecordRows`). Returns the opened store."""
    if file_format not in ("raw", "array_record"):
        raise ValueError(f'file_format must be "raw" or "array_record", got {file_format!r}')
    meta = {"num_classes": int(num_classes)}
    if dequantize is not None:
        meta["dequantize"] = float(dequantize)
    rows = {"x": ((max_count, *feature_shape), x_dtype), "y": ((max_count, *label_shape), y_dtype)}
    store = (HostStore.create if file_format == "raw" else _RecordWriter)(
        path, num_clients, rows, meta
    )
    counts = np.zeros(num_clients, np.int32)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=num_clients, unit="client", desc="writing client store")
    for start in range(0, num_clients, block):
        ids = np.arange(start, min(num_clients, start + block))
        x, y, c = fill(ids)
        store.write_rows(start, {"x": x, "y": y})
        counts[ids] = c
        if bar is not None:
            bar.update(ids.size)
    if bar is not None:
        bar.close()
    np.save(os.path.join(path, "counts.npy"), counts)
    if isinstance(store, _RecordWriter):
        store.close()
    del store
    return ClientStore.open(path)


class _RecordWriter:
    """Writes `RecordRows` files: `write_rows` must be called with consecutive blocks."""

    def __init__(self, path: str, c: int, rows: dict[str, tuple[tuple[int, ...], Any]], meta):
        from array_record.python.array_record_module import ArrayRecordWriter

        os.makedirs(path, exist_ok=True)
        self.names = list(rows)
        self.writer = ArrayRecordWriter(os.path.join(path, RECORDS), "group_size:1")
        self.next = 0
        leaves = {n: {"shape": list(s), "dtype": np.dtype(d).str} for n, (s, d) in rows.items()}
        self.dtypes = {n: np.dtype(d) for n, (_, d) in rows.items()}
        info = {"num_clients": c, "format": "array_record", "leaves": leaves, "meta": meta}
        with open(os.path.join(path, STORE_META), "w") as f:
            json.dump(info, f)

    def write_rows(self, start: int, rows: dict[str, np.ndarray]) -> None:
        if start != self.next:
            raise ValueError(f"array_record rows are written in order: expected {self.next}")
        arrays = [np.ascontiguousarray(np.asarray(rows[n], self.dtypes[n])) for n in self.names]
        for i in range(arrays[0].shape[0]):
            self.writer.write(b"".join(a[i].tobytes() for a in arrays))
        self.next += arrays[0].shape[0]

    def close(self) -> None:
        self.writer.close()


# ------------------------------------------------------------------------------ cohort view
@struct.dataclass
class CohortData(FederatedData):
    """One round's cohort rows of a larger population (see the module docstring).

    Attributes (beyond `FederatedData`'s): `x`, `y` are `[M, N_max, ...]` rows of the clients
    `slot_ids [M]` (int32, sorted ascending; duplicates allowed), `counts` is `[C]`.
    `poison_missing`: a client read through `client(cid)` whose id is not in `slot_ids`
    gets NaN features, so a cohort plan that misses an id fails the run loudly
    (`NonFiniteError`) instead of training silently on another client's rows.
    """

    slot_ids: Array = None
    poison_missing: bool = struct.field(pytree_node=False, default=True)

    @property
    def num_clients(self) -> int:
        return int(self.counts.shape[0])

    @property
    def cohort_size(self) -> int:
        return int(self.x.shape[0])

    def slot(self, i: Array) -> tuple[jax.Array, jax.Array]:
        """`(row of client i in x/y, whether client i is in the cohort)`."""
        s = jnp.searchsorted(self.slot_ids, i).astype(jnp.int32)
        s = jnp.minimum(s, self.cohort_size - 1)
        return s, self.slot_ids[s] == i

    def client(self, i: Array) -> ClientData:
        s, found = self.slot(i)
        x = self.x[s]
        if self.poison_missing and jnp.issubdtype(x.dtype, jnp.floating):
            x = jnp.where(found, x, jnp.nan)
        return ClientData(x, self.y[s], self.counts[i])

    def client_test(self, i: Array) -> ClientData:
        raise ValueError(
            "a streamed cohort view holds no per-client test split: evaluate streamed runs on "
            "the central test set (EvalSpec(clients=False))"
        )


__all__ = [
    "ClientStore",
    "CohortData",
    "Dequantize",
    "HostStore",
    "RecordRows",
    "identity",
    "write_client_store",
]
