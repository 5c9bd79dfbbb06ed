"""Run configuration and its assembly into data, model and algorithm (used by the CLI, the
sweeps and the benchmarks; no import of the CLI).

Every flag that names a concept reaches every algorithm that has it: `--client-lr` (and
`--client-lr-decay`) is the `client_optimizer` of every preset, `--server-lr` its
`server_optimizer`, the local-work flags its `local`, the cohort flags its `cohort`,
`--straggler-fraction` its `stragglers`, `--mu` FedProx's `mu`; `--hparams key=value` sets any
other hyper-parameter of the chosen algorithm (type-checked against its default). A flag the
user set that the chosen algorithm does not use is an error, not silently dropped.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import os
import re
from collections.abc import Collection, Sequence
from typing import Any, Literal

from fedjax_sim.app import validate
from fedjax_sim.app.validate import algorithm_factory
from fedjax_sim.core.checks import UsageError, first_line, flag


@dataclasses.dataclass
class RunConfig:
    """Run a federated simulation and write history.json/.csv/.png to --out."""

    algorithm: str = "fedavg"
    """Registered algorithm (see `fedjax-sim list`) or your own factory as module:attribute
    (e.g. mypkg.algs:my_fedavg, imported from the Python path; checked like a preset)."""
    dataset: str = "digits"
    """Registered dataset (see `fedjax-sim list`: digits, fashion_mnist, shakespeare, mnist,
    cifar10, ...) or tfds:<catalogue name> (prepared on disk in array_record format)."""
    data_dir: str | None = None
    """Directory of dataset files (idx files, tfds data dir, Shakespeare texts)."""
    partition: Literal["dirichlet", "iid", "shards", "quantity_skew"] = "dirichlet"
    """How examples are split over clients."""
    alpha: float = 0.5
    """Dirichlet concentration (dirichlet partition) or alpha of fedprox_synthetic."""
    shards_per_client: int = 2
    """Shards per client (shards partition)."""
    sigma: float = 1.0
    """Log-normal sigma of client sizes (quantity_skew partition)."""
    num_clients: int = 100
    """Number of simulated clients C."""
    model: str = "mlp"
    """Registered model: logistic, mlp, cnn, lstm, gru, transformer (token models for
    shakespeare and markov_tokens)."""
    hidden: tuple[int, ...] = (64,)
    """Hidden widths of the MLP."""
    l2: float = 0.0
    """L2 penalty l2/2 ||w||^2 added to each client's loss."""
    lora_rank: int | None = None
    """Federated LoRA (--model transformer): adapters of this rank beside the projections of
    --lora-targets; only they train and travel, the base is frozen (`lora_partition`; the
    algorithm must take a partition: every synchronous preset)."""
    lora_alpha: float | None = None
    """LoRA scaling alpha: the adapters' output is scaled by alpha / rank (default: rank)."""
    lora_targets: tuple[str, ...] = ()
    """Projections that get adapters (query, key, value, out, mlp_in, mlp_out; default: all)."""
    lora_rule: Literal["hetlora", "flora"] | None = None
    """Heterogeneous LoRA ranks (with --lora-ranks; any synchronous --algorithm: the rule's hook
    first in its chain, `lora.with_rule`): client i trains the first --lora-ranks[i mod n] ranks
    of the rank --lora-rank adapters; the server aggregates with HetLoRA (zero-padding, sparsity
    weights; --hparams prune_lam=, decay= for rank self-pruning) or FLoRA (stacking, merged into
    the frozen base). bytes_up counts each client's true rank."""
    lora_ranks: tuple[int, ...] = ()
    """The ranks of --lora-rule, each <= --lora-rank, assigned to clients by id modulo their
    number (e.g. 2 4 8: clients 0, 3, 6, ... rank 2), or by device class (--lora-ranks-by)."""
    lora_ranks_by: Literal["id", "speed"] = "id"
    """How --lora-ranks are assigned: by client id modulo their number, or by device class
    ("speed", with --device-model): the clients sorted by compute speed are cut into as many
    equal classes as ranks, the slowest class gets the smallest rank."""
    pretrained: str | None = None
    """A pretrained transformer checkpoint (a flax msgpack file, `models.transformer.
    save_params`, or an orbax checkpoint directory) as the run's initial model; with
    --lora-rank its frozen base, the adapters at their initialisation (B = 0). Its leaves
    and shapes must be those of the --model flags."""
    rounds: int = 200
    """Number of communication rounds."""
    cohort_size: int | None = 10
    """Clients per round (None = all)."""
    cohort_sampling: Literal["uniform", "proportional", "bernoulli"] = "uniform"
    """Uniform without replacement, with replacement proportional to client size, or
    Bernoulli (Poisson): each client independently with --cohort-probability (then
    --cohort-size, if given, is the capacity of the cohort buffer)."""
    cohort_probability: float | None = None
    """Participation probability q of --cohort-sampling bernoulli."""
    weighting: Literal["auto", "counts", "uniform"] = "auto"
    """Aggregation weights of client updates."""
    client_lr: float = 0.1
    """Client learning rate: the `client_optimizer` of every algorithm that has one (the
    step-size paper's presets: the step size s_k)."""
    client_lr_decay: float = 1.0
    """Per-round decay of the local learning rate, `client_lr * decay^t` (the FedMIM paper's
    0.998), for algorithms whose client learning rate may be a schedule."""
    server_lr: float = 1.0
    """Server learning rate: the `server_optimizer` (1.0 with SGD = plain averaging; FedSGD's
    only learning rate; the named optimizer's for fedadam, fedyogi, ...)."""
    local_steps: int = 10
    """Local steps per round (ignored when --local-epochs is set)."""
    local_epochs: float | None = None
    """Local epochs per round (steps then differ across clients)."""
    batch_size: int = 16
    """Local minibatch size."""
    sampling: Literal["replacement", "epoch", "full", "fixed"] = "replacement"
    """How local minibatches are drawn."""
    mu: float = 0.01
    """FedProx proximal coefficient."""
    clusters: int = 2
    """IFCA's number of cluster models K (an int >= 1)."""
    straggler_fraction: float = 0.0
    """Fraction of each cohort that straggles (FedProx keeps partial work, others drop)."""
    dp_clip: float | None = None
    """User-level DP (DP-FedAvg): clip each client's update to this L2 norm (the initial norm
    with --dp-quantile); the sum is noised and divided by the expected cohort size."""
    dp_noise: float = 0.0
    """DP noise multiplier z (noise std z * clip per coordinate on the sum)."""
    dp_delta: float = 1e-5
    """DP delta at which epsilon is reported."""
    target_epsilon: float | None = None
    """Calibrate --dp-noise so that epsilon after --rounds rounds is this (<=, within 1 %)."""
    dp_quantile: float | None = None
    """Adaptive clipping (Andrew et al. 2021): the clip norm tracks this quantile of the
    update norms."""
    dp_accountant: Literal["rdp", "pld"] = "rdp"
    """Privacy accountant of dp_accounting (uniform cohorts: rdp)."""
    aggregator: Literal[
        "mean", "median", "trimmed_mean", "krum", "multi_krum", "geometric_median", "centered_clip"
    ] = "mean"
    """Aggregator of the client updates (robust ones need the [M, d] updates)."""
    aggregator_args: tuple[str, ...] = ()
    """Hyper-parameters of --aggregator as key=value (trimmed_mean: beta; krum: f;
    multi_krum: f, m; geometric_median: iters, nu; centered_clip: tau, iters; chunk)."""
    secure_aggregation: tuple[str, ...] = ()
    """Secure aggregation of the uploads (SecAgg, Bonawitz et al. 2017; SecAgg+ with fewer
    neighbours, Bell et al. 2020) as key=value, any of them turning it on: clip (L2 norm;
    required without --dp-clip, which then sets the range), bits (32), neighbours (cohort
    size - 1), threshold (0.5), dropout (0), bound, rounding (stochastic)."""
    device_model: str | None = None
    """Device profiles and the virtual clock (synchronous algorithms): a named procedural
    profile drawn from --seed (phones: log-normal speeds and bandwidths, diurnal online
    windows, 2 % mid-round dropout; always_on: the same, always online, no dropout;
    homogeneous: identical always-online devices), bundled (the bundled 64-device trace) or
    the path of a CSV device trace (format: `fedjax_sim.algorithms.device_model`). Adds the
    metrics round_time, virtual_time, unavailable, late, dropouts and a virtual-hours plot."""
    deadline: float | None = None
    """Round deadline in virtual seconds (needs --device-model); clients past it: --late."""
    late: Literal["drop", "partial"] = "drop"
    """Clients past --deadline are dropped, or keep the local steps that fit (partial, as
    FedProx's stragglers)."""
    over_selection: float = 1.0
    """Draw ceil(f M) clients and keep the first M to finish (Bonawitz et al. 2019; needs
    --device-model and a --cohort-size with uniform or proportional sampling)."""
    availability: bool = True
    """Clients offline at a round's start (their profile's online window) do not take part
    (needs --device-model; --no-availability: every client always online, dropout remains)."""
    available_cohorts: bool = False
    """Draw each round's cohort among the clients online at its start (its first N online of
    --cohort-candidates times as many candidates; needs --device-model and --cohort-size with
    uniform or proportional sampling); default: among all clients, offline ones sit out."""
    cohort_candidates: float = 8.0
    """Candidates per drawn cohort client of --available-cohorts (g >= 1: ceil(g N) are drawn,
    at most --num-clients; a round with fewer than N of them online runs with fewer)."""
    concurrency: int | None = None
    """Asynchronous presets on --device-model: at most K clients training at once (idle clients
    start uniformly at random when a slot frees; `event_model(concurrency=K)`); default: every
    client trains all the time. Synchronous presets train their --cohort-size."""
    round_trip_latency: float = 0.1
    """Virtual seconds each extra server round trip of the upload protocol adds to a client's
    time (--secure-aggregation's 3 beyond the plain upload; an assumed mobile round trip)."""
    attack: Literal["sign_flip", "scale", "gaussian", "alie", "label_flip"] | None = None
    """Byzantine attack of --byzantine-fraction of the clients."""
    byzantine_fraction: float = 0.1
    """Fraction of Byzantine clients (fixed set drawn from --seed)."""
    attack_args: tuple[str, ...] = ()
    """Attack hyper-parameters as key=value (scale, sampling=fixed|round)."""
    hparams: tuple[str, ...] = ()
    """Extra algorithm hyper-parameters as key=value (e.g. --hparams momentum=0.9)."""
    client_map: Literal["auto", "vmap", "map"] = "auto"
    """How clients are mapped: vmap (accelerators), map = lax.map in chunks (CPU)."""
    map_batch_size: int | None = None
    """Clients per chunk in map mode."""
    devices: int | None = None
    """Shard the client axis (`sweep`: the runs axis) over this many devices (on CPU: virtual
    devices, one per core is the useful number). With multi-process flags the default is
    every device of every process."""
    coordinator: str | None = None
    """Multi-process: coordinator host:port, or "auto" for SLURM/MPI/TPU-pod auto-detection
    (or env FEDJAX_SIM_COORDINATOR)."""
    num_processes: int | None = None
    """Multi-process: number of processes (or env FEDJAX_SIM_NUM_PROCESSES)."""
    process_id: int | None = None
    """Multi-process: this process's id (or env FEDJAX_SIM_PROCESS_ID)."""
    eval_every: int = 20
    """Rounds between evaluations (one compiled scan chunk each)."""
    personal_eval: bool = False
    """Evaluate each client's own model on its test split at every evaluation (personalized
    algorithms: its personal model; the others: the global model): personal mean, worst and
    10th-percentile accuracy beside the global model's; history.json keeps every client's."""
    unseen_clients: int = 0
    """Hold out this many of the --num-clients clients (drawn from --seed) as unseen: never
    trained on; at every evaluation each adapts by --unseen-steps local steps from the global
    model on its training data and is evaluated on its test split."""
    unseen_steps: int = 5
    """Local SGD steps (size --client-lr, minibatches of --batch-size) of the unseen clients'
    adaptation (0: the global model as it is)."""
    seed: int = 0
    """Seed of the run key and of the partition."""
    out: str = "results/{algorithm}_{dataset}{settings}"
    """Results folder ({algorithm}, {dataset} and {settings} are filled in; {settings} is
    empty for the default settings, else _ and a hash of the changed ones, so runs with other
    settings never replace each other's results)."""
    checkpoint_every: int | None = None
    """Checkpoint the full state every N rounds (into OUT/checkpoints)."""
    resume: bool = False
    """Resume from the latest checkpoint in OUT/checkpoints (an error if there is none or if
    it was written with other settings)."""
    resume_or_start: bool = False
    """Resume if OUT/checkpoints holds a checkpoint of this run, else start from round 0."""
    progress: bool = True
    """Show a progress bar."""
    client_store: str | None = None
    """Stream the training population from this client store folder (written by
    `fedjax_sim.data.store.write_client_store`: memory-mapped files or array_record, never
    loaded whole; each chunk's cohorts are gathered ahead of the rounds, `simulate_streamed`).
    --num-clients: its first N clients (default: all). No central test set."""
    population: Literal["uniform", "fedprox_synthetic"] | None = None
    """Stream a procedural population of --num-clients clients (up to 2^27), generated on
    device from (--seed, client id): uniform (784 features uniform in [0, 1), 10 uniform
    labels, 20 examples per client) or fedprox_synthetic (Synthetic(--alpha, --alpha) of Li
    et al. 2020: 60 features, 10 classes, 50..200 examples). Tested on 20 held-out clients."""
    state_rows: Literal["device", "host"] = "device"
    """Streamed runs: where per-client state rows (SCAFFOLD's control variates, FedDyn's h_i,
    error-feedback memories) live: device ([C, ...] on the device) or host (host RAM, or
    memory-mapped files in --rows-dir; the device holds a chunk's rows)."""
    rows_dir: str | None = None
    """Folder for the memory-mapped state rows of --state-rows host (default: host RAM)."""


