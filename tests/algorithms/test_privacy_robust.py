"""Issue 21: DP-FedAvg aggregator, accounting, robust aggregators and attacks."""

import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting import rdp

from fedjax_sim.algorithms import fedavg
from fedjax_sim.algorithms.accounting import PrivacyAccounting
from fedjax_sim.algorithms.attacks import Attack, byzantine
from fedjax_sim.algorithms.client_work import ClientWork
from fedjax_sim.algorithms.core import Cohort, CohortSpec, LocalSpec
from fedjax_sim.algorithms.local_hook import chain
from fedjax_sim.algorithms.privacy import AdaptiveClipping, dp_mean
from fedjax_sim.algorithms.robust import (
    centered_clip,
    geometric_median,
    krum,
    median,
    multi_krum,
    trimmed_mean,
)
from fedjax_sim.data import least_squares
from fedjax_sim.models import linear_regression


# ------------------------------------------------------------------------------ DP
def test_clipping_bounds_norm_and_keeps_small_updates():
    agg = dp_mean(0.0, 1.0, 4.0)
    server, _ = agg.init({"w": jnp.zeros(3)}, 1)
    rng = np.random.default_rng(0)
    for scale in (0.01, 0.3, 5.0, 100.0):
        u = {"w": jnp.asarray(rng.normal(size=3) * scale, jnp.float32), "b": jnp.float32(scale)}
        (sent, b), _ = agg.encode(u, {}, jax.random.key(0), server)
        norm = math.sqrt(sum(float(jnp.sum(x**2)) for x in jax.tree.leaves(u)))
        sent_norm = math.sqrt(sum(float(jnp.sum(x**2)) for x in jax.tree.leaves(sent)))
        assert sent_norm <= 1.0 + 1e-6
        if norm <= 1.0:
            np.testing.assert_array_equal(sent["w"], u["w"])
            assert float(b) == 0.5
        else:
            np.testing.assert_allclose(sent["w"], u["w"] / norm, rtol=1e-6)
            assert float(b) == -0.5


def test_noise_std_uses_expected_cohort_size():
    # 3 clients took part, the expected cohort is m = 10: the update is (sum + N(0, (zC)^2))/m.
    z, c, m, d = 1.3, 0.7, 10.0, 200_000
    agg = dp_mean(z, c, m)
    server, _ = agg.init({"w": jnp.zeros(d)}, 1)
    clean = jnp.asarray(np.random.default_rng(1).normal(size=d), jnp.float32)
    weights = jnp.array([1.0, 1.0, 1.0, 0.0, 0.0])
    cohort = Cohort(jnp.arange(5), weights, jnp.int32(0), 5)
    update, _, metrics = agg.reduce(
        server, ({"w": clean}, jnp.float32(0)), jnp.float32(3), None, cohort, jax.random.key(3)
    )
    noise = np.asarray(update["w"]) - np.asarray(clean) / m
    # sample std of d normals: relative sd 1/sqrt(2d) = 0.0016; 5 sd = 0.8 %; mean: 5 sd/sqrt(d)
    target = z * c / m
    assert abs(noise.std() / target - 1) < 5 / math.sqrt(2 * d)
    assert abs(noise.mean()) < 5 * target / math.sqrt(d)
    assert abs(noise.std() / (z * c / 3) - 1) > 0.5  # not the realised count
    assert float(metrics["dp_unit_weights"]) == 1.0


def test_dp_fedavg_divides_by_expected_cohort_in_a_bernoulli_run():
    problem = least_squares(num_clients=8, examples_per_client=10, dim=3, seed=0)
    data, loss = problem.data, linear_regression(3).loss
    cohort = CohortSpec(sampling="bernoulli", probability=0.5, weighting="uniform")
    kw = dict(cohort=cohort, local=LocalSpec(steps=2, batch_size=4), report_cohort=True)
    plain = fedavg(loss, **kw)
    dp = fedavg(loss, aggregator=dp_mean(0.0, 1e6, 4.0), **kw)  # no noise, no clipping
    p0, key = {"w": jnp.ones(3)}, jax.random.key(0)
    s1, m1 = plain.step(plain.init(p0, key), data, key)
    s2, _ = dp.step(dp.init(p0, key), data, key)
    n = float(jnp.sum(m1["cohort_weights"] > 0))
    assert n not in (0.0, 4.0)  # the realised cohort differs from the expected one
    np.testing.assert_allclose(
        s2.params["w"] - 1.0, (s1.params["w"] - 1.0) * n / 4.0, rtol=1e-5, atol=1e-7
    )


