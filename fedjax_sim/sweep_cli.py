"""`fedjax-sim sweep`: seeds x hyper-parameter grid of one run configuration, as one program.

    fedjax-sim sweep --seeds 10 --grid client_lr=0.01,0.03,0.1 --grid mu=0,0.01 [run flags]

Every `run` flag is accepted (`SweepConfig` extends `cli.RunConfig`); the partition is fixed
by `--seed`, the runs use the keys `seed, seed+1, ..., seed+N-1` (so run 0 of a grid point is
`fedjax-sim run` with the same flags). Writes `summary.csv/.md`, `best.json`, `sweep.png`
(mean +- 95 % CI bands) and every run's history (`histories.json`, `runs.csv`) to `--out`.

To be wired by the algorithm layer (issue 18): register `"sweep": (SweepConfig,
sweep_command)` in `cli.COMMANDS`, and replace `grid_kwargs` (grid name -> factory keyword
arguments) by the config module's mapping. Until then `python -m fedjax_sim.sweep_cli ...`
runs it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Annotated, Any
from unittest import mock

import tyro

from fedjax_sim.cli import EXIT_USAGE, RunConfig, UsageError, _check_config, build_run

# grid names understood besides the factories' own keyword arguments
RUN_FLAG_NAMES = ("client_lr", "server_lr")


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
    out: str = "results/sweep_{algorithm}_{dataset}"
    """Results folder ({algorithm} and {dataset} are filled in)."""


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


def grid_kwargs(cfg: RunConfig, name: str, value: Any) -> dict[str, Any]:
    """Factory keyword arguments of grid hyper-parameter `name` = `value` (a float, or a
    traced scalar inside the sweep). THE mapping to replace by the config module: the CLI's
    `client_lr`/`server_lr` become SGD optimizers (optax accepts traced rates), every other
    name is passed as the factory keyword of that name."""
    import optax

    from fedjax_sim.schedules import client_sgd, round_decay

    if name == "client_lr":
        if cfg.client_lr_decay != 1.0:
            lr = round_decay(value, cfg.client_lr_decay)
            return {"client_optimizer": client_sgd(lr), "client_lr": lr, "learning_rate": value}
        return {"client_optimizer": optax.sgd(value), "client_lr": value, "learning_rate": value}
    if name == "server_lr":
        return {"server_optimizer": optax.sgd(value), "server_lr": value}
    return {name: value}


def _known_names() -> set[str]:
    """Grid names: the CLI's rates and every numeric keyword of a registered factory."""
    import inspect

    from fedjax_sim import algorithms

    names = set(RUN_FLAG_NAMES)
    for factory in algorithms.ALGORITHMS.values():
        for p in inspect.signature(factory).parameters.values():
            d = p.default
            if isinstance(d, (int, float)) and not isinstance(d, bool):
                names.add(p.name)
    return names


def check_grid(cfg: RunConfig, grid: dict[str, list[float]]) -> None:
    """UsageError for a name no algorithm knows, one `cfg.algorithm` does not use, or a
    value the run command rejects (no compilation; run before the data is loaded)."""
    from fedjax_sim import algorithms

    if cfg.algorithm not in algorithms.ALGORITHMS:
        return  # reported by the run checks
    known, accepted = _known_names(), algorithms.accepted_kwargs(cfg.algorithm)
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    for name, values in grid.items():
        if name not in known:
            raise UsageError(f"--grid {name}: unknown hyper-parameter; choose from {sorted(known)}")
        used = set(grid_kwargs(cfg, name, values[0]))
        if accepted is not None and not used & accepted:
            raise UsageError(
                f"--grid {name}: {cfg.algorithm} does not use it; it takes {sorted(accepted)}"
            )
        if name in fields:  # the run command's own checks of that flag (e.g. client_lr > 0)
            for v in values:
                try:
                    _check_config(dataclasses.replace(cfg, **{name: v}))
                except UsageError as e:
                    raise UsageError(f"--grid {name}={v:g}: {e}") from None


# ------------------------------------------------------------------------------ building
def build_sweep(cfg: RunConfig, grid: dict[str, list[float]], mesh=None):
    """`(dataset, model, make_algorithm, client_map)`: the run of `cfg` (built by
    `cli.build_run`) whose grid hyper-parameters come from `make_algorithm(hparams)`.
    Every grid value is first built statically, so the factories' own value checks run."""
    from fedjax_sim import algorithms

    captured: dict[str, Any] = {}
    real_build = algorithms.build

    def capture(name: str, loss_fn: Callable, **kwargs: Any):
        captured.update(kwargs)
        return real_build(name, loss_fn, **kwargs)

    with mock.patch.object(algorithms, "build", capture):
        dataset, model, _, client_map = build_run(cfg, mesh)

    def make_algorithm(hparams: dict[str, Any]):
        kwargs = dict(captured)
        for name, value in hparams.items():
            kwargs.update(grid_kwargs(cfg, name, value))
        return real_build(cfg.algorithm, model.loss, **kwargs)

    for name, values in grid.items():
        for v in values:
            try:
                make_algorithm({name: v})
            except (ValueError, TypeError) as e:
                raise UsageError(f"--grid {name}={v:g}: {e}") from None
    return dataset, model, make_algorithm, client_map


# ------------------------------------------------------------------------------ command
def sweep_command(cfg: SweepConfig) -> int:
    """`fedjax-sim sweep`: parse and check the grid, build the run, sweep, write results."""
    out_dir = cfg.out.format(algorithm=cfg.algorithm, dataset=cfg.dataset)
    grid = parse_grid(cfg.grid)
    if cfg.seeds < 1:
        raise UsageError(f"--seeds must be >= 1, got {cfg.seeds}")
    if cfg.runs_per_group is not None and cfg.runs_per_group < 1:
        raise UsageError(f"--runs-per-group must be >= 1, got {cfg.runs_per_group}")
    if cfg.devices is not None or cfg.coordinator is not None:
        raise UsageError("sweep runs on one device; drop --devices / multi-process flags")
    try:
        _check_config(cfg)
        check_grid(cfg, grid)
        dataset, model, make_algorithm, client_map = build_sweep(cfg, grid)
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e
    from fedjax_sim.simulate import EvalSpec
    from fedjax_sim.sweep import expand_grid, sweep

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
            checkpoint_dir=os.path.join(out_dir, "checkpoints")
            if (cfg.checkpoint_every or cfg.resume)
            else None,
            checkpoint_every=cfg.checkpoint_every,
            resume=cfg.resume,
            progress=cfg.progress,
            meta={"config": dataclasses.asdict(cfg), "data": dataset.train.summary()},
        )
        result.values(cfg.metric, cfg.at_round)  # a bad --metric / --at-round: one line
    except ValueError as e:
        raise UsageError(str(e)) from e
    result.save(out_dir, cfg.metric, cfg.at_round)
    print(result.table(cfg.metric, cfg.at_round), end="")
    best = result.best(cfg.metric, cfg.at_round)
    print(
        f"best: {best['config']} ({cfg.metric} {best['mean']:.4f}, 95% CI "
        f"[{best['ci95_low']:.4f}, {best['ci95_high']:.4f}]) after "
        f"{result.meta['seconds']:.1f} s; results in {out_dir}/"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fedjax_sim.sweep_cli [flags]` (until `sweep` is registered in the CLI)."""
    try:
        cfg = tyro.cli(
            SweepConfig, args=list(sys.argv[1:] if argv is None else argv), prog="fedjax-sim sweep"
        )
        return sweep_command(cfg)
    except UsageError as e:
        print(f"fedjax-sim: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
