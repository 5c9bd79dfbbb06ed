"""`python -m fedjax_sim.app.bench.worker SPEC_JSON`: one measurement in a fresh process.

SPEC: `{"task": "engine" | "loop" | "torch" | "pfl" | "fedjax" | "rounds", "workload":
Workload.describe(), "suite", "label", "repeats", "flops", "peak_n", "torch_threads",
"python" (of a venv peer's venv), "rounds"}`. Prints the
result row as one JSON line; an exception becomes a `skipped` row naming it (e.g. an
algorithm that cannot run on the generic workload).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from fedjax_sim.app.bench import baselines, measure, runner
from fedjax_sim.app.bench.workloads import Workload


def workload_from(d: dict[str, Any]) -> Workload:
    d = dict(d)
    d["hidden"] = tuple(d.get("hidden") or ())
    d["image"] = tuple(d.get("image") or ())
    d["hparams"] = tuple(sorted((d.get("hparams") or {}).items()))
    return Workload(**d)


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    w = workload_from(spec["workload"])
    suite, label = spec.get("suite", "round"), spec.get("label")
    task, repeats = spec["task"], int(spec.get("repeats", 3))
    named: dict[str, Any] = {"label": label} if label else {}
    try:
        named["peak"] = measure.matmul_peak(spec.get("peak_n"))
        if task == "engine":
            return runner.measure_engine(
                w, repeats=repeats, suite=suite, flops=spec.get("flops", True), **named
            )
        if task == "loop":
            return runner.measure_loop(w, repeats=repeats, suite=suite, **named)
        if task == "torch":
            return runner.measure_torch(
                w, repeats=repeats, suite=suite, threads=spec.get("torch_threads"), **named
            )
        if task in baselines.VENV_PEERS:
            return runner.measure_venv_peer(
                task,
                w,
                repeats=repeats,
                suite=suite,
                threads=spec.get("torch_threads"),
                python=spec.get("python"),
                **named,
            )
        if task == "rounds":
            return runner.measure_rounds_memory(
                w, int(spec["rounds"]), suite=suite, peak=named["peak"]
            )
    except Exception as e:  # reported as a skipped configuration, with the reason
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return runner.skipped_row(suite, label or task, w, f"{type(e).__name__}: {first}")
    raise ValueError(f"unknown task {task!r}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    row = run_spec(json.loads(argv[0]))
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
