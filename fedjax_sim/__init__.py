"""fedjax_sim: a JAX-native, vectorized simulator of federated learning.

Clients are an array axis; every algorithm is a pure `Algorithm(init, step)`; a round is one
compiled function and rounds run under `lax.scan`.
"""

from fedjax_sim import algorithms, data, models
from fedjax_sim.algorithms import (
    Algorithm,
    CohortSpec,
    LocalSpec,
    Stragglers,
    fedavg,
    fedprox,
    fedsgd,
    local_train,
)
from fedjax_sim.data import ArrayData, Batch, FederatedData
from fedjax_sim.history import History
from fedjax_sim.models import Model
from fedjax_sim.parallel import ClientMap
from fedjax_sim.simulate import EvalSpec, NonFiniteError, simulate
from fedjax_sim.streaming import simulate_streamed

__version__ = "0.1.0"

__all__ = [
    "Algorithm",
    "ArrayData",
    "Batch",
    "ClientMap",
    "CohortSpec",
    "EvalSpec",
    "FederatedData",
    "History",
    "LocalSpec",
    "Model",
    "NonFiniteError",
    "Stragglers",
    "algorithms",
    "data",
    "fedavg",
    "fedprox",
    "fedsgd",
    "local_train",
    "models",
    "simulate",
    "simulate_streamed",
]
