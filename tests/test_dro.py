"""Group-DRO evaluation (`fedjax_sim.run.dro`): per-group stats vs NumPy, summaries, and the
`EvalSpec.extra` hook end to end with `simulate` (natural split, FGDRO-KL, plot)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import fgdro_kl
from fedjax_sim.algorithms.core import LocalSpec
from fedjax_sim.data.builtin import load_shifted_minority
from fedjax_sim.models import logistic_regression
from fedjax_sim.run.dro import dro_evaluator, group_stats, plot_worst_vs_average, summarize
from fedjax_sim.run.simulate import EvalSpec, simulate
from fedjax_sim.runtime.parallel import ClientMap


def _np_softmax_ce(logits, y):
    z = logits - logits.max(1, keepdims=True)
    return np.log(np.exp(z).sum(1)) - z[np.arange(len(y)), y]


def test_group_stats_matches_numpy_per_class():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(203, 5)).astype(np.float32)
    y = rng.integers(0, 3, size=203).astype(np.int32)
    model = logistic_regression((5,), 3)
    params = model.init(jax.random.key(1))
    params = jax.tree.map(lambda p: p + 0.3 * jnp.ones_like(p), params)
    stats = group_stats(model, params, x, y, y, 4, batch_size=64)  # group 3 is empty
    logits = np.asarray(model.apply(params, x), np.float64)
    losses, correct = _np_softmax_ce(logits, y), logits.argmax(1) == y
    for g in range(3):
        sel = y == g
        assert float(stats["loss"][g]) == pytest.approx(losses[sel].mean(), rel=1e-5)
        assert float(stats["accuracy"][g]) == pytest.approx(correct[sel].mean(), abs=1e-6)
        assert float(stats["count"][g]) == sel.sum()
    assert float(stats["count"][3]) == 0


def test_summarize_worst_mean_cvar_kl_skip_empty_groups(x64):
    loss = jnp.array([0.5, 2.0, 9.0, 1.0])
    acc = jnp.array([0.9, 0.4, 0.0, 0.7])
    count = jnp.array([10.0, 5.0, 0.0, 3.0])  # group 2 has no examples: ignored
    out = summarize(loss, acc, count, prefix="g", k=2, temperature=0.5, per_group=True)
    valid = np.array([0.5, 2.0, 1.0])
    assert float(out["g_loss_worst"]) == 2.0 and float(out["g_accuracy_worst"]) == 0.4
    assert float(out["g_loss_mean"]) == pytest.approx(valid.mean())
    assert float(out["g_accuracy_mean"]) == pytest.approx(np.mean([0.9, 0.4, 0.7]))
    assert float(out["g_cvar"]) == pytest.approx(1.5)
    assert float(out["g_kl"]) == pytest.approx(0.5 * np.log(np.mean(np.exp(valid / 0.5))))
    assert float(out["g_accuracy_3"]) == pytest.approx(0.7)


def test_simulate_with_dro_evaluator_end_to_end(tmp_path):
    """Natural split (one client per group) -> FGDRO-KL under `simulate` with the DRO
    evaluator: evaluation rows carry per-group and worst/average values that agree with each
    other, the per-round metrics carry the learned client weights, and the plot is written."""
    ds = load_shifted_minority(num_clients=4, examples_per_client=40, dim=4)
    model = logistic_regression((4,), 2)
    alg = fgdro_kl(
        model.loss,
        num_clients=4,
        temperature=0.5,
        client_optimizer=0.1,
        local=LocalSpec(steps=4, batch_size=8),
        client_map=ClientMap("vmap"),
    )
    extra = dro_evaluator(model, groups="train", k=2, temperature=0.5, per_group=True)
    hist = simulate(
        alg,
        ds.train,
        jax.random.key(0),
        model=model,
        num_rounds=4,
        test=ds.test,
        evaluation=EvalSpec(every=2, extra=extra),
        progress=False,
    )
    row = hist.final()
    per = np.array([row[f"train_clients_loss_{g}"] for g in range(4)])
    assert row["train_clients_loss_worst"] == pytest.approx(per.max(), rel=1e-6)
    assert row["train_clients_loss_mean"] == pytest.approx(per.mean(), rel=1e-6)
    assert row["train_clients_cvar"] == pytest.approx(np.sort(per)[-2:].mean(), rel=1e-6)
    assert row["train_clients_kl"] == pytest.approx(
        0.5 * np.log(np.mean(np.exp(per / 0.5))), rel=1e-5
    )
    weights = np.asarray(hist.metrics["client_weights"])
    assert weights.shape == (4, 4) and np.allclose(weights.sum(1), 1.0, atol=1e-5)
    assert [e["round"] for e in hist.evals] == [0, 2, 4]
    path = os.path.join(tmp_path, "worst_vs_avg.png")
    plot_worst_vs_average(
        {"fgdro_kl": hist}, path, worst="train_clients_accuracy_worst", mean="test_accuracy"
    )
    assert os.path.getsize(path) > 1000


def test_dro_evaluator_rejects_bad_arguments():
    model = logistic_regression((4,), 2)
    with pytest.raises(ValueError, match="groups must be one of"):
        dro_evaluator(model, groups="domains")
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        dro_evaluator(model, temperature=0.0)
    with pytest.raises(ValueError, match="k must be >= 1"):
        dro_evaluator(model, k=0)
