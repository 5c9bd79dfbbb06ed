"""Up-front validation of command-line configs: every bad input refused before compilation.

Pure functions over config dataclasses (`RunConfig`, `BenchConfig`, any future one such as a
sweep config): they read fields by name and type, so a new config gets the generic checks
(every float finite, every int in range, paths writable) by declaring its fields. Each
failure raises `UsageError` with one line naming the flag (`--field-name`) and the problem.
The ranges are `checks.Range`s, the value checks the algorithms use for their
hyper-parameters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import math
import os
import string
import tempfile
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

from fedjax_sim.core.checks import (
    FLOAT32_MAX,
    INT32_MAX,
    NONNEG,
    POSITIVE,
    POSITIVE_INT,
    RESUMABLE,
    UINT32_MAX,
    Range,
    UsageError,
    comparable,
    first_line,
    flag,
)

# ------------------------------------------------------------------------------ field rules
# Rules by field name, shared by every config that has a field of that name.
RULES: dict[str, Range] = {
    # run
    "rounds": POSITIVE_INT,
    "num_clients": POSITIVE_INT,
    "local_steps": POSITIVE_INT,
    "batch_size": POSITIVE_INT,
    "eval_every": POSITIVE_INT,
    "unseen_clients": Range(0, INT32_MAX),
    "unseen_steps": Range(0, INT32_MAX),
    "cohort_size": POSITIVE_INT,
    "shards_per_client": POSITIVE_INT,
    "map_batch_size": POSITIVE_INT,
    "checkpoint_every": POSITIVE_INT,
    "devices": POSITIVE_INT,
    "num_processes": POSITIVE_INT,
    "process_id": Range(0, INT32_MAX),
    "hidden": POSITIVE_INT,
    "seed": Range(0, UINT32_MAX),
    "client_lr": POSITIVE,
    "server_lr": POSITIVE,
    "client_lr_decay": POSITIVE,
    "alpha": POSITIVE,
    "sigma": NONNEG,
    "l2": NONNEG,
    "lora_rank": POSITIVE_INT,
    "lora_alpha": POSITIVE,
    "lora_ranks": POSITIVE_INT,
    "mu": NONNEG,
    "clusters": POSITIVE_INT,
    "local_epochs": POSITIVE,
    "straggler_fraction": Range(0, 1),
    "cohort_probability": Range(0, 1, lo_open=True),
    "dp_clip": POSITIVE,
    "dp_noise": NONNEG,
    "dp_delta": Range(0, 1, lo_open=True, hi_open=True),
    "target_epsilon": POSITIVE,
    "dp_quantile": Range(0, 1, lo_open=True, hi_open=True),
    "byzantine_fraction": Range(0, 1),
    "deadline": POSITIVE,
    "over_selection": Range(1),
    "cohort_candidates": Range(1),
    "concurrency": POSITIVE_INT,
    "round_trip_latency": NONNEG,
    # sweep
    "seeds": POSITIVE_INT,
    "at_round": Range(0, INT32_MAX),
    "runs_per_group": POSITIVE_INT,
    # bench
    "clients": POSITIVE_INT,
    "per_client": POSITIVE_INT,
    "map_batch": POSITIVE_INT,
    "repeats": Range(3, INT32_MAX),
    "cohorts": POSITIVE_INT,
    "baseline_cohorts": POSITIVE_INT,
    "steps_list": POSITIVE_INT,
    "widths": POSITIVE_INT,
    "map_batches": POSITIVE_INT,
    "memory_rounds": POSITIVE_INT,
    "memory_budget_gb": POSITIVE,
    "max_round_s": POSITIVE,
    "peak_n": POSITIVE_INT,
    "torch_threads": POSITIVE_INT,
    "peer_max_cohort": POSITIVE_INT,
    "competing_threads": Range(0, 64),
}

# Output-folder fields: checked to be creatable and writable before any work starts.
PATH_FIELDS = ("out",)


def check_fields(cfg: Any, rules: Mapping[str, Range] = RULES) -> None:
    """Generic checks of every field of a config dataclass: its type (the value of a
    `--config` file may be anything), finite floats within float32 range, and the named
    `rules` (applied to each element of tuple fields)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        check_type(f.name, value, hints[f.name])
        items = value if isinstance(value, tuple) else (value,)
        for item in items:
            if isinstance(item, float):
                check_finite(f.name, item)
            if f.name in rules and isinstance(item, (int, float)) and not isinstance(item, bool):
                problem = rules[f.name].violation(item)
                if problem:
                    raise UsageError(f"{flag(f.name)} must be {problem}, got {item}")