def test_adaptive_clipping_converges_to_target_quantile():
    # norms ~ lognormal: C_t should reach the gamma-quantile of the norm distribution
    gamma, m = 0.7, 200
    agg = dp_mean(0.0, 0.1, float(m), adaptive=AdaptiveClipping(gamma, learning_rate=0.2))
    server, _ = agg.init({"w": jnp.zeros(2)}, 1)
    enc = jax.jit(jax.vmap(agg.encode, in_axes=(0, None, None, None)))
    red = jax.jit(agg.reduce)
    key = jax.random.key(0)
    for t in range(300):
        k = jax.random.fold_in(key, t)
        norms = jnp.exp(jax.random.normal(k, (m,)))
        u = {"w": jnp.stack([norms, jnp.zeros(m)], 1)}
        (sent, b), _ = enc(u, {}, key, server)
        total = (jax.tree.map(lambda x: x.sum(0), sent), b.sum())
        cohort = Cohort(jnp.arange(m), jnp.ones(m), jnp.int32(t), m)
        _, server, _ = red(server, total, jnp.float32(m), None, cohort, k)
    expected = math.exp(0.5244)  # lognormal 0.7-quantile: exp(Phi^-1(0.7))
    assert abs(float(server["clip"]) / expected - 1) < 0.1


# ------------------------------------------------------------------------------ accounting
def _direct_epsilon(event, delta, relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE):
    acc = rdp.RdpAccountant(neighboring_relation=relation)
    acc.compose(event)
    return acc.get_epsilon(delta)


def test_accounting_matches_dp_accounting():
    z, q, t, delta = 1.1, 0.05, 50, 1e-5
    ours = PrivacyAccounting(z, 100, "poisson", delta, probability=q).epsilon(t)
    direct = _direct_epsilon(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), t
        ),
        delta,
    )
    assert ours == pytest.approx(direct, rel=1e-12)
    full = PrivacyAccounting(z, 100, "full", delta).epsilon(t)
    direct = _direct_epsilon(
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), t), delta
    )
    assert full == pytest.approx(direct, rel=1e-12)
    assert full > ours  # sampling amplifies
    assert PrivacyAccounting(0.0, 100, "full", delta).epsilon(t) == math.inf


def test_run_reports_dp_accounting_epsilon_and_target(tmp_path):
    from fedjax_sim.app.cli import run
    from fedjax_sim.app.config import RunConfig

    common = dict(
        dataset="fedprox_synthetic",
        model="logistic",
        num_clients=20,
        rounds=6,
        eval_every=3,
        local_steps=2,
        progress=False,
        cohort_sampling="bernoulli",
        cohort_probability=0.25,
        dp_clip=1.0,
        cohort_size=None,
    )
    cfg = RunConfig(out=str(tmp_path / "a"), dp_noise=1.2, **common)
    assert run(cfg) == 0
    import json

    evals = json.load(open(tmp_path / "a" / "history.json"))["eval"]
    direct = _direct_epsilon(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(1.2)), 6
        ),
        1e-5,
    )
    assert [e["round"] for e in evals] == [0, 3, 6]
    assert evals[-1]["epsilon"] == pytest.approx(direct, rel=1e-9)
    cfg = RunConfig(out=str(tmp_path / "b"), target_epsilon=3.0, **common)
    assert run(cfg) == 0
    final = json.load(open(tmp_path / "b" / "history.json"))["eval"][-1]["epsilon"]
    assert 0.98 * 3.0 <= final <= 3.0


# ------------------------------------------------------------------------------ robust
def _reduce(agg, rows, weights):
    x = jnp.asarray(rows, jnp.float32)
    server, _ = agg.init({"w": x[0]}, 1)
    w = jnp.asarray(weights, jnp.float32)
    total = {"w": jnp.tensordot(w, x, axes=1)}
    cohort = Cohort(jnp.arange(x.shape[0]), w, jnp.int32(0), x.shape[0])
    out, _, _ = agg.reduce(server, total, w.sum(), {"w": x}, cohort, jax.random.key(0))
    return np.asarray(out["w"])


def _trimmed_ref(x, beta):
    n = x.shape[0]
    k = int(math.floor(beta * n))
    s = np.sort(x, axis=0)
    return s[k : n - k].mean(0)


