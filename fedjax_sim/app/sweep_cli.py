"""`fedjax-sim sweep`: seeds x hyper-parameter grid of one run configuration, as one program.

    fedjax-sim sweep --seeds 10 --grid client_lr=0.01,0.03,0.1 --grid mu=0,0.01 [run flags]

Every `run` flag is accepted (`SweepConfig` extends `cli.RunConfig`); the partition is fixed
by `--seed`, the runs use the keys `seed, seed+1, ..., seed+N-1` (so run 0 of a grid point is
`fedjax-sim run` with the same flags). Writes `summary.csv/.md`, `best.json`, `sweep.png`
(mean +- 95 % CI bands) and every run's history (`histories.json`, `runs.csv`) to `--out`.

Grid names are the numeric run flags that name a concept (`client_lr`, `client_lr_decay`,
`server_lr`, `mu`: `config.ALGORITHM_FLAGS`) and the algorithm's own numeric
hyper-parameters (`momentum`, `rho`, `beta`, ...); the values reach the factory as traced
scalars (`config.algorithm_kwargs` builds everything else).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Collection, Sequence
from typing import Annotated, Any

import tyro

from fedjax_sim.app import validate
from fedjax_sim.app.config import (
    RunConfig,
    algorithm_kwargs,
    build_run,
    hyper_parameters,
    model_kwargs,
    privacy_accounting,
    privacy_record,
    run_factory,
    setup_devices,
)
from fedjax_sim.core.checks import UsageError
from fedjax_sim.runtime import memory

EXIT_INTERRUPTED = 130  # as `fedjax-sim run` (Ctrl-C)

# numeric run flags that may be swept, and the hyper-parameter (concept) each sets
GRID_FLAGS = {
    "client_lr": "client_optimizer",
    "client_lr_decay": "client_optimizer",
    "server_lr": "server_optimizer",
    "mu": "mu",
}


@dataclasses.dataclass
class SweepConfig(RunConfig):
    """Sweep seeds x a hyper-parameter grid of a run as one compiled program."""

    seeds: int = 5
    """Runs per grid point (keys seed, seed+1, ...; the partition stays that of --seed)."""
    grid: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """Repeated: name=v1,v2,... (client_lr, server_lr, mu or any numeric keyword of the
    algorithm, e.g. momentum, beta)."""
    metric: str = "test_accuracy"
    """Metric of the summary table and of the best configuration."""
    at_round: int | None = None
    """Round of the summary (default: the last evaluation)."""
    runs_per_group: int | None = None
    """Runs vmapped together (default: planned from the memory budget)."""
    memory_budget_gb: float | None = None
    """Memory budget of the run planner (default: half the available memory)."""
    out: str = "results/sweep_{algorithm}_{dataset}{settings}"
    """Results folder ({algorithm}, {dataset} and {settings} are filled in, as for run)."""


# ------------------------------------------------------------------------------ the grid
def parse_grid(items: Sequence[str]) -> dict[str, list[float]]:
    """`["client_lr=0.01,0.1", "mu=0"]` -> `{"client_lr": [0.01, 0.1], "mu": [0.0]}`
    (UsageError on a malformed, empty, duplicate or non-numeric entry)."""
    out: dict[str, list[float]] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise UsageError(f"--grid entries must look like name=v1,v2,..., got {item!r}")
        if name in out:
            raise UsageError(f"--grid {name} given twice")
        parts = [p.strip() for p in raw.split(",") if p.strip()]
        if not parts:
            raise UsageError(f"--grid {name} has no values")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise UsageError(f"--grid {name}: values must be numbers, got {raw!r}") from None
        if not all(math.isfinite(v) for v in values):
            raise UsageError(f"--grid {name}: values must be finite, got {raw!r}")
        out[name] = values
    return out


def grid_kwargs(cfg: RunConfig, name: str, value: Any, hparams: dict[str, Any]) -> dict:
    """Factory keyword arguments of grid hyper-parameter `name` = `value` (a float, or a
    traced scalar inside the sweep): a run flag sets its concept as `run` does (`client_lr`
    and `client_lr_decay` together make the client schedule), any other name is the
    algorithm's keyword of that name."""
    from fedjax_sim.algorithms.schedules import round_decay

    if name in ("client_lr", "client_lr_decay"):
        lr = hparams.get("client_lr", cfg.client_lr)
        decay = hparams.get("client_lr_decay", cfg.client_lr_decay)
        if "client_lr_decay" not in hparams and cfg.client_lr_decay == 1.0:
            return {"client_optimizer": lr}
        return {"client_optimizer": round_decay(lr, decay)}
    return {GRID_FLAGS.get(name, name): value}


