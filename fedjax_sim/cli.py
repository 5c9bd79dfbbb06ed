"""Command line: `fedjax-sim run | list | bench` (thin: parse a config, call the library).

`fedjax-sim run` with no flags runs the built-in default: FedAvg on scikit-learn digits,
Dirichlet(0.5)-partitioned over 100 clients, an MLP, results under `results/`.
Bad flags or impossible settings print one error line and exit with code 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Literal

import tyro

from fedjax_sim.bench.config import BenchConfig
from fedjax_sim.config import RunConfig, UsageError, build_run, check_config, explicit_fields

EXIT_USAGE = 2


@dataclasses.dataclass
class ListConfig:
    """List registered algorithms, datasets, partitioners and models."""

    what: Literal["all", "algorithms", "datasets", "partitioners", "models"] = "all"


# ------------------------------------------------------------------------------ run
def _setup_devices(cfg: RunConfig):
    """Multi-process initialisation and the client mesh (None for a single device). Must run
    before anything touches a JAX device (virtual CPU devices are an XLA flag)."""
    import jax

    from fedjax_sim import distributed
    from fedjax_sim.parallel import client_mesh

    multi = any(v is not None for v in (cfg.coordinator, cfg.num_processes, cfg.process_id)) or (
        any(os.environ.get(v) for v in distributed.ENV.values())
    )
    if cfg.devices and cfg.devices > 1 and not multi and "JAX_PLATFORMS" not in os.environ:
        os.environ["XLA_FLAGS"] = distributed.host_device_flags(
            cfg.devices, os.environ.get("XLA_FLAGS", "")
        )
    if multi:
        distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id)
    if not multi and not (cfg.devices and cfg.devices > 1):
        return None
    if cfg.devices and cfg.devices > len(jax.devices()):
        raise UsageError(f"--devices {cfg.devices}: only {len(jax.devices())} devices available")
    return client_mesh(cfg.devices)


def run(cfg: RunConfig, explicit: set[str] | None = None) -> int:
    """`fedjax-sim run`; `explicit` names the fields set on the command line or in --config."""
    out_dir = cfg.out.format(algorithm=cfg.algorithm, dataset=cfg.dataset)
    try:
        check_config(cfg)
        mesh = _setup_devices(cfg)
        dataset, model, algorithm, client_map = build_run(cfg, mesh, explicit)
    except (ValueError, TypeError, FileNotFoundError) as e:  # bad settings or missing data
        raise UsageError(str(e)) from e
    import jax

    from fedjax_sim.simulate import EvalSpec, NonFiniteError, simulate

    summary = dataset.train.summary()
    natural = cfg.dataset in ("shakespeare", "fedprox_synthetic", "shifted_minority")
    partition_name = "natural" if natural else cfg.partition
    main_process = jax.process_index() == 0
    if main_process:
        print(
            f"{cfg.algorithm} on {dataset.name}: {summary['num_clients']} clients, "
            f"{summary['num_examples']} training examples, {partition_name} partition, "
            f"model {model.name}, {cfg.rounds} rounds, results -> {out_dir}",
            flush=True,
        )
    try:
        history = simulate(
            algorithm,
            dataset.train,
            jax.random.key(cfg.seed),
            model=model,
            num_rounds=cfg.rounds,
            test=dataset.test,
            evaluation=EvalSpec(every=cfg.eval_every),
            out_dir=out_dir,
            checkpoint_dir=os.path.join(out_dir, "checkpoints")
            if (cfg.checkpoint_every or cfg.resume)
            else None,
            checkpoint_every=cfg.checkpoint_every,
            resume=cfg.resume,
            progress=cfg.progress,
            meta={
                "config": dataclasses.asdict(cfg),
                "data": summary,
                "title": f"{cfg.algorithm} on {dataset.name}",
            },
            client_map=client_map,
            mesh=mesh,
        )
    except NonFiniteError as e:
        print(f"fedjax-sim: error: {e}", file=sys.stderr)
        return 1
    if not main_process:
        return 0
    final = history.final()
    line = f"final test accuracy: {final.get('test_accuracy', float('nan')):.4f}"
    if "client_accuracy_mean" in final:
        line += (
            f" (client mean {final['client_accuracy_mean']:.4f}, "
            f"worst {final['client_accuracy_worst']:.4f})"
        )
    print(
        f"{line} after {history.num_rounds} rounds in {history.meta['seconds']:.1f} s; "
        f"results in {out_dir}/"
    )
    return 0


# ------------------------------------------------------------------------------ list
def list_registered(cfg: ListConfig) -> int:
    from fedjax_sim import algorithms, data, models

    sections: dict[str, list[str]] = {
        "algorithms": [_algorithm_line(n) for n in sorted(algorithms.ALGORITHMS)],
        "datasets": [f"{n:14s} {_first_line(f)}" for n, f in sorted(data.DATASETS.items())]
        + [f"{'tfds:<name>':14s} any tfds catalogue dataset prepared on disk (array_record)"],
        "partitioners": [f"{n:14s} {_first_line(f)}" for n, f in sorted(data.PARTITIONERS.items())],
        "models": [f"{n:14s} {_first_line(f)}" for n, f in sorted(models.MODELS.items())],
    }
    for name, lines in sections.items():
        if cfg.what in ("all", name):
            print(f"{name}:")
            print("\n".join(f"  {line}" for line in lines))
    return 0


def _algorithm_line(name: str) -> str:
    """`name  description` and, indented below, its own hyper-parameters with defaults and
    the common options it takes."""
    from fedjax_sim import algorithms
    from fedjax_sim.algorithms.compose import option_names
    from fedjax_sim.config import hyper_parameters

    factory = algorithms.ALGORITHMS[name]
    params, common = hyper_parameters(factory), option_names(factory)
    own = [
        f"{p.name}=<required>" if p.default is p.empty else f"{p.name}={_short(p.default)}"
        for p in params.values()
        if p.name not in common
    ]
    options = [p for p in params if p in common]
    return (
        f"{name:14s} {algorithms.describe(name)}\n"
        f"{'':16s} hyper-parameters: {', '.join(own) or '-'}\n"
        f"{'':16s} options: {', '.join(options)}"
    )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else type(value).__name__ + "(...)"


def _first_line(obj: Callable) -> str:
    return (obj.__doc__ or "").strip().split("\n")[0]


# ------------------------------------------------------------------------------ bench
def bench(cfg: BenchConfig) -> int:
    from fedjax_sim import algorithms
    from fedjax_sim.bench import suites, workloads

    if cfg.workload not in workloads.PRESETS:
        raise UsageError(
            f"unknown workload {cfg.workload!r}; choose from {sorted(workloads.PRESETS)}"
        )
    if cfg.algorithm is not None and cfg.algorithm not in algorithms.ALGORITHMS:
        raise UsageError(
            f"unknown algorithm {cfg.algorithm!r}; choose from {sorted(algorithms.ALGORITHMS)}"
        )
    for name in cfg.cohort_workloads:
        if name not in workloads.PRESETS:
            raise UsageError(f"unknown cohort workload {name!r}")
    try:
        suites.run(cfg)
    except ValueError as e:
        raise UsageError(str(e)) from e
    return 0


# ------------------------------------------------------------------------------ entry point
COMMANDS: dict[str, tuple[type, Callable[..., int]]] = {
    "run": (RunConfig, run),
    "list": (ListConfig, list_registered),
    "bench": (BenchConfig, bench),
}


def _load_config_file(cls: type, argv: list[str]) -> tuple[object | None, list[str]]:
    """Pops `--config FILE` (JSON with field names as keys) and returns it as defaults."""
    if "--config" not in argv:
        return None, argv
    i = argv.index("--config")
    if i + 1 >= len(argv):
        raise UsageError("--config needs a file path")
    path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
    try:
        with open(path) as f:
            values = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"cannot read config {path}: {e}") from e
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - fields
    if unknown:
        raise UsageError(f"config {path} has unknown keys {sorted(unknown)}")
    for k, v in values.items():
        if isinstance(v, list):
            values[k] = tuple(v)
    return cls(**values), rest


def _flags_given(cls: type, args: Sequence[str]) -> set[str]:
    """Fields of `cls` named by `--flag` / `--flag=value` / `--no-flag` in `args`."""
    fields = {f.name for f in dataclasses.fields(cls)}
    given = set()
    for arg in args:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0].replace("-", "_")
            name = name[3:] if name.startswith("no_") and name[3:] in fields else name
            if name in fields:
                given.add(name)
    return given


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        names = ", ".join(COMMANDS)
        if argv and argv[0] not in ("-h", "--help"):
            print(
                f"fedjax-sim: error: unknown command {argv[0]!r}; choose from {names}",
                file=sys.stderr,
            )
            return EXIT_USAGE
        print(
            f"usage: fedjax-sim {{{names}}} [--help] [options]\n\n"
            "  run    run a federated simulation (default: FedAvg on digits)\n"
            "  list   list algorithms, datasets, partitioners and models\n"
            "  bench  benchmark round throughput (see benchmarks/README.md)"
        )
        return 0 if argv else EXIT_USAGE
    cls, handler = COMMANDS[argv[0]]
    try:
        default, rest = _load_config_file(cls, argv[1:])
        cfg = tyro.cli(cls, args=rest, default=default, prog=f"fedjax-sim {argv[0]}")
        if handler is run:
            from_file = set() if default is None else explicit_fields(default)
            return run(cfg, from_file | _flags_given(cls, rest))
        return handler(cfg)
    except UsageError as e:
        print(f"fedjax-sim: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