def check_finite(name: str, value: float) -> None:
    """Refuses NaN, +-inf and values that overflow float32 (e.g. a learning rate of 1e39)."""
    if not math.isfinite(value):
        raise UsageError(f"{flag(name)} must be a finite number, got {value}")
    if abs(value) > FLOAT32_MAX:
        raise UsageError(f"{flag(name)} {value} overflows float32 (|x| <= 3.4e38)")


def check_type(name: str, value: Any, hint: Any) -> None:
    """Raises UsageError if `value` does not match the annotation `hint` (int, float, str,
    bool, None, Literal, tuple[X, ...], unions)."""
    if not _matches(value, hint):
        raise UsageError(
            f"{flag(name)} must be {_type_name(hint)}, got {type(value).__name__} {value!r}"
        )


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if hint is type(None) or hint is None:
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(args) == len(value) and all(map(_matches, value, args))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if hint is type(None):
        return "null"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


# ------------------------------------------------------------------------------ key=value args
def check_args(
    name: str,
    what: str,
    factory: Callable[..., Any],
    values: Mapping[str, Any],
    accepted: Collection[str] | None = None,
) -> dict[str, Any]:
    """Parsed `key=value` arguments of flag `name` (`aggregator_args`, `attack_args`) for
    `factory`, checked against its annotations: unknown names (`accepted`: the names the flag
    may set, default every parameter), wrong types (a number given as text, a float for an
    integer) and non-finite numbers. Returns them, integers given for floats as floats. The
    ranges are the factory's own checks."""
    hints = typing.get_type_hints(factory)
    names = sorted(inspect.signature(factory).parameters if accepted is None else accepted)
    out = {}
    for key, value in values.items():
        if key not in names:
            raise UsageError(f"{flag(name)} {key}: {what} takes {', '.join(names)}")
        hint = hints.get(key, Any)
        if type(value) is int and _matches(0.5, hint):
            value = float(value)
        if not _matches(value, hint):
            raise UsageError(
                f"{flag(name)} {key}={value!r}: {what}'s {key} must be {_type_name(hint)}"
            )
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
            raise UsageError(f"{flag(name)} {key}={value!r}: must be a finite float32 number")
        out[key] = value
    return out


def check_robust_cohort(aggregator: str, args: Mapping[str, Any], cohort: int) -> None:
    """Refuses (multi-)Krum `--aggregator-args` that a cohort of `cohort` participants cannot
    satisfy (`robust.min_participants`: n > 2 f + 2 and m <= n)."""
    from fedjax_sim.algorithms.robust import min_participants

    if aggregator not in ("krum", "multi_krum"):
        return
    need = min_participants(**{k: v for k, v in args.items() if k in ("f", "m")})
    if cohort < need:
        given = " ".join(f"{k}={v}" for k, v in args.items()) or "(defaults)"
        raise UsageError(
            f"--aggregator-args {given}: {aggregator} needs at least {need} participants "
            f"(n > 2 f + 2 and m <= n), the cohort has {cohort}"
        )


