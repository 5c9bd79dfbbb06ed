"""Checks of numeric values, shared by every layer: the algorithms' hyper-parameters
(`check_number`, `positive`, `non_negative`) and the command line's field rules
(`Range`, used by `validate`), the user-error type `UsageError` and the one-line messages
(`flag`, `first_line`).

A failed check raises a `ValueError` that names the value and what it must be. Values that
`jax.vmap` or `jit` traces cannot be checked in Python and pass, so an algorithm can be built
inside a `jax.vmap` over its hyper-parameters (sweeps). Nothing here imports the app layer
(`config`, `validate`, `cli`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


class UsageError(ValueError):
    """A user error in the command line or config: reported in one line, exit code 2."""


def flag(name: str) -> str:
    """`client_lr` -> `--client-lr`."""
    return "--" + name.replace("_", "-")


def first_line(e: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's message (its type name if it has none), cut to
    `limit` characters (ending in "...") if given."""
    lines = str(e).strip().splitlines()
    line = lines[0] if lines else type(e).__name__
    return line if limit is None or len(line) <= limit else line[: limit - 3] + "..."


# Settings that may change between a run and its resumption (they do not change results,
# or only how many rounds are run).
RESUMABLE = frozenset(
    {
        "rounds",
        "resume",
        "resume_or_start",
        "progress",
        "checkpoint_every",
        "eval_every",
        "devices",
        "client_map",
        "map_batch_size",
        "coordinator",
        "num_processes",
        "process_id",
        "data_dir",
        "rows_dir",  # where a streamed run's host state rows live (restored on resume)
        "out",
        "runs_per_group",  # a sweep's planner
        "memory_budget_gb",
    }
)


def config_diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """`["--num-clients 100 -> 50", ...]`: settings (outside `RESUMABLE`) that differ."""
    diffs = []
    for k in sorted(set(saved) | set(current)):
        if k in RESUMABLE:
            continue
        a, b = comparable(saved.get(k)), comparable(current.get(k))
        if a != b:
            diffs.append(f"{flag(k)} {a!r} -> {b!r}")
    return diffs


def comparable(v: Any) -> Any:
    """A setting as compared between runs (tuples and lists alike)."""
    return list(v) if isinstance(v, (tuple, list)) else v


FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class Range:
    """An allowed interval of numbers."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def violation(self, value: float) -> str | None:
        """None if `value` is inside, else what it must be (`describe` of the violated side)."""
        lo, hi = self.lo, self.hi
        bad_lo = lo is not None and (value <= lo if self.lo_open else value < lo)
        bad_hi = hi is not None and (value >= hi if self.hi_open else value > hi)
        return self.describe(bad_lo) if bad_lo or bad_hi else None

    def describe(self, low_side: bool = True) -> str:
        """`>= 1`, `<= 4294967295` (technical maxima: only the violated side) or `in [0, 1]`."""
        lo, hi = self.lo, self.hi
        if hi in (INT32_MAX, UINT32_MAX):
            lo, hi = (lo, None) if low_side else (None, hi)
        if hi is None:
            return f"{'>' if self.lo_open else '>='} {_num(lo)}"
        if lo is None:
            return f"{'<' if self.hi_open else '<='} {_num(hi)}"
        left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        return f"in {left}{_num(lo)}, {_num(hi)}{right}"


def _num(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


POSITIVE_INT = Range(1, INT32_MAX)
NONNEG = Range(0)
POSITIVE = Range(0, lo_open=True)


def is_concrete(value: Any) -> bool:
    """True for Python / NumPy numbers and concrete arrays; False for tracers (a value that
    `jax.vmap` or `jit` traces cannot be checked in Python)."""
    from jax.core import Tracer

    return not isinstance(value, Tracer)


def check_number(
    name: str, value: Any, ok: Callable[[float], bool] | Range, requirement: str = ""
) -> None:
    """Raises `ValueError("{name} must be {requirement}, got {value}")` when `value` is
    concrete and fails `ok` (NaN fails every test); traced values pass. A `Range` is its own
    requirement."""
    if not is_concrete(value):
        return
    if isinstance(ok, Range):
        allowed = ok
        ok, requirement = (lambda v: allowed.violation(v) is None), allowed.describe()
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number ({requirement}), got {value!r}") from None
    if not (v == v and ok(v)):
        raise ValueError(f"{name} must be {requirement}, got {value!r}")


def positive(name: str, value: Any) -> None:
    """A concrete value must be a finite number > 0."""
    check_number(name, value, lambda v: 0 < v < float("inf"), "a finite number > 0")


def non_negative(name: str, value: Any) -> None:
    """A concrete value must be a finite number >= 0."""
    check_number(name, value, lambda v: 0 <= v < float("inf"), "a finite number >= 0")
