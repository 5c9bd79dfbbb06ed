"""FedAvg rounds in Google's fedjax 0.0.17, the way fedjax's own examples run them.

Runs under the fedjax venv's python (`benchmarks/peers/fedjax_venv.sh`), never the project's:
it imports only numpy, jax, haiku and fedjax. `fedjax-sim bench --suite baselines` calls it
(through `fedjax_sim.app.bench.runner.measure_venv_peer`) with one JSON spec argument and
reads the last stdout line, a JSON object (the spec and result of `pfl_fedavg.py`):

    spec: {"model": "mlp" | "simple_cnn", "widths": [784, 200, 200, 10] (mlp),
           "image": [32, 32, 3] (simple_cnn), "num_classes", "clients", "per_client",
           "local_steps", "batch_size", "lr", "rounds", "threads" (ignored: XLA's own thread
           pool, as for the jitted JAX loop), "seed",
           "fixed": optional path of an .npz with x [C, N, d], y [C, N], indices [C, K, B] and
           the initial parameters p0, p1, ...: kernel then bias of each layer in order, in
           haiku's (and flax's) layout, dense kernels [in, out], conv kernels [kh, kw, in, out];
           "out": where the parameters after the rounds are written (.npz, same names)}
    out:  {"round_s": [...], "fedjax": version, "jax": version, "haiku": version,
           "peak_rss_bytes", "local": how local training is fed}

fedjax's API as its examples use it (`examples/emnist_fed_avg.py`, the FedAvg tutorial):
`fedjax.InMemoryFederatedData({client_id: {"x": ..., "y": ...}})`, a haiku model through
`fedjax.create_model_from_haiku` with `unreduced_cross_entropy_loss`, `fedjax.model_grad`,
`fedjax.algorithms.fed_avg.federated_averaging(grad_fn, optimizers.sgd(lr),
optimizers.sgd(1.0), ShuffleRepeatBatchHParams(...))`, clients from
`fedjax.client_samplers.UniformGetClientSampler(fd, num_clients, seed)` and
`algorithm.apply(server_state, clients)` per round. Local training runs through fedjax's
default `for_each_client` backend (jit): a Python loop over the clients, per client a jitted
`client_init`, one jitted `client_step` per batch (NumPy batches handed to it from the host)
and a jitted `client_final`; the server sums the count-weighted deltas client by client.

Every round trains all `clients` clients (the sampler draws `clients` of `clients` without
replacement: full participation, in a random order). Local work: the client's `per_client`
examples through `shuffle_repeat_batch(batch_size=B, num_epochs=None, num_steps=K)`, which
yields exactly K batches of exactly B examples: shuffled epochs (without replacement within
an epoch) repeated as needed; ours draws each step's rows with replacement. On `cifar_pfl`
(5 x 10 = 50 examples) that is one shuffled epoch, as in pfl's benchmark; on W1 (10 x 32 from
100) 3.2 epochs. With `fixed`, each client's dataset is its `indices` rows in order (K x B)
and batches are taken in order (`num_epochs=1, skip_shuffle=True`): the tests' apples-to-
apples update (fedjax weights clients by their dataset sizes, K x B for every client then;
the tests use equal client sizes, where this equals count weighting).

The models: the MLP (ReLU between `hk.Linear` layers) and the CNN of
`fedjax_sim.models.simple_cnn` as `hk.Conv2D(VALID)` / `hk.max_pool` / `hk.Linear` (NHWC,
flattened in (h, w, c) order like ours; no dropout, like ours: it is fedjax's own EMNIST
`create_conv_model` less its two dropout layers, at CIFAR's shape). Initialisation: haiku's
defaults (truncated normal weights, zero biases), which changes no timing.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import fedjax
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from fedjax.algorithms import fed_avg
from fedjax.version import __version__ as FEDJAX_VERSION

CHANNELS, DENSE = (32, 64), 128


def layer_names(spec: dict) -> list[str]:
    """Haiku module names of the weighted layers, in order (the `p0, p1, ...` order)."""
    if spec["model"] == "simple_cnn":
        return ["conv_0", "conv_1", "dense_0", "dense_1"]
    if spec["model"] == "mlp":
        return [f"dense_{i}" for i in range(len(spec["widths"]) - 1)]
    raise ValueError(f"fedjax peer: unknown model {spec['model']!r}")


def make_model(spec: dict, sample_x: np.ndarray) -> fedjax.Model:
    """The workload's model as a fedjax `Model` built from a haiku forward pass."""
    names = layer_names(spec)

    def forward(batch):
        x = batch["x"]
        if spec["model"] == "simple_cnn":
            for name, ch in zip(names[:2], CHANNELS, strict=True):
                x = jax.nn.relu(hk.Conv2D(ch, (3, 3), padding="VALID", name=name)(x))
            x = hk.max_pool(x, window_shape=(1, 2, 2, 1), strides=(1, 2, 2, 1), padding="VALID")
            x = hk.Flatten()(x)
            x = jax.nn.relu(hk.Linear(DENSE, name=names[2])(x))
            return hk.Linear(spec["num_classes"], name=names[3])(x)
        widths = spec["widths"]
        for i, out in enumerate(widths[1:]):
            x = hk.Linear(out, name=names[i])(x)
            x = jax.nn.relu(x) if i < len(widths) - 2 else x
        return x

    return fedjax.create_model_from_haiku(
        transformed_forward_pass=hk.transform(forward),
        sample_batch={"x": sample_x, "y": np.zeros(len(sample_x), np.int32)},
        train_loss=lambda batch, preds: fedjax.metrics.unreduced_cross_entropy_loss(
            batch["y"], preds
        ),
        eval_metrics={"accuracy": fedjax.metrics.Accuracy()},
    )