def parse_hparams(items: Sequence[str], flag: str = "--hparams") -> dict[str, object]:
    """`["momentum=0.9", "server=adam"]` -> `{"momentum": 0.9, "server": "adam"}`."""
    out: dict[str, object] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise UsageError(f"{flag} entries must look like key=value, got {item!r}")
        try:
            out[name] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            try:  # inf, nan: checked (and refused) by the algorithm's hyper-parameter types
                out[name] = float(raw)
            except ValueError:
                out[name] = raw
    return out


def setup_devices(cfg: RunConfig, axis: str | None = None):
    """Multi-process initialisation and a 1-D mesh named `axis` (default: the clients axis;
    `sweep` shards its runs axis) over `--devices` devices; None for a single device. Must
    run before anything touches a JAX device (virtual CPU devices are an XLA flag)."""
    import os

    import jax

    from fedjax_sim.runtime import distributed
    from fedjax_sim.runtime.parallel import CLIENT_AXIS, client_mesh

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
    return client_mesh(cfg.devices, axis or CLIENT_AXIS)


def build_run(cfg: RunConfig, mesh=None, explicit: Collection[str] | None = None):
    """`(dataset, model, algorithm, client_map)` for a run config (UsageError on bad
    settings). `explicit` names the fields the user set (default: those that differ from
    `RunConfig()`); an explicit flag the algorithm cannot use is an error. With a
    multi-process `mesh`, each process keeps only its clients' rows."""
    import jax

    from fedjax_sim import data
    from fedjax_sim.data.unseen import held_out

    validate.check_config(cfg)
    load_kwargs: dict[str, object] = {"num_clients": cfg.num_clients, "seed": cfg.seed}
    if cfg.dataset == "fedprox_synthetic":
        load_kwargs.update(alpha=cfg.alpha, beta=cfg.alpha)
    elif cfg.dataset == "shakespeare":  # natural per-speaker partition
        if cfg.data_dir:
            load_kwargs["data_dir"] = cfg.data_dir
    elif cfg.dataset in ("shifted_minority", "markov_tokens"):  # natural split
        pass
    else:
        load_kwargs["partitioner"] = cfg.partition
        load_kwargs.update(
            {
                "dirichlet": {"alpha": cfg.alpha},
                "shards": {"per_client": cfg.shards_per_client},
                "quantity_skew": {"sigma": cfg.sigma},
                "iid": {},
            }[cfg.partition]
        )
        if cfg.data_dir:
            load_kwargs["data_dir"] = cfg.data_dir
    kwargs_without_data = algorithm_kwargs(cfg, explicit)  # refuse bad flags before loading
    dataset = data.load(cfg.dataset, **load_kwargs)
    if cfg.unseen_clients:  # held out before the algorithm sizes its [C, ...] rows
        train, unseen = held_out(dataset.train, cfg.unseen_clients, cfg.seed)
        dataset = dataset._replace(train=train, unseen=unseen)
    if mesh is not None and jax.process_count() > 1:
        from fedjax_sim.runtime import distributed

        train = distributed.local_rows(dataset.train, mesh, cfg.num_clients, all_rows=True)
        train = distributed.globalize(train, mesh, cfg.num_clients, all_rows=True)
        dataset = dataset._replace(train=train)
    model = _model(cfg, dataset.feature_shape, dataset.num_classes)
    client_map = make_client_map(cfg, mesh)
    kwargs = algorithm_kwargs(cfg, explicit, data=dataset.train, client_map=client_map, model=model)
    assert kwargs.keys() >= kwargs_without_data.keys()
    return dataset, model, _algorithm(cfg, model, kwargs), client_map