def check_grid(cfg: RunConfig, grid: dict[str, list[float]]) -> None:
    """UsageError for a name `cfg.algorithm` does not have, a non-numeric hyper-parameter,
    or a value the run command rejects (no compilation; before the data is loaded)."""
    from fedjax_sim import algorithms

    takes = hyper_parameters(run_factory(cfg))
    numeric = {
        n for n, p in takes.items() if isinstance(p.default, int | float) and p.default is not True
    }
    known = sorted((numeric | {f for f, c in GRID_FLAGS.items() if c in takes}) - {"num_clients"})
    everywhere = set(GRID_FLAGS).union(
        takes, *(hyper_parameters(f) for f in algorithms.ALGORITHMS.values())
    )
    for name, values in grid.items():
        concept = GRID_FLAGS.get(name, name)
        if name not in everywhere:
            raise UsageError(f"--grid {name}: unknown hyper-parameter; sweepable: {known}")
        if concept not in takes:
            raise UsageError(
                f"--grid {name}: {cfg.algorithm} does not use it; sweepable: {', '.join(known)}"
            )
        if name not in GRID_FLAGS and name not in known:
            raise UsageError(f"--grid {name}: not a numeric hyper-parameter of {cfg.algorithm}")
        if name in GRID_FLAGS:  # the run command's own checks of that flag (e.g. client_lr > 0)
            for v in values:
                try:
                    validate.check_config(dataclasses.replace(cfg, **{name: v}))
                except UsageError as e:
                    raise UsageError(f"--grid {name}={v:g}: {e}") from None


# ------------------------------------------------------------------------------ building
def build_sweep(
    cfg: RunConfig, grid: dict[str, list[float]], explicit: Collection[str] | None = None
):
    """`(dataset, model, make_algorithm, client_map)`: the run of `cfg` (`config.build_run`)
    whose grid hyper-parameters come from `make_algorithm(hparams)`. Every grid value is
    first built statically, so the factories' own value checks run before compiling."""
    dataset, model, _, client_map = build_run(cfg, None, explicit)
    factory = run_factory(cfg)  # --algorithm's, with --lora-rule's hook
    kwargs = algorithm_kwargs(cfg, explicit, data=dataset.train, client_map=client_map, model=model)
    kwargs = model_kwargs(factory, model, kwargs)

    def make_algorithm(hparams: dict[str, Any]):
        args = dict(kwargs)
        for name, value in hparams.items():
            args.update(grid_kwargs(cfg, name, value, hparams))
        return factory(model.loss, **args)

    for name, values in grid.items():
        for v in values:
            try:
                make_algorithm({name: v})
            except (ValueError, TypeError) as e:
                raise UsageError(f"--grid {name}={v:g}: {e}") from None
    return dataset, model, make_algorithm, client_map


def check_abstract(
    cfg: SweepConfig,
    grid: dict[str, list[float]],
    dataset: Any,
    model: Any,
    make_algorithm: Any,
    client_map: Any,
    private: bool,
) -> None:
    """Checks on the traced shapes of one run (no compilation): the states of all runs fit
    the available memory, and `--metric` / `--at-round` name something the runs record."""
    import jax

    from fedjax_sim.data.federated import tree_size_bytes
    from fedjax_sim.run.simulate import EvalSpec, compiled_evaluator
    from fedjax_sim.runtime.parallel import batched_runs

    key = jax.random.key(0)
    algorithm = make_algorithm({name: values[0] for name, values in grid.items()})
    evaluate = compiled_evaluator(
        model, EvalSpec(every=cfg.eval_every), client_map, dataset.test is not None
    )
    with batched_runs():  # shapes only: no client-map measuring
        params = jax.eval_shape(model.init, key)
        state = jax.eval_shape(algorithm.init, params, key)
        metrics = jax.eval_shape(lambda s: algorithm.step(s, dataset.train, key)[1], state)
        evals = jax.eval_shape(evaluate, params, dataset.train, dataset.test)
    runs = cfg.seeds * math.prod(len(v) for v in grid.values())
    validate.check_memory(
        2 * tree_size_bytes(state),  # the states in and out of a chunk
        runs,
        memory.available_bytes(jax.devices()[0]),
        what=f"--seeds {cfg.seeds} x {runs // cfg.seeds} grid points: ",
        items="runs",
        advice="lower --seeds or the number of grid values",
    )
    validate.check_metric(
        cfg.metric,
        cfg.at_round,
        set(metrics),
        {*evals, *(("epsilon",) if private else ())},
        cfg.rounds,
        cfg.eval_every,
    )