def run(spec: dict) -> dict:
    seed = spec.get("seed", 0)
    rng = np.random.default_rng(seed)
    C, N, K, B = spec["clients"], spec["per_client"], spec["local_steps"], spec["batch_size"]
    shape = tuple(spec["image"]) if spec["model"] == "simple_cnn" else (spec["widths"][0],)
    fixed = np.load(spec["fixed"]) if spec.get("fixed") else None
    if fixed is not None:
        x = fixed["x"].astype(np.float32).reshape(C, N, *shape)
        y = fixed["y"].astype(np.int32)
        rows = fixed["indices"].reshape(C, K * B)  # each client's minibatches, in order
        x, y = np.stack([x[i][r] for i, r in enumerate(rows)]), np.take_along_axis(y, rows, 1)
        batching = fedjax.ShuffleRepeatBatchHParams(batch_size=B, num_epochs=1, skip_shuffle=True)
    else:  # synthetic data like the bench's: uniform [0, 1) features, uniform labels
        x = rng.random((C, N, *shape), dtype=np.float32)
        y = rng.integers(0, spec["num_classes"], (C, N), dtype=np.int32)
        batching = fedjax.ShuffleRepeatBatchHParams(batch_size=B, num_epochs=None, num_steps=K)
    fd = fedjax.InMemoryFederatedData({b"%d" % i: {"x": x[i], "y": y[i]} for i in range(C)})
    model = make_model(spec, x[0, :1])
    params = model.init(jax.random.PRNGKey(seed))
    names = layer_names(spec)
    if fixed is not None:
        params = {
            name: {"w": jnp.asarray(fixed[f"p{2 * i}"]), "b": jnp.asarray(fixed[f"p{2 * i + 1}"])}
            for i, name in enumerate(names)
        }
    algorithm = fed_avg.federated_averaging(
        fedjax.model_grad(model),
        fedjax.optimizers.sgd(spec["lr"]),
        fedjax.optimizers.sgd(1.0),
        batching,
    )
    state = algorithm.init(params)
    sampler = fedjax.client_samplers.UniformGetClientSampler(fd, num_clients=C, seed=seed)
    laps = []
    for _ in range(int(spec["rounds"])):
        t0 = time.perf_counter()
        state, _ = algorithm.apply(state, sampler.sample())
        jax.block_until_ready(state.params)
        laps.append(time.perf_counter() - t0)
    if spec.get("out"):
        arrays = {}
        for i, name in enumerate(names):
            arrays[f"p{2 * i}"] = np.asarray(state.params[name]["w"])
            arrays[f"p{2 * i + 1}"] = np.asarray(state.params[name]["b"])
        np.savez(spec["out"], **arrays)
    return {
        "round_s": laps,
        "fedjax": FEDJAX_VERSION,
        "jax": jax.__version__,
        "haiku": hk.__version__,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "local": f"{K} given batches of {B}, in order"
        if fixed is not None
        else f"{K} batches of {B} from shuffle_repeat_batch (shuffled epochs of {N})",
    }


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
