"""Algorithms (one family per module) and the registry used by the CLI and benchmarks.

To add an algorithm: write `fedjax_sim/algorithms/<family>.py` with a factory
`name(loss_fn, *, ...) -> Algorithm` and register it below with `register(...)`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

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
from fedjax_sim.algorithms.fedavg import (
    ServerState,
    fedadagrad,
    fedadam,
    fedavg,
    fedavgm,
    fedopt,
    fedsgd,
    fedyogi,
    server_optimizer,
)
from fedjax_sim.algorithms.fedlps import fedlps
from fedjax_sim.algorithms.fedprox import fedprox

ALGORITHMS: dict[str, Callable[..., Algorithm]] = {}
_DESCRIPTIONS: dict[str, str] = {}


def register(name: str, factory: Callable[..., Algorithm], description: str | None = None) -> None:
    """Adds `factory(loss_fn, *, **hyper_parameters) -> Algorithm` to the registry;
    `description` defaults to the first line of its docstring."""
    if name in ALGORITHMS:
        raise ValueError(f"algorithm {name!r} is already registered")
    ALGORITHMS[name] = factory
    _DESCRIPTIONS[name] = description or (inspect.getdoc(factory) or "").split("\n")[0]


register("fedavg", fedavg)
register("fedsgd", fedsgd)
register("fedprox", fedprox)
register("fedopt", fedopt)
register("fedavgm", fedavgm, "FedAvgM: FedAvg with server momentum (Hsu et al. 2019).")
register("fedadam", fedadam, "FedAdam: server Adam, optax bias-corrected (Reddi et al. 2021).")
register("fedyogi", fedyogi, "FedYogi: server Yogi (Reddi et al. 2021).")
register("fedadagrad", fedadagrad, "FedAdagrad: server Adagrad (Reddi et al. 2021).")
register("fedlps", fedlps)


def describe(name: str) -> str:
    """One-line description of a registered algorithm."""
    return _DESCRIPTIONS[name]


def build(name: str, loss_fn: Callable, **kwargs: Any) -> Algorithm:
    """Builds a registered algorithm, passing only the keyword arguments its factory accepts
    (after checking that every user-chosen one is accepted; see `accepted_kwargs`)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose from {sorted(ALGORITHMS)}")
    accepted = accepted_kwargs(name)
    if accepted is None:
        return ALGORITHMS[name](loss_fn, **kwargs)
    return ALGORITHMS[name](loss_fn, **{k: v for k, v in kwargs.items() if k in accepted})


def accepted_kwargs(name: str) -> set[str] | None:
    """Keyword arguments of a factory (None if it takes **kwargs: everything is passed on)."""
    params = inspect.signature(ALGORITHMS[name]).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind is p.KEYWORD_ONLY}


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "CohortSpec",
    "LocalResult",
    "LocalSpec",
    "ServerState",
    "Stragglers",
    "accepted_kwargs",
    "build",
    "client_key",
    "describe",
    "fedadagrad",
    "fedadam",
    "fedavg",
    "fedavgm",
    "fedlps",
    "fedopt",
    "fedprox",
    "fedsgd",
    "fedyogi",
    "local_train",
    "map_cohort",
    "register",
    "round_key",
    "server_optimizer",
    "server_update",
    "weighted_mean",
]