def _check_resume(checkpoint_dir: str) -> None:
    """Refuses `--resume` without a (readable) checkpoint to resume."""
    from fedjax_sim.run.checkpoint import Checkpointer, CheckpointError

    ckpt = Checkpointer(checkpoint_dir)
    try:
        latest = ckpt.latest_round()
    except CheckpointError as e:
        raise UsageError(f"--resume: {e}") from e
    finally:
        ckpt.close()
    if latest is None:
        raise UsageError(f"--resume: no checkpoint in {checkpoint_dir}; start without --resume")


# ------------------------------------------------------------------------------ command
def sweep_command(cfg: SweepConfig, explicit: set[str] | None = None) -> int:
    """`fedjax-sim sweep`: parse and check the grid, build the run, sweep, write results
    (`explicit`: the flags the user set, as for `run`)."""
    out_dir = validate.check_sweep(cfg)
    grid = parse_grid(cfg.grid)
    checkpoint_dir = os.path.join(out_dir, "checkpoints")
    if cfg.resume:
        _check_resume(checkpoint_dir)
    try:
        from fedjax_sim.run.sweep import RUNS_AXIS  # jax imported, no device touched yet

        mesh = setup_devices(cfg, RUNS_AXIS)  # --devices shards the runs axis
        check_grid(cfg, grid)
        dataset, model, make_algorithm, client_map = build_sweep(cfg, grid, explicit)
        privacy = privacy_accounting(cfg, dataset.train.num_clients)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e
    check_abstract(cfg, grid, dataset, model, make_algorithm, client_map, privacy is not None)
    from fedjax_sim.run.loop import Interrupted
    from fedjax_sim.run.simulate import EvalSpec
    from fedjax_sim.run.sweep import expand_grid, sweep

    runs = expand_grid(range(cfg.seed, cfg.seed + cfg.seeds), grid)
    print(
        f"sweep of {cfg.algorithm} on {dataset.name}: {len(runs) // cfg.seeds} grid points x "
        f"{cfg.seeds} seeds = {len(runs)} runs, {cfg.rounds} rounds, results -> {out_dir}",
        flush=True,
    )
    budget = int(cfg.memory_budget_gb * 2**30) if cfg.memory_budget_gb else None
    try:
        result = sweep(
            make_algorithm,
            dataset.train,
            seeds=range(cfg.seed, cfg.seed + cfg.seeds),
            grid=grid,
            model=model,
            num_rounds=cfg.rounds,
            test=dataset.test,
            evaluation=EvalSpec(every=cfg.eval_every),
            client_map=client_map,
            runs_per_group=cfg.runs_per_group,
            memory_budget_bytes=budget,
            mesh=mesh,
            checkpoint_dir=checkpoint_dir if (cfg.checkpoint_every or cfg.resume) else None,
            checkpoint_every=cfg.checkpoint_every,
            resume=cfg.resume,
            progress=cfg.progress,
            meta={
                "config": dataclasses.asdict(cfg),
                "data": dataset.train.summary(),
                **(
                    {}
                    if privacy is None
                    else {
                        "noise_multiplier": privacy.noise_multiplier,
                        "privacy": privacy_record(cfg, privacy),
                    }
                ),
            },
            privacy=None if privacy is None else privacy.epsilon,
        )
    except ValueError as e:
        raise UsageError(str(e)) from e
    except Interrupted as e:
        print(f"\nfedjax-sim: {e.message()}", file=sys.stderr)
        return EXIT_INTERRUPTED
    result.save(out_dir, cfg.metric, cfg.at_round)
    print(result.table(cfg.metric, cfg.at_round), end="")
    best = result.best(cfg.metric, cfg.at_round)
    print(
        f"best: {best['config']} ({cfg.metric} {best['mean']:.4f}, 95% CI "
        f"[{best['ci95_low']:.4f}, {best['ci95_high']:.4f}]) after "
        f"{result.meta['seconds']:.1f} s; results in {out_dir}/"
    )
    if privacy is not None:
        print(
            f"epsilon {privacy.epsilon(cfg.rounds):.4g} at delta {cfg.dp_delta:g} after "
            f"{cfg.rounds} rounds (noise multiplier {privacy.noise_multiplier:.4g})"
        )
    return 0
