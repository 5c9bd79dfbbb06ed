"""Benchmark workloads: algorithm x model x cohort x local steps x batch, and named presets.

A `Workload` is a full-participation round on random data generated on device (features
uniform in [0, 1), labels uniform over the classes), so the cohort is the whole client axis
and nothing but the benchmarked round touches memory. `build(workload)` returns the model,
the data, the algorithm (built through the registry with generic keyword arguments, see
`algorithm_kwargs`) and the initial state.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Collection
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fedjax_sim import algorithms, models
from fedjax_sim.algorithms.core import Algorithm, CohortSpec, LocalSpec
from fedjax_sim.app.config import hyper_parameters
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.base import Model
from fedjax_sim.models.simple_cnn import conv_macs
from fedjax_sim.runtime import distributed
from fedjax_sim.runtime.parallel import ClientMap, client_mesh

CLIENT_LR = 0.05
MODELS = ("mlp", "logistic", "simple_cnn")
GEN_BLOCK_BYTES = 64 * 2**20  # data generated at once by `make_data`


def mode_label(mode: str, map_batch: int | None = None, devices: int = 1) -> str:
    """How rows name a client map: `vmap`, `map(batch_size=k)`, `... over n devices`."""
    label = f"map(batch_size={map_batch or 'default'})" if mode == "map" else mode
    return label if devices == 1 else f"{label} over {devices} devices"


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmarked round.

    Attributes:
      algorithm: registered algorithm name. model: "mlp", "logistic" or "simple_cnn"
        (pfl-research's CIFAR CNN, `models.simple_cnn`).
      hidden: MLP hidden widths. input_dim, num_classes: flat features and classes.
      image: the CNN's image shape `(H, W, C)` (`H * W * C == input_dim`; the data stay
        flat, the model reshapes them); empty for dense models.
      clients: cohort size M = number of clients C (full participation).
      local_steps, batch_size: local work per client (minibatches drawn with replacement).
      per_client: examples per client (N_max).
      mode, map_batch: client map ("vmap", "map" with `map_batch` clients per chunk, or
        "auto" = `ClientMap("auto")`).
      hparams: extra algorithm hyper-parameters (passed if the factory accepts them).
      devices: devices the client axis is sharded over (`ClientMap(mesh=client_mesh(n))`);
        on CPU these are host devices (`--xla_force_host_platform_device_count`), one per
        core, which `bench` sets in each measurement's process
        (`distributed.host_device_flags`).
    """

    name: str = "custom"
    algorithm: str = "fedavg"
    model: str = "mlp"
    hidden: tuple[int, ...] = (200, 200)
    input_dim: int = 784
    num_classes: int = 10
    clients: int = 1000
    local_steps: int = 10
    batch_size: int = 32
    per_client: int = 100
    mode: str = "map"
    map_batch: int | None = 5
    hparams: tuple[tuple[str, Any], ...] = ()
    devices: int = 1
    image: tuple[int, ...] = ()

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"benchmark model must be one of {MODELS}, got {self.model!r}")
        if (self.model == "simple_cnn") != bool(self.image) or (
            self.image and math.prod(self.image) != self.input_dim
        ):
            raise ValueError(
                f"workload image {self.image} must be (H, W, C) with H * W * C = input_dim "
                f"({self.input_dim}) for the CNN, and empty for dense models"
            )
        for field in (
            "input_dim",
            "num_classes",
            "clients",
            "local_steps",
            "batch_size",
            "devices",
        ):
            if getattr(self, field) < 1:
                raise ValueError(f"workload {field} must be >= 1, got {getattr(self, field)}")
        if self.per_client < 1:
            raise ValueError(f"workload per_client must be >= 1, got {self.per_client}")
        if self.mode not in ("auto", "vmap", "map"):
            raise ValueError(f"workload mode must be auto|vmap|map, got {self.mode!r}")
        if self.map_batch is not None and self.map_batch < 1:
            raise ValueError(f"workload map_batch must be >= 1, got {self.map_batch}")

    @property
    def widths(self) -> tuple[int, ...]:
        """Layer widths input -> output, e.g. (784, 200, 200, 10)."""
        hidden = self.hidden if self.model == "mlp" else ()
        return (self.input_dim, *hidden, self.num_classes)

    @property
    def client_steps(self) -> int:
        return self.clients * self.local_steps

    @property
    def examples(self) -> int:
        """Examples processed per round (client steps x batch)."""
        return self.client_steps * self.batch_size

    @property
    def mode_label(self) -> str:
        return mode_label(self.mode, self.map_batch, self.devices)

    def replace(self, **kw: Any) -> Workload:
        return dataclasses.replace(self, **kw)

    def describe(self) -> dict[str, Any]:
        """JSON-ready fields of the workload (hidden widths as a list)."""
        d = dataclasses.asdict(self)
        d["hidden"] = list(self.hidden) if self.model == "mlp" else []
        d["hparams"] = dict(self.hparams)
        d["image"] = list(self.image)
        return d