# ------------------------------------------------------------------------------ streamed runs
# Presets that draw their cohort from their own state, not with `CohortSpec.sample`: a
# streamed run cannot draw their ids ahead of the rounds (`streaming.AlgorithmCohorts`).
OWN_COHORTS: dict[str, str] = {
    "drfa": "draws its cohort from its client weights lam",
    "fedlps": "draws its cohort from its similarity graph",
}
# In-memory dataset flags, which a streamed population does not read.
DATASET_FLAGS = ("dataset", "data_dir", "partition", "shards_per_client", "sigma", "alpha")
MAX_EXACT_CLIENTS = 2**27  # `simulate_streamed`: exact plans draw over all C on device


def stream_flag(cfg: RunConfig) -> str | None:
    """`--client-store` or `--population` if `cfg` streams its population, else None."""
    if getattr(cfg, "client_store", None) is not None:
        return "--client-store"
    return "--population" if getattr(cfg, "population", None) is not None else None


def check_stream(cfg: RunConfig, explicit: Collection[str]) -> RunConfig:
    """UsageError (one line naming the flag) for what a streamed run (`--client-store`,
    `--population`) cannot do; reads only a store's `store.json`. Returns `cfg` with
    `--num-clients` the store's when not given."""
    explicit = set(explicit)
    source = stream_flag(cfg)
    if cfg.client_store is not None and cfg.population is not None:
        raise UsageError("--client-store and --population both name the population; give one")
    if source is None:
        for name in ("state_rows", "rows_dir"):
            if name in explicit:
                raise UsageError(f"{flag(name)} needs --client-store or --population")
        return cfg
    for name in DATASET_FLAGS:
        if name in explicit and not (name == "alpha" and cfg.population == "fedprox_synthetic"):
            raise UsageError(
                f"{flag(name)} sets up an in-memory dataset; {source} names the "
                "population of this run: drop one of them"
            )
    for name in ("personal_eval", "unseen_clients"):
        if name in explicit:
            raise UsageError(
                f"{flag(name)}: a streamed run ({source}) evaluates on the central test set "
                "only (no per-client test splits); run it on an in-memory --dataset"
            )
    multi = [n for n in ("coordinator", "num_processes", "process_id") if n in explicit]
    if (cfg.devices or 1) > 1 or multi:
        name = flag(multi[0]) if multi else f"--devices {cfg.devices}"
        raise UsageError(
            f"{name}: a streamed run ({source}) puts each chunk's cohort on one device (no "
            "mesh); drop it"
        )
    if cfg.rows_dir is not None:
        if cfg.state_rows != "host":
            raise UsageError("--rows-dir holds host state rows: give it with --state-rows host")
        validate.check_writable_dir(cfg.rows_dir, "rows_dir")
    factory = algorithm_factory(cfg.algorithm)
    if cfg.algorithm in OWN_COHORTS or "cohort" not in hyper_parameters(factory):
        why = OWN_COHORTS.get(cfg.algorithm, "is event-driven (no cohort option)")
        raise UsageError(
            f"--algorithm {cfg.algorithm} {why}: {source} streams cohorts drawn ahead with "
            "CohortSpec.sample; run it on an in-memory --dataset"
        )
    if cfg.population is not None:
        if cfg.num_clients > MAX_EXACT_CLIENTS:
            raise UsageError(
                f"--num-clients {cfg.num_clients}: a streamed run draws its cohorts over all "
                f"clients on device, at most {MAX_EXACT_CLIENTS} (2^27)"
            )
        return cfg
    if cfg.client_store is not None and os.path.abspath(cfg.rows_dir or "") == os.path.abspath(
        cfg.client_store
    ):
        raise UsageError("--rows-dir must not be the --client-store folder (it would replace it)")
    stored = _store_clients(cfg.client_store)
    if "num_clients" not in explicit:
        return dataclasses.replace(cfg, num_clients=stored)
    if cfg.num_clients > stored:
        raise UsageError(
            f"--num-clients {cfg.num_clients} exceeds the {stored} clients of --client-store "
            f"{cfg.client_store}"
        )
    return cfg


