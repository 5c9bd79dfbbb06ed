"""Algorithms (one family per module) and the registry used by the CLI and benchmarks.

To add an algorithm: write `fedjax_sim/algorithms/<family>.py` with a factory
`name(loss_fn, *, ...) -> Algorithm` and register it below with `register(...)`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from fedjax_sim.algorithms.area import area
from fedjax_sim.algorithms.asynchronous import (
    AsyncOptions,
    ServerRule,
    compose_async,
    diminishing,
    sample_size_scale,
)
from fedjax_sim.algorithms.clustered import ifca
from fedjax_sim.algorithms.core import (
    Algorithm,
    CohortSpec,
    LocalResult,
    LocalSpec,
    Stragglers,
    client_key,
    local_train,
    map_cohort,
    round_key,
    server_update,
    weighted_mean,
)
from fedjax_sim.algorithms.dro_baselines import dr_dsgd, drfa
from fedjax_sim.algorithms.fedadam import adam_without_bias_correction, fedadam_reddi
from fedjax_sim.algorithms.fedavg import (
    fedadagrad,
    fedadam,
    fedavg,
    fedavgm,
    fednova,
    fedopt,
    fedprox,
    fedsgd,
    fedyogi,
    named_server_optimizer,
)
from fedjax_sim.algorithms.fedbuff import as_fedavg, fedasync, fedbuff
from fedjax_sim.algorithms.fedcm import fedcm, mofedsam
from fedjax_sim.algorithms.feddyn import feddyn
from fedjax_sim.algorithms.fedlps import fedlps
from fedjax_sim.algorithms.fedmim import fedmim
from fedjax_sim.algorithms.fedsam import fedsam
from fedjax_sim.algorithms.fgdro import fgdro_cvar, fgdro_kl, fgdro_kl_adam, local_adam
from fedjax_sim.algorithms.fixed_point import ef_fedavg, ef_fedprox, fp_fedavg, fp_fedprox
from fedjax_sim.algorithms.mifa import mifa
from fedjax_sim.algorithms.partition import Partition, by_path
from fedjax_sim.algorithms.partitioned import fedbabu, fedper, fedrep, lg_fedavg
from fedjax_sim.algorithms.personal_models import apfl, ditto, fedavg_ft, per_fedavg, pfedme
from fedjax_sim.algorithms.scaffold import scaffold
from fedjax_sim.algorithms.schedules import client_sgd, round_decay
from fedjax_sim.algorithms.sfedavg import s_fedavg

ALGORITHMS: dict[str, Callable[..., Algorithm]] = {}
_DESCRIPTIONS: dict[str, str] = {}


def _first_paragraph(factory: Callable) -> str:
    doc = inspect.getdoc(factory) or ""
    return " ".join(doc.split("\n\n")[0].split())


def register(name: str, factory: Callable[..., Algorithm], description: str | None = None) -> None:
    """Adds `factory(loss_fn, *, **hyper_parameters) -> Algorithm` to the registry;
    `description` defaults to the first paragraph of its docstring."""
    if name in ALGORITHMS:
        raise ValueError(f"algorithm {name!r} is already registered")
    ALGORITHMS[name] = factory
    _DESCRIPTIONS[name] = description or _first_paragraph(factory)


register("fedavg", fedavg)
register("fedsgd", fedsgd)
register("fedprox", fedprox)
register("fedopt", fedopt)
register("fedavgm", fedavgm, "FedAvgM: FedAvg with server momentum (Hsu et al. 2019).")
register("fedadam", fedadam, "FedAdam: server Adam, optax bias-corrected (Reddi et al. 2021).")
register("fedyogi", fedyogi, "FedYogi: server Yogi (Reddi et al. 2021).")
register("fedadagrad", fedadagrad, "FedAdagrad: server Adagrad (Reddi et al. 2021).")
register(
    "fedadam_reddi",
    fedadam_reddi,
    "FedAdam as in Reddi et al. Alg. 2 / the FedMIM paper: server Adam, no bias correction.",
)
register("fedmim", fedmim, "FedMIM: multi-step inertial momentum (Liu et al., Algorithm 1).")
register("fedcm", fedcm, "FedCM: client-level momentum (Xu et al. 2021).")
register("scaffold", scaffold, "SCAFFOLD option II: per-client control variates (ICML 2020).")
register("feddyn", feddyn, "FedDyn: dynamic regularization, per-client h_i (ICLR 2021).")
register("fedsam", fedsam, "FedSAM: local SAM steps, FedAvg aggregation (Qu et al. 2022).")
register("mofedsam", mofedsam, "MoFedSAM: FedCM with local SAM gradients (Qu et al. 2022).")
register("fp_fedavg", fp_fedavg, "FedAvg as T local SGD steps of step s_k/T (Beikmohammadi+ 2024).")
register("fp_fedprox", fp_fedprox, "FedProx as one prox_{s_k F_i} per round (Beikmohammadi+ 2024).")
register("ef_fedavg", ef_fedavg, "Error-feedback FedAvg, top-1% uploads (Beikmohammadi+ 2024).")
register("ef_fedprox", ef_fedprox, "Error-feedback FedProx, top-1% uploads (Beikmohammadi+ 2024).")
register("area", area)
register("s_fedavg", s_fedavg)
register("as_fedavg", as_fedavg)
register("fedbuff", fedbuff)
register("mifa", mifa)
register("fedasync", fedasync)
register(
    "fgdro_cvar", fgdro_cvar, "FGDRO-CVaR: mean of the K worst client losses (Guo & Yang 2024)."
)
register("fgdro_kl", fgdro_kl, "FGDRO-KL: KL-regularised group DRO (Guo & Yang 2024).")
register("fgdro_kl_adam", fgdro_kl_adam, "FGDRO-KL-Adam: FGDRO-KL with local Adam steps.")
register("local_adam", local_adam, "LocalAdam: Adam-type local steps, averaged moments (ERM).")
register("drfa", drfa, "DRFA: distributionally robust FedAvg (Deng et al. 2020).")
register("dr_dsgd", dr_dsgd, "DR-DSGD, federated: exp(l/t)-weighted local SGD (Issaid et al.).")
register("fedlps", fedlps)
register("fedper", fedper)
register("lg_fedavg", lg_fedavg)
register("fedrep", fedrep)
register("fedbabu", fedbabu)
register("ifca", ifca)
register("fednova", fednova)
register("ditto", ditto, "Ditto: FedAvg plus proximal personal models v_i (Li et al., ICML 2021).")
register("apfl", apfl, "APFL: personal models mixed with the global one (Deng et al. 2020).")
register("pfedme", pfedme, "pFedMe: Moreau-envelope personal models (T. Dinh et al. 2020).")
register("per_fedavg", per_fedavg, "Per-FedAvg: MAML local steps (Fallah et al. 2020).")
register("fedavg_ft", fedavg_ft, "FedAvg-FT: FedAvg, personal models by local fine-tuning.")


def describe(name: str) -> str:
    """One-line description of a registered algorithm (never cut mid-sentence)."""
    return _DESCRIPTIONS[name]


def build(name: str, loss_fn: Callable, **kwargs: Any) -> Algorithm:
    """Builds a registered algorithm; an argument it does not take is a TypeError (nothing is
    dropped silently)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose from {sorted(ALGORITHMS)}")
    return ALGORITHMS[name](loss_fn, **kwargs)


