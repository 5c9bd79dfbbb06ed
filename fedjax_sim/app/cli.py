"""Command line: `fedjax-sim run | list | bench` (thin: parse a config, call the library).

`fedjax-sim run` with no flags runs the built-in default: FedAvg on scikit-learn digits,
Dirichlet(0.5)-partitioned over 100 clients, an MLP, results under `results/`.
Bad flags or impossible settings print one error line and exit with code 2.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Literal

import tyro

from fedjax_sim.app import validate
from fedjax_sim.app.bench.config import BenchConfig
from fedjax_sim.app.config import (
    RunConfig,
    build_run,
    build_streamed_run,
    check_stream,
    device_summary,
    explicit_fields,
    lora_summary,
    parse_hparams,
    privacy_accounting,
    privacy_record,
    setup_devices,
    stream_flag,
)
from fedjax_sim.app.sweep_cli import EXIT_INTERRUPTED, SweepConfig, sweep_command
from fedjax_sim.core import extras
from fedjax_sim.core.checks import UsageError, config_diff
from fedjax_sim.runtime import autotune, memory

EXIT_USAGE = 2


@dataclasses.dataclass
class ListConfig:
    """List registered algorithms, datasets, partitioners and models."""

    what: Literal["all", "algorithms", "datasets", "partitioners", "models"] = "all"


# ------------------------------------------------------------------------------ run
def run(cfg: RunConfig, explicit: set[str] | None = None) -> int:
    """`fedjax-sim run`; `explicit` names the fields set on the command line or in --config
    (default: those that differ from the defaults). With `--client-store` / `--population`
    the population is streamed (`simulate_streamed`), else loaded on device (`simulate`):
    the same checks, results, checkpoints, resume, Ctrl-C and privacy accounting."""
    explicit = explicit_fields(cfg) if explicit is None else set(explicit)
    cfg = check_stream(cfg, explicit)  # a streamed population's checks (no JAX)
    out_dir = validate.check_run(cfg)  # every generic check; nothing created
    checkpoint_dir = os.path.join(out_dir, "checkpoints")
    resume_round = _check_resume(cfg, checkpoint_dir)
    streamed = stream_flag(cfg) is not None
    try:
        mesh = setup_devices(cfg)
        if streamed:
            source, test, model, algorithm, plan = build_streamed_run(cfg, explicit)
        else:
            dataset, model, algorithm, client_map = build_run(cfg, mesh, explicit)
            test = dataset.test
        privacy = privacy_accounting(
            cfg, cfg.num_clients if streamed else dataset.train.num_clients
        )
    except UsageError:
        raise
    except (ValueError, TypeError, FileNotFoundError) as e:  # bad settings or missing data
        raise UsageError(str(e)) from e
    import jax

    from fedjax_sim.run.checkpoint import CheckpointError
    from fedjax_sim.run.loop import Interrupted, NonFiniteError
    from fedjax_sim.run.simulate import EvalSpec, simulate

    if streamed:
        from fedjax_sim.run.streaming import simulate_streamed

        name = validate.data_name(cfg)
        summary = _stream_summary(source, plan)
        setting = f"streamed ({cfg.state_rows} state rows)"
        driver = functools.partial(
            simulate_streamed,
            algorithm,
            source,
            plan=plan,
            state_rows=cfg.state_rows,
            rows_dir=cfg.rows_dir,
        )
        evaluation = EvalSpec(every=cfg.eval_every, clients=False)  # central test set only
    else:
        _check_loaded(cfg, dataset, model, client_map, mesh)
        name, summary = dataset.name, dataset.train.summary()
        natural = cfg.dataset in (
            "shakespeare",
            "fedprox_synthetic",
            "shifted_minority",
            "markov_tokens",
        )
        setting = f"{'natural' if natural else cfg.partition} partition"
        if cfg.personal_eval:
            setting += ", personal models evaluated"
        if cfg.unseen_clients:
            setting += f", {cfg.unseen_clients} unseen clients ({cfg.unseen_steps} steps)"
        driver = functools.partial(
            simulate,
            algorithm,
            dataset.train,
            client_map=client_map,
            mesh=mesh,
            unseen=dataset.unseen,
        )
        evaluation = EvalSpec(
            every=cfg.eval_every,
            personal=cfg.personal_eval,
            unseen_steps=cfg.unseen_steps,
            unseen_lr=cfg.client_lr,
            unseen_batch_size=cfg.batch_size,
        )
    for words in (lora_summary(cfg, model), device_summary(cfg)):
        if words:
            setting += f", {words}"
    main_process = jax.process_index() == 0
    if main_process:
        print(
            f"{cfg.algorithm} on {name}: {summary['num_clients']} clients, "
            f"{summary['num_examples']} training examples, {setting}, "
            f"model {model.name}, {cfg.rounds} rounds, results -> {out_dir}",
            flush=True,
        )
    try:
        history = driver(
            key=jax.random.key(cfg.seed),
            model=model,
            num_rounds=cfg.rounds,
            test=test,
            evaluation=evaluation,
            out_dir=out_dir,
            checkpoint_dir=checkpoint_dir,  # always: Ctrl-C saves a checkpoint
            checkpoint_every=cfg.checkpoint_every,
            resume=resume_round is not None,
            on_resume=lambda r: (
                main_process and print(f"resumed from round {r} ({checkpoint_dir}/{r})", flush=True)
            ),
            progress=cfg.progress,
            meta={
                "config": dataclasses.asdict(cfg),
                "data": summary,
                "title": f"{cfg.algorithm} on {name}",
                **({} if privacy is None else {"privacy": privacy_record(cfg, privacy)}),
            },
            privacy=None if privacy is None else privacy.epsilon,
        )
    except NonFiniteError as e:
        print(f"fedjax-sim: error: {e}", file=sys.stderr)
        return 1
    except CheckpointError as e:
        raise UsageError(f"--resume: {e}") from e
    except Interrupted as e:
        if main_process:
            print(f"\nfedjax-sim: {e.message()}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if not main_process:
        return 0
    warning = validate.divergence_message(history.metrics.get("train_loss", []))
    if warning:
        print(f"fedjax-sim: warning: {warning}", file=sys.stderr)
    final = history.final()
    if test is None:  # a client store: no central test set
        loss = history.metrics.get("train_loss", [float("nan")])
        line = f"final training loss: {float(loss[-1]):.4f} (no central test set)"
    else:
        line = f"final test accuracy: {final.get('test_accuracy', float('nan')):.4f}"
    if "client_accuracy_mean" in final and math.isfinite(final["client_accuracy_worst"]):
        line += (
            f" (client mean {final['client_accuracy_mean']:.4f}, "
            f"worst {final['client_accuracy_worst']:.4f})"
        )
    if "personal_accuracy_mean" in final and math.isfinite(final["personal_accuracy_worst"]):
        line += (
            f"; personal models: mean {final['personal_accuracy_mean']:.4f}, 10th pct. "
            f"{final['personal_accuracy_p10']:.4f}, worst {final['personal_accuracy_worst']:.4f}"
        )
    if "unseen_accuracy_mean" in final:
        line += (
            f"; unseen clients after {cfg.unseen_steps} steps: mean "
            f"{final['unseen_accuracy_mean']:.4f}"
        )
    if "epsilon" in final:
        line += (
            f"; epsilon {final['epsilon']:.4g} at delta {cfg.dp_delta:g} (noise multiplier "
            f"{privacy.noise_multiplier:.4g})"
        )
    if "virtual_time" in history.metrics and len(history.metrics["virtual_time"]):
        hours = float(history.metric("virtual_time")[-1]) / 3600.0
        line += f"; {hours:.4g} virtual hours"
    mode = history.meta.get("client_map")
    print(
        f"{line} after {history.num_rounds} rounds in {history.meta['seconds']:.1f} s"
        f"{f' (client map {mode})' if mode else ''}; results in {out_dir}/"
    )
    return 0


def _stream_summary(source, plan) -> dict[str, object]:
    """`history.meta["data"]` of a streamed population (as `FederatedData.summary`)."""
    import numpy as np

    counts = np.asarray(plan.counts)
    return {
        "num_clients": int(counts.size),
        "num_examples": int(counts.sum()),
        "max_count": int(source.max_count),
        "min_count": int(counts.min()),
        "mean_count": float(counts.mean()),
        "empty_clients": int((counts == 0).sum()),
        "num_classes": int(source.num_classes),
    }


def _report_measured(choice: autotune.Choice) -> None:
    """One line on stderr (process 0, above the progress bar) for each `ClientMap("auto")`
    measured now."""
    import jax
    from tqdm.auto import tqdm

    if choice.measured_seconds is None or jax.process_index() != 0:
        return
    mode = "vmap" if choice.mode == "vmap" else f"map:{choice.batch_size}"
    tqdm.write(
        f"fedjax-sim: ClientMap('auto') timed the modes for {choice.num} clients in "
        f"{choice.measured_seconds:.1f} s (once per machine): {mode}",
        file=sys.stderr,
    )


def _check_resume(cfg: RunConfig, checkpoint_dir: str) -> int | None:
    """The round to resume from (None: start at 0). Refuses `--resume` without a checkpoint
    or with settings that differ from the checkpoint's, an unreadable checkpoint, and a fresh
    start over an interrupted run's checkpoint (it would be replaced)."""
    from fedjax_sim.run.checkpoint import Checkpointer, CheckpointError

    ckpt = Checkpointer(checkpoint_dir)
    flag = "--resume" if cfg.resume else "--resume-or-start"
    try:
        latest = ckpt.latest_round()
        if latest is None:
            if cfg.resume:
                raise UsageError(
                    f"--resume: no checkpoint in {checkpoint_dir}; start without --resume "
                    "(or use --resume-or-start)"
                )
            return None
        saved = ckpt.read_history(latest).get("meta", {}).get("config")
    except CheckpointError as e:
        raise UsageError(f"{flag if cfg.resume or cfg.resume_or_start else '--out'}: {e}") from e
    finally:
        ckpt.close()
    if not isinstance(saved, dict):
        raise UsageError(f"{flag}: checkpoint {checkpoint_dir}/{latest} stores no run config")
    if not (cfg.resume or cfg.resume_or_start):
        if latest < int(saved.get("rounds", 0)):
            raise UsageError(
                f"--out {os.path.dirname(checkpoint_dir)} holds an interrupted run (checkpoint "
                f"at round {latest} of {saved.get('rounds')}); continue it with --resume, or "
                "choose another --out"
            )
        return None
    diffs = config_diff(saved, dataclasses.asdict(cfg))
    if diffs:
        raise UsageError(
            f"{flag}: the checkpoint in {checkpoint_dir} was written with other settings: "
            f"{'; '.join(diffs)}"
        )
    return latest


