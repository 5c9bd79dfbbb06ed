"""`sweep`: seeds x hyper-parameter grids as ONE compiled program, runs on a leading axis.

A sweep has R = (grid points) x (seeds) runs. Their states are stacked on a leading runs axis
`[R, ...]` and every round of every run is one `jax.vmap` over runs of the algorithm's pure
`step`, inside the same chunked `lax.scan` over rounds that `simulate` uses; evaluations are
vmapped over runs the same way. Numeric hyper-parameters are `[R]` arrays: the algorithm is
built *inside* the vmap from traced scalars, `make_algorithm({"client_lr": lr, ...})`, so the
factory must accept traced values (optax transformations do; see `abstract_run`).

When R runs do not fit the memory budget, runs are mapped in groups (`lax.map` with
`batch_size=group`, each group vmapped); the group is chosen by `parallel.fit_client_map`
with a per-run working set measured from XLA's buffer assignment of one run's round. Inside
a vmapped group, `ClientMap("auto")` vmaps the cohort too (`parallel.batched_runs`).

With a `mesh` (`runs_mesh(n)`), the runs axis is sharded over its devices (`jax.shard_map`,
DrJAX-style: runs are independent, so no communication); R is padded to a multiple of the
device count with copies of the last run, which are dropped from the results. On a CPU,
`--xla_force_host_platform_device_count` makes each core a device: the runs then proceed
on both cores at once instead of sharing every small op between them.

Run r reproduces `simulate(make_algorithm(hp_r), data, key(seed_r), ...)`: the same keys,
initial model and steps. With `runs_per_group=1` (the unbatched step mapped over runs) the
per-round training metrics are bitwise the single run's; in vmapped groups XLA orders some
reductions of the batched ops differently, so runs equal the single run to float32
round-off (1-3 ulp per round measured), as do the evaluations, which are compiled in
another program (`tests/test_sweep.py`).

Order of runs: grid points in `itertools.product` order of the grid (first name slowest),
seeds innermost: run `r = g * S + s`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fedjax_sim.algorithms.core import Algorithm, float_dtype, tree_all_finite
from fedjax_sim.data.federated import ArrayData, FederatedData, tree_size_bytes
from fedjax_sim.models.base import Model
from fedjax_sim.run.history import History, atomic_write, jsonable
from fedjax_sim.run.loop import RunOptions, chunk_length, run_loop, run_options
from fedjax_sim.run.simulate import INIT_PURPOSE, EvalSpec, compiled_evaluator
from fedjax_sim.runtime.memory import default_budget_bytes
from fedjax_sim.runtime.parallel import ClientMap, batched_runs, client_mesh, fit_client_map

HParams = dict[str, jax.Array]
RUNS_AXIS = "runs"
_PLANS: dict[tuple, int] = {}  # planned run groups of already-checked sweeps
MakeAlgorithm = Callable[[HParams], Algorithm]


# ------------------------------------------------------------------------------ the grid
@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its index r, grid point (`config`, `hparams`, `label`) and seed."""

    index: int
    config: int
    seed: int
    hparams: dict[str, float]
    label: str


def config_label(hparams: Mapping[str, float]) -> str:
    """`"client_lr=0.1,mu=0.01"` (`"default"` for an empty grid)."""
    return ",".join(f"{k}={v:g}" for k, v in hparams.items()) or "default"


