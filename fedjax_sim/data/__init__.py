"""Federated datasets: containers, partitioners, synthetic problems and real data sources."""

from fedjax_sim.data.buckets import Bucket, Buckets, pack_buckets, size_buckets
from fedjax_sim.data.builtin import (
    DATASETS,
    is_registered,
    load,
    load_digits,
    load_fedprox_synthetic,
    needs_tfds,
)
from fedjax_sim.data.cache import default_cache_dir
from fedjax_sim.data.dataset import (
    Dataset,
    check_examples,
    federate,
    from_arrays,
    from_client_lists,
    split_clients,
)
from fedjax_sim.data.federated import (
    ArrayData,
    Batch,
    ClientData,
    FederatedData,
    pack,
    tree_size_bytes,
    unpack,
    with_client_test,
)
from fedjax_sim.data.idx import (
    FASHION_MNIST_DIR,
    load_fashion_mnist,
    read_fashion_mnist,
    read_idx,
)
from fedjax_sim.data.jax_partition import DEVICE_PARTITIONERS, client_index, padding_waste
from fedjax_sim.data.partition import (
    PARTITIONERS,
    dirichlet,
    iid,
    natural,
    partition,
    quantity_skew,
    shards,
)
from fedjax_sim.data.procedural import FedProxSynthetic, Population, UniformClassification
from fedjax_sim.data.shakespeare import load_shakespeare
from fedjax_sim.data.store import (
    ClientStore,
    CohortData,
    Dequantize,
    HostStore,
    RecordRows,
    write_client_store,
)
from fedjax_sim.data.synthetic import (
    QuadraticProblem,
    fedprox_synthetic,
    least_squares,
    markov_tokens,
    toy_quadratic,
)
from fedjax_sim.data.tfds_source import DataNotPrepared, load_tfds

__all__ = [
    "ClientStore",
    "CohortData",
    "Dequantize",
    "FedProxSynthetic",
    "HostStore",
    "RecordRows",
    "Population",
    "UniformClassification",
    "write_client_store",
    "ArrayData",
    "Batch",
    "Bucket",
    "Buckets",
    "ClientData",
    "DATASETS",
    "DEVICE_PARTITIONERS",
    "DataNotPrepared",
    "Dataset",
    "FASHION_MNIST_DIR",
    "FederatedData",
    "PARTITIONERS",
    "QuadraticProblem",
    "check_examples",
    "client_index",
    "default_cache_dir",
    "dirichlet",
    "fedprox_synthetic",
    "federate",
    "from_arrays",
    "from_client_lists",
    "iid",
    "is_registered",
    "least_squares",
    "markov_tokens",
    "load",
    "load_digits",
    "load_fashion_mnist",
    "load_fedprox_synthetic",
    "load_shakespeare",
    "load_tfds",
    "natural",
    "needs_tfds",
    "pack",
    "pack_buckets",
    "padding_waste",
    "partition",
    "quantity_skew",
    "read_fashion_mnist",
    "read_idx",
    "shards",
    "size_buckets",
    "split_clients",
    "toy_quadratic",
    "tree_size_bytes",
    "unpack",
    "with_client_test",
]