__all__ = [
    "Partition",
    "by_path",
    "fedbabu",
    "fedper",
    "fedrep",
    "ifca",
    "lg_fedavg",
    "ALGORITHMS",
    "Algorithm",
    "apfl",
    "ditto",
    "fedavg_ft",
    "per_fedavg",
    "pfedme",
    "AsyncOptions",
    "ServerRule",
    "area",
    "as_fedavg",
    "compose_async",
    "CohortSpec",
    "LocalResult",
    "LocalSpec",
    "Stragglers",
    "adam_without_bias_correction",
    "build",
    "client_key",
    "client_sgd",
    "describe",
    "ef_fedavg",
    "ef_fedprox",
    "dr_dsgd",
    "drfa",
    "fedadagrad",
    "fedadam",
    "fedavg",
    "fedavgm",
    "fedcm",
    "feddyn",
    "fedmim",
    "fednova",
    "diminishing",
    "fedasync",
    "fedbuff",
    "fedlps",
    "fedopt",
    "fedprox",
    "fedsam",
    "fedsgd",
    "fedyogi",
    "fp_fedavg",
    "fp_fedprox",
    "fgdro_cvar",
    "fgdro_kl",
    "fgdro_kl_adam",
    "local_adam",
    "local_train",
    "map_cohort",
    "mofedsam",
    "mifa",
    "register",
    "round_decay",
    "round_key",
    "scaffold",
    "s_fedavg",
    "sample_size_scale",
    "named_server_optimizer",
    "server_update",
    "weighted_mean",
]