def expand_grid(seeds: int | Sequence[int], grid: Mapping[str, Sequence[float]]) -> list[RunSpec]:
    """The runs of `seeds x grid`: grid points in `itertools.product` order (first name
    slowest), seeds innermost. `seeds` is a count (seeds 0..n-1) or explicit seeds.

    Raises ValueError (one line) on an empty seed list or grid entry, duplicate seeds or
    non-numeric values."""
    seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    if not seed_list:
        raise ValueError("a sweep needs at least one seed")
    if len(set(seed_list)) != len(seed_list):
        raise ValueError(f"seeds must be distinct, got {seed_list}")
    values: dict[str, list[float]] = {}
    for name, vs in grid.items():
        vs = list(vs) if not isinstance(vs, (int, float)) else [vs]
        if not vs:
            raise ValueError(f"grid {name!r} has no values")
        try:
            values[name] = [float(v) for v in vs]
        except (TypeError, ValueError):
            raise ValueError(f"grid {name!r} has non-numeric values {vs}") from None
        if not all(math.isfinite(v) for v in values[name]):
            raise ValueError(f"grid {name!r} has non-finite values {vs}")
    runs = []
    for g, point in enumerate(itertools.product(*values.values())):
        hp = dict(zip(values, point, strict=True))
        for seed in seed_list:
            runs.append(RunSpec(len(runs), g, seed, hp, config_label(hp)))
    return runs


def stack_hparams(runs: Sequence[RunSpec]) -> HParams:
    """`{name: [R] float array}` of the runs' grid values."""
    names = list(runs[0].hparams)
    return {n: jnp.asarray([r.hparams[n] for r in runs], float_dtype()) for n in names}


def stack_keys(runs: Sequence[RunSpec]) -> jax.Array:
    """`[R]` run keys, `jax.random.key(seed_r)`."""
    return jax.vmap(jax.random.key)(jnp.asarray([r.seed for r in runs], jnp.uint32))


# ------------------------------------------------------------------------------ mapping runs
def map_runs(fn: Callable[..., Any], xs: Any, group: int) -> Any:
    """`fn` over the leading runs axis of `xs`: one vmap if `group >= R`, else `lax.map` over
    groups of `group` runs (each vmapped; a last partial group is vmapped on its own;
    `group == 1`: a plain `lax.map` of the unbatched step)."""
    num = jax.tree.leaves(xs)[0].shape[0]
    if group == 1 or num == 1:  # the unbatched body: bitwise the single run's computation
        return lax.map(lambda a: fn(*a), xs)
    with batched_runs():
        if group >= num:
            return jax.vmap(fn)(*xs)
        # `lax.map(batch_size=group)`, with explicit shapes: its `reshape(-1, ...)` of the
        # outputs fails on zero-size leaves (e.g. an asynchronous state's empty buffers)
        groups, full = num // group, num // group * group
        head = jax.tree.map(lambda a: a[:full].reshape(groups, group, *a.shape[1:]), xs)
        out = lax.map(lambda a: jax.vmap(fn)(*a), head)
        out = jax.tree.map(lambda a: a.reshape(full, *a.shape[2:]), out)
        if full == num:
            return out
        rest = jax.vmap(fn)(*jax.tree.map(lambda a: a[full:], xs))
        return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out, rest)


def runs_mesh(num_devices: int | None = None) -> Mesh:
    """A 1-D mesh named "runs" over the first `num_devices` devices (all by default)."""
    return client_mesh(num_devices, RUNS_AXIS)


def _over_runs(fn: Callable[..., Any], mesh: Mesh | None, specs: tuple, out_specs: Any):
    """`jit(fn)`, with `fn` run per device on its slice of the runs axis if `mesh` is given
    (`specs`: True for an argument with a leading runs axis, False for a replicated one)."""
    if mesh is None:
        return jax.jit(fn)
    in_specs = tuple(P(RUNS_AXIS) if runs else P() for runs in specs)
    # runs never communicate: no varying-axis typing needed (the algorithms' scans start
    # from replicated constants)
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    )


TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


