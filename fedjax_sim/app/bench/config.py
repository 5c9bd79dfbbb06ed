"""`BenchConfig`: the options of `fedjax-sim bench` (a tyro dataclass)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

Suite = Literal["round", "baselines", "modes", "cohort", "steps", "width", "algorithms", "memory"]
SUITES: tuple[str, ...] = (
    "round",
    "baselines",
    "modes",
    "cohort",
    "steps",
    "width",
    "algorithms",
    "memory",
)


@dataclasses.dataclass
class BenchConfig:
    """Benchmark round throughput: JSON lines + PNG plots + a markdown table under --out."""

    # the venv peers (`bench.baselines.VENV_PEERS`) -> the field naming their venv's python
    VENV_PEER_FLAGS: ClassVar[dict[str, str]] = {"pfl": "pfl_python", "fedjax": "fedjax_python"}

    suite: tuple[Suite, ...] = ("round",)
    """Suites to run: round (one workload), baselines (vs per-client loop and PyTorch),
    modes (vmap vs map(batch_size) vs memory-fitted), cohort (10 -> 10^6 clients), steps
    (local steps), width (MLP widths), algorithms (every registered algorithm vs FedAvg),
    memory (peak memory of 20 vs 200 scanned rounds)."""
    workload: str = "W1"
    """Preset workload (W1, W1-100, LR, cifar_pfl, tiny-mlp, tiny-lr, tiny-cnn); the flags
    below override it."""
    algorithm: str | None = None
    """Registered algorithm (default: the preset's, fedavg)."""
    model: Literal["mlp", "logistic"] | None = None
    """Model of the workload."""
    hidden: tuple[int, ...] | None = None
    """MLP hidden widths."""
    clients: int | None = None
    """Cohort size M (= number of clients; full participation)."""
    local_steps: int | None = None
    """Local steps per client."""
    batch_size: int | None = None
    """Local minibatch size."""
    per_client: int | None = None
    """Examples per client."""
    mode: Literal["preset", "fit", "vmap", "map", "auto"] = "preset"
    """Client map: the preset's, fit (chosen for the memory budget by
    `parallel.fit_client_map`), vmap, map (with --map-batch), auto (`ClientMap("auto")`)."""
    map_batch: int | None = None
    """Clients per chunk in map mode."""
    devices: int | None = None
    """Devices the engine shards the client axis over (CPU: host devices, one per core, set
    in each measurement's process; baselines always run on one device)."""
    hparams: tuple[str, ...] = ()
    """Extra algorithm hyper-parameters key=value (given to factories that accept them)."""
    repeats: int = 3
    """Timed rounds after the first (compiling) one; median and min are reported (>= 3)."""
    cohorts: tuple[int, ...] = (10, 100, 1000, 10_000, 100_000, 1_000_000)
    """Cohort sizes of the cohort sweep (stops at the largest that fits the budget)."""
    cohort_workloads: tuple[str, ...] = ("LR", "W1")
    """Presets swept over cohort sizes (logistic regression and the MLP)."""
    steps_list: tuple[int, ...] = (1, 3, 10, 30, 100)
    """Local steps of the steps sweep."""
    widths: tuple[int, ...] = (50, 100, 200, 400, 800)
    """Hidden width of the two-layer MLP in the width sweep."""
    map_batches: tuple[int, ...] = (1, 2, 5, 8, 16, 32)
    """Chunk sizes of the modes suite."""
    algorithms: tuple[str, ...] = ()
    """Algorithms of the algorithms suite (default: every registered one)."""
    memory_rounds: tuple[int, ...] = (20, 200)
    """Numbers of rounds compared by the memory suite."""
    memory_budget_gb: float | None = None
    """Memory budget of one measurement (default: min(8, half of the available memory));
    larger configurations are skipped, and a measurement is killed at 1.25x the budget."""
    max_round_s: float = 120.0
    """Skip sweep points predicted to take longer than this per round."""
    peak_n: int | None = None
    """Size n of the f32 [n, n] matmul whose rate is the roofline's peak (default: 2048 on
    CPU, 8192 on accelerators)."""
    torch_threads: int | None = None
    """Threads of the PyTorch loop and of pfl-research (default: one row with 1 thread and
    one with torch's default, = cores)."""
    baseline_cohorts: tuple[int, ...] = ()
    """Cohort sizes of the baselines suite: every system at each, the order of the systems
    reversed at every other size (default: the workload's cohort only)."""
    peer_max_cohort: int | None = None
    """Largest cohort at which the PyTorch loop, pfl-research and fedjax run in the baselines
    suite (above it: a skipped row naming this flag; on a GPU the PyTorch loop's time per
    round grows with the cohort while the engine's barely does)."""
    pfl_python: str | None = None
    """Python of the pfl-research venv (default: .venv-pfl/bin/python of the checkout, made
    by benchmarks/peers/pfl_venv.sh; without it the pfl rows are skipped, naming it)."""
    fedjax_python: str | None = None
    """Python of the fedjax 0.0.17 venv (default: .venv-fedjax/bin/python of the checkout,
    made by benchmarks/peers/fedjax_venv.sh; without it the fedjax row is skipped, naming
    it)."""
    competing_threads: int = 0
    """Run every measurement beside one competing job: a NumPy f32 2048^2 matmul loop in its
    own process session (so the scheduler treats it as another user's job) with this many
    BLAS threads, started before the suites and stopped after them; rows carry
    `competing_job`. 0: none (a quiet machine)."""
    isolate: bool = True
    """Run each measurement in its own process (needed for per-measurement peak RSS)."""
    flops: bool = True
    """Count FLOPs with XLA's cost analysis (a few extra compilations per measurement)."""
    plots: bool = True
    """Write a PNG per suite."""
    out: str = "bench_results"
    """Results folder (relative to the current directory): <suite>.jsonl, <suite>.png,
    <suite>.md."""

    def peer_python(self, peer: str) -> str | None:
        """The `--<peer>-python` option of a venv peer (`VENV_PEER_FLAGS`); None: the
        checkout's `.venv-<peer>` (and for any other task)."""
        field = self.VENV_PEER_FLAGS.get(peer)
        return None if field is None else getattr(self, field)