def _store_clients(path: str) -> int:
    """The number of clients in the store at `path` (its `store.json`; UsageError naming
    --client-store if it is missing or unreadable)."""
    from fedjax_sim.data.store import STORE_META

    where = f"--client-store {path}"
    meta = os.path.join(path, STORE_META)
    if not os.path.isdir(path):
        raise UsageError(f"{where}: no such folder")
    if not os.path.isfile(meta) or not os.path.isfile(os.path.join(path, "counts.npy")):
        raise UsageError(
            f"{where}: not a client store (it needs {STORE_META} and counts.npy, as "
            "write_client_store writes them)"
        )
    try:
        with open(meta) as f:
            info = json.load(f)
        c = info["num_clients"]
        if not {"x", "y"} <= set(info["leaves"]):
            raise ValueError("it needs arrays x and y")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{where}: unreadable {STORE_META} ({first_line(e)})") from e
    if not isinstance(c, int) or c < 1:
        raise UsageError(f"{where}: {STORE_META} has num_clients {c!r}")
    return c


def build_streamed_run(cfg: RunConfig, explicit: Collection[str] | None = None):
    """`(source, test, model, algorithm, plan)` of a streamed run (after `check_stream`):
    the `ClientStore` or procedural `Population`, its central test set (a population's
    `HELD_OUT` held-out clients; None for a store), and the `AlgorithmCohorts` plan of the
    algorithm's cohort. UsageError on bad settings or an unreadable store."""
    import numpy as np

    from fedjax_sim.run.streaming import AlgorithmCohorts

    validate.check_config(cfg)
    explicit = explicit_fields(cfg) if explicit is None else set(explicit)
    algorithm_kwargs(cfg, explicit)  # refuse bad flags before opening the data
    source, (feature_shape, x_dtype) = _stream_source(cfg)
    where = f"--client-store {cfg.client_store}" if cfg.population is None else "--population"
    validate.check_model_data(cfg.model, where, x_dtype, feature_shape)
    model = _model(cfg, feature_shape, source.num_classes)
    kwargs = algorithm_kwargs(cfg, explicit, client_map=make_client_map(cfg), model=model)
    algorithm = _algorithm(cfg, model, kwargs)
    if cfg.population is None:
        test, counts = None, source.counts
    else:
        test, counts = _held_out(source), np.asarray(source.all_counts())
    spec = _cohort_spec(cfg, explicit)
    if cfg.device_model is not None and cfg.over_selection > 1:  # the drawn cohort: ceil(f M)
        spec = dataclasses.replace(spec, size=_device_model(cfg).selection_size(spec.size))
    plan = AlgorithmCohorts(spec, counts)
    return source, test, model, algorithm, plan


HELD_OUT = 20  # clients of a procedural population held out as its central test set


def _stream_source(cfg: RunConfig):
    """`(source, (feature_shape, decoded x dtype))` of a streamed run."""
    import jax
    import numpy as np

    from fedjax_sim.data.procedural import FedProxSynthetic, Population, UniformClassification
    from fedjax_sim.data.store import ClientStore

    if cfg.population is None:
        try:
            store = ClientStore.open(cfg.client_store, num_clients=cfg.num_clients)
            x = store.decode(jax.numpy.asarray(store.rows.gather(np.zeros(1, np.int64))["x"]))
        except (OSError, ValueError, KeyError, TypeError, ImportError) as e:
            raise UsageError(f"--client-store {cfg.client_store}: {first_line(e)}") from e
        return store, (tuple(x.shape[2:]), x.dtype)
    generator = {
        "uniform": lambda: UniformClassification(),
        "fedprox_synthetic": lambda: FedProxSynthetic(alpha=cfg.alpha, beta=cfg.alpha),
    }[cfg.population]()
    population = Population(generator, cfg.num_clients, seed=cfg.seed)
    return population, (population.feature_shape, np.dtype(np.float32))


def _held_out(population: Any):
    """The central test set of a procedural population: the examples of clients
    `C .. C + HELD_OUT - 1` of its generator (never trained on)."""
    import jax
    import numpy as np

    from fedjax_sim.data.federated import ArrayData

    ids = np.arange(population.num_clients, population.num_clients + HELD_OUT)
    x, y = (np.asarray(a) for a in jax.jit(population.rows)(ids))
    keep = np.arange(x.shape[1]) < np.asarray(population.counts(ids))[:, None]
    return ArrayData(x=jax.numpy.asarray(x[keep]), y=jax.numpy.asarray(y[keep]))


def _model(cfg: RunConfig, feature_shape: tuple[int, ...], num_classes: int):
    from fedjax_sim import models

    model_kwargs: dict[str, object] = {"l2": cfg.l2}
    if cfg.model == "mlp":
        model_kwargs["hidden"] = cfg.hidden
    if cfg.lora_rank is not None:  # validate.check_lora: only with --model transformer
        model_kwargs.update(lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha)
        if cfg.lora_targets:
            model_kwargs["lora_targets"] = cfg.lora_targets
    model = models.build(cfg.model, feature_shape, num_classes, **model_kwargs)
    return model if cfg.pretrained is None else _pretrained(cfg.pretrained, model)


def _pretrained(path: str, model: Any):
    """`model` starting from the checkpoint at `path` (UsageError naming --pretrained for an
    unreadable checkpoint or one whose leaves or shapes differ from the model's: traced by
    `jax.eval_shape`, nothing compiled)."""
    import jax

    from fedjax_sim.models.transformer import load_params, pretrained_init

    where = f"--pretrained {path}"
    try:
        params = load_params(path)
    except Exception as e:  # msgpack / orbax errors of a corrupt or foreign file
        raise UsageError(f"{where}: not a readable checkpoint ({first_line(e)})") from None
    model = pretrained_init(model, params)
    try:
        jax.eval_shape(model.init, jax.random.key(0))
    except ValueError as e:
        raise UsageError(f"{where}: {first_line(e)}") from None
    return model