def abstract_run(
    make_algorithm: MakeAlgorithm,
    model: Model,
    data: FederatedData,
    hparams: Mapping[str, float],
    params: Any = None,
) -> Any:
    """The abstract state of one run, after tracing its `init` and one `step` with traced
    hyper-parameters (shapes only, no compilation). Raises a one-line ValueError naming the
    hyper-parameters if the factory refuses tracers (a Python-level check on a value)."""
    hp = {k: jnp.asarray(v, float_dtype()) for k, v in hparams.items()}
    key = jax.random.key(0)

    def init(hp, key):
        p = params if params is not None else model.init(jax.random.fold_in(key, INIT_PURPOSE))
        return make_algorithm(hp).init(p, key)

    try:  # shapes only: no client-map measuring (`batched_runs`)
        with batched_runs():
            state = jax.eval_shape(init, hp, key)
            jax.eval_shape(lambda s, h, k: make_algorithm(h).step(s, data, k), state, hp, key)
    except TRACER_ERRORS as e:
        first = str(e).strip().split("\n")[0]
        raise ValueError(
            f"the algorithm does not accept traced hyper-parameters {sorted(hparams)}: {first}"
        ) from None
    return state


# ------------------------------------------------------------------------------ compiled parts
@functools.lru_cache(maxsize=16)
def _compiled_init(
    make_algorithm: MakeAlgorithm, model: Model, group: int, has_params: bool, mesh: Mesh | None
):
    def init_one(hp, key, params):
        if not has_params:
            params = model.init(jax.random.fold_in(key, INIT_PURPOSE))
        return make_algorithm(hp).init(params, key)

    def init(hps, keys, params):
        return map_runs(lambda hp, key: init_one(hp, key, params), (hps, keys), group)

    return _over_runs(init, mesh, (True, True, False), P(RUNS_AXIS))


@functools.lru_cache(maxsize=16)
def _compiled_sweep_chunk(
    make_algorithm: MakeAlgorithm, length: int, group: int, mesh: Mesh | None
):
    """`jit(run(states, hps, data, keys, n))`: a `lax.scan` of static `length` over rounds
    whose first `n` iterations advance every run (vmapped / mapped in groups); metrics come
    out as `[length, R, ...]`."""

    def one(state, hp, key, data):
        state, metrics = make_algorithm(hp).step(state, data, key)
        return state, {**metrics, "params_finite": tree_all_finite(state.params)}

    def run(states, hps, data, keys, n):
        def advance(states):
            return map_runs(lambda s, h, k: one(s, h, k, data), (states, hps, keys), group)

        out_shape = jax.eval_shape(advance, states)[1]

        def skip(states):
            return states, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)

        def body(states, i):
            return lax.cond(i < n, advance, skip, states)

        return lax.scan(body, states, jnp.arange(length))

    runs = P(RUNS_AXIS)
    return _over_runs(run, mesh, (True, True, False, True, False), (runs, P(None, RUNS_AXIS)))


@functools.lru_cache(maxsize=16)
def _compiled_sweep_evaluator(
    model: Model,
    spec: EvalSpec,
    client_map: ClientMap,
    has_test: bool,
    group: int,
    mesh: Mesh | None,
):
    evaluate = compiled_evaluator(model, spec, client_map, has_test)

    def run(params, data, test):
        return map_runs(lambda p: evaluate(p, data, test), (params,), group)

    return _over_runs(run, mesh, (True, False, False), P(RUNS_AXIS))


# ------------------------------------------------------------------------------ memory plan
def per_run_bytes(make_algorithm: MakeAlgorithm, state: Any, hp: HParams, data, key) -> int:
    """Working memory of one run's round: XLA's temporaries + outputs of a compiled
    single-run step (abstract shapes; the cohort mapped as inside a vmapped group of runs),
    or 4x the state if XLA gives no memory analysis."""
    one = lambda s, h, k: make_algorithm(h).step(s, data, k)
    try:
        with batched_runs():
            lowered = jax.jit(one).lower(state, hp, key)
        m = lowered.compile().memory_analysis()
        return max(1, int(m.temp_size_in_bytes + m.output_size_in_bytes))
    except Exception:  # backends without memory analysis
        return 4 * max(1, tree_size_bytes(state))


