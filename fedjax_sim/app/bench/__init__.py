"""Throughput benchmarks: compile time, seconds/round, client-steps/s, roofline ratio (XLA's
FLOP count of the compiled round over a matmul peak measured in the same run), peak memory,
scaling sweeps, the algorithm kernel table and side-by-side baselines.

- `workloads`: `Workload` (algorithm x model x cohort x local steps x batch) and `PRESETS`.
- `measure`: machine info, `matmul_peak`, `loop_aware_flops`, memory, `time_round`.
- `baselines`: per-client jitted Python loop, PyTorch per-client loop (`TorchFedAvg`), the
  peers run in venvs of their own (`VENV_PEERS`: pfl-research, fedjax 0.0.17).
- `runner`: one measurement -> one result row; `results`: the row schema.
- `suites`: the suites behind `fedjax-sim bench` (isolated processes, memory budget).

Command line: `fedjax-sim bench --suite round baselines --workload W1` (see
`benchmarks/README.md`).
"""

from fedjax_sim.app.bench.config import SUITES, BenchConfig
from fedjax_sim.app.bench.measure import loop_aware_flops, machine_info, matmul_peak
from fedjax_sim.app.bench.results import validate_row
from fedjax_sim.app.bench.workloads import PRESETS, Workload, preset

__all__ = [
    "PRESETS",
    "SUITES",
    "BenchConfig",
    "Workload",
    "loop_aware_flops",
    "machine_info",
    "matmul_peak",
    "preset",
    "validate_row",
]