# ------------------------------------------------------------------------------ config files
def load_config_file(cls: type, path: str) -> dict[str, Any]:
    """Reads a `--config` JSON file: an object whose keys are field names of `cls` and whose
    values have the field's type (lists for tuples). Returns the values as keyword arguments."""
    try:
        with open(path) as f:
            values = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--config {path}: cannot read it: {e}") from e
    if not isinstance(values, dict):
        raise UsageError(
            f"--config {path} must hold a JSON object of flag names, got {type(values).__name__}"
        )
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - fields
    if unknown:
        raise UsageError(f"--config {path} has unknown keys {sorted(unknown)}")
    hints = typing.get_type_hints(cls)
    for k, v in values.items():
        if isinstance(v, list):
            v = values[k] = tuple(v)
        if isinstance(v, float) and not math.isfinite(v):
            raise UsageError(f"--config {path}: key {k!r} must be a finite number, got {v}")
        if not _matches(v, hints[k]):
            raise UsageError(
                f"--config {path}: key {k!r} must be {_type_name(hints[k])}, "
                f"got {type(v).__name__} {v!r}"
            )
    return values


# ------------------------------------------------------------------------------ paths
def format_out(template: str, name: str = "out", **fields: str) -> str:
    """`template.format(**fields)` with one-line errors naming the flag (empty path, unknown
    or malformed `{placeholder}`)."""
    if not template.strip():
        raise UsageError(f"{flag(name)} must be a folder path, got an empty string")
    try:
        names = [n for _, n, _, _ in string.Formatter().parse(template) if n is not None]
    except ValueError as e:
        raise UsageError(f"{flag(name)} {template!r}: malformed placeholder ({e})") from e
    bad = [n for n in names if n not in fields]
    if bad:
        raise UsageError(
            f"{flag(name)} {template!r}: unknown placeholder {{{bad[0]}}}; "
            f"only {', '.join('{' + k + '}' for k in fields)} are filled in"
        )
    try:
        return template.format(**fields)
    except (ValueError, IndexError, KeyError) as e:
        raise UsageError(f"{flag(name)} {template!r}: malformed placeholder ({e})") from e


def check_writable_dir(path: str, name: str = "out") -> None:
    """Refuses a folder that could not be created or written, without creating anything:
    the path (or its nearest existing ancestor) must be a writable directory."""
    if not path.strip():
        raise UsageError(f"{flag(name)} must be a folder path, got an empty string")
    if "\0" in path:
        raise UsageError(f"{flag(name)} contains a NUL character")
    p = os.path.abspath(path)
    if os.path.exists(p):
        if not os.path.isdir(p):
            raise UsageError(f"{flag(name)} {path!r} exists and is not a folder")
        if not os.access(p, os.W_OK | os.X_OK):
            raise UsageError(f"{flag(name)} {path!r} is not writable")
        _probe(p, f"{flag(name)} {path!r} is not writable")
        return
    parent = p
    while not os.path.exists(parent):
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    if not os.path.isdir(parent):
        raise UsageError(f"{flag(name)} {path!r} cannot be created: {parent!r} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag(name)} {path!r} cannot be created: {parent!r} is not writable")
    _probe(parent, f"{flag(name)} {path!r} cannot be created in {parent!r}")


def _probe(folder: str, message: str) -> None:
    """What `os.access` cannot tell (/proc, read-only mounts, root's view): a folder made in
    `folder` and removed at once."""
    try:
        os.rmdir(tempfile.mkdtemp(dir=folder))
    except OSError as e:
        raise UsageError(f"{message}: {e.strerror}") from None


# ------------------------------------------------------------------------------ run configs
CHAR_MODELS = ("lstm", "gru", "transformer")  # models of integer token sequences


