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
    area,
    as_fedavg,
    dr_dsgd,
    drfa,
    ef_fedavg,
    ef_fedprox,
    fedadagrad,
    fedadam,
    fedadam_reddi,
    fedasync,
    fedavg,
    fedavgm,
    fedbuff,
    fedcm,
    feddyn,
    fedlps,
    fedmim,
    fednova,
    fedopt,
    fedprox,
    fedsam,
    fedsgd,
    fedyogi,
    fgdro_cvar,
    fgdro_kl,
    fgdro_kl_adam,
    fp_fedavg,
    fp_fedprox,
    local_adam,
    local_train,
    mifa,
    mofedsam,
    s_fedavg,
    scaffold,
)
from fedjax_sim.algorithms.aggregators import Aggregator, clipped, compressed, error_feedback, mean
from fedjax_sim.algorithms.client_work import ClientWork
from fedjax_sim.algorithms.compose import compose
from fedjax_sim.algorithms.distributors import Distributor, forced_cohorts
from fedjax_sim.algorithms.local_hook import LocalHook, chain
from fedjax_sim.algorithms.secure_aggregation import secure_aggregation
from fedjax_sim.data import ArrayData, Batch, FederatedData
from fedjax_sim.models import Model
from fedjax_sim.run.history import History
from fedjax_sim.run.loop import NonFiniteError
from fedjax_sim.run.simulate import EvalSpec, simulate
from fedjax_sim.run.streaming import simulate_streamed
from fedjax_sim.runtime.parallel import ClientMap

__version__ = "0.1.0"

__all__ = [
    "Aggregator",
    "Algorithm",
    "ArrayData",
    "Batch",
    "ClientMap",
    "ClientWork",
    "CohortSpec",
    "Distributor",
    "EvalSpec",
    "FederatedData",
    "History",
    "LocalHook",
    "LocalSpec",
    "Model",
    "NonFiniteError",
    "Stragglers",
    "algorithms",
    "area",
    "as_fedavg",
    "chain",
    "clipped",
    "compose",
    "compressed",
    "data",
    "dr_dsgd",
    "drfa",
    "ef_fedavg",
    "ef_fedprox",
    "error_feedback",
    "fedadagrad",
    "fedadam",
    "fedadam_reddi",
    "fedasync",
    "fedavg",
    "fedavgm",
    "fedbuff",
    "fedcm",
    "feddyn",
    "fedlps",
    "fedmim",
    "fednova",
    "fedopt",
    "fedprox",
    "fedsam",
    "fedsgd",
    "fedyogi",
    "fgdro_cvar",
    "fgdro_kl",
    "fgdro_kl_adam",
    "forced_cohorts",
    "fp_fedavg",
    "fp_fedprox",
    "local_adam",
    "local_train",
    "mean",
    "mifa",
    "models",
    "mofedsam",
    "s_fedavg",
    "scaffold",
    "secure_aggregation",
    "simulate",
    "simulate_streamed",
]