PRESETS: dict[str, Workload] = {
    # the W1: FedAvg, 1000 clients x 10 steps x batch 32, MLP 784-200-200-10; one
    # client per map step is its fastest CPU mode (benchmarks/README.md, "modes" suite)
    "W1": Workload("W1", map_batch=1),
    "W1-100": Workload("W1-100", clients=100, map_batch=1),
    # multinomial logistic regression on FedProx-Synthetic-sized data (60 features, 10 classes)
    "LR": Workload(
        "LR", model="logistic", input_dim=60, per_client=20, batch_size=10, map_batch=256
    ),
    # pfl-research's CIFAR-10 benchmark: 1,000 users x 50 images, cohort 50, one epoch of
    # batch 10 (5 steps), its 2-conv CNN (`models.simple_cnn`); random data of CIFAR's shape
    "cifar_pfl": Workload(
        "cifar_pfl",
        model="simple_cnn",
        image=(32, 32, 3),
        input_dim=32 * 32 * 3,
        clients=50,
        local_steps=5,
        batch_size=10,
        per_client=50,
        map_batch=1,
    ),
    # tiny workloads for tests and smoke runs
    "tiny-cnn": Workload(
        "tiny-cnn",
        model="simple_cnn",
        image=(8, 8, 3),
        input_dim=8 * 8 * 3,
        num_classes=3,
        clients=4,
        local_steps=2,
        batch_size=4,
        per_client=8,
        map_batch=2,
    ),
    "tiny-mlp": Workload(
        "tiny-mlp",
        hidden=(16,),
        input_dim=12,
        num_classes=3,
        clients=6,
        local_steps=3,
        batch_size=4,
        per_client=8,
        map_batch=2,
    ),
    "tiny-lr": Workload(
        "tiny-lr",
        model="logistic",
        input_dim=12,
        num_classes=3,
        clients=6,
        local_steps=3,
        batch_size=4,
        per_client=8,
        map_batch=2,
    ),
}


def preset(name: str) -> Workload:
    if name not in PRESETS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]


# ------------------------------------------------------------------------------ flops
def step_flops(macs: list[int], batch: int) -> int:
    """Exact matmul FLOPs of one SGD step on a batch (multiply-add = 2) of layers doing
    `macs[l]` multiply-adds per example: forward `2B sum macs`, weight gradients the same,
    input gradients of every layer but the first (the data needs none) `2B sum_{l>=2} macs`."""
    return 2 * batch * (2 * sum(macs) + sum(macs[1:]))


def dense_step_flops(widths: tuple[int, ...], batch: int) -> int:
    """`step_flops` of a dense net (`in * out` multiply-adds per layer)."""
    return step_flops([a * b for a, b in zip(widths[:-1], widths[1:], strict=True)], batch)


