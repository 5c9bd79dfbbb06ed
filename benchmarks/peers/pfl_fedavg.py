"""FedAvg rounds in pfl-research (PyTorch backend), the way pfl's own benchmarks run them.

Runs under the pfl venv's python (`benchmarks/peers/pfl_venv.sh`), never the project's: it
imports only numpy, torch and pfl. `fedjax-sim bench --suite baselines` calls it (through
`fedjax_sim.app.bench.runner.measure_venv_peer`) with one JSON spec argument and reads the last
stdout line, a JSON object:

    spec: {"model": "mlp" | "simple_cnn", "widths": [784, 200, 200, 10] (mlp),
           "image": [32, 32, 3] (simple_cnn), "num_classes", "clients", "per_client",
           "local_steps", "batch_size", "lr", "rounds", "threads": int | null, "seed",
           "fixed": optional path of an .npz with x [C, N, d], y [C, N], indices [C, K, B] and
           the initial parameters p0, p1, ... in the torch module's order; "out": where the
           parameters after the rounds are written (.npz, same names)}
    out:  {"round_s": [...], "pfl": version, "torch": version, "torch_threads",
           "peak_rss_bytes", "local": how local training is fed}

pfl's API as its benchmarks use it (`benchmarks/image_classification/pytorch/train.py`):
`FederatedDataset(make_dataset_fn, get_user_sampler("minimize_reuse", users))`,
`PyTorchModel(module, local_optimizer_create=torch.optim.SGD, central_optimizer=SGD(lr=1))`,
`SimulatedBackend(training_data, val_data=None, postprocessors=[WeightByUser()])`,
`FederatedAveraging().run(NNAlgorithmParams(...), backend, model, NNTrainHyperParams(...),
NNEvalHyperParams(...), callbacks)`. Every round trains all `clients` users (full
participation: pfl's cohort = its population, as on our side). Local work: when
`local_steps x batch_size == per_client` (pfl's CIFAR-10 configuration: 50 images, batch 10)
one epoch over the user's data in order (pfl's `local_num_epochs=1`); otherwise (W1: 10 steps
of 32 from 100 examples) the user's dataset is `local_steps x batch_size` rows drawn with
replacement when pfl asks for it, trained for `local_num_steps` batches in order, which is
what our engine computes (minibatches drawn with replacement). With `fixed`, those rows are
the given `indices` (the tests' apples-to-apples update).
"""

from __future__ import annotations

import json
import resource
import sys
import time
import types

import numpy as np
import pfl
import torch
import torch.nn.functional as F
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByUser
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Metrics, StringMetricName, Weighted
from pfl.model.pytorch import PyTorchModel
from torch import nn


def _loss(self, x, y, eval=False):  # noqa: A002 (pfl's signature)
    self.eval() if eval else self.train()
    return F.cross_entropy(self(x), y.long())


@torch.no_grad()
def _metrics(self, x, y, eval=True):  # noqa: A002
    self.eval() if eval else self.train()
    loss = F.cross_entropy(self(x), y.long(), reduction="sum").item()
    return {StringMetricName("loss"): Weighted(loss, len(y))}


class _NHWCtoNCHW(nn.Module):  # pfl's Transpose2D
    def forward(self, x):
        return x.permute(0, 3, 1, 2)