def algorithm_factory(name: str) -> Callable[..., Any]:
    """The factory `--algorithm name` names: a registered preset, or `module:attribute` (a
    user's own factory, imported; `attribute` may be dotted). UsageError (one line) for an
    unknown name, a module that cannot be imported or a missing or non-callable attribute."""
    from fedjax_sim import algorithms

    if name in algorithms.ALGORITHMS:
        return algorithms.ALGORITHMS[name]
    module, sep, attribute = name.partition(":")
    if not sep:
        raise UsageError(
            f"unknown algorithm {name!r}; choose from {sorted(algorithms.ALGORITHMS)} or give "
            "your own factory as module:attribute"
        )
    try:
        factory = importlib.import_module(module)
    except Exception as e:  # ImportError, or the module's own error while importing
        raise UsageError(f"--algorithm {name}: cannot import {module!r} ({first_line(e)})") from e
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise UsageError(f"--algorithm {name}: {module!r} has no attribute {attribute!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise UsageError(f"--algorithm {name}: {attribute!r} is not a callable factory")
    return factory


def check_config(cfg: Any, max_virtual_devices: int | None = None) -> None:
    """Every check of a run config that needs no data, no device and no file system: its
    fields (types, `RULES`), the settings that depend on each other, a known algorithm,
    dataset and model, and the extras its features need."""
    from fedjax_sim import data, models
    from fedjax_sim.core import extras

    check_fields(cfg)
    if cfg.cohort_size is not None and cfg.cohort_sampling == "uniform":
        if cfg.cohort_size > cfg.num_clients:
            raise UsageError(
                f"--cohort-size {cfg.cohort_size} exceeds --num-clients {cfg.num_clients}"
            )
    check_unseen(cfg)
    if cfg.num_processes is not None and cfg.process_id is not None:
        if cfg.process_id >= cfg.num_processes:
            raise UsageError(
                f"--process-id must be < --num-processes {cfg.num_processes}, got {cfg.process_id}"
            )
    multi = any(v is not None for v in (cfg.coordinator, cfg.num_processes, cfg.process_id))
    if cfg.devices is not None and not multi:
        if cfg.devices > cfg.num_clients:
            raise UsageError(
                f"--devices {cfg.devices} exceeds --num-clients {cfg.num_clients} (the client "
                "axis is what is sharded)"
            )
        check_devices(cfg.devices, max_virtual_devices)
    if getattr(cfg, "resume", False) and getattr(cfg, "resume_or_start", False):
        raise UsageError("--resume and --resume-or-start are exclusive; give one")
    algorithm_factory(cfg.algorithm)
    if not data.is_registered(cfg.dataset):
        raise UsageError(
            f"unknown dataset {cfg.dataset!r}; choose from {sorted(data.DATASETS)} "
            f"or tfds:<catalogue name>"
        )
    if cfg.model not in models.MODELS:
        raise UsageError(f"unknown model {cfg.model!r}; choose from {sorted(models.MODELS)}")
    check_lora(cfg)
    if cfg.dp_clip is not None:
        extras.require("privacy", "--dp-clip")
    if data.needs_tfds(cfg.dataset):
        extras.require("tfds", f"--dataset {cfg.dataset}")


def check_lora(cfg: Any) -> None:
    """The LoRA flags: --lora-alpha / --lora-targets need --lora-rank, which needs --model
    transformer; targets among the transformer's projections (ranges: `RULES`)."""
    from fedjax_sim.models.transformer import PROJECTIONS

    rank = getattr(cfg, "lora_rank", None)
    for name in ("lora_alpha", "lora_targets"):
        if getattr(cfg, name, None) and rank is None:
            raise UsageError(f"{flag(name)} needs --lora-rank (the adapters' rank)")
    if rank is not None and cfg.model != "transformer":
        raise UsageError(
            f"--lora-rank needs --model transformer (LoRA adapts its projections), got "
            f"--model {cfg.model}"
        )
    bad = [t for t in getattr(cfg, "lora_targets", ()) if t not in PROJECTIONS]
    if bad:
        raise UsageError(f"--lora-targets must be among {', '.join(PROJECTIONS)}, got {bad[0]}")
    check_lora_rule(cfg)
    if getattr(cfg, "pretrained", None) is not None and cfg.model != "transformer":
        raise UsageError(
            f"--pretrained loads a transformer checkpoint: it needs --model transformer, got "
            f"--model {cfg.model}"
        )


def check_lora_rule(cfg: Any) -> None:
    """--lora-rule and --lora-ranks come together, need --lora-rank (the largest rank) and
    the plain upload (the rule's bytes_up); the preset must take hooks (`config.run_factory`)."""
    rule, ranks = getattr(cfg, "lora_rule", None), getattr(cfg, "lora_ranks", ())
    by = getattr(cfg, "lora_ranks_by", "id")
    if rule is None:
        if ranks:
            raise UsageError("--lora-ranks needs --lora-rule hetlora or flora (the aggregation)")
        if by != "id":
            raise UsageError(f"--lora-ranks-by {by} needs --lora-rule and --lora-ranks")
        return
    if by == "speed" and getattr(cfg, "device_model", None) is None:
        raise UsageError("--lora-ranks-by speed needs --device-model (the clients' speeds)")
    if not ranks:
        raise UsageError(f"--lora-rule {rule} needs --lora-ranks (the clients' ranks)")
    if cfg.lora_rank is None:
        raise UsageError(f"--lora-rule {rule} needs --lora-rank (the adapters' largest rank)")
    if max(ranks) > cfg.lora_rank:
        raise UsageError(
            f"--lora-ranks {max(ranks)} exceeds --lora-rank {cfg.lora_rank} (the adapters' rank)"
        )
    for name in ("secure_aggregation", "dp_clip"):
        if getattr(cfg, name, None):
            raise UsageError(
                f"--lora-rule {rule} counts the plain upload of each client's rank (bytes_up); "
                f"drop {flag(name)}"
            )


def check_unseen(cfg: Any) -> None:
    """`--unseen-clients` leaves some clients to train, fits the cohort, runs unsharded;
    `--unseen-steps` needs it."""
    held = getattr(cfg, "unseen_clients", 0)
    if held and held >= cfg.num_clients:
        raise UsageError(
            f"--unseen-clients {held} must be < --num-clients {cfg.num_clients} (the others train)"
        )
    trained = cfg.num_clients - held
    if held and cfg.cohort_size is not None and cfg.cohort_sampling == "uniform":
        if cfg.cohort_size > trained:
            raise UsageError(
                f"--cohort-size {cfg.cohort_size} exceeds the {trained} trained clients "
                f"(--num-clients {cfg.num_clients} - --unseen-clients {held})"
            )
    if held and cfg.devices is not None and cfg.devices > 1:
        raise UsageError(
            "--unseen-clients: unseen clients are evaluated unsharded; drop "
            f"--devices {cfg.devices}"
        )
    if not held and getattr(cfg, "unseen_steps", 5) != getattr(type(cfg)(), "unseen_steps", 5):
        raise UsageError("--unseen-steps sets the adaptation of --unseen-clients: give both")


def check_run(cfg: Any, max_virtual_devices: int | None = None) -> str:
    """All checks of a run config that need neither data nor a device (`check_config`, the
    output folder); returns the output folder."""
    check_config(cfg, max_virtual_devices)
    pretrained = getattr(cfg, "pretrained", None)
    if pretrained is not None and not os.path.exists(pretrained):
        raise UsageError(f"--pretrained {pretrained}: no such file or folder")
    algorithm = cfg.algorithm.replace(":", ".")  # a user's module:factory
    out = format_out(
        cfg.out, algorithm=algorithm, dataset=data_name(cfg), settings=settings_tag(cfg)
    )
    check_writable_dir(out)
    return out


def data_name(cfg: Any) -> str:
    """`--out`'s `{dataset}`: the dataset, `--population`'s name or `store-<folder name>` of
    `--client-store`."""
    store = getattr(cfg, "client_store", None)
    if store is not None:
        return "store-" + (os.path.basename(os.path.normpath(store)) or "root")
    return getattr(cfg, "population", None) or cfg.dataset


def check_sweep(cfg: Any) -> str:
    """All checks of a sweep config that need neither data nor JAX; returns the output
    folder."""
    default = type(cfg)()
    for name in ("client_store", "population", "state_rows", "rows_dir"):
        if getattr(cfg, name) != getattr(default, name):
            raise UsageError(
                f"{flag(name)}: a sweep runs on an in-memory --dataset; stream a population "
                "with `fedjax-sim run`"
            )
    for name in ("personal_eval", "unseen_clients"):
        if getattr(cfg, name) != getattr(default, name):
            raise UsageError(
                f"{flag(name)}: a sweep evaluates its runs' global models; evaluate personal "
                "models and unseen clients with `fedjax-sim run`"
            )
    out = check_run(cfg)
    last = cfg.seed + cfg.seeds - 1
    if last > UINT32_MAX:
        raise UsageError(
            f"--seeds {cfg.seeds}: the last run's seed {last} exceeds {UINT32_MAX} "
            f"(--seed {cfg.seed} + --seeds - 1)"
        )
    if any(v is not None for v in (cfg.coordinator, cfg.num_processes, cfg.process_id)):
        raise UsageError("--num-processes: sweep runs in one process; drop the multi-process flags")
    return out


def check_metric(
    metric: str,
    at_round: int | None,
    round_metrics: Collection[str],
    eval_metrics: Collection[str],
    rounds: int,
    eval_every: int,
) -> None:
    """Refuses a sweep's `--metric` that no run reports, and an `--at-round` where it is not
    recorded: evaluation metrics at rounds 0, eval_every, 2 eval_every, ... and the last
    round; per-round metrics at rounds 1..rounds (`SweepResult.values`)."""
    if metric in eval_metrics:
        if at_round is not None and not (
            at_round == rounds or (at_round <= rounds and at_round % eval_every == 0)
        ):
            raise UsageError(
                f"--at-round {at_round}: {metric} is evaluated at round 0, every --eval-every "
                f"{eval_every} rounds and at --rounds {rounds}"
            )
    elif metric in round_metrics:
        if at_round is not None and not 1 <= at_round <= rounds:
            raise UsageError(f"--at-round {at_round}: {metric} is recorded at rounds 1..{rounds}")
    else:
        names = ", ".join(sorted({*eval_metrics, *round_metrics}))
        raise UsageError(f"--metric {metric!r}: no run reports it; choose from {names}")


def check_devices(devices: int, max_virtual_devices: int | None = None) -> None:
    """Refuses more `--devices` than one host can have (virtual CPU devices: 4 per core)."""
    cap = max_virtual_devices or max(64, 4 * (os.cpu_count() or 1))
    if devices > cap:
        raise UsageError(f"--devices {devices}: more than {cap} devices on one host")


def settings_tag(cfg: Any) -> str:
    """`--out`'s `{settings}`: empty for the default settings, else `_` and 8 hex digits of a
    hash of the settings that differ from the defaults (outside `RESUMABLE`; the algorithm
    and the dataset name the folder themselves), so runs with other settings (DP, attack,
    aggregator, seed, ...) never share a default results folder; the same command (also with
    --resume or more --rounds) always finds its own."""
    default = type(cfg)()
    changed = {
        f.name: comparable(getattr(cfg, f.name))
        for f in dataclasses.fields(cfg)
        if f.name not in RESUMABLE | {"algorithm", "dataset"}
        and comparable(getattr(cfg, f.name)) != comparable(getattr(default, f.name))
    }
    if not changed:
        return ""
    return "_" + hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:8]


