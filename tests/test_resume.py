"""Issue 34: resuming a long run or sweep keeps the history's memory bounded and writes the
same files, byte for byte, as the uninterrupted run."""

import csv
import json

import jax
import numpy as np
import optax
import pytest

from fedjax_sim import EvalSpec, simulate
from fedjax_sim.algorithms import CohortSpec, LocalSpec, fedavg
from fedjax_sim.data import load_digits
from fedjax_sim.models import mlp
from fedjax_sim.run.history import History, Series
from fedjax_sim.run.sweep import sweep

LEFT = 32  # chunks run after the resume (one round each)


@pytest.fixture(scope="module")
def setup():
    ds = load_digits(num_clients=10)
    model = mlp(ds.feature_shape, 10, hidden=(4,))
    local, cohort = LocalSpec(steps=1, batch_size=8), CohortSpec(size=3)
    alg = fedavg(model.loss, client_optimizer=0.1, local=local, cohort=cohort)

    def make(hp):
        return fedavg(model.loss, client_optimizer=optax.sgd(hp["lr"]), local=local, cohort=cohort)

    return ds, model, alg, make


def _bounded(history: History) -> None:
    for name, column in history.metrics.items():
        assert isinstance(column, Series), name
        assert column.capacity < max(16, 2 * len(column)), (name, column.capacity, len(column))


def test_series_grows_geometrically_and_keeps_its_dtype():
    restored = History.from_dict(json.loads(json.dumps(_float32_history().to_dict())))
    assert restored.metrics["loss"].dtype == np.float32
    assert restored.metrics["count"].dtype == np.int32
    legacy = Series([1.0, 2.0])  # a history saved without dtypes: float64
    for _ in range(1000):
        legacy.extend(np.ones(1, np.float32))
    assert legacy.dtype == np.float64 and len(legacy) == 1002 and legacy.capacity < 2004


def _float32_history() -> History:
    h = History()
    h.append_rounds(1, {"loss": np.float32([0.7754148, 2.5]), "count": np.int32([10, 3])})
    return h


def test_resumed_run_memory_stays_bounded(setup, tmp_path):
    ds, model, alg, _ = setup
    kw = dict(model=model, test=ds.test, evaluation=EvalSpec(every=1), progress=False)
    ckpt = str(tmp_path / "ckpt")
    simulate(alg, ds.train, jax.random.key(0), num_rounds=2, checkpoint_dir=ckpt, **kw)
    resumed = simulate(
        alg,
        ds.train,
        jax.random.key(0),
        num_rounds=2 + LEFT,
        checkpoint_dir=ckpt,
        checkpoint_every=2,
        resume=True,
        **kw,
    )
    assert resumed.rounds == list(range(1, 3 + LEFT))
    _bounded(resumed)


def test_resumed_sweep_memory_stays_bounded(setup, tmp_path):
    ds, model, _, make = setup
    kw = dict(
        seeds=2,
        grid={"lr": [0.1]},
        model=model,
        test=ds.test,
        evaluation=EvalSpec(every=1, clients=False),
        progress=False,
        runs_per_group=2,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=2,
    )
    sweep(make, ds.train, num_rounds=2, **kw)
    resumed = sweep(make, ds.train, num_rounds=2 + LEFT, resume=True, **kw)
    for h in resumed.histories:
        assert h.rounds == list(range(1, 3 + LEFT))
        _bounded(h)


def test_resumed_run_writes_the_same_files(setup, tmp_path):
    """N rounds straight and N/2 + resume to N: history.csv and history.jsonl identical byte
    for byte (float32 metrics print as float32, ints as ints), history.json equal but for the
    wall-clock seconds."""
    ds, model, alg, _ = setup
    kw = dict(model=model, test=ds.test, evaluation=EvalSpec(every=2), progress=False)
    straight, parts = tmp_path / "straight", tmp_path / "parts"
    simulate(alg, ds.train, jax.random.key(1), num_rounds=8, out_dir=str(straight), **kw)
    ckpt = str(parts / "checkpoints")
    for rounds in (4, 8):
        simulate(
            alg,
            ds.train,
            jax.random.key(1),
            num_rounds=rounds,
            out_dir=str(parts),
            checkpoint_dir=ckpt,
            checkpoint_every=4,
            resume=rounds == 8,
            **kw,
        )
    for name in ("history.csv", "history.jsonl"):
        assert (parts / name).read_bytes() == (straight / name).read_bytes(), name
    rows = list(csv.DictReader((straight / "history.csv").read_text().splitlines()))[1:]
    assert {row["participants"] for row in rows} == {"3"}  # ints stay ints
    assert all(row["train_loss"] == str(np.float32(row["train_loss"])) for row in rows)

    def summary(folder):
        d = json.loads((folder / "history.json").read_text())
        d["meta"].pop("seconds")
        return d

    assert summary(parts) == summary(straight)


def test_resumed_sweep_writes_the_same_runs_csv(setup, tmp_path):
    ds, model, _, make = setup
    kw = dict(
        seeds=2,
        grid={"lr": [0.1, 0.2]},
        model=model,
        test=ds.test,
        evaluation=EvalSpec(every=2, clients=False),
        progress=False,
        runs_per_group=4,
    )
    sweep(make, ds.train, num_rounds=6, out_dir=str(tmp_path / "straight"), **kw)
    ck = dict(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2)
    sweep(make, ds.train, num_rounds=4, **ck, **kw)
    sweep(make, ds.train, num_rounds=6, out_dir=str(tmp_path / "parts"), resume=True, **ck, **kw)
    text = (tmp_path / "straight" / "runs.csv").read_bytes()
    assert (tmp_path / "parts" / "runs.csv").read_bytes() == text
