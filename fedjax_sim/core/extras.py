"""Optional dependencies: the extras of `pyproject.toml` and the features that need them.

The bare install (`pip install -e .`) never imports these packages. A command whose flags
need one checks it up front with `require` (one line naming the extra, exit 2, before
anything is loaded or compiled); library code imports it inside the function that uses it
with `load` (an ImportError naming the extra).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from fedjax_sim.core.checks import UsageError

EXTRAS: dict[str, tuple[str, ...]] = {
    "privacy": ("dp_accounting", "jax_privacy"),  # DP-FedAvg: accountants, clipping
    "tfds": ("tensorflow_datasets",),  # mnist, emnist, cifar10, cifar100, tfds:<name>
    "peers": ("torch",),  # the PyTorch baseline of `bench --suite baselines`
}


def message(extra: str, feature: str) -> str:
    """`<feature> needs the '<extra>' extra: pip install -e ".[<extra>]"`."""
    return f'{feature} needs the {extra!r} extra: pip install -e ".[{extra}]"'


def installed(extra: str) -> bool:
    """True if every package of `extra` can be found (nothing is imported)."""
    for module in EXTRAS[extra]:
        try:
            if importlib.util.find_spec(module) is None:
                return False
        except (ImportError, ValueError):
            return False
    return True


def require(extra: str, feature: str) -> None:
    """UsageError (one line naming the extra to install) unless `extra` is installed."""
    if not installed(extra):
        raise UsageError(message(extra, feature))


def load(module: str, extra: str, feature: str) -> ModuleType:
    """`import module`, or an ImportError naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(message(extra, feature)) from e