def check_bench(cfg: Any) -> str:
    """All checks of a bench config that need no JAX; returns the output folder."""
    check_fields(cfg)
    if cfg.devices is not None:
        check_devices(cfg.devices)
        for clients in (cfg.clients, *cfg.baseline_cohorts):
            if clients is not None and cfg.devices > clients:
                raise UsageError(
                    f"--devices {cfg.devices} exceeds the cohort {clients} (the client axis "
                    "is what is sharded)"
                )
    for peer in cfg.VENV_PEER_FLAGS:
        python = cfg.peer_python(peer)
        if python is not None and not os.path.isfile(python):
            raise UsageError(
                f"--{peer}-python {python}: no such file (benchmarks/peers/{peer}_venv.sh "
                f"makes .venv-{peer}/bin/python)"
            )
    check_writable_dir(cfg.out)
    return cfg.out


def check_model_data(model: str, dataset: str, x_dtype: Any, feature_shape: tuple) -> None:
    """Refuses a model that cannot read the dataset's features (a character RNN on images,
    an image model on token sequences); `dataset`: a dataset name, or the flag and value
    naming a streamed population (`--client-store PATH`)."""
    if not dataset.startswith("--"):
        dataset = f"--dataset {dataset}"
    import numpy as np

    tokens = np.issubdtype(np.dtype(x_dtype), np.integer)
    if model in CHAR_MODELS and not tokens:
        raise UsageError(
            f"--model {model} is a character model (integer token sequences); "
            f"{dataset} has float features of shape {tuple(feature_shape)}"
        )
    if model not in CHAR_MODELS and tokens:
        raise UsageError(
            f"--model {model} reads float features; {dataset} has integer token "
            f"sequences: use --model lstm, gru or transformer"
        )