def layer_macs(w: Workload) -> list[int]:
    """Multiply-adds per example of each matmul (or convolution) layer of the model."""
    if w.model == "simple_cnn":
        return conv_macs(w.image, w.num_classes)
    return [a * b for a, b in zip(w.widths[:-1], w.widths[1:], strict=True)]


def model_flops(w: Workload) -> int:
    """FLOPs of a round in the usual `6 x batch x multiply-adds per example` convention (for
    dense nets `6 x batch x params-in-matmuls`, the issue's ~382 GFLOP for W1); larger than
    the exact matmul count (`step_flops`), which skips the first layer's input gradient."""
    return 6 * w.examples * sum(layer_macs(w))


def exact_round_matmul_flops(w: Workload) -> int:
    return w.client_steps * step_flops(layer_macs(w), w.batch_size)


# ------------------------------------------------------------------------------ building
class Built(NamedTuple):
    model: Model
    data: FederatedData
    algorithm: Algorithm
    state: Any
    key: jax.Array


def make_model(w: Workload) -> Model:
    if w.model == "simple_cnn":
        return models.simple_cnn(w.image, w.num_classes)
    if w.model == "mlp":
        return models.mlp((w.input_dim,), w.num_classes, hidden=w.hidden)
    return models.logistic_regression((w.input_dim,), w.num_classes)