def make_module(spec: dict) -> nn.Module:
    """pfl's `simple_cnn` (its benchmarks' CIFAR-10 CNN, dropout included) or the MLP."""
    if spec["model"] == "simple_cnn":
        h, w, c = spec["image"]
        flat = (h - 4) // 2 * ((w - 4) // 2) * 64
        module = nn.Sequential(
            _NHWCtoNCHW(),
            nn.Conv2d(c, 32, kernel_size=(3, 3)),
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=(3, 3)),
            nn.ReLU(),
            nn.MaxPool2d((2, 2)),
            nn.Dropout(0.25),
            nn.Flatten(),
            nn.Linear(flat, 128),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(128, spec["num_classes"]),
        )
        for m in module.modules():  # pfl's Glorot init
            if isinstance(m, nn.Conv2d | nn.Linear):
                nn.init.xavier_uniform_(m.weight)
    elif spec["model"] == "mlp":
        widths = spec["widths"]
        layers: list[nn.Module] = []
        for a, b in zip(widths[:-1], widths[1:], strict=True):
            layers += [nn.Linear(a, b), nn.ReLU()]
        module = nn.Sequential(*layers[:-1])
    else:
        raise ValueError(f"pfl peer: unknown model {spec['model']!r}")
    module.loss = types.MethodType(_loss, module)
    module.metrics = types.MethodType(_metrics, module)
    return module


class _Laps(TrainingProcessCallback):
    """Wall-clock seconds of each central iteration."""

    def on_train_begin(self, *, model):
        self.laps, self.t = [], time.perf_counter()
        return Metrics()

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        t = time.perf_counter()
        self.laps.append(t - self.t)
        self.t = t
        return False, Metrics()


def run(spec: dict) -> dict:
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    torch.manual_seed(spec.get("seed", 0))
    rng = np.random.default_rng(spec.get("seed", 0))
    C, N, K, B = spec["clients"], spec["per_client"], spec["local_steps"], spec["batch_size"]
    shape = tuple(spec["image"]) if spec["model"] == "simple_cnn" else (spec["widths"][0],)
    module = make_module(spec)
    fixed = np.load(spec["fixed"]) if spec.get("fixed") else None
    if fixed is not None:
        x = fixed["x"].astype(np.float32).reshape(C, N, *shape)
        y = fixed["y"].astype(np.int64)
        with torch.no_grad():
            for i, p in enumerate(module.parameters()):
                p.copy_(torch.from_numpy(np.array(fixed[f"p{i}"], np.float32)))
    else:  # synthetic data like the bench's: uniform [0, 1) features, uniform labels
        x = rng.random((C, N, *shape), dtype=np.float32)
        y = rng.integers(0, spec["num_classes"], (C, N), dtype=np.int64)
    epoch = fixed is None and K * B == N

    def make_dataset_fn(uid):
        if epoch:
            return Dataset((x[uid], y[uid]), user_id=uid)
        rows = fixed["indices"][uid].reshape(-1) if fixed is not None else rng.integers(0, N, K * B)
        return Dataset((x[uid][rows], y[uid][rows]), user_id=uid)

    users = list(range(C))
    data = FederatedDataset(make_dataset_fn, get_user_sampler("minimize_reuse", users))
    params = [p for p in module.parameters() if p.requires_grad]
    model = PyTorchModel(
        model=module,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(params, 1.0),
    )
    backend = SimulatedBackend(training_data=data, val_data=None, postprocessors=[WeightByUser()])
    rounds = int(spec["rounds"])
    algorithm_params = NNAlgorithmParams(
        central_num_iterations=rounds,
        evaluation_frequency=rounds + 1,  # no evaluation inside the timed rounds
        train_cohort_size=C,
        val_cohort_size=0,
    )
    train = NNTrainHyperParams(
        local_learning_rate=spec["lr"],
        local_num_epochs=1 if epoch else None,
        local_num_steps=None if epoch else K,
        local_batch_size=B,
    )
    laps = _Laps()
    FederatedAveraging().run(
        algorithm_params=algorithm_params,
        backend=backend,
        model=model,
        model_train_params=train,
        model_eval_params=NNEvalHyperParams(local_batch_size=B),
        callbacks=[laps],
    )
    if spec.get("out"):
        arrays = {f"p{i}": p.detach().numpy() for i, p in enumerate(module.parameters())}
        np.savez(spec["out"], **arrays)
    return {
        "round_s": laps.laps,
        "pfl": pfl.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "local": "1 epoch over the user's data"
        if epoch
        else f"{K} steps over {K * B} rows drawn with replacement",
    }


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