def central_test_message(num_test: int, num_clients: int) -> tuple[str, bool] | None:
    """`(message, fatal)` about a central test set that is empty (fatal) or tiny (< 100
    examples: a warning), else None."""
    if num_test == 0:
        return (
            f"--num-clients {num_clients}: the central test set is empty (each client holds "
            "out too few examples); use fewer clients",
            True,
        )
    if num_test < 100:
        return (
            f"the central test set has only {num_test} examples at --num-clients "
            f"{num_clients}: test accuracies are coarse (steps of {1 / num_test:.3f})",
            False,
        )
    return None


def check_memory(
    per_client_bytes: int,
    live_clients: int,
    available_bytes: int | None,
    *,
    what: str = "",
    items: str = "live clients",
    advice: str = "lower --batch-size, --cohort-size, --map-batch-size or --hidden",
) -> int:
    """Refuses a configuration whose live clients' (or a sweep's runs') working set cannot
    fit the available memory, using the planner `parallel.fit_client_map`'s notion of
    per-client bytes. Returns the estimate."""
    need = per_client_bytes * live_clients
    if available_bytes is not None and need > available_bytes:
        raise UsageError(
            f"{what}needs an estimated {need / 2**30:.2f} GiB ({live_clients} {items} x "
            f"{per_client_bytes / 2**20:.3g} MiB), more than the {available_bytes / 2**30:.2f} "
            f"GiB available; {advice}"
        )
    return need