def _check_loaded(cfg: RunConfig, dataset, model, client_map, mesh) -> None:
    """Checks that need the loaded data and the model (no compilation): model/data
    mismatch, an empty or tiny central test set, and a memory estimate."""
    import jax
    import numpy as np

    from fedjax_sim.data.federated import tree_size_bytes

    train = dataset.train
    validate.check_model_data(cfg.model, cfg.dataset, train.x.dtype, train.feature_shape)
    if (cfg.personal_eval or cfg.unseen_clients) and not train.has_client_test:
        name = "--personal-eval" if cfg.personal_eval else "--unseen-clients"
        raise UsageError(f"{name}: --dataset {cfg.dataset} has no per-client test splits")
    num_test = dataset.test.size if dataset.test is not None else 0
    message = validate.central_test_message(num_test, cfg.num_clients)
    if message and message[1]:
        raise UsageError(message[0])
    if message and jax.process_index() == 0:
        print(f"fedjax-sim: warning: {message[0]}", file=sys.stderr)
    key = jax.random.key(0)
    params = jax.eval_shape(model.init, key)
    x_one = jax.ShapeDtypeStruct((1, *train.feature_shape), train.x.dtype)
    try:
        act = validate.forward_activation_bytes(model.apply, params, x_one)
    except Exception:  # a model that cannot be traced on one example: count its output only
        act = 0
    row_bytes = (
        int(np.prod(train.feature_shape)) * train.x.dtype.itemsize
        + int(np.prod(train.y.shape[2:])) * train.y.dtype.itemsize
    )
    rows = train.max_count
    batch = rows if cfg.sampling == "full" else cfg.batch_size
    pcb = validate.per_client_bytes(tree_size_bytes(params), row_bytes, act, batch, rows)
    cohort = cfg.cohort_size or cfg.num_clients
    shards = 1 if mesh is None else int(np.prod(list(mesh.shape.values())))
    _, live = client_map.resolve(-(-cohort // shards))  # clients computed at once
    available = memory.available_bytes(jax.devices()[0])
    validate.check_memory(pcb, live, available, what=f"--batch-size {batch}: ")


# ------------------------------------------------------------------------------ list
def list_registered(cfg: ListConfig) -> int:
    from fedjax_sim import algorithms, data, models

    sections: dict[str, list[str]] = {
        "algorithms": [_algorithm_line(n) for n in sorted(algorithms.ALGORITHMS)],
        "datasets": [f"{n:14s} {_first_line(f)}" for n, f in sorted(data.DATASETS.items())]
        + [f"{'tfds:<name>':14s} any tfds catalogue dataset prepared on disk (array_record)"],
        "partitioners": [
            f"{n:14s} {_first_line(data.PARTITIONERS[n])}"
            for n in typing.get_args(typing.get_type_hints(RunConfig)["partition"])
        ]
        + ["(more in the Python API: fedjax_sim.data.PARTITIONERS)"],
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
    from fedjax_sim.app.config import hyper_parameters

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
    """The first sentence of a docstring (joined over line breaks)."""
    text = " ".join((obj.__doc__ or "").strip().split("\n\n")[0].split())
    end = text.find(". ")
    while end > 0 and text[:end].endswith(("et al", "e.g", "i.e", "cf")):
        end = text.find(". ", end + 1)
    return text if end < 0 else text[: end + 1]


# ------------------------------------------------------------------------------ bench
def bench(cfg: BenchConfig) -> int:
    validate.check_bench(cfg)
    if "baselines" in cfg.suite:
        extras.require("peers", "--suite baselines")
    from fedjax_sim import algorithms
    from fedjax_sim.app.bench import suites, workloads

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
    unknown = sorted(set(cfg.algorithms) - set(algorithms.ALGORITHMS))
    if unknown:
        raise UsageError(f"--algorithms {unknown}: not registered; see `fedjax-sim list`")
    try:
        main = cfg.algorithm or workloads.PRESETS[cfg.workload].algorithm
        workloads.check_hparams(main, parse_hparams(cfg.hparams))
        suites.run(cfg)
    except ValueError as e:
        raise UsageError(str(e)) from e
    return 0


# ------------------------------------------------------------------------------ entry point
COMMANDS: dict[str, tuple[type, Callable[..., int]]] = {
    "run": (RunConfig, run),
    "sweep": (SweepConfig, sweep_command),
    "list": (ListConfig, list_registered),
    "bench": (BenchConfig, bench),
}


def _load_config_file(cls: type, argv: list[str]) -> tuple[object | None, list[str]]:
    """Pops `--config FILE` (JSON with field names as keys) and returns it as defaults."""
    if "--config" not in argv:
        return None, argv
    i = argv.index("--config")
    if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
        raise UsageError("--config needs a file path")
    path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
    return cls(**validate.load_config_file(cls, path)), rest


CONFIG_HELP = (
    "--config FILE: a JSON object of flag defaults, keyed by field name (e.g. "
    '{"num_clients": 50, "hidden": [128, 64]}); flags given on the command line override it.'
)


def _parse(cls: type, args: list[str], default: object | None, prog: str) -> object:
    """tyro's parse, with its boxed error output condensed into one UsageError line."""
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return tyro.cli(
                cls,
                args=args,
                default=default,
                prog=prog,
                description=f"{(cls.__doc__ or '').strip()}\n\n{CONFIG_HELP}",
            )
    except SystemExit as e:
        if not e.code:
            raise
        raise UsageError(_condense(err.getvalue())) from None


def _condense(text: str) -> str:
    """The message of a tyro error box in one line (plus its "did you mean" flags)."""
    lines = [ln.strip().strip("│╭╰─╮╯").strip() for ln in text.splitlines()]
    body: list[str] = []
    for ln in lines[1:] if lines and "─" in text.splitlines()[0] else lines:
        if not ln or set(ln) <= set("─ "):
            break
        body.append(ln)
    message = " ".join(body) or "invalid command line"
    if "Perhaps you meant:" in text:
        tail = text.split("Perhaps you meant:")[1]
        flags = sorted({w for w in tail.split() if w.startswith("--") and w != "--help"})
        if flags:
            message += f" (did you mean {', '.join(flags)}?)"
    return message


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
    """Entry point; returns the exit code (0, 1: NaN guard, 2: usage error, 130: Ctrl-C)."""
    code = _main(list(sys.argv[1:] if argv is None else argv))
    if argv is None and code == EXIT_INTERRUPTED:
        # as a program: skip interpreter teardown, which can crash while JAX/XLA threads are
        # still busy after an interrupt (everything is saved and flushed by now)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: list[str]) -> int:
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
            "  sweep  seeds x hyper-parameter grid of a run as one compiled program\n"
            "  list   list algorithms, datasets, partitioners and models\n"
            "  bench  benchmark round throughput (see benchmarks/README.md)"
        )
        return 0 if argv else EXIT_USAGE
    cls, handler = COMMANDS[argv[0]]
    try:
        default, rest = _load_config_file(cls, argv[1:])
        cfg = _parse(cls, rest, default, prog=f"fedjax-sim {argv[0]}")
        with autotune.reporting(_report_measured):
            if handler in (run, sweep_command):
                from_file = set() if default is None else explicit_fields(default)
                return handler(cfg, from_file | _flags_given(cls, rest))
            return handler(cfg)
    except UsageError as e:
        print(f"fedjax-sim: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\nfedjax-sim: interrupted before the first round; nothing saved", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
