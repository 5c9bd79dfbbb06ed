"""tensorflow-datasets image classification data, read WITHOUT TensorFlow.

Any tfds catalogue dataset (`mnist`, `fashion_mnist`, `emnist/byclass`, `cifar10`,
`cifar100`, ...) or a dataset someone prepared with their own builder, once it is prepared on
disk in the `array_record` file format, is read through `tfds.data_source(name, split=...,
data_dir=..., download=False)` (random access, NumPy values; TensorFlow is not imported) or,
for a dataset whose builder code is not importable here, `tfds.builder_from_directory(dir)`.
We never let tfds download: on a machine without the data (or without network), a missing
dataset raises `DataNotPrepared` at once with the command that prepares it on a machine with
internet. The first load converts the split to padded per-client arrays (see `cache`).

Preparing data (on a machine with internet; tfds' image encoders need TensorFlow there):

    pip install tensorflow tensorflow-datasets
    tfds build mnist --data_dir ~/tensorflow_datasets --file_format array_record

then copy the folder `~/tensorflow_datasets/mnist` to this machine's data dir (default
`$TFDS_DATA_DIR` or `~/tensorflow_datasets`). Data prepared in the default TFRecord format can
be converted with `tfds convert_format --dataset_dir DIR/mnist --out_file_format array_record`.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import numpy as np

from fedjax_sim.core import extras
from fedjax_sim.data import cache
from fedjax_sim.data.dataset import Backend, Dataset, check_examples, federate, federate_ids
from fedjax_sim.data.federated import ArrayData
from fedjax_sim.data.idx import to_unit_float

READ_CHUNK = 4096


class DataNotPrepared(FileNotFoundError):
    """A tfds dataset is not prepared (in array_record format) under the data dir."""


def _tfds() -> Any:
    """tensorflow_datasets (the `tfds` extra; TensorFlow is not needed)."""
    return extras.load("tensorflow_datasets", "tfds", "reading tfds datasets")


def default_data_dir() -> str:
    return os.environ.get("TFDS_DATA_DIR") or os.path.join(
        os.path.expanduser("~"), "tensorflow_datasets"
    )


def prepared_dirs(name: str, data_dir: str) -> list[str]:
    """Version folders `data_dir/name[/config]/x.y.z` holding a dataset_info.json."""
    pattern = os.path.join(data_dir, name, "*", "dataset_info.json")
    found = [os.path.dirname(p) for p in glob.glob(pattern)]
    return sorted(
        found, key=lambda d: [int(v) for v in os.path.basename(d).split(".") if v.isdigit()]
    )


def _file_format(version_dir: str) -> str:
    with open(os.path.join(version_dir, "dataset_info.json")) as f:
        info = json.load(f)
    return str(info.get("fileFormat", "tfrecord")).lower()


def missing_message(name: str, data_dir: str, detail: str = "") -> str:
    return (
        f"tfds dataset {name!r} is not prepared in array_record format under {data_dir!r}"
        f"{': ' + detail if detail else ''}. fedjax_sim reads tfds data without TensorFlow and "
        f"never downloads. On a machine with internet run\n"
        f"    pip install tensorflow tensorflow-datasets\n"
        f"    tfds build {name} --data_dir {data_dir} --file_format array_record\n"
        f"and copy {os.path.join(data_dir, name.split('/')[0])} here (or pass data_dir= / set "
        f"TFDS_DATA_DIR). Data already prepared as TFRecord converts with\n"
        f"    tfds convert_format --dataset_dir {os.path.join(data_dir, name.split('/')[0])} "
        f"--out_file_format array_record"
    )


def open_splits(name: str, splits: tuple[str, ...], data_dir: str) -> dict[str, Any]:
    """Random-access data sources of `splits` (no download, no TensorFlow)."""
    tfds = _tfds()
    try:
        return {
            s: tfds.data_source(name, split=s, data_dir=data_dir, download=False) for s in splits
        }
    except tfds.core.registered.DatasetNotFoundError:
        pass  # not a catalogue name: maybe a dataset prepared with the user's own builder
    except (NotImplementedError, FileNotFoundError, AssertionError, ValueError) as e:
        if not prepared_dirs(name, data_dir):
            raise DataNotPrepared(missing_message(name, data_dir)) from e
    found = prepared_dirs(name, data_dir)
    if not found:
        raise DataNotPrepared(missing_message(name, data_dir, "no prepared version found"))
    version_dir = found[-1]
    fmt = _file_format(version_dir)
    if fmt != "array_record":
        raise DataNotPrepared(
            missing_message(name, data_dir, f"{version_dir} holds the {fmt!r} file format")
        )
    builder = tfds.builder_from_directory(version_dir)
    missing = set(splits) - set(builder.info.splits.keys())
    if missing:
        raise ValueError(
            f"{name}: no split(s) {sorted(missing)}; available {sorted(builder.info.splits)}"
        )
    return {s: builder.as_data_source(split=s) for s in splits}


def read_split(source: Any, keys: tuple[str, ...]) -> list[np.ndarray]:
    """All examples of a data source as stacked arrays, one per feature key."""
    out: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    for start in range(0, len(source), READ_CHUNK):
        index = list(range(start, min(start + READ_CHUNK, len(source))))
        try:
            rows = source.__getitems__(index)
        except TypeError:  # tfds.testing.mock_data's sources only support [i]
            rows = [source[i] for i in index]
        for k in keys:
            if k not in rows[0]:
                raise ValueError(f"feature {k!r} not in the dataset; it has {sorted(rows[0])}")
            out[k].append(np.stack([np.asarray(r[k]) for r in rows]))
    return [np.concatenate(out[k]) if out[k] else np.zeros((0,)) for k in keys]


def load_tfds(
    name: str,
    num_clients: int = 100,
    partitioner: str = "dirichlet",
    seed: int = 0,
    *,
    data_dir: str | None = None,
    train_split: str = "train",
    test_split: str = "test",
    image_key: str | None = None,
    label_key: str | None = None,
    group_key: str | None = None,
    client_test_fraction: float = 0.2,
    backend: Backend = "numpy",
    cache_dir: str | None = None,
    use_cache: bool = True,
    **partition_kwargs: Any,
) -> Dataset:
    """A prepared tfds image-classification dataset, federated.

    Features/labels are the builder's supervised keys (else "image"/"label"); uint8 images
    become float32 in [0, 1]. `group_key` (e.g. a writer id feature) gives the natural
    partition (one client per distinct value) instead of `partitioner`. The central test set
    is `test_split`.
    """
    data_dir = os.path.expanduser(data_dir or default_data_dir())
    sources = open_splits(name, (train_split, test_split), data_dir)
    info = sources[train_split].dataset_info
    supervised = info.supervised_keys or ("image", "label")
    image_key = image_key or supervised[0]
    label_key = label_key or supervised[1]
    label_feature = info.features[label_key]
    num_classes = int(getattr(label_feature, "num_classes", 0) or 0) or None
    if partitioner == "dirichlet" and group_key is None:
        partition_kwargs.setdefault("alpha", 0.5)
    info_file = os.path.join(str(getattr(info, "data_dir", "")), "dataset_info.json")
    spec = {
        "name": f"tfds_{name}",
        "source": [name, str(info.version), str(getattr(info, "data_dir", data_dir))]
        + (cache.file_fingerprint([info_file]) if os.path.exists(info_file) else []),
        "splits": [train_split, test_split],
        "keys": [image_key, label_key, group_key],
        "num_clients": num_clients if group_key is None else None,
        "partitioner": partitioner if group_key is None else "natural",
        "partition_kwargs": partition_kwargs,
        "seed": seed,
        "client_test_fraction": client_test_fraction,
        "backend": backend,
    }

    def build() -> Dataset:
        keys = (image_key, label_key) + ((group_key,) if group_key else ())
        train = read_split(sources[train_split], keys)
        x_test, y_test = read_split(sources[test_split], (image_key, label_key))
        x, y = train[0], train[1].astype(np.int32)
        central = ArrayData(x=x_test, y=y_test.astype(np.int32))
        if group_key is None:
            return federate(
                x,
                y,
                num_clients=num_clients,
                partitioner=partitioner,
                seed=seed,
                client_test_fraction=client_test_fraction,
                central_test=central,
                num_classes=num_classes,
                name=name,
                backend=backend,
                **partition_kwargs,
            )
        classes = check_examples(x, y, num_classes)
        check_examples(central.x, central.y, classes)
        _, ids = np.unique(train[2], return_inverse=True)
        return federate_ids(
            x,
            y,
            ids.astype(np.int32),
            int(ids.max()) + 1,
            seed=seed,
            client_test_fraction=client_test_fraction,
            central_test=central,
            num_classes=classes,
            name=name,
        )

    return to_unit_float(cache.cached(spec, build, cache_dir=cache_dir, enabled=use_cache))
