"""Evaluation of personal models (issue 37 item 3): each client's own model on its test
split (mean, worst, 10th percentile, the per-client distribution), the global model beside
it, and unseen clients after k local steps; NumPy references on hand-built personal models."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import ditto, fedavg
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.core.rows import Rows
from fedjax_sim.data import FederatedData, load
from fedjax_sim.data.unseen import held_out
from fedjax_sim.models.nets import logistic_regression
from fedjax_sim.run.evaluation import (
    client_summary,
    evaluate_clients,
    evaluate_personal,
    evaluate_unseen,
)
from fedjax_sim.run.history import History
from fedjax_sim.run.simulate import EvalSpec, simulate
from fedjax_sim.run.streaming import simulate_streamed
from fedjax_sim.run.sweep import sweep
from fedjax_sim.runtime.parallel import ClientMap

MODEL = logistic_regression((4,), 3)
SUMMARIES = ("accuracy_mean", "accuracy_worst", "accuracy_p10", "loss_mean", "loss_worst")


def _data(num_clients=7, seed=0) -> FederatedData:
    """Small 3-class clients with unequal train / test sizes; client 2 has no test data."""
    rng = np.random.default_rng(seed)
    n = 6
    x = rng.normal(size=(num_clients, n, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=(num_clients, n)).astype(np.int32)
    counts = rng.integers(2, n + 1, size=num_clients)
    xt = rng.normal(size=(num_clients, n, 4)).astype(np.float32)
    yt = rng.integers(0, 3, size=(num_clients, n)).astype(np.int32)
    test_counts = rng.integers(1, n + 1, size=num_clients)
    test_counts[2] = 0
    return FederatedData.create(
        x, y, counts, x_test=xt, y_test=yt, test_counts=test_counts, num_classes=3
    )


def _numpy_stats(w, b, data):
    """Per-client accuracy and mean loss of logistic models `w [C, 4, 3]`, `b [C, 3]` on each
    client's test rows (float64); NaN for clients without test rows."""
    acc, loss = [], []
    for i in range(data.num_clients):
        n = int(data.test_counts[i])
        if n == 0:
            acc.append(np.nan), loss.append(np.nan)
            continue
        logits = np.asarray(data.x_test[i, :n], np.float64) @ w[i] + b[i]
        yi = np.asarray(data.y_test[i, :n])
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        acc.append(np.mean(np.argmax(logits, -1) == yi))
        loss.append(-np.mean(logp[np.arange(n), yi]))
    return np.array(acc), np.array(loss)


def _expected(acc, loss, prefix):
    """The summaries over clients with test data; the 10th percentile is
    numpy.percentile(method="lower")."""
    ok = ~np.isnan(acc)
    return {
        f"{prefix}_accuracy_mean": acc[ok].mean(),
        f"{prefix}_accuracy_worst": acc[ok].min(),
        f"{prefix}_accuracy_p10": np.percentile(acc[ok], 10, method="lower"),
        f"{prefix}_loss_mean": loss[ok].mean(),
        f"{prefix}_loss_worst": loss[ok].max(),
    }


@pytest.mark.parametrize("client_map", [ClientMap("vmap"), ClientMap("map", 3)])
def test_hand_built_personal_rows_match_numpy(client_map):
    """Ditto's state with known personal rows v_i: the personal metrics are NumPy's per-client
    accuracies / losses of v_i, their mean, worst and lower 10th percentile (7 clients in
    blocks of 3: the last block padded)."""
    data = _data()
    c = data.num_clients
    alg = ditto(MODEL.loss, num_clients=c, client_optimizer=0.1)
    key = jax.random.key(0)
    state = alg.init(MODEL.init(key), key)
    rng = np.random.default_rng(1)
    rows = jax.tree.map(
        lambda a: jnp.asarray(rng.normal(size=(c, *a.shape)), a.dtype), state.params
    )
    state = state.replace(rows={**state.rows, "personal_proximal": Rows(rows)})
    out = evaluate_personal(MODEL, alg.personalize, state, data, key, client_map)
    layer = rows["Dense_0"]
    acc, loss = _numpy_stats(np.asarray(layer["kernel"]), np.asarray(layer["bias"]), data)
    np.testing.assert_array_equal(np.asarray(out["personal_accuracy"]), acc.astype(np.float32))
    np.testing.assert_allclose(np.asarray(out["personal_loss"]), loss, rtol=1e-5)
    for k, v in _expected(acc, loss, "personal").items():
        np.testing.assert_allclose(float(out[k]), v, rtol=1e-5, err_msg=k)


def test_p10_is_numpy_lower_percentile():
    """The 10th percentile over 23 clients (index floor(0.1 * 22) = 2 of the sorted values),
    clients without data excluded."""
    acc = np.random.default_rng(3).uniform(size=25).round(2)
    counts = np.full(25, 10)
    counts[[4, 9]] = 0
    stats = {"correct": acc * 10, "loss": acc, "count": counts.astype(float)}
    out = client_summary(jax.tree.map(jnp.asarray, stats), jnp.asarray(counts), "g")
    keep = counts > 0
    assert float(out["g_accuracy_p10"]) == pytest.approx(
        np.percentile(acc[keep], 10, method="lower")
    )
    assert float(out["g_accuracy_p10"]) == pytest.approx(np.sort(acc[keep])[2])