def make_data(w: Workload, seed: int = 0) -> FederatedData:
    """Random data generated on device (no host copy): `x [C, N, d]` uniform in [0, 1),
    `y [C, N]` uniform labels; client i's rows depend only on `(seed, i)`."""
    block = max(1, min(w.clients, GEN_BLOCK_BYTES * w.clients // data_bytes(w)))
    x, y = _generate(
        jax.random.key(seed), w.clients, w.per_client, w.input_dim, w.num_classes, block
    )
    counts = jnp.full((w.clients,), w.per_client, jnp.int32)
    return FederatedData(x=x, y=y, counts=counts, num_classes=w.num_classes)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _generate(key, clients, per_client, dim, classes, block):
    def one(i):
        kx, ky = jax.random.split(jax.random.fold_in(key, i))
        x = jax.random.uniform(kx, (per_client, dim), jnp.float32)
        return x, jax.random.randint(ky, (per_client,), 0, classes, jnp.int32)

    # written block by block into the output (in place in the loop), so the peak is the data
    # itself plus one block; the last block is shifted back to end at the last client (rows
    # it overlaps are regenerated with the same values: each depends only on its client id)
    def body(b, xy):
        start = jnp.minimum(b * block, clients - block)
        bx, by = jax.vmap(one)(start + jnp.arange(block))
        x, y = xy
        return (
            lax.dynamic_update_slice_in_dim(x, bx, start, 0),
            lax.dynamic_update_slice_in_dim(y, by, start, 0),
        )

    out = (
        jnp.zeros((clients, per_client, dim), jnp.float32),
        jnp.zeros((clients, per_client), jnp.int32),
    )
    return lax.fori_loop(0, -(-clients // block), body, out)


def abstract_data(w: Workload) -> FederatedData:
    """The data's shapes only (for lowering/compiling without allocating)."""
    f32, i32 = jnp.float32, jnp.int32
    return FederatedData(
        x=jax.ShapeDtypeStruct((w.clients, w.per_client, w.input_dim), f32),
        y=jax.ShapeDtypeStruct((w.clients, w.per_client), i32),
        counts=jax.ShapeDtypeStruct((w.clients,), i32),
        num_classes=w.num_classes,
    )


def data_bytes(w: Workload) -> int:
    return w.clients * w.per_client * (4 * w.input_dim + 4) + 4 * w.clients


def client_map(w: Workload) -> ClientMap:
    """The workload's client map; with `devices > 1`, sharded over a client mesh."""
    mesh = None
    if w.devices > 1:
        if jax.device_count() < w.devices:
            raise ValueError(
                f"workload needs {w.devices} devices, this process has {jax.device_count()} "
                "(on CPU start it with XLA_FLAGS=--xla_force_host_platform_device_count=N; "
                "`fedjax-sim bench` does so in each measurement process)"
            )
        mesh = client_mesh(w.devices)
    return ClientMap(w.mode, w.map_batch if w.mode == "map" else None, mesh=mesh)


def algorithm_kwargs(w: Workload, data: FederatedData | None = None) -> dict[str, Any]:
    """Generic keyword arguments offered to every factory (each gets those it takes, see
    `make_algorithm`): the client/server optimizers, local work, full participation and
    `num_clients`; `data` for factories that precompute something from the training data.
    Asynchronous algorithms get `firing_probability=1`, `capacity=None` and `buffer_size=C`:
    every client fires and is trained in each event iteration, aggregated once, so one `step`
    does a FedAvg round's work."""
    kw: dict[str, Any] = {
        "client_optimizer": CLIENT_LR,
        "server_optimizer": 1.0,
        "local": LocalSpec(steps=w.local_steps, batch_size=w.batch_size),
        "cohort": CohortSpec(),
        "client_map": client_map(w),
        "num_clients": w.clients,
        "firing_probability": 1.0,
        "capacity": None,
        "buffer_size": w.clients,
    }
    if data is not None:
        kw["data"] = data
    kw.update(dict(w.hparams))
    return kw


def missing_required(name: str, offered: dict[str, Any]) -> list[str]:
    """Required keyword-only arguments of a factory that `offered` does not provide."""
    params = hyper_parameters(algorithms.ALGORITHMS[name]).values()
    return [p.name for p in params if p.default is p.empty and p.name not in offered]


def check_hparams(algorithm: str, names: Collection[str]) -> dict[str, Any]:
    """The hyper-parameters of `algorithm` (ValueError naming the `--hparams` `names` it
    does not take)."""
    takes = hyper_parameters(algorithms.ALGORITHMS[algorithm])
    unknown = set(names) - set(takes)
    if unknown:
        raise ValueError(
            f"--hparams {sorted(unknown)} not accepted by {algorithm}; it takes {sorted(takes)}"
        )
    return takes


def make_algorithm(w: Workload, data: FederatedData | None = None) -> Algorithm:
    """Builds `w.algorithm` through the registry with the offered arguments it takes
    (ValueError naming any required hyper-parameter the generic workload cannot provide, or
    a `--hparams` name it does not take)."""
    offered = algorithm_kwargs(w, data)
    if w.algorithm not in algorithms.ALGORITHMS:
        raise ValueError(
            f"unknown algorithm {w.algorithm!r}; choose from {sorted(algorithms.ALGORITHMS)}"
        )
    missing = missing_required(w.algorithm, offered)
    if missing:
        raise ValueError(f"{w.algorithm} requires hyper-parameters {missing} (pass --hparams)")
    takes = check_hparams(w.algorithm, dict(w.hparams))
    model = make_model(w)
    kwargs = {k: v for k, v in offered.items() if k in takes}
    return algorithms.build(w.algorithm, model.loss, **kwargs)


def build(w: Workload, seed: int = 0) -> Built:
    """Model, data, algorithm, initial state and key of a workload (allocates the data)."""
    model = make_model(w)
    data = make_data(w, seed)
    alg = make_algorithm(w, data)
    key = jax.random.key(seed)
    state = alg.init(model.init(key), key)
    if w.devices > 1:  # per-client data and state live sharded, as in a real sharded run
        state, data = distributed.place_run(state, data, client_mesh(w.devices))
    return Built(model, data, alg, state, key)


__all__ = [
    "PRESETS",
    "Built",
    "Workload",
    "abstract_data",
    "algorithm_kwargs",
    "build",
    "client_map",
    "data_bytes",
    "dense_step_flops",
    "exact_round_matmul_flops",
    "layer_macs",
    "make_algorithm",
    "make_data",
    "make_model",
    "missing_required",
    "model_flops",
    "preset",
    "step_flops",
]
