"""Result rows (one JSON object per line) and their schema.

Every row has `kind`, `suite`, `label`, `time` and the four fields that make it a record of
code: `commit` (`git rev-parse --short HEAD`, `-dirty` when tracked files differ from it),
`machine` (CPU model, cores, memory, device kind, backend, jax version...), `load` (1-minute
load average when the run started and ended) and `command` (the command line). `stamp()`
takes them once per run; `Recorder` stamps every row of a benchmark script and writes the
suite's one current file `benchmarks/results/<suite>.jsonl`, replacing the rows a re-run
measures again (same `label`) atomically and keeping the others. Rows converted from files
written before the schema say `UNKNOWN` where the file did not record a field. Kinds:

- `"round"`: one measured round (our engine or a baseline: `engine` says which), with
  compile time, seconds/round (median, min, all), client-steps/s, examples/s, FLOPs
  (XLA, loop-aware; None for baselines), the matmul peak of the same run and the roofline
  ratio, peak memory and its source.
- `"skipped"`: a configuration not run, with the `reason` (memory budget, unsupported
  algorithm, missing optional dependency...).
- `"summary"`: derived ratios of a suite (speedups, ratios to FedAvg).
- `"measurement"`: a row of a script in `benchmarks/` (its own fields, free-form).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from typing import Any

UNKNOWN = "unknown (recorded before the schema)"
REPO = str(pathlib.Path(__file__).resolve().parents[3])  # fedjax_sim/app/bench/results.py
RESULTS = os.path.join(REPO, "benchmarks", "results")

NUM = (int, float)
OPT_NUM = (int, float, type(None))

COMMON: dict[str, tuple[type, ...]] = {
    "kind": (str,),
    "suite": (str,),
    "label": (str,),
    "time": (str,),
    "commit": (str,),
    "machine": (dict, str),
    "load": (dict, str),
    "command": (str,),
}

ROUND: dict[str, tuple[type, ...]] = {
    "engine": (str,),  # "fedjax_sim" | "python-loop" | "torch-loop" | "pfl" | "fedjax"
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
    "measurement": {},
}
LOAD = ("start_1m", "end_1m")


STAMP = ("commit", "load", "command")  # added by `finish` when the run's rows are written


def validate_row(row: dict[str, Any], stamped: bool = True) -> None:
    """Raises ValueError naming the first missing or mistyped field (`stamped=False`: a row
    measured but not yet stamped by `finish`)."""
    kind = row.get("kind")
    if kind not in SCHEMAS:
        raise ValueError(f"row kind must be one of {sorted(SCHEMAS)}, got {kind!r}")
    fields = {**COMMON, **SCHEMAS[kind]}
    if not stamped:
        fields = {k: v for k, v in fields.items() if k not in STAMP}
    for name, types in fields.items():
        if name not in row:
            raise ValueError(f"{kind} row lacks field {name!r}")
        value = row[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise ValueError(f"{kind} row field {name!r} has type {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{kind} row field {name!r} is not finite: {value}")
    for field, keys in (("machine", MACHINE), ("load", LOAD)):
        if field not in fields:
            continue
        if isinstance(row[field], str):
            if row[field] != UNKNOWN:
                raise ValueError(f"row {field} must be a dict or {UNKNOWN!r}")
            continue
        for name in keys:
            if name not in row[field]:
                raise ValueError(f"row {field} info lacks {name!r}")
    if stamped and not (row["commit"] and row["command"]):
        raise ValueError("row commit and command must not be empty")
    if kind == "round":
        times = row["round_s"]
        if len(times) != row["repeats"] or not all(t > 0 for t in times):
            raise ValueError("round_s must hold `repeats` positive times")
        if not row["round_s_min"] <= row["round_s_median"]:
            raise ValueError("round_s_min exceeds round_s_median")


def git_commit() -> str:
    """`git rev-parse --short HEAD` of this checkout, `-dirty` when a tracked file differs."""
    git = ["git", "-C", REPO]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        return "unknown (not a git checkout)"
    status = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def load_1m() -> float:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else float("nan")


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: `python <script> <args>` (or the given argv)."""
    argv = sys.argv if argv is None else argv
    return "python " + shlex.join(argv)


def stamp(argv: list[str] | None = None, machine: bool = True) -> dict[str, Any]:
    """commit, machine, command and the load at the start (`end_1m` is set by `finish`).
    `machine=False` where this process must not start JAX (it would take the accelerator
    from its measuring children): the machine info is then taken in a child process (a row
    that brings its own `machine` keeps it)."""
    if machine:
        from fedjax_sim.app.bench import measure  # imports jax: only where a run measures

        info = measure.machine_info()
    else:
        code = "import json; from fedjax_sim.app.bench import measure; "
        code += "print(json.dumps(measure.machine_info()))"
        child = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        info = json.loads(child.stdout.strip().splitlines()[-1])
    return {
        "commit": git_commit(),
        "machine": info,
        "load": {"start_1m": load_1m(), "end_1m": None},
        "command": command_line(argv),
    }


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def finish(rows: list[dict[str, Any]], stamped: dict[str, Any]) -> list[dict[str, Any]]:
    """Stamps every row (the load at the end measured now) and validates it."""
    stamped = {**stamped, "load": {**stamped["load"], "end_1m": load_1m()}}
    # a row measured in its own process keeps its own machine info (load at that time)
    out = [{**row, **{k: v for k, v in stamped.items() if k not in row}} for row in rows]
    for row in out:
        validate_row(row)
    return out


def suite_path(suite: str) -> str:
    return os.path.join(RESULTS, f"{suite}.jsonl")


def replace_rows(path: str, rows: list[dict[str, Any]]) -> None:
    """Writes `rows` into `path`: each replaces the old row with its label (in place), new
    labels follow, old rows of labels not measured again stay. Atomic (`os.replace`)."""
    new = {row["label"]: row for row in rows}
    old = read_rows(path) if os.path.exists(path) else []
    merged = [new.pop(row["label"], row) for row in old]
    merged += [row for row in rows if row["label"] in new]
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".jsonl.tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in merged)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class Recorder:
    """The rows of one benchmark run, stamped once: `add(label, **fields)` per measurement,
    `write()` at the end (also after each row, so an interrupted run keeps what it
    measured). `out` defaults to `benchmarks/results/<suite>.jsonl`."""

    def __init__(
        self, suite: str, out: str | None = None, argv: list[str] | None = None, machine=True
    ):
        self.suite, self.path = suite, out or suite_path(suite)
        self.stamped = stamp(argv, machine)
        self.rows: list[dict[str, Any]] = []

    def add(self, label: str, **fields: Any) -> dict[str, Any]:
        row = {"kind": "measurement", "suite": self.suite, "label": label, "time": now()}
        self.rows.append({**row, **fields})
        return self.rows[-1]

    def add_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """A row made elsewhere (`runner.measure_engine`: kind `round`), in this suite."""
        self.rows.append({**row, "suite": self.suite})
        return self.rows[-1]

    def write(self) -> str:
        replace_rows(self.path, finish(self.rows, self.stamped))
        return self.path


def write_rows(path: str, rows: Iterable[dict[str, Any]], append: bool = False) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_rows(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
