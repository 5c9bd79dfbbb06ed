"""Baselines run on the same FedAvg workload as our engine.

- `loop_round`: a Python loop over clients of a jitted per-client update with a running
  weighted sum of deltas (how fedjax and most JAX research code simulate).
- `TorchFedAvg`: a plain PyTorch per-client loop, the way FL research code and Flower
  clients train: per client a fresh copy of the global model (`copy.deepcopy`), a new SGD
  optimizer, K minibatch steps with `cross_entropy` + `backward` + `step`, then the
  count-weighted average of the local models. Needs the optional extra `peers` (torch).
- `VENV_PEERS`, frameworks run in venvs of their own (they pin packages the project does
  not) by `benchmarks/peers/<name>_fedavg.py`: pfl-research (its `FederatedAveraging` on its
  `SimulatedBackend` with its PyTorch model; `.venv-pfl`) and Google's fedjax 0.0.17 (its
  `federated_averaging` with a haiku model, on jax 0.5.3; `.venv-fedjax`).

All compute plain FedAvg (client SGD with a fixed learning rate, server averaging with
count weights) on `Workload` data, so times are comparable with `fedavg` rounds.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sim.algorithms.core import LOCAL, client_key, local_train, round_key
from fedjax_sim.app.bench.results import REPO
from fedjax_sim.app.bench.workloads import CLIENT_LR, Workload
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.base import Model
from fedjax_sim.models.simple_cnn import CHANNELS as CNN_CHANNELS
from fedjax_sim.models.simple_cnn import DENSE as CNN_DENSE


def loop_round(
    model: Model, data: FederatedData, params: Any, key: jax.Array, w: Workload
) -> Callable[[], Any]:
    """`run() -> new params`: one FedAvg round as a Python loop over a jitted client update
    (same keys, hence the same minibatches, as `fedavg` round 0)."""

    @jax.jit
    def client_update(params, x, y, count, k):
        res = local_train(
            params,
            data.client(0)._replace(x=x, y=y, count=count),
            k,
            loss_fn=model.loss,
            optimizer=optax.sgd(CLIENT_LR),
            max_steps=w.local_steps,
            batch_size=w.batch_size,
        )
        return jax.tree.map(lambda a, b: (a - b) * count, res.params, params)

    local_key = round_key(key, jnp.int32(0), LOCAL)

    def run():
        total = jax.tree.map(jnp.zeros_like, params)
        for i in range(data.num_clients):
            delta = client_update(
                params, data.x[i], data.y[i], data.counts[i], client_key(local_key, i)
            )
            total = jax.tree.map(jnp.add, total, delta)
        n = jnp.sum(data.counts)
        return jax.block_until_ready(jax.tree.map(lambda p, t: p + t / n, params, total))

    return run


def batch_indices(key: jax.Array, counts: np.ndarray, w: Workload, round_: int = 0) -> np.ndarray:
    """`[C, K, B]` minibatch row indices that `fedavg` (sampling with replacement) draws in
    round `round_` (for apples-to-apples checks of the baselines)."""
    local_key = round_key(key, jnp.int32(round_), LOCAL)

    def one(cid, n):
        k = jax.random.fold_in(client_key(local_key, cid), 0)
        steps = jnp.arange(w.local_steps)
        return jax.vmap(
            lambda s: jax.random.randint(
                jax.random.fold_in(k, s), (w.batch_size,), 0, jnp.maximum(n, 1)
            )
        )(steps)

    ids = jnp.arange(len(counts))
    return np.asarray(jax.vmap(one)(ids, jnp.asarray(counts, jnp.int32)))


class TorchFedAvg:
    """FedAvg as a plain PyTorch per-client loop on a `Workload`'s model: its dense net, or
    `models.simple_cnn` as `Conv2d`/`MaxPool2d`/`Linear` layers (NCHW: each client's images
    are transposed once, when stored).

    `params` is our flax parameter tree (`{"Dense_l": {"kernel": [in, out], "bias": [out]}}`,
    `Conv_l` kernels `[kh, kw, in, out]`); the torch model starts from the same weights.
    `indices [C, K, B]` fixes the minibatches (tests); without it each step draws
    `torch.randint(0, n_i, (B,))` like a research loop. On a GPU host (JAX's backend "gpu"
    and a CUDA build of torch) the model, the data and the draws live on the GPU, and a round
    ends with `torch.cuda.synchronize()` (its time includes the queued kernels).
    """

    def __init__(
        self,
        w: Workload,
        params: Any,
        x: np.ndarray,
        y: np.ndarray,
        counts: np.ndarray,
        *,
        threads: int | None = None,
        seed: int = 0,
    ):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.w = w
        self.threads = torch.get_num_threads()
        self.device = torch_device(torch)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.model = torch_net(torch, w).to(self.device)
        self.set_params(params)
        # per-client tensors, as a per-client Dataset would hold them
        x = np.array(x, np.float32)  # a writable copy (torch tensors share its memory)
        if w.model == "simple_cnn":  # [C, N, H * W * C] -> [C, N, C, H, W]
            x = x.reshape(*x.shape[:2], *w.image).transpose(0, 1, 4, 2, 3)
        self.x = [torch.from_numpy(np.ascontiguousarray(xi)).to(self.device) for xi in x]
        self.y = [torch.from_numpy(np.asarray(yi, np.int64)).to(self.device) for yi in y]
        self.counts = [int(n) for n in np.asarray(counts)]

    def _layers(self) -> dict[str, Any]:
        """Our layer names -> the torch layers with weights, in order."""
        nn = self.torch.nn
        convs = [m for m in self.model if isinstance(m, nn.Conv2d)]
        dense = [m for m in self.model if isinstance(m, nn.Linear)]
        return {
            **{f"Conv_{i}": m for i, m in enumerate(convs)},
            **{f"Dense_{i}": m for i, m in enumerate(dense)},
        }

    def _pooled(self) -> tuple[int, int, int]:
        """`(h, w, c)` of the CNN's pooled features (the first dense layer's input)."""
        h, w, _ = self.w.image
        return (h - 4) // 2, (w - 4) // 2, CNN_CHANNELS[-1]

    def set_params(self, params: Any) -> None:
        with self.torch.no_grad():
            for name, layer in self._layers().items():
                k = np.asarray(params[name]["kernel"])
                if name.startswith("Conv"):  # [kh, kw, in, out] -> [out, in, kh, kw]
                    k = k.transpose(3, 2, 0, 1)
                elif name == "Dense_0" and self.w.model == "simple_cnn":
                    # flax flattens (h, w, c), torch (c, h, w): permute the rows
                    h, w, c = self._pooled()
                    k = k.reshape(h, w, c, -1).transpose(2, 0, 1, 3).reshape(h * w * c, -1).T
                else:
                    k = k.T
                layer.weight.copy_(self.torch.from_numpy(np.ascontiguousarray(k)))
                layer.bias.copy_(self.torch.from_numpy(np.array(params[name]["bias"])))

    def params(self) -> dict[str, dict[str, np.ndarray]]:
        """The global model in our flax layout."""
        out = {}
        for name, layer in self._layers().items():
            k = layer.weight.detach().cpu().numpy()
            if name.startswith("Conv"):
                k = k.transpose(2, 3, 1, 0)
            elif name == "Dense_0" and self.w.model == "simple_cnn":
                h, w, c = self._pooled()
                k = k.T.reshape(c, h, w, -1).transpose(1, 2, 0, 3).reshape(h * w * c, -1)
            else:
                k = k.T
            out[name] = {"kernel": k.copy(), "bias": layer.bias.detach().cpu().numpy().copy()}
        return out

    def round(self, indices: np.ndarray | None = None) -> None:
        """One FedAvg round over all clients (updates the global model in place)."""
        torch, w = self.torch, self.w
        f = torch.nn.functional
        total = {k: torch.zeros_like(v) for k, v in self.model.state_dict().items()}
        n_total = 0
        for i, n in enumerate(self.counts):
            if n == 0:
                continue
            local = copy.deepcopy(self.model)
            opt = torch.optim.SGD(local.parameters(), lr=CLIENT_LR)
            xi, yi = self.x[i], self.y[i]
            for k in range(w.local_steps):
                if indices is None:
                    idx = torch.randint(
                        0, n, (w.batch_size,), generator=self.generator, device=self.device
                    )
                else:
                    idx = torch.from_numpy(np.asarray(indices[i, k], np.int64)).to(self.device)
                opt.zero_grad()
                loss = f.cross_entropy(local(xi[idx]), yi[idx])
                loss.backward()
                opt.step()
            with torch.no_grad():
                for name, v in local.state_dict().items():
                    total[name] += n * v
            n_total += n
        if n_total:
            self.model.load_state_dict({k: v / n_total for k, v in total.items()})
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def torch_device(torch: Any) -> Any:
    """Where a torch peer runs: the GPU when JAX runs on one (and torch is a CUDA build), so
    peers compare on the same hardware; else the CPU."""
    gpu = jax.default_backend() == "gpu" and torch.cuda.is_available()
    return torch.device("cuda" if gpu else "cpu")


def torch_net(torch: Any, w: Workload) -> Any:
    """The workload's model as a torch `Sequential` (NCHW images for the CNN; pfl's module
    without its two dropout layers, see `models.simple_cnn`)."""
    nn = torch.nn
    if w.model == "simple_cnn":
        h, wd, c = w.image
        a, b = CNN_CHANNELS
        return nn.Sequential(
            nn.Conv2d(c, a, 3), nn.ReLU(), nn.Conv2d(a, b, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear((h - 4) // 2 * ((wd - 4) // 2) * b, CNN_DENSE), nn.ReLU(),
            nn.Linear(CNN_DENSE, w.num_classes),
        )  # fmt: skip
    layers: list[Any] = []
    for a, b in zip(w.widths[:-1], w.widths[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


# ------------------------------------------------------------------------------ venv peers
@dataclasses.dataclass(frozen=True)
class VenvPeer:
    """A peer framework that runs in a venv of its own (it pins packages the project does
    not), through `benchmarks/peers/<name>_fedavg.py`: one JSON spec argument (`peer_spec`)
    in, its last stdout line, a JSON object with `round_s` (every round's seconds, the first
    compiling) and `peak_rss_bytes`, out. `benchmarks/peers/<name>_venv.sh` makes the venv
    `.venv-<name>`.

    Attributes:
      name: the bench task and the rows' `engine` ("pfl", "fedjax").
      title: how rows and messages name it.
      fields: result fields copied into the row (versions, threads, how local work is fed).
    """

    name: str
    title: str
    fields: tuple[str, ...]

    @property
    def script(self) -> str:
        return os.path.join(REPO, "benchmarks", "peers", f"{self.name}_fedavg.py")

    @property
    def recipe(self) -> str:
        return f"benchmarks/peers/{self.name}_venv.sh"

    @property
    def venv_python(self) -> str:
        return os.path.join(REPO, f".venv-{self.name}", "bin", "python")

    def python(self, python: str | None = None) -> str | None:
        """The venv's python: `python` if given, else `.venv-<name>/bin/python` of this
        checkout; None if that file does not exist."""
        path = python or self.venv_python
        return path if os.path.exists(path) else None

    def run(self, spec: dict, python: str, timeout_s: float | None = None) -> dict:
        """Runs the peer's script with `python` on `spec`; its result object (RuntimeError
        with the end of its stderr if it fails)."""
        proc = subprocess.run(
            [python, self.script, json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
            raise RuntimeError(f"{self.name} peer failed (exit {proc.returncode}): {tail}")
        return json.loads(lines[-1])


VENV_PEERS: dict[str, VenvPeer] = {
    # pfl-research 0.6.0: its FederatedAveraging on its SimulatedBackend, PyTorch model
    "pfl": VenvPeer("pfl", "pfl-research", ("pfl", "torch", "torch_threads", "local")),
    # Google's fedjax 0.0.17: fed_avg.federated_averaging, a haiku model, jax 0.5.3
    "fedjax": VenvPeer("fedjax", "fedjax 0.0.17", ("fedjax", "jax", "haiku", "local")),
}


def peer_spec(w: Workload, rounds: int, threads: int | None = None, seed: int = 0) -> dict:
    """The JSON spec of a venv peer's script for `rounds` FedAvg rounds of `w` (every client
    each round, client SGD at `CLIENT_LR`, server SGD at 1)."""
    if w.algorithm != "fedavg":
        raise ValueError(f"the venv peers run FedAvg only, got {w.algorithm!r}")
    return {
        "model": "simple_cnn" if w.model == "simple_cnn" else "mlp",  # logistic: no hidden
        "widths": list(w.widths),
        "image": list(w.image),
        "num_classes": w.num_classes,
        "clients": w.clients,
        "per_client": w.per_client,
        "local_steps": w.local_steps,
        "batch_size": w.batch_size,
        "lr": CLIENT_LR,
        "rounds": rounds,
        "threads": threads,
        "seed": seed,
    }
