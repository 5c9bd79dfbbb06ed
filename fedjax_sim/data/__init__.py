"""Federated datasets: containers, partitioners, synthetic problems and built-in data."""

from fedjax_sim.data.builtin import (
    DATASETS,
    Dataset,
    federate,
    load,
    load_digits,
    load_fashion_mnist,
    read_idx,
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
from fedjax_sim.data.partition import (
    PARTITIONERS,
    dirichlet,
    iid,
    natural,
    partition,
    quantity_skew,
    shards,
)
from fedjax_sim.data.synthetic import (
    QuadraticProblem,
    fedprox_synthetic,
    least_squares,
    toy_quadratic,
)

__all__ = [
    "ArrayData",
    "Batch",
    "ClientData",
    "DATASETS",
    "Dataset",
    "FederatedData",
    "PARTITIONERS",
    "QuadraticProblem",
    "dirichlet",
    "fedprox_synthetic",
    "federate",
    "iid",
    "load",
    "load_fashion_mnist",
    "read_idx",
    "least_squares",
    "load_digits",
    "natural",
    "pack",
    "partition",
    "quantity_skew",
    "shards",
    "toy_quadratic",
    "tree_size_bytes",
    "unpack",
    "with_client_test",
]
