"""Result rows (one JSON object per line) and their schema.

Every row has `kind`, `suite`, `label`, `time` and `machine` (device kind, backend, jax
version, load average...). Kinds:

- `"round"`: one measured round (our engine or a baseline: `engine` says which), with
  compile time, seconds/round (median, min, all), client-steps/s, examples/s, FLOPs
  (XLA, loop-aware; None for baselines), the matmul peak of the same run and the roofline
  ratio, peak memory and its source.
- `"skipped"`: a configuration not run, with the `reason` (memory budget, unsupported
  algorithm, missing optional dependency...).
- `"summary"`: derived ratios of a suite (speedups, ratios to FedAvg).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from typing import Any

NUM = (int, float)
OPT_NUM = (int, float, type(None))

COMMON: dict[str, tuple[type, ...]] = {
    "kind": (str,),
    "suite": (str,),
    "label": (str,),
    "time": (str,),
    "machine": (dict,),
}

ROUND: dict[str, tuple[type, ...]] = {
    "engine": (str,),  # "fedjax_sim" | "python-loop" | "torch-loop"
    "workload": (dict,),
    "algorithm": (str,),
    "mode": (str,),
    "clients": (int,),
    "local_steps": (int,),
    "batch_size": (int,),
    "repeats": (int,),
    "compile_s": OPT_NUM,
    "first_round_s": NUM,
    "round_s": (list,),
    "round_s_median": NUM,
    "round_s_min": NUM,
    "client_steps_per_s": NUM,
    "examples_per_s": NUM,
    "flops_xla": OPT_NUM,
    "flops_method": (str, type(None)),
    "flops_model": NUM,
    "achieved_flops_per_s": OPT_NUM,
    "peak_flops_per_s": NUM,
    "roofline_ratio": OPT_NUM,
    "peak_memory_bytes": (int,),
    "memory_source": (str,),
    "xla_memory_bytes": (int, type(None)),
}

MACHINE = ("device_kind", "backend", "jax", "cpu_count", "load_avg_1m")

SCHEMAS: dict[str, dict[str, tuple[type, ...]]] = {
    "round": ROUND,
    "skipped": {"reason": (str,)},
    "summary": {},
}


def validate_row(row: dict[str, Any]) -> None:
    """Raises ValueError naming the first missing or mistyped field."""
    kind = row.get("kind")
    if kind not in SCHEMAS:
        raise ValueError(f"row kind must be one of {sorted(SCHEMAS)}, got {kind!r}")
    for name, types in {**COMMON, **SCHEMAS[kind]}.items():
        if name not in row:
            raise ValueError(f"{kind} row lacks field {name!r}")
        value = row[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise ValueError(f"{kind} row field {name!r} has type {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{kind} row field {name!r} is not finite: {value}")
    for name in MACHINE:
        if name not in row["machine"]:
            raise ValueError(f"row machine info lacks {name!r}")
    if kind == "round":
        times = row["round_s"]
        if len(times) != row["repeats"] or not all(t > 0 for t in times):
            raise ValueError("round_s must hold `repeats` positive times")
        if not row["round_s_min"] <= row["round_s_median"]:
            raise ValueError("round_s_min exceeds round_s_median")


def write_rows(path: str, rows: Iterable[dict[str, Any]], append: bool = False) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_rows(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
