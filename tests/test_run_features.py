"""Every driver x every run feature of the one run loop (`fedjax_sim.run.loop`): resume is bit
for bit the uninterrupted run, Ctrl-C saves a checkpoint that resumes to it too, the
privacy accountant's epsilon is in the history, `out_dir` gets files, the NaN guard stops
(or, in a sweep, marks) the run, and a mesh works or is refused with one line naming why."""

import functools
import os

import jax
import numpy as np
import optax
import pytest

from fedjax_sim import EvalSpec, NonFiniteError, simulate
from fedjax_sim.algorithms import CohortSpec, LocalSpec, fedavg, scaffold
from fedjax_sim.data import load_digits
from fedjax_sim.data.store import ClientStore
from fedjax_sim.models import logistic_regression
from fedjax_sim.run.loop import Interrupted
from fedjax_sim.run.streaming import AlgorithmCohorts, simulate_streamed
from fedjax_sim.run.sweep import runs_mesh, sweep
from fedjax_sim.runtime.parallel import client_mesh

C, M, ROUNDS = 12, 3, 4
LOCAL = LocalSpec(steps=2, batch_size=8)
DRIVERS = ["simulate", "streamed_device", "streamed_host", "sweep"]


@functools.cache
def _setup():
    digits = load_digits(num_clients=C)
    model = logistic_regression(digits.feature_shape, 10)
    alg = scaffold(model.loss, num_clients=C, local=LOCAL, cohort=CohortSpec(size=M))

    def make(hp):  # one object per process (`_setup` is cached): one compilation
        return fedavg(
            model.loss, local=LOCAL, cohort=CohortSpec(size=M), client_optimizer=optax.sgd(0.1)
        )

    return digits, model, alg, make


def _run(driver, **kw):
    """The histories of a 4-round run of `driver` (evaluations every 2 rounds)."""
    digits, model, alg, make = _setup()
    kw = {"model": model, "num_rounds": ROUNDS, "test": digits.test, "progress": False, **kw}
    if driver == "simulate":
        return [simulate(alg, digits.train, jax.random.key(0), evaluation=EvalSpec(every=2), **kw)]
    if driver == "sweep":
        return sweep(make, digits.train, seeds=2, evaluation=EvalSpec(every=2), **kw).histories
    store = ClientStore.from_federated(digits.train)
    plan = AlgorithmCohorts(CohortSpec(size=M), store.counts)
    return [
        simulate_streamed(
            alg, store, jax.random.key(0), plan=plan, evaluation=EvalSpec(every=2, clients=False),
            state_rows=driver.split("_")[1], **kw,
        )
    ]  # fmt: skip


def _same(h1, h2):
    assert h1.rounds == h2.rounds
    for k in h1.metrics:
        np.testing.assert_array_equal(np.asarray(h1.metrics[k]), np.asarray(h2.metrics[k]), k)
    assert h1.evals == h2.evals


def _epsilon(r):
    return 0.25 * r


@pytest.mark.parametrize("driver", DRIVERS)
def test_resume_and_privacy(driver, tmp_path):
    full = _run(driver, privacy=_epsilon)
    assert [e["epsilon"] for e in full[0].evals] == [0.0, 0.5, 1.0]
    ckpt = str(tmp_path / "ckpt")
    kw = dict(checkpoint_dir=ckpt, checkpoint_every=2, privacy=_epsilon)
    first = _run(driver, **{**kw, "num_rounds": 2})
    assert first[0].num_rounds == 2
    resumed = _run(driver, resume=True, **kw)
    for a, b in zip(full, resumed, strict=True):
        _same(a, b)


@pytest.mark.parametrize("driver", DRIVERS)
def test_ctrl_c_saves_a_checkpoint_that_resumes(driver, tmp_path):
    full = _run(driver, privacy=_epsilon)

    def interrupt_at_2(r):
        if r == 2:
            raise KeyboardInterrupt
        return _epsilon(r)

    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(Interrupted) as e:
        _run(driver, checkpoint_dir=ckpt, privacy=interrupt_at_2)
    assert e.value.round == 2 and e.value.checkpoint == ckpt
    resumed = _run(driver, checkpoint_dir=ckpt, resume=True, privacy=_epsilon)
    for a, b in zip(full, resumed, strict=True):
        _same(a, b)


@pytest.mark.parametrize("driver", DRIVERS)
def test_out_dir_files(driver, tmp_path):
    _run(driver, out_dir=str(tmp_path))
    files = set(os.listdir(tmp_path))
    assert ({"histories.json", "runs.csv"} if driver == "sweep" else {"history.csv"}) <= files


@pytest.mark.parametrize("driver", DRIVERS)
def test_nan_guard(driver):
    digits, model, alg, make = _setup()
    nan = jax.tree.map(lambda p: p * np.nan, model.init(jax.random.key(0)))
    if driver == "sweep":  # the other runs go on: each run's first bad round is marked
        assert [h.meta["nonfinite_round"] for h in _run(driver, params=nan)] == [1, 1]
        return
    with pytest.raises(NonFiniteError, match="at round 1"):
        _run(driver, params=nan)


@pytest.mark.parametrize("driver", DRIVERS)
def test_mesh_works_or_is_refused_in_one_line(driver):
    if driver.startswith("streamed"):
        with pytest.raises(ValueError, match="^mesh: a streamed run puts each chunk's") as e:
            _run(driver, mesh=client_mesh(1))
        assert "\n" not in str(e.value)
        return
    mesh = runs_mesh(1) if driver == "sweep" else client_mesh(1)
    for a, b in zip(_run(driver), _run(driver, mesh=mesh), strict=True):
        _same(a, b)