def plan_group(num_runs: int, run_bytes: int, budget_bytes: int) -> int:
    """Runs per vmapped group: `parallel.fit_client_map` with runs in place of clients."""
    try:
        cmap = fit_client_map(num_runs, run_bytes, budget_bytes)
    except ValueError as e:
        raise ValueError(f"sweep: {e} (per run)") from None
    return num_runs if cmap.mode == "vmap" else int(cmap.batch_size)


# ------------------------------------------------------------------------------ results
@dataclasses.dataclass
class SweepResult:
    """Per-run histories of a sweep (`histories[r]` is run `runs[r]`) with summaries."""

    runs: list[RunSpec]
    histories: list[History]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    states: Any = None  # the final `[R, ...]` states (not saved)

    @property
    def configs(self) -> list[str]:
        """Grid-point labels in run order (each once)."""
        return list(dict.fromkeys(r.label for r in self.runs))

    def values(self, metric: str, round_: int | None = None) -> np.ndarray:
        """`[R]` value of `metric` at `round_` in each run: an evaluation metric (default
        round: the last evaluation) or a per-round metric (default: the last round)."""
        out = []
        for h in self.histories:
            rows = [e for e in h.evals if metric in e]
            if rows:
                rows = [e for e in rows if round_ is None or e["round"] == round_]
                if not rows:
                    raise ValueError(f"no evaluation of {metric!r} at round {round_}")
                out.append(rows[-1][metric])
            elif metric in h.metrics:
                i = -1 if round_ is None else h.rounds.index(round_)
                out.append(float(np.asarray(h.metrics[metric][i])))
            else:
                raise ValueError(f"unknown metric {metric!r}")
        return np.asarray(out, np.float64)

    def summary(self, metric: str = "test_accuracy", round_: int | None = None) -> list[dict]:
        """One row per grid point: `n`, `mean`, `std` (ddof 1), `ci95_low/high` (Student t
        over seeds; NaN half-width for a single seed)."""
        vals = self.values(metric, round_)
        rows = []
        for label in self.configs:
            idx = [r.index for r in self.runs if r.label == label]
            v = vals[idx]
            mean, half, std = mean_ci(v)
            hp = self.runs[idx[0]].hparams
            rows.append(
                {
                    "config": label,
                    **hp,
                    "metric": metric,
                    "round": round_,
                    "n": len(v),
                    "mean": mean,
                    "std": std,
                    "ci95_low": mean - half,
                    "ci95_high": mean + half,
                }
            )
        return rows

    def best(
        self, metric: str = "test_accuracy", round_: int | None = None, mode: str | None = None
    ) -> dict:
        """The summary row of the best grid point by mean `metric` (mode "max", or "min";
        default "min" for metrics named *loss*)."""
        mode = mode or ("min" if "loss" in metric else "max")
        rows = self.summary(metric, round_)
        pick = max if mode == "max" else min
        return pick(rows, key=lambda row: row["mean"])

    def bands(self, metric: str = "test_accuracy") -> dict[str, tuple[np.ndarray, ...]]:
        """`{config: (rounds, mean, ci_low, ci_high)}` of an evaluation metric over rounds."""
        out = {}
        for label in self.configs:
            hs = [self.histories[r.index] for r in self.runs if r.label == label]
            series = [h.eval_series(metric) for h in hs]
            rounds = series[0][0]
            v = np.stack([s[1] for s in series])  # [S, T]
            stats = [mean_ci(v[:, t]) for t in range(v.shape[1])]
            mean = np.array([s[0] for s in stats])
            half = np.nan_to_num(np.array([s[1] for s in stats]))
            out[label] = (rounds, mean, mean - half, mean + half)
        return out

    def plot(self, path: str | None = None, metric: str = "test_accuracy", ax: Any = None):
        """Mean +- 95 % CI band of `metric` per grid point over rounds (matplotlib)."""
        import matplotlib

        if path is not None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = None
        if ax is None:
            fig, ax = plt.subplots(figsize=(7, 4))
        for label, (rounds, mean, lo, hi) in self.bands(metric).items():
            (line,) = ax.plot(rounds, mean, lw=1.5, label=label)
            ax.fill_between(rounds, lo, hi, color=line.get_color(), alpha=0.2)
        n = len(self.runs) // max(1, len(self.configs))
        ax.set(xlabel="round", ylabel=metric, title=f"{metric}: mean and 95% CI over {n} seeds")
        ax.legend(fontsize=8)
        if path is not None and fig is not None:
            fig.tight_layout()
            fig.savefig(path, dpi=110)
            plt.close(fig)
        return ax

    def table(self, metric: str = "test_accuracy", round_: int | None = None) -> str:
        """The summary as a markdown table."""
        rows = self.summary(metric, round_)
        head = f"| config | n | mean {metric} | std | 95% CI |\n|---|---:|---:|---:|---|\n"
        return head + "".join(
            f"| {r['config']} | {r['n']} | {r['mean']:.4f} | {r['std']:.4f} | "
            f"[{r['ci95_low']:.4f}, {r['ci95_high']:.4f}] |\n"
            for r in rows
        )

    def to_dict(self) -> dict[str, Any]:
        return jsonable(
            {
                "meta": self.meta,
                "runs": [
                    {**dataclasses.asdict(r), "history": h.to_dict()}
                    for r, h in zip(self.runs, self.histories, strict=True)
                ],
            }
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SweepResult:
        runs = [
            RunSpec(r["index"], r["config"], r["seed"], r["hparams"], r["label"]) for r in d["runs"]
        ]
        return cls(runs, [History.from_dict(r["history"]) for r in d["runs"]], dict(d["meta"]))

    def runs_csv(self) -> str:
        """Per-run histories in one CSV: `run, config, seed, <hparams>`, then each run's
        `History.to_csv` columns."""
        names = list(self.runs[0].hparams) if self.runs else []
        lines: list[str] = []
        for r, h in zip(self.runs, self.histories, strict=True):
            body = h.to_csv().splitlines()
            if not lines:
                lines.append(",".join(["run", "config", "seed", *names, body[0]]))
            prefix = ",".join(
                [str(r.index), f'"{r.label}"', str(r.seed), *(f"{r.hparams[n]:g}" for n in names)]
            )
            lines.extend(f"{prefix},{row}" for row in body[1:])
        return "\n".join(lines) + "\n"

    def save(
        self,
        out_dir: str,
        metric: str = "test_accuracy",
        round_: int | None = None,
        plot: bool = True,
    ) -> dict[str, str]:
        """Writes `histories.json` (every run), `runs.csv`, `summary.csv`, `summary.md`,
        `best.json` and (if `plot`) `sweep.png` under `out_dir`."""
        os.makedirs(out_dir, exist_ok=True)
        p = {
            k: os.path.join(out_dir, f)
            for k, f in [
                ("json", "histories.json"),
                ("csv", "runs.csv"),
                ("summary", "summary.csv"),
                ("md", "summary.md"),
                ("best", "best.json"),
            ]
        }
        atomic_write(p["json"], json.dumps(self.to_dict()))
        atomic_write(p["csv"], self.runs_csv())
        has_metric = any(metric in e for e in (self.histories[0].evals if self.histories else []))
        if has_metric or (self.histories and metric in self.histories[0].metrics):
            rows = self.summary(metric, round_)
            cols = list(rows[0])
            text = (
                ",".join(cols)
                + "\n"
                + "".join(
                    ",".join(f'"{row[c]}"' if c == "config" else str(row[c]) for c in cols) + "\n"
                    for row in rows
                )
            )
            atomic_write(p["summary"], text)
            atomic_write(p["md"], self.table(metric, round_))
            atomic_write(p["best"], json.dumps(jsonable(self.best(metric, round_)), indent=1))
            if plot and has_metric:
                p["png"] = os.path.join(out_dir, "sweep.png")
                self.plot(p["png"], metric)
        return p


def mean_ci(values: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """`(mean, CI half-width, std)` of `values` with Student's t (ddof 1)."""
    from scipy import stats

    v = np.asarray(values, np.float64)
    n = v.size
    mean = float(v.mean())
    if n < 2:
        return mean, float("nan"), 0.0
    std = float(v.std(ddof=1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1) * std / math.sqrt(n))
    return mean, half, std


# ------------------------------------------------------------------------------ runner
def sweep(
    make_algorithm: MakeAlgorithm,
    data: FederatedData,
    *,
    seeds: int | Sequence[int],
    grid: Mapping[str, Sequence[float]] | None = None,
    model: Model,
    num_rounds: int,
    test: ArrayData | None = None,
    params: Any = None,
    evaluation: EvalSpec = EvalSpec(),
    client_map: ClientMap = ClientMap(),
    runs_per_group: int | None = None,
    memory_budget_bytes: int | None = None,
    mesh: Mesh | None = None,
    meta: dict[str, Any] | None = None,
    **options: Unpack[RunOptions],
) -> SweepResult:
    """Runs R = |grid points| x |seeds| runs as one compiled program; see the module doc.

    Args:
      make_algorithm: `hparams -> Algorithm`, called inside the vmap over runs with
        `{name: traced scalar}` for every grid name (an empty dict for a seeds-only sweep).
        It must be the same object across calls to reuse the compilation.
      data, model, num_rounds, test, params, evaluation, client_map: as in `simulate`
        (every run uses the same data; run r's key is `jax.random.key(seed_r)`).
      seeds: a count n (seeds 0..n-1) or the seeds themselves.
      grid: `{name: values}` of numeric hyper-parameters (their product is swept).
      runs_per_group: runs vmapped together (the rest are `lax.map`-ed in groups); default:
        planned from `memory_budget_bytes` (default `memory.default_budget_bytes`) by
        `parallel.fit_client_map` (per device with a `mesh`).
      mesh: shard the runs over this mesh's devices (`runs_mesh`; axis "runs"); None: one
        device.
      **options: `RunOptions`, as in `simulate`: `out_dir` receives the results
        (`SweepResult.save`) at the end; checkpoints hold all runs' states and histories
        (resuming is bit-identical and refuses a checkpoint of other seeds or grid points);
        the progress bar counts rounds x runs; `privacy` adds `epsilon` to every run's
        evaluation rows (the runs of a sweep share the privacy parameters: only the seeds
        and numeric grid values differ).

    Returns the `SweepResult` (histories per run; a run whose model became NaN/Inf keeps
    running and has `meta["nonfinite_round"]` set, the other runs are unaffected).
    """
    options = run_options("sweep", options, num_rounds, evaluation.every)
    if evaluation.personal:
        raise ValueError(
            "a sweep evaluates its runs' global models: personal models are evaluated by "
            "simulate (one run)"
        )
    if runs_per_group is not None and runs_per_group < 1:
        raise ValueError(f"runs_per_group must be >= 1, got {runs_per_group}")
    runs = expand_grid(seeds, dict(grid or {}))
    num = len(runs)
    if mesh is not None and RUNS_AXIS not in mesh.axis_names:
        raise ValueError(f"the sweep's mesh needs an axis named {RUNS_AXIS!r}: runs_mesh(n)")
    shards = 1 if mesh is None else int(mesh.shape[RUNS_AXIS])
    padded = runs + [runs[-1]] * (-num % shards)  # copies of the last run, dropped at the end
    hps, keys = stack_hparams(padded), stack_keys(padded)
    budget = memory_budget_bytes or default_budget_bytes(jax.devices()[0])
    sig = (
        make_algorithm,
        model,
        num,
        tuple(runs[0].hparams),
        params is not None,
        str(jax.tree.map(lambda a: (a.shape, a.dtype), data)),
        runs_per_group,
        memory_budget_bytes,  # the default budget (available memory) varies: not keyed
        shards,
    )
    if sig not in _PLANS:  # trace once (one-line error for untraceable factories), plan
        one = abstract_run(make_algorithm, model, data, runs[0].hparams, params)
        if runs_per_group is None:
            resident = 2 * num * tree_size_bytes(one) + tree_size_bytes(data)
            hp0 = {k: v[0] for k, v in hps.items()}
            run_bytes = per_run_bytes(make_algorithm, one, hp0, data, keys[0])
            _PLANS[sig] = plan_group(len(padded) // shards, run_bytes, budget - resident)
        else:
            _PLANS[sig] = min(runs_per_group, len(padded) // shards)
    group = _PLANS[sig]

    init = _compiled_init(make_algorithm, model, group, params is not None, mesh)
    states = init(hps, keys, params)
    metas = [
        {**(meta or {}), "seed": r.seed, "hparams": r.hparams, "label": r.label, "run": r.index}
        for r in runs
    ]
    chunk = chunk_length(num_rounds, evaluation.every, options["checkpoint_every"])
    source = _SweepChunks(
        _compiled_sweep_chunk(make_algorithm, chunk, group, mesh),
        _compiled_sweep_evaluator(model, evaluation, client_map, test is not None, group, mesh),
        hps,
        keys,
        data,
        test,
        num,
        _models_of(make_algorithm, runs[0].hparams),
    )
    t0 = time.perf_counter()
    histories, states = run_loop(
        source,
        states,
        source.saved(keys),
        metas,
        num_rounds=num_rounds,
        every=evaluation.every,
        options={**options, "out_dir": None},  # saved below, all runs at once
        nonfinite="mark",
    )
    seconds = time.perf_counter() - t0
    result = SweepResult(
        runs,
        histories,
        {
            **(meta or {}),
            "seconds": seconds,
            "runs_per_group": group,
            "num_runs": num,
            "num_rounds": num_rounds,
            "devices": shards,
        },
        source.saved(states),
    )
    if options["out_dir"]:
        result.save(options["out_dir"])
    return result


def _models_of(make_algorithm: MakeAlgorithm, hp: HParams) -> Callable[..., Any] | None:
    """`(states, hps) -> each run's global model` where the algorithm declares one
    (`Algorithm.model`); None: the runs' `states.params`."""
    if make_algorithm(hp).model is None:
        return None
    return jax.jit(jax.vmap(lambda state, h: make_algorithm(h).model(state)))


@dataclasses.dataclass(frozen=True)
class _SweepChunks:
    """`sweep`'s chunks: every run's rounds at once; `num` real runs, then the mesh's
    padding copies of the last run (neither checkpointed nor reported)."""

    run_chunk: Callable[..., Any]
    evaluator: Callable[..., Any]
    hps: HParams
    keys: jax.Array
    data: FederatedData
    test: ArrayData | None
    num: int
    models_of: Callable[[Any, HParams], Any] | None = None  # `Algorithm.model` of each run

    def run(self, states: Any, start: int, stop: int) -> tuple[Any, list[dict[str, np.ndarray]]]:
        states, metrics = self.run_chunk(states, self.hps, self.data, self.keys, stop - start)
        metrics = jax.tree.map(lambda m: np.asarray(m[: stop - start]), jax.device_get(metrics))
        return states, [{k: v[:, i] for k, v in metrics.items()} for i in range(self.num)]

    def evaluate(self, states: Any) -> list[dict[str, float]]:
        params = states.params if self.models_of is None else self.models_of(states, self.hps)
        results = jax.device_get(self.evaluator(params, self.data, self.test))
        return [{k: float(v[i]) for k, v in results.items()} for i in range(self.num)]

    def saved(self, states: Any) -> Any:
        return jax.tree.map(lambda a: a[: self.num], states)

    def restored(self, tree: Any) -> Any:
        pad = self.keys.shape[0] - self.num
        return jax.tree.map(lambda a: jnp.concatenate([a, a[-1:].repeat(pad, 0)]), tree)