def run_factory(cfg: RunConfig):
    """The factory of the run: `--algorithm`'s, with `--lora-rule`'s hook first in its chain
    (`algorithms.lora.with_rule`; refused for a preset that takes no hooks)."""
    factory = algorithm_factory(cfg.algorithm)
    if cfg.lora_rule is None:
        return factory
    from fedjax_sim.algorithms.lora import with_rule

    try:
        return with_rule(factory, cfg.lora_rule)
    except ValueError as e:
        raise UsageError(f"--lora-rule {cfg.lora_rule}: {e}") from None


def model_kwargs(factory: Any, model: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with the model's initializer as `cluster_init` where the factory takes one
    (IFCA: its K initial models from K keys)."""
    if "cluster_init" in hyper_parameters(factory) and "cluster_init" not in kwargs:
        return {**kwargs, "cluster_init": model.init}
    return kwargs


def _algorithm(cfg: RunConfig, model: Any, kwargs: dict[str, Any]):
    factory = run_factory(cfg)
    try:
        return factory(model.loss, **model_kwargs(factory, model, kwargs))
    except ValueError as e:  # the preset's own range checks: name the --hparams it concerns
        named = [h for h in cfg.hparams if re.search(rf"\b{re.escape(h.split('=')[0])}\b", str(e))]
        raise UsageError(f"--hparams {' '.join(named)}: {e}" if named else str(e)) from None


# ------------------------------------------------------------------------------ algorithm flags
# RunConfig field -> the algorithm hyper-parameter (concept) it sets
ALGORITHM_FLAGS: dict[str, str] = {
    "client_lr": "client_optimizer",
    "client_lr_decay": "client_optimizer",
    "server_lr": "server_optimizer",
    "local_steps": "local",
    "local_epochs": "local",
    "batch_size": "local",
    "sampling": "local",
    "cohort_size": "cohort",
    "cohort_sampling": "cohort",
    "cohort_probability": "cohort",
    "weighting": "cohort",
    "mu": "mu",
    "clusters": "clusters",
    "straggler_fraction": "stragglers",
    "dp_clip": "aggregator",
    "dp_noise": "aggregator",
    "dp_delta": "aggregator",
    "target_epsilon": "aggregator",
    "dp_quantile": "aggregator",
    "dp_accountant": "aggregator",
    "aggregator": "aggregator",
    "aggregator_args": "aggregator",
    "secure_aggregation": "aggregator",
    "device_model": "device_model",
    "deadline": "device_model",
    "late": "device_model",
    "over_selection": "device_model",
    "availability": "device_model",
    "available_cohorts": "device_model",
    "cohort_candidates": "device_model",
    "round_trip_latency": "device_model",
    "attack": "attack",
    "byzantine_fraction": "attack",
    "attack_args": "attack",
}


def explicit_fields(cfg: RunConfig) -> set[str]:
    """Fields of `cfg` that differ from the defaults (what a user set, absent argv)."""
    default = type(cfg)()
    return {
        f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name)
    }


def make_client_map(cfg: RunConfig, mesh=None):
    from fedjax_sim.runtime.parallel import ClientMap

    return ClientMap(cfg.client_map, cfg.map_batch_size, mesh=mesh)


def _cohort_spec(cfg: RunConfig, explicit: Collection[str]):
    from fedjax_sim.algorithms.core import CohortSpec

    weighting = cfg.weighting
    if (cfg.dp_clip is not None or cfg.secure_aggregation) and "weighting" not in explicit:
        weighting = "uniform"  # DP, secure aggregation: every participant counts once
    if cfg.cohort_sampling == "bernoulli":
        size = cfg.cohort_size if "cohort_size" in explicit else None
        return CohortSpec(size, "bernoulli", weighting, cfg.cohort_probability)
    return CohortSpec(cfg.cohort_size, cfg.cohort_sampling, weighting, cfg.cohort_probability)


def check_privacy_robustness(cfg: RunConfig, explicit: Collection[str]) -> None:
    """UsageError (one line) for DP / robust / attack flags that cannot work together."""
    explicit = set(explicit)
    dp_only = ["dp_noise", "dp_delta", "target_epsilon", "dp_quantile", "dp_accountant"]
    if cfg.dp_clip is None:
        for name in dp_only:
            if name in explicit:
                raise UsageError(f"--{name.replace('_', '-')} needs --dp-clip (DP-FedAvg)")
    else:
        if cfg.aggregator != "mean":
            raise UsageError(
                f"--dp-clip replaces the mean: it cannot be combined with "
                f"--aggregator {cfg.aggregator}"
            )
        if cfg.target_epsilon is not None and "dp_noise" in explicit:
            raise UsageError("--target-epsilon calibrates --dp-noise: give one of them")
        if cfg.cohort_sampling == "proportional":
            raise UsageError("--dp-clip needs --cohort-sampling uniform or bernoulli")
        if cfg.weighting == "counts" and "weighting" in explicit:
            raise UsageError("--dp-clip needs --weighting uniform (each client counts once)")
        if cfg.cohort_sampling == "bernoulli" and "cohort_size" in explicit and cfg.cohort_size:
            raise UsageError(
                "--dp-clip with bernoulli cohorts needs an exact cohort: drop "
                "--cohort-size (a capacity would truncate the Poisson sample)"
            )
        if (
            cfg.dp_accountant == "pld"
            and cfg.cohort_sampling == "uniform"
            and (cfg.cohort_size is not None and cfg.cohort_size < cfg.num_clients)
        ):
            raise UsageError(
                "--dp-accountant pld does not account sampling without "
                "replacement: use rdp or bernoulli cohorts"
            )
    if cfg.aggregator_args and cfg.aggregator == "mean":
        raise UsageError("--aggregator-args needs a robust --aggregator")
    if cfg.secure_aggregation and cfg.aggregator != "mean":
        raise UsageError(
            f"--secure-aggregation reveals only the sum: it cannot be combined with "
            f"--aggregator {cfg.aggregator}"
        )
    if cfg.secure_aggregation and cfg.weighting == "counts" and "weighting" in explicit:
        raise UsageError("--secure-aggregation needs --weighting uniform (each client counts once)")
    if cfg.attack is None:
        for name in ("byzantine_fraction", "attack_args"):
            if name in explicit:
                raise UsageError(f"--{name.replace('_', '-')} needs --attack")
    if cfg.cohort_sampling == "bernoulli" and cfg.cohort_probability is None:
        raise UsageError("--cohort-sampling bernoulli needs --cohort-probability")
    if cfg.cohort_probability is not None and cfg.cohort_sampling != "bernoulli":
        raise UsageError("--cohort-probability needs --cohort-sampling bernoulli")


DEVICE_FLAGS = (
    "deadline",
    "late",
    "over_selection",
    "availability",
    "available_cohorts",
    "cohort_candidates",
    "concurrency",
    "round_trip_latency",
)


def check_device_model(cfg: RunConfig, explicit: Collection[str]) -> None:
    """UsageError (one line naming the flag) for device-model flags that cannot work: a clock
    flag without --device-model, an unknown profile or a malformed trace, --late partial
    without --deadline, over-selection without a fixed cohort or beyond the population, a
    latency that nothing pays. Reads the trace file (no JAX work)."""
    explicit = set(explicit)
    if cfg.device_model is None:
        for name in DEVICE_FLAGS:
            if name in explicit:
                raise UsageError(f"{flag(name)} needs --device-model (the virtual clock)")
        return
    device_profiles(cfg)
    if cfg.late == "partial" and cfg.deadline is None:
        raise UsageError("--late partial needs --deadline (clients past it keep what fits)")
    if cfg.over_selection > 1:
        if cfg.cohort_size is None or cfg.cohort_sampling == "bernoulli":
            raise UsageError(
                "--over-selection needs --cohort-size with --cohort-sampling uniform or "
                "proportional (it draws ceil(f M) and keeps M)"
            )
        drawn = math.ceil(cfg.over_selection * cfg.cohort_size - 1e-9)
        if cfg.cohort_sampling == "uniform" and drawn > cfg.num_clients:
            raise UsageError(
                f"--over-selection {cfg.over_selection:g} draws {drawn} clients, more than "
                f"--num-clients {cfg.num_clients}"
            )
    if "cohort_candidates" in explicit and not cfg.available_cohorts:
        raise UsageError("--cohort-candidates is used by --available-cohorts only")
    if cfg.available_cohorts:
        if cfg.cohort_size is None or cfg.cohort_sampling == "bernoulli":
            raise UsageError(
                "--available-cohorts needs --cohort-size with --cohort-sampling uniform or "
                "proportional (it draws the cohort among the online clients)"
            )
        if not cfg.availability:
            raise UsageError(
                "--available-cohorts needs availability (with --no-availability every client "
                "is online)"
            )
        if stream_flag(cfg):
            raise UsageError(
                f"--available-cohorts is not supported with {stream_flag(cfg)} (the streamed "
                "cohorts are planned before the clock is known)"
            )
    if cfg.concurrency is not None and stream_flag(cfg):
        raise UsageError(
            f"--concurrency is not supported with {stream_flag(cfg)} (the streamed event "
            "cohorts are planned without the cap)"
        )
    if "round_trip_latency" in explicit and not cfg.secure_aggregation:
        raise UsageError(
            "--round-trip-latency is paid by --secure-aggregation's extra round trips; "
            "without it the upload is one message"
        )


# synchronous rounds only
ROUND_CLOCK_FLAGS = ("deadline", "late", "over_selection", "available_cohorts", "cohort_candidates")


def check_device_events(cfg: RunConfig, kwargs: dict[str, Any]) -> None:
    """UsageError for an asynchronous preset's flags that a device model cannot time."""
    if kwargs["local"].epochs is not None:
        raise UsageError(
            f"--device-model with {cfg.algorithm} needs --local-steps (a delivery's time is "
            "its steps / the client's speed), not --local-epochs"
        )
    if "firing_probability" in kwargs:
        raise UsageError(
            f"--hparams firing_probability is not used with --device-model ({cfg.algorithm}'s "
            "clients fire at the device model's rates)"
        )


def device_events(cfg: RunConfig, model: Any, kwargs: dict[str, Any], accepted: Any):
    """An asynchronous preset's `events` from --device-model (`device_model.event_model`):
    each delivery downloads and uploads one model and runs --local-steps steps; the server
    aggregates every `buffer_size` deliveries (the preset's; FedAsync, which fixes it: 1)."""
    import jax

    from fedjax_sim.algorithms.device_model import event_model
    from fedjax_sim.algorithms.events import Aggregation
    from fedjax_sim.data.federated import tree_size_bytes

    size = tree_size_bytes(jax.eval_shape(model.init, jax.random.key(0)))
    buffer = kwargs.get(
        "buffer_size", accepted["buffer_size"].default if "buffer_size" in accepted else 1
    )
    return event_model(
        device_profiles(cfg),
        kwargs["num_clients"],
        steps=kwargs["local"].steps,
        bytes_down=size,
        bytes_up=size,
        aggregation=Aggregation.every(buffer),
        availability=cfg.availability,
        capacity=kwargs.get("capacity", "auto"),
        concurrency=cfg.concurrency,
    )


def device_profiles(cfg: RunConfig):
    """The `--device-model` profiles (UsageError naming the flag)."""
    from fedjax_sim.algorithms.device_model import named_profiles

    try:
        return named_profiles(cfg.device_model, seed=cfg.seed)
    except (ValueError, OSError) as e:
        raise UsageError(f"--device-model {first_line(e)}") from None


def _device_model(cfg: RunConfig):
    if cfg.device_model is None:
        return None
    from fedjax_sim.algorithms.device_model import DeviceModel

    return DeviceModel(
        device_profiles(cfg),
        deadline=cfg.deadline,
        late=cfg.late,
        over_selection=cfg.over_selection,
        availability=cfg.availability,
        round_trip_latency=cfg.round_trip_latency,
        cohort="available" if cfg.available_cohorts else "all",
        candidates=cfg.cohort_candidates,
    )


def lora_summary(cfg: RunConfig, model: Any) -> str | None:
    """The run summary's words on the LoRA adapters and their size against the frozen
    base's, the heterogeneous ranks and the pretrained checkpoint (None without them)."""
    start = None if cfg.pretrained is None else f"initial model from {cfg.pretrained}"
    if cfg.lora_rank is None:
        return start
    import jax

    from fedjax_sim.algorithms.lora import lora_partition
    from fedjax_sim.models.transformer import PROJECTIONS

    params = jax.eval_shape(model.init, jax.random.key(0))
    labels = jax.tree.leaves(lora_partition().of(params))
    sizes = [x.size for x in jax.tree.leaves(params)]
    adapters = sum(n for n, label in zip(sizes, labels, strict=True) if label == "shared")
    base = sum(sizes) - adapters
    targets = ", ".join(cfg.lora_targets or PROJECTIONS)
    words = (
        f"LoRA rank {cfg.lora_rank} on {targets}: {adapters:,} adapter parameters train and "
        f"travel, {base:,} base parameters frozen ({100 * adapters / base:.2g}% of the base)"
    )
    if cfg.lora_rule is not None:
        ranks = " ".join(map(str, cfg.lora_ranks))
        if cfg.lora_ranks_by == "speed":
            words += f", {cfg.lora_rule} with ranks ({ranks}) by device speed class"
        else:
            n = len(cfg.lora_ranks)
            words += f", {cfg.lora_rule} with client i of rank ({ranks})[i mod {n}]"
    return words if start is None else f"{words}, {start}"


def device_summary(cfg: RunConfig) -> str | None:
    """The run summary's words on the device model (None without one)."""
    if cfg.device_model is None:
        return None
    parts = [f"availability {'on' if cfg.availability else 'off'}"]
    if cfg.deadline is not None:
        kept = "partial work kept" if cfg.late == "partial" else "late clients dropped"
        parts.append(f"deadline {cfg.deadline:g} s, {kept}")
    if cfg.over_selection > 1:
        parts.append(f"over-selection {cfg.over_selection:g}")
    if cfg.available_cohorts:
        parts.append(f"cohorts among online clients ({cfg.cohort_candidates:g}x candidates)")
    if cfg.concurrency is not None:
        parts.append(f"at most {cfg.concurrency} clients training")
    if cfg.secure_aggregation:
        parts.append(f"round-trip latency {cfg.round_trip_latency:g} s")
    return f"device model {cfg.device_model} ({', '.join(parts)})"


def privacy_accounting(cfg: RunConfig, num_clients: int | None = None):
    """The `accounting.PrivacyAccounting` of a DP run (None without --dp-clip), with z
    calibrated for --target-epsilon over --rounds."""
    if cfg.dp_clip is None:
        return None
    from fedjax_sim.algorithms.accounting import PrivacyAccounting

    c = cfg.num_clients if num_clients is None else num_clients
    if cfg.cohort_sampling == "bernoulli":
        kind = dict(sampling="poisson", probability=cfg.cohort_probability)
    elif cfg.cohort_size is None or cfg.cohort_size >= c:
        kind = dict(sampling="full")
    else:
        kind = dict(sampling="uniform", cohort_size=cfg.cohort_size)
    try:
        acc = PrivacyAccounting(
            cfg.dp_noise, c, delta=cfg.dp_delta, accountant=cfg.dp_accountant, **kind
        )
    except ValueError as e:
        raise UsageError(f"--dp-clip: {e}") from e
    if cfg.target_epsilon is None:
        try:
            acc.check(cfg.rounds)
        except ValueError as e:
            raise UsageError(f"--dp-accountant {cfg.dp_accountant}: {e}") from e
        return acc
    try:
        return acc.calibrated(cfg.target_epsilon, cfg.rounds)
    except ValueError as e:
        raise UsageError(f"--target-epsilon {cfg.target_epsilon:g}: {e}") from e


def privacy_record(cfg: RunConfig, acc: Any) -> dict[str, Any]:
    """What a DP run's history records of its accounting (`meta["privacy"]`): the (calibrated)
    noise multiplier at full precision, the sampling (kind, rate, expected cohort), the
    accountant, delta, the clip norm, the adaptive clipping quantile and the target epsilon."""
    return {
        **acc.record(),
        "clip_norm": cfg.dp_clip,
        "clip_quantile": cfg.dp_quantile,
        "target_epsilon": cfg.target_epsilon,
    }


SECURE_AGGREGATION_ARGS = (
    "clip",
    "bits",
    "neighbours",
    "threshold",
    "dropout",
    "bound",
    "rounding",
)


def _aggregator(cfg: RunConfig, num_clients: int, explicit: Collection[str] = ()):
    """The aggregator of the flags, inside secure aggregation with --secure-aggregation."""
    inner = _inner_aggregator(cfg, num_clients)
    if not cfg.secure_aggregation:
        return inner
    from fedjax_sim.algorithms.secure_aggregation import (
        levels,
        neighbour_offsets,
        secure_aggregation,
    )

    args = validate.check_args(
        "secure_aggregation",
        "secure aggregation",
        secure_aggregation,
        parse_hparams(cfg.secure_aggregation, "--secure-aggregation"),
        SECURE_AGGREGATION_ARGS,
    )
    if cfg.dp_clip is not None:
        args.setdefault("bound", cfg.dp_clip)
    elif "clip" not in args:
        raise UsageError("--secure-aggregation needs clip=... (an L2 norm) without --dp-clip")
    slots = _cohort_spec(cfg, explicit).size or num_clients  # M, the cohort's slots
    args.setdefault("neighbours", slots - 1)
    try:
        neighbour_offsets(slots, args["neighbours"])  # the graph and the field fit M
        levels(args.get("bits", 32), slots)
        return secure_aggregation(inner, **args)
    except ValueError as e:
        raise UsageError(f"--secure-aggregation: {e}") from None


def _inner_aggregator(cfg: RunConfig, num_clients: int):
    from fedjax_sim.algorithms import robust

    if cfg.dp_clip is not None:
        from fedjax_sim.algorithms import privacy

        acc = privacy_accounting(cfg, num_clients)
        m = privacy.expected_cohort_size(_cohort_spec(cfg, ()), num_clients)
        adaptive = (
            privacy.AdaptiveClipping(cfg.dp_quantile) if cfg.dp_quantile is not None else None
        )
        return privacy.dp_mean(acc.noise_multiplier, cfg.dp_clip, m, adaptive=adaptive)
    if cfg.aggregator == "mean":
        return None
    factory = robust.ROBUST[cfg.aggregator]
    args = validate.check_args(
        "aggregator_args",
        cfg.aggregator,
        factory,
        parse_hparams(cfg.aggregator_args, "--aggregator-args"),
    )
    try:
        aggregator = factory(**args)
    except ValueError as e:
        raise UsageError(f"--aggregator-args: {e}") from None
    if cfg.cohort_sampling != "bernoulli":
        validate.check_robust_cohort(cfg.aggregator, args, cfg.cohort_size or num_clients)
    return aggregator


ATTACK_ARGS = ("sampling", "scale")  # the `Attack` fields --attack-args may set


def _attack(cfg: RunConfig, data: Any):
    if cfg.attack is None:
        return None
    import numpy as np

    from fedjax_sim.algorithms.attacks import Attack

    args = validate.check_args(
        "attack_args",
        cfg.attack,
        Attack,
        parse_hparams(cfg.attack_args, "--attack-args"),
        ATTACK_ARGS,
    )
    num_classes = None
    if cfg.attack == "label_flip":
        num_classes = 10 if data is None else int(np.max(np.asarray(data.y))) + 1
    try:
        return Attack(
            cfg.attack, cfg.byzantine_fraction, seed=cfg.seed, num_classes=num_classes, **args
        )
    except ValueError as e:
        raise UsageError(f"--attack-args: {e}") from None


def _concept_values(
    cfg: RunConfig, factory: Any, explicit: Collection[str] = (), data: Any = None
) -> dict[str, Any]:
    """The value of each concept the flags set, for `factory`."""
    from fedjax_sim.algorithms.core import LocalSpec, Stragglers
    from fedjax_sim.algorithms.schedules import round_decay

    params = inspect.signature(factory).parameters
    client = cfg.client_lr
    if cfg.client_lr_decay != 1.0:
        client = round_decay(cfg.client_lr, cfg.client_lr_decay)
    stragglers = params.get("stragglers")
    policy = getattr(getattr(stragglers, "default", None), "policy", "partial")
    values = {
        "client_optimizer": client,
        "server_optimizer": cfg.server_lr,
        "local": LocalSpec(
            steps=cfg.local_steps,
            epochs=cfg.local_epochs,
            batch_size=cfg.batch_size,
            sampling=cfg.sampling,
        ),
        "cohort": _cohort_spec(cfg, explicit),
        "mu": cfg.mu,
        "clusters": cfg.clusters,
        "stragglers": Stragglers(cfg.straggler_fraction, policy),
    }
    if "aggregator" in params:
        values["aggregator"] = _aggregator(
            cfg, cfg.num_clients if data is None else data.num_clients, explicit
        )
    if "attack" in params:
        values["attack"] = _attack(cfg, data)
    if "device_model" in params:
        values["device_model"] = _device_model(cfg)
    if cfg.lora_rank is not None and "partition" in params:
        from fedjax_sim.algorithms.lora import lora_partition

        values["partition"] = lora_partition()
    if cfg.lora_rule is not None:  # validate.check_lora: with --lora-rank and --lora-ranks
        from fedjax_sim.algorithms.lora import client_ranks, device_class_ranks
        from fedjax_sim.models.transformer import lora_scale

        num_clients = cfg.num_clients if data is None else data.num_clients
        if cfg.lora_ranks_by == "speed":  # validate.check_lora_rule: with --device-model
            import jax.numpy as jnp

            speeds = device_profiles(cfg)(jnp.arange(num_clients)).speed
            values["ranks"] = device_class_ranks(cfg.lora_ranks, speeds)
        else:
            values["ranks"] = client_ranks(cfg.lora_ranks, num_clients)
        values["scale"] = lora_scale(cfg.lora_rank, cfg.lora_alpha)
    return values


def hyper_parameters(factory: Any) -> dict[str, inspect.Parameter]:
    """Keyword arguments of an algorithm factory, by name."""
    return {
        p.name: p
        for p in inspect.signature(factory).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def _check_hparam(algorithm: str, name: str, value: Any, param: inspect.Parameter) -> Any:
    """`value` converted to the type of the parameter's default (UsageError naming the key)."""
    default = param.default
    where = f"--hparams {name}={value!r}"
    if default is inspect.Parameter.empty or default is None:
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise UsageError(f"{where}: {algorithm}'s {name} is a bool (True/False)")
        return value
    if isinstance(default, int | float) and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UsageError(f"{where}: {algorithm}'s {name} is a number")
        if not math.isfinite(value):
            raise UsageError(f"{where}: {algorithm}'s {name} must be finite")
        if isinstance(default, int) and not isinstance(value, int):
            raise UsageError(f"{where}: {algorithm}'s {name} is an integer")
        return float(value) if isinstance(default, float) else value
    if isinstance(default, str):
        if not isinstance(value, str):
            raise UsageError(f"{where}: {algorithm}'s {name} is a string")
        return value
    if isinstance(default, tuple):
        values = value if isinstance(value, list | tuple) else (value,)
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            raise UsageError(f"{where}: {algorithm}'s {name} is a tuple of numbers")
        return tuple(float(v) for v in values)
    raise UsageError(f"{where}: {algorithm}'s {name} cannot be set from the command line")


def algorithm_kwargs(
    cfg: RunConfig,
    explicit: Collection[str] | None = None,
    *,
    data: Any = None,
    client_map: Any = None,
    model: Any = None,
) -> dict[str, Any]:
    """The keyword arguments of `cfg.algorithm`'s factory: every concept the flags set that
    the algorithm has, `num_clients` / `data` / `client_map` where it takes them, and the
    `--hparams`; for an asynchronous preset with --device-model and a `model`, its `events`
    (`device_events`). Raises UsageError for an explicit flag the algorithm does not use, an
    unknown or ill-typed hyper-parameter."""
    factory = run_factory(cfg)
    accepted = hyper_parameters(factory)
    explicit = explicit_fields(cfg) if explicit is None else set(explicit)
    asynchronous = "events" in accepted
    for name, concept in ALGORITHM_FLAGS.items():
        if name in explicit and asynchronous and name in ROUND_CLOCK_FLAGS:
            raise UsageError(
                f"{flag(name)} is not used by {cfg.algorithm} (asynchronous: no rounds to "
                "wait for; its clients deliver at the device model's rates)"
            )
        if asynchronous and concept == "device_model":
            continue  # the device model sets the event engine's rates (`device_events`)
        if name in explicit and concept not in accepted:
            raise UsageError(
                f"{flag(name)} is not used by {cfg.algorithm} (it has no "
                f"{concept}); see `fedjax-sim list --what algorithms`"
            )
    if cfg.concurrency is not None and not asynchronous:
        raise UsageError(
            f"--concurrency caps an asynchronous preset's training clients; {cfg.algorithm} "
            "trains its cohort each round (--cohort-size)"
        )
    if cfg.concurrency is not None and cfg.concurrency > cfg.num_clients:
        raise UsageError(f"--concurrency {cfg.concurrency} exceeds --num-clients {cfg.num_clients}")
    if cfg.lora_rank is not None and "partition" not in accepted:
        raise UsageError(
            f"--lora-rank is not used by {cfg.algorithm} (it has no partition, which LoRA "
            "needs to train and send only the adapters); use a synchronous preset"
        )
    check_privacy_robustness(cfg, explicit)
    check_device_model(cfg, explicit)
    try:
        values = _concept_values(cfg, factory, explicit, data)
    except ValueError as e:  # an aggregator's / attack's own check
        raise UsageError(str(e)) from e
    kwargs = {k: v for k, v in values.items() if k in accepted and v is not None}
    if "num_clients" in accepted:
        kwargs["num_clients"] = cfg.num_clients if data is None else data.num_clients
    if data is not None and "data" in accepted:
        kwargs["data"] = data
    if client_map is not None and "client_map" in accepted:
        kwargs["client_map"] = client_map
    for name, value in parse_hparams(cfg.hparams).items():
        if name not in accepted:
            raise UsageError(
                f"--hparams {name} not accepted by {cfg.algorithm}; it takes {sorted(accepted)}"
            )
        kwargs[name] = _check_hparam(cfg.algorithm, name, value, accepted[name])
    if asynchronous and cfg.device_model is not None:
        check_device_events(cfg, kwargs)
        if model is not None:
            kwargs["events"] = device_events(cfg, model, kwargs, accepted)
    if "graph" in accepted and kwargs.get("data") is not None and "graph" not in kwargs:
        # FedLPS' similarity graph, computed once on the host (not again inside a sweep's trace)
        from fedjax_sim.algorithms.similarity import graph_from_data

        method = kwargs.get("message_method", "auto")
        kwargs["graph"] = graph_from_data(kwargs.pop("data"), method=method)
    return kwargs