@pytest.mark.parametrize("n_valid", [5, 6])  # odd / even participants
def test_median_and_trimmed_mean_vs_numpy_with_padding_and_ties(n_valid):
    rng = np.random.default_rng(n_valid)
    x = rng.integers(-3, 4, size=(8, 7)).astype(np.float32)  # many ties
    weights = np.zeros(8)
    weights[:n_valid] = rng.integers(1, 5, n_valid)
    x[n_valid:] = 1e6  # padding rows must not count
    honest = x[:n_valid]
    np.testing.assert_allclose(_reduce(median(), x, weights), np.median(honest, 0))
    np.testing.assert_allclose(_reduce(median(chunk=3), x, weights), np.median(honest, 0))
    for beta in (0.0, 0.2, 0.4):
        np.testing.assert_allclose(
            _reduce(trimmed_mean(beta), x, weights), _trimmed_ref(honest, beta), rtol=1e-6
        )


def test_breakdown_median_trimmed_mean_stay_in_honest_range():
    rng = np.random.default_rng(0)
    m, f = 11, 5  # f < M / 2
    x = rng.normal(size=(m, 20)).astype(np.float32)
    x[:f] = 1e6
    lo, hi = x[f:].min(0), x[f:].max(0)
    for agg in (median(), trimmed_mean(0.49)):  # trimmed mean: floor(beta M) = 5 >= f
        out = _reduce(agg, x, np.ones(m))
        assert np.all(out >= lo) and np.all(out <= hi)


def _krum_ref(x, f, m):
    n = x.shape[0]
    d2 = ((x[:, None] - x[None]) ** 2).sum(-1)
    scores = [np.sort(np.delete(d2[i], i))[: n - f - 2].sum() for i in range(n)]
    return x[np.argsort(scores, kind="stable")[:m]].mean(0)


def test_krum_vs_numpy_and_selects_honest():
    rng = np.random.default_rng(2)
    n, f = 9, 3  # n > 2f + 2
    x = rng.normal(size=(n, 6)).astype(np.float32)
    x[:f] = rng.normal(size=(f, 6)) * 5 + 40  # Byzantine cluster far away
    for m in (1, 3):
        np.testing.assert_allclose(
            _reduce(multi_krum(f, m), x, np.ones(n)), _krum_ref(x, f, m), rtol=1e-5
        )
    out = _reduce(krum(f), x, np.ones(n))
    assert any(np.allclose(out, x[i]) for i in range(f, n))
    # padding rows (weight 0) are never selected nor counted
    xp = np.concatenate([x, np.zeros((2, 6), np.float32)])
    np.testing.assert_allclose(
        _reduce(krum(f), xp, np.r_[np.ones(n), 0, 0]), _krum_ref(x, f, 1), rtol=1e-5
    )


def test_geometric_median_and_centered_clip_vs_numpy():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(7, 4)).astype(np.float64)
    w = rng.uniform(0.5, 2, 7)
    v = (w[:, None] * x).sum(0) / w.sum()
    for _ in range(10):
        b = w / np.maximum(1e-6, np.linalg.norm(x - v, axis=1))
        v = (b[:, None] * x).sum(0) / b.sum()
    np.testing.assert_allclose(_reduce(geometric_median(10), x, w), v, rtol=1e-4, atol=1e-5)
    tau, v = 0.5, np.zeros(4)
    for _ in range(3):
        diff = x - v
        s = np.minimum(1, tau / np.linalg.norm(diff, axis=1))
        v = v + (s[:, None] * diff).mean(0)
    np.testing.assert_allclose(_reduce(centered_clip(tau, 3), x, np.ones(7)), v, rtol=1e-5)


def test_robust_aggregators_run_in_presets_with_bernoulli_cohorts():
    from fedjax_sim.algorithms import scaffold
    from fedjax_sim.algorithms.aggregators import compressed
    from fedjax_sim.algorithms.compression import TopK

    problem = least_squares(num_clients=8, examples_per_client=10, dim=3, seed=0)
    cohort = CohortSpec(size=6, sampling="bernoulli", probability=0.5)
    loss, p0, key = linear_regression(3).loss, {"w": jnp.zeros(3)}, jax.random.key(0)
    for alg in (
        scaffold(loss, num_clients=8, cohort=cohort, aggregator=median()),
        fedavg(loss, cohort=cohort, aggregator=compressed(TopK(k=2), krum(1))),
        fedavg(loss, cohort=cohort, aggregator=geometric_median(), server_optimizer=0.5),
    ):
        state = alg.init(p0, key)
        step = jax.jit(alg.step)
        for _ in range(3):
            state, _ = step(state, problem.data, key)
        assert np.isfinite(state.params["w"]).all()