def test_fedavg_personal_equals_global_per_client_exactly():
    """Without `personalize` each client's model is the global one: the personal metrics and
    distribution equal the global model's per-client ones bit for bit, at every evaluation."""
    data = _data()
    alg = fedavg(
        MODEL.loss,
        client_optimizer=0.5,
        local=LocalSpec(steps=2, batch_size=4),
        cohort=CohortSpec(size=3),
    )
    h = simulate(
        alg,
        data,
        jax.random.key(0),
        model=MODEL,
        num_rounds=2,
        evaluation=EvalSpec(every=1, central=False, personal=True),
        progress=False,
    )
    assert [e["round"] for e in h.client_evals] == [0, 1, 2]
    for e in h.evals:
        for s in SUMMARIES:
            assert e[f"personal_{s}"] == e[f"client_{s}"], s
    for what in ("accuracy", "loss"):
        rounds, personal = h.client_series(f"personal_{what}")
        _, global_ = h.client_series(f"client_{what}")
        assert personal.shape == (3, data.num_clients)
        np.testing.assert_array_equal(personal, global_)
    assert np.isnan(personal[:, 2]).all()  # client 2 has no test split
    assert h.evals[-1]["client_accuracy_mean"] != h.evals[0]["client_accuracy_mean"]


def test_unseen_with_zero_steps_is_the_global_model():
    """Unseen clients adapted by 0 local steps are evaluated with the global model; k > 0
    steps change their losses (the adaptation uses their own training rows)."""
    data = _data(num_clients=8)
    train, unseen = held_out(data, 3, seed=0)
    assert (train.num_clients, unseen.num_clients) == (5, 3)
    key = jax.random.key(0)
    state = fedavg(MODEL.loss).init(MODEL.init(key), key)
    adapted = jax.jit(
        lambda state, steps: evaluate_unseen(
            MODEL, state, unseen, key, steps=steps, lr=0.5, batch_size=4
        ),
        static_argnums=1,
    )
    zero = adapted(state, 0)
    ref = evaluate_clients(
        MODEL,
        state.params,
        unseen.x_test,
        unseen.y_test,
        unseen.test_counts,
        prefix="unseen",
        distribution=True,
    )
    for k, v in ref.items():
        np.testing.assert_allclose(np.asarray(zero[k]), np.asarray(v), rtol=1e-6, err_msg=k)
    np.testing.assert_array_equal(zero["unseen_accuracy"], ref["unseen_accuracy"])
    three = adapted(state, 3)
    assert not np.allclose(three["unseen_loss"], zero["unseen_loss"], equal_nan=True)


def test_simulate_records_personal_and_unseen_and_history_round_trips(tmp_path):
    """Ditto on a non-IID digits split: personal, global and unseen metrics in every
    evaluation row, per-client distributions in History.client_evals (saved, loaded,
    truncated by a resume), the plot written."""
    ds = load("digits", num_clients=8, alpha=0.1, seed=0)
    train, unseen = held_out(ds.train, 2)
    model = logistic_regression((64,), 10)
    alg = ditto(
        model.loss,
        num_clients=train.num_clients,
        client_optimizer=0.2,
        local=LocalSpec(steps=5, batch_size=16),
        cohort=CohortSpec(size=3),
    )
    h = simulate(
        alg,
        train,
        jax.random.key(1),
        model=model,
        num_rounds=4,
        test=ds.test,
        evaluation=EvalSpec(every=2, personal=True, unseen_steps=2),
        unseen=unseen,
        out_dir=str(tmp_path),
        progress=False,
    )
    last = h.final()
    for prefix in ("personal", "client", "unseen"):
        assert {f"{prefix}_{s}" for s in SUMMARIES} <= set(last)
    assert last["personal_accuracy_mean"] > last["client_accuracy_mean"]  # label skew
    rounds, acc = h.client_series("personal_accuracy")
    assert rounds.tolist() == [0, 2, 4] and acc.shape == (3, train.num_clients)
    assert h.client_series("unseen_accuracy")[1].shape == (3, 2)
    ok = ~np.isnan(acc[-1])
    assert acc[-1][ok].mean() == pytest.approx(last["personal_accuracy_mean"], rel=1e-6)
    loaded = History.load(str(tmp_path / "history.json"))
    np.testing.assert_array_equal(loaded.client_series("personal_accuracy")[1], acc)
    assert (tmp_path / "history.png").exists()
    loaded.truncate(2)
    assert [e["round"] for e in loaded.client_evals] == [0, 2]


def test_refusals():
    data = _data()
    spec = EvalSpec(every=1, personal=True)
    no_test = dataclasses.replace(data, x_test=None, y_test=None, test_counts=None)
    alg = fedavg(MODEL.loss)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="the data has no per-client test splits"):
        simulate(alg, no_test, key, model=MODEL, num_rounds=1, evaluation=spec, progress=False)
    with pytest.raises(ValueError, match="unseen clients need test splits"):
        simulate(alg, data, key, model=MODEL, num_rounds=1, unseen=no_test, progress=False)
    with pytest.raises(ValueError, match="a streamed run evaluates on the central test set only"):
        simulate_streamed(alg, None, key, plan=None, model=MODEL, num_rounds=1, evaluation=spec)
    with pytest.raises(ValueError, match="a sweep evaluates its runs' global models"):
        sweep(lambda hp: alg, data, seeds=1, model=MODEL, num_rounds=1, evaluation=spec)
    with pytest.raises(ValueError, match="unseen_steps must be an int >= 0"):
        EvalSpec(unseen_steps=-1)
    with pytest.raises(ValueError, match="unseen_lr must be > 0"):
        EvalSpec(unseen_lr=0.0)
    with pytest.raises(ValueError, match=r"unseen clients must be an int in \[1, 6\]"):
        held_out(data, 7)