def per_client_bytes(
    param_bytes: int, example_bytes: int, activation_bytes: int, batch_size: int, rows: int
) -> int:
    """Working memory of one mapped client: 4 model-sized buffers (params, gradient,
    optimizer state, delta), forward + backward activations of a batch (3x), the gathered
    batch and a copy of the client's rows."""
    return (
        4 * param_bytes
        + batch_size * (3 * activation_bytes + example_bytes)
        + rows * (example_bytes)
    )


def forward_activation_bytes(apply: Callable[..., Any], params: Any, x_one: Any) -> int:
    """Bytes of all intermediate values of `apply(params, x)` for one example (traced with
    `jax.make_jaxpr` on abstract values: no compilation, nothing allocated)."""
    import jax
    import numpy as np

    jaxpr = jax.make_jaxpr(apply)(params, x_one)
    total = 0
    for eqn in jaxpr.jaxpr.eqns:
        for v in eqn.outvars:
            aval = getattr(v, "aval", None)
            if aval is not None and hasattr(aval, "shape"):
                total += int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize
    return total


def divergence_message(train_loss: Any, factor: float = 10.0, window: int = 10) -> str | None:
    """A warning if the mean training loss of the last `window` rounds is more than `factor`
    times that of the first ones (a run that diverged without reaching NaN)."""
    import numpy as np

    loss = np.asarray(train_loss, dtype=np.float64)
    if loss.ndim != 1 or loss.size < 2:
        return None
    w = max(1, min(window, loss.size // 2))
    first, last = float(np.mean(loss[:w])), float(np.mean(loss[-w:]))
    if math.isfinite(first) and last > factor * max(first, 1e-12) and last - first > 1e-6:
        return (
            f"the training loss grew from {first:.4g} (first {w} rounds) to {last:.4g} (last "
            f"{w} rounds): the run diverged; lower --client-lr / --server-lr"
        )
    return None