# ------------------------------------------------------------------------------ attacks
@pytest.mark.parametrize("kind", ["sign_flip", "scale", "gaussian", "label_flip"])
def test_attacks_change_exactly_the_chosen_clients(kind):
    problem = least_squares(num_clients=6, examples_per_client=10, dim=3, seed=0)
    data = problem.data
    if kind == "label_flip":  # labels in {0, 1} for this test: y -> 1 - y
        data = (
            data.replace(y=(data.y > 0).astype(data.y.dtype))
            if hasattr(data, "replace")
            else data._replace(y=(data.y > 0).astype(data.y.dtype))
        )
    loss = linear_regression(3).loss
    attack = Attack(kind, ids=(1, 4), num_classes=2 if kind == "label_flip" else None)
    honest = ClientWork(loss, local=LocalSpec(steps=2, batch_size=4))
    bad = ClientWork(loss, local=LocalSpec(steps=2, batch_size=4), hook=chain(byzantine(attack)))
    p = {"w": jnp.ones(3)}

    def updates(work):
        def one(c):
            flag = {"byzantine": attack.is_byzantine(c, jnp.int32(0), 6)}
            return work.train(
                p,
                data,
                c,
                jax.random.key(c),
                round_=jnp.int32(0),
                server={"byzantine": None},
                rows={},
                client_input=flag if work is bad else {},
                num_steps=None,
            ).update["w"]

        return np.stack([np.asarray(one(jnp.int32(c))) for c in range(6)])

    a, b = updates(honest), updates(bad)
    changed = ~np.all(np.isclose(a, b), axis=1)
    np.testing.assert_array_equal(changed, [False, True, False, False, True, False])
    if kind == "sign_flip":
        np.testing.assert_allclose(b[[1, 4]], -a[[1, 4]])


def test_alie_replaces_byzantine_rows_with_mean_minus_z_std():
    attack = Attack("alie", ids=(0, 2, 3), scale=1.5)
    x = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    weights = jnp.array([1.0, 1.0, 1.0, 0.0, 1.0])  # client 3 is padding
    byz = jnp.array([True, False, True, True, False])
    out = np.asarray(attack.poison_cohort({"w": jnp.asarray(x)}, byz, weights)["w"])
    b = x[[0, 2]]
    bad = b.mean(0) - 1.5 * b.std(0)
    np.testing.assert_allclose(out[[0, 2]], [bad, bad], rtol=1e-5)
    np.testing.assert_array_equal(out[[1, 3, 4]], x[[1, 3, 4]])


def test_sweep_reports_dp_accounting_epsilon_for_every_run(tmp_path, capsys):
    """`fedjax-sim sweep` with DP flags: every run's evaluation rows carry epsilon (as `run`
    does), equal to dp_accounting's for the same event; the noise multiplier is in meta."""
    import json

    from fedjax_sim.app.cli import main
    from fedjax_sim.run.sweep import SweepResult

    flags = [
        "sweep", "--dataset", "fedprox_synthetic", "--model", "logistic", "--num-clients", "20",
        "--rounds", "4", "--eval-every", "2", "--local-steps", "1", "--seeds", "2",
        "--cohort-sampling", "bernoulli", "--cohort-probability", "0.25", "--cohort-size", "None",
        "--dp-clip", "1.0", "--dp-noise", "1.2", "--no-progress", "--out", str(tmp_path),
    ]  # fmt: skip
    assert main(flags) == 0
    res = SweepResult.from_dict(json.loads((tmp_path / "histories.json").read_text()))
    direct = _direct_epsilon(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(1.2)), 4
        ),
        1e-5,
    )
    for h in res.histories:
        assert [e["round"] for e in h.evals] == [0, 2, 4]
        assert h.evals[0]["epsilon"] == 0.0
        assert h.evals[-1]["epsilon"] == pytest.approx(direct, rel=1e-9)
    assert res.meta["noise_multiplier"] == pytest.approx(1.2)
    assert "epsilon" in capsys.readouterr().out
