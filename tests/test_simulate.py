"""simulate(): chunked scan equals stepping, resume is bit-identical, NaN guard, outputs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import EvalSpec, NonFiniteError, simulate
from fedjax_sim.algorithms import CohortSpec, LocalSpec, fedavg
from fedjax_sim.data import ArrayData, least_squares, load_digits
from fedjax_sim.models import linear_regression, mlp
from fedjax_sim.run.history import History
from fedjax_sim.run.simulate import client_stats, evaluate_central, evaluate_clients


@pytest.fixture(scope="module")
def digits():
    return load_digits(num_clients=20)


def _setup(ds):
    model = mlp(ds.feature_shape, 10, hidden=(16,))
    alg = fedavg(
        model.loss,
        client_optimizer=0.1,
        local=LocalSpec(steps=3, batch_size=8),
        cohort=CohortSpec(size=5),
    )
    return model, alg


def test_simulate_equals_manual_steps(digits):
    model, alg = _setup(digits)
    key = jax.random.key(3)
    hist = simulate(
        alg,
        digits.train,
        key,
        model=model,
        num_rounds=7,
        test=digits.test,
        evaluation=EvalSpec(every=3),
        progress=False,
    )
    params = model.init(jax.random.fold_in(key, 7))
    state = alg.init(params, key)
    losses = []
    step = jax.jit(alg.step)
    for _ in range(7):
        state, m = step(state, digits.train, key)
        losses.append(float(m["train_loss"]))
    np.testing.assert_allclose(hist.metric("train_loss"), losses, rtol=1e-5)
    assert hist.rounds == list(range(1, 8))
    assert [e["round"] for e in hist.evals] == [0, 3, 6, 7]
    final = evaluate_central(model, state.params, digits.test)
    np.testing.assert_allclose(
        hist.final()["test_accuracy"], float(final["test_accuracy"]), atol=1e-6
    )


def test_chunks_donate_the_state_but_never_the_callers_arrays(digits):
    """A chunk reuses its input state's buffers (per-client rows updated in place, not
    copied once per chunk): the input arrays are deleted after the call. `simulate` first
    copies the state, so the params a caller passes in stay usable."""
    from fedjax_sim.run.loop import owned
    from fedjax_sim.run.simulate import _compiled_chunk

    model, alg = _setup(digits)
    key = jax.random.key(3)
    params = model.init(key)
    state = owned(alg.init(params, key))
    new_state, _ = _compiled_chunk(alg, 2)(state, digits.train, key, 2)
    assert all(a.is_deleted() for a in jax.tree.leaves(state))
    assert not any(a.is_deleted() for a in jax.tree.leaves(new_state))
    hist = simulate(
        alg, digits.train, key, model=model, num_rounds=3, params=params, progress=False
    )
    assert not any(a.is_deleted() for a in jax.tree.leaves(params))
    again = simulate(
        alg, digits.train, key, model=model, num_rounds=3, params=params, progress=False
    )
    np.testing.assert_array_equal(again.metric("train_loss"), hist.metric("train_loss"))


def test_resume_is_bit_identical(digits, tmp_path):
    model, alg = _setup(digits)
    key = jax.random.key(11)
    kw = dict(model=model, test=digits.test, evaluation=EvalSpec(every=2), progress=False)
    full = simulate(alg, digits.train, key, num_rounds=8, **kw)
    ckpt = str(tmp_path / "ckpt")
    first = simulate(
        alg, digits.train, key, num_rounds=5, checkpoint_dir=ckpt, checkpoint_every=2, **kw
    )
    assert first.num_rounds == 5
    resumed = simulate(
        alg,
        digits.train,
        key,
        num_rounds=8,
        checkpoint_dir=ckpt,
        checkpoint_every=2,
        resume=True,
        **kw,
    )
    assert resumed.rounds == full.rounds
    for name in full.metrics:
        np.testing.assert_array_equal(resumed.metric(name), full.metric(name), err_msg=name)
    # the interrupted run also evaluated its last round (5); all others coincide exactly
    assert [e for e in resumed.evals if e["round"] != 5] == full.evals


def test_resume_rejects_other_key(digits, tmp_path):
    model, alg = _setup(digits)
    ckpt = str(tmp_path / "c")
    simulate(
        alg,
        digits.train,
        jax.random.key(0),
        model=model,
        num_rounds=2,
        checkpoint_dir=ckpt,
        checkpoint_every=2,
        progress=False,
    )
    with pytest.raises(ValueError, match="different key"):
        simulate(
            alg,
            digits.train,
            jax.random.key(1),
            model=model,
            num_rounds=4,
            checkpoint_dir=ckpt,
            checkpoint_every=2,
            resume=True,
            progress=False,
        )


def test_nan_guard_names_the_round():
    problem = least_squares(num_clients=4, examples_per_client=10, dim=3)
    model = linear_regression(3)
    alg = fedavg(model.loss, client_optimizer=50.0, local=LocalSpec(steps=5, sampling="full"))
    with pytest.raises(NonFiniteError, match=r"at round \d+"):
        simulate(
            alg,
            problem.data,
            jax.random.key(0),
            model=model,
            params={"w": jnp.ones(3)},
            num_rounds=200,
            evaluation=EvalSpec(every=50),
            progress=False,
        )


def test_nan_round_is_the_first_bad_one():
    """The reported round is where the params first become non-finite (checked by stepping)."""
    problem = least_squares(num_clients=2, examples_per_client=5, dim=2)
    model = linear_regression(2)
    alg = fedavg(model.loss, client_optimizer=20.0, local=LocalSpec(steps=3, sampling="full"))
    state = alg.init({"w": jnp.ones(2)}, jax.random.key(0))
    bad = None
    for r in range(1, 300):
        state, _ = alg.step(state, problem.data, jax.random.key(0))
        if not np.isfinite(np.asarray(state.params["w"])).all():
            bad = r
            break
    assert bad is not None
    with pytest.raises(NonFiniteError, match=f"at round {bad} "):
        simulate(
            alg,
            problem.data,
            jax.random.key(0),
            model=model,
            params={"w": jnp.ones(2)},
            num_rounds=300,
            evaluation=EvalSpec(every=40),
            progress=False,
        )


def test_outputs_written(digits, tmp_path):
    model, alg = _setup(digits)
    out = tmp_path / "run"
    simulate(
        alg,
        digits.train,
        jax.random.key(0),
        model=model,
        num_rounds=4,
        test=digits.test,
        evaluation=EvalSpec(every=2),
        out_dir=str(out),
        progress=False,
        meta={"title": "t"},
    )
    for name in ["history.json", "history.csv", "history.png"]:
        assert (out / name).stat().st_size > 0
    loaded = History.load(str(out / "history.json"))
    assert loaded.rounds == [1, 2, 3, 4] and loaded.evals[-1]["round"] == 4
    header = (out / "history.csv").read_text().splitlines()[0].split(",")
    assert header[0] == "round" and "train_loss" in header and "test_accuracy" in header
    assert json.loads((out / "history.json").read_text())["meta"]["title"] == "t"


def test_evaluate_clients_summaries():
    """Per-client accuracy summaries against a direct NumPy computation."""
    model = linear_regression(1)
    x = jnp.arange(12.0).reshape(3, 4, 1)
    y = jnp.zeros((3, 4))
    counts = jnp.array([4, 2, 0])
    params = {"w": jnp.array([0.5])}
    out = evaluate_clients(model, params, x, y, counts)
    losses = [
        np.mean(0.5 * (0.5 * np.arange(4.0)) ** 2),
        np.mean(0.5 * (0.5 * np.arange(4.0, 6.0)) ** 2),
    ]
    np.testing.assert_allclose(out["client_loss_mean"], np.mean(losses), rtol=1e-6)
    np.testing.assert_allclose(out["client_loss_worst"], max(losses), rtol=1e-6)


def test_evaluate_clients_in_row_blocks_match_whole_clients():
    """Blocks of 3 rows (padded, 7 rows per client) give the NumPy sums of each client's
    valid rows, as the whole-client evaluation does (`EvalSpec.client_rows`)."""
    model = linear_regression(1)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 7, 1)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(3, 7)), jnp.float32)
    counts = jnp.array([7, 5, 0])
    params = {"w": jnp.array([0.5])}
    whole = client_stats(model, params, x, y, counts)
    blocked = client_stats(model, params, x, y, counts, rows=3)
    valid = np.arange(7)[None, :] < np.asarray(counts)[:, None]
    ref = np.sum(0.5 * (0.5 * np.asarray(x)[..., 0] - np.asarray(y)) ** 2 * valid, 1)
    for out in (whole, blocked):
        np.testing.assert_allclose(out["loss"], ref, rtol=1e-6)
        np.testing.assert_array_equal(out["count"], [7, 5, 0])
    with pytest.raises(ValueError, match="client_rows"):
        EvalSpec(client_rows=0)


def test_evaluate_central_batches_match_single_batch():
    model = linear_regression(2)
    rng = np.random.default_rng(0)
    test = ArrayData(
        x=jnp.asarray(rng.normal(size=(37, 2)), jnp.float32),
        y=jnp.asarray(rng.normal(size=37), jnp.float32),
    )
    params = {"w": jnp.array([0.3, -0.7])}
    a = evaluate_central(model, params, test, batch_size=5)
    b = evaluate_central(model, params, test, batch_size=1000)
    np.testing.assert_allclose(a["test_loss"], b["test_loss"], rtol=1e-6)


@pytest.mark.parametrize(
    "kw", [dict(num_rounds=0), dict(evaluation=EvalSpec(every=0)), dict(checkpoint_every=2)]
)
def test_simulate_bad_arguments(digits, kw):
    model, alg = _setup(digits)
    args = dict(model=model, num_rounds=2, progress=False) | kw
    with pytest.raises(ValueError):
        simulate(alg, digits.train, jax.random.key(0), **args)


def test_return_state_is_the_final_state(digits, tmp_path):
    """`return_state=True`: the state after the last round (its evaluation is the history's
    last row, and a resumed run returns the same state bit for bit)."""
    model, alg = _setup(digits)
    key = jax.random.key(5)
    kw = dict(model=model, test=digits.test, evaluation=EvalSpec(every=2), progress=False)
    hist, state = simulate(alg, digits.train, key, num_rounds=6, return_state=True, **kw)
    assert int(state.round) == 6
    final = evaluate_central(model, state.params, digits.test)
    assert hist.final()["test_accuracy"] == float(final["test_accuracy"])
    ckpt = dict(checkpoint_dir=str(tmp_path / "c"), checkpoint_every=3)
    simulate(alg, digits.train, key, num_rounds=3, **ckpt, **kw)
    for rounds in (6, 4):  # continued to 6; then already past 4: the restored state
        _, resumed = simulate(
            alg, digits.train, key, num_rounds=rounds, resume=True, return_state=True, **ckpt, **kw
        )
        jax.tree.map(np.testing.assert_array_equal, resumed, state)
