"""Step-size schedules (spec 8.5), caps and the rate theory helpers (spec sections 3, 6)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_sim.algorithms import schedules


def test_fixed_schedule_paper_value():
    s = np.asarray(schedules.values(schedules.fixed(2.0, 400), 400))
    assert s.shape == (400,)
    np.testing.assert_allclose(s, 2.0 / math.sqrt(400), rtol=1e-7)
    np.testing.assert_allclose(s, 0.1, rtol=1e-7)


def test_diminishing_schedule_spec_values():
    s = np.asarray(schedules.values(schedules.diminishing(0.8, 0.51), 400))
    expected = {0: 0.8, 1: 0.561778, 2: 0.456834, 9: 0.247224, 49: 0.108797, 99: 0.076399}
    expected.update({199: 0.053649, 399: 0.037674})
    for k, v in expected.items():
        np.testing.assert_allclose(s[k], v, rtol=1e-6, atol=5e-7)
    assert np.all(np.diff(s) < 0)


def test_diminishing_square_sum_below_lemma2(x64):
    s = np.asarray(schedules.values(schedules.diminishing(0.8, 0.51), 400))
    total = float(np.sum(s**2))
    bound = schedules.lemma2_sum(0.8, 0.51)
    np.testing.assert_allclose(bound, 32.64, rtol=1e-12)
    np.testing.assert_allclose(total, 3.985, atol=5e-4)
    assert total <= bound


def test_step_decay_halves_every_phase(x64):
    s = np.asarray(schedules.values(schedules.step_decay(0.8, 2.0, 50), 400))
    for m in range(8):
        phase = s[50 * m : 50 * m + 50]
        assert np.all(phase == 0.8 / 2**m)  # exact: powers of two
    assert s[-1] == 0.00625
    assert np.all(np.diff(s) <= 0)
    assert np.count_nonzero(np.diff(s)) == 7  # changes exactly at k = 50, 100, ..., 350


def test_theory_phase_length():
    np.testing.assert_allclose(schedules.theory_phase_length(400, 2.0), 92.55, atol=5e-3)
    np.testing.assert_allclose(schedules.theory_phase_length(256, 2.0), 64.0)


def test_schedules_are_jittable_optax_schedules():
    sched = schedules.step_decay(0.8, 2.0, 50)
    assert float(jax.jit(sched)(jnp.int32(120))) == pytest.approx(0.2)
    # server step size: optax counts the updates, i.e. the rounds
    opt = optax.sgd(schedules.diminishing(1.0, 1.0))
    params = jnp.zeros(())
    state = opt.init(params)
    got = []
    for _ in range(3):
        updates, state = opt.update(jnp.ones(()), state, params)
        got.append(-float(updates))
    np.testing.assert_allclose(got, [1.0, 0.5, 1 / 3], rtol=1e-6)


def test_client_sgd_divides_by_T():
    opt = schedules.client_sgd(schedules.diminishing(0.8, 0.5), scale=1 / 4)(jnp.int32(3))
    updates, _ = opt.update(jnp.ones(()), opt.init(jnp.zeros(())))
    np.testing.assert_allclose(-float(updates), 0.8 / 2 / 4, rtol=1e-6)


def test_caps_match_formulas():
    L = 2.0
    assert schedules.fedavg_cap(L) == pytest.approx(1 / (math.sqrt(6) * 2))
    assert schedules.fedprox_cap(L) == schedules.fedavg_cap(L)
    # delta = 1: the square-root terms are +inf (spec 7.8)
    assert schedules.ef_fedavg_cap(L, 1.0) == pytest.approx(1 / 12)
    assert schedules.ef_fedprox_cap(L, 1.0) == pytest.approx(1 / 12)
    d = 0.01
    factor = (1 - d) * (1 + 2 / d)
    assert schedules.ef_fedavg_cap(L, d) == pytest.approx(
        min(1 / 6, math.sqrt(3 * d / (64 * factor))) / L
    )
    c1 = factor * (4 + 4 * L**2 / 3)
    assert schedules.ef_fedprox_cap(L, d) == pytest.approx(min(1 / 12, 0.5 * math.sqrt(d / c1)))
    assert schedules.ef_fedavg_cap(L, d) < schedules.fedavg_cap(L)


def test_check_cap_names_the_round():
    sched = schedules.diminishing(0.8, 0.51)
    schedules.check_cap(sched, 0.8, 100)
    with pytest.raises(ValueError, match="s_0"):
        schedules.check_cap(sched, 0.5, 100)


@pytest.mark.parametrize(
    "build",
    [
        lambda: schedules.fixed(0.0, 10),
        lambda: schedules.fixed(1.0, 0),
        lambda: schedules.diminishing(1.0, -0.5),
        lambda: schedules.step_decay(1.0, 1.0, 5),
        lambda: schedules.step_decay(1.0, 2.0, 0),
        lambda: schedules.constant(float("nan")),
        lambda: schedules.ef_fedavg_cap(1.0, 0.0),
    ],
)
def test_bad_hyper_parameters_raise(build):
    with pytest.raises(ValueError):
        build()


def test_theorem_bounds_follow_from_inequality_on_the_worst_case_sequence():
    """The worst sequence allowed by (1) (equality, V kept >= 0 by the smallest W): the bounds
    of Theorems 1 and 2 must upper-bound its min W (a failing constant would show here)."""
    rc = schedules.RateConstants(b1=3.0, b2=0.5, b3=0.2)
    v0, K = 2.0, 200
    for steps, bound in [
        (np.full(K, 0.3 / math.sqrt(K)), schedules.theorem1_bound(rc, v0, 0.3, K)),
        (0.3 / np.arange(1, K + 1) ** 0.7, schedules.theorem2_bound(rc, v0, 0.3, 0.7, K)),
    ]:
        # constant W = w is feasible iff V stays >= 0; the largest such w is what min W can be
        lo, hi = 0.0, 1e3
        for _ in range(200):
            w = (lo + hi) / 2
            v, ok = v0, True
            for s in steps:
                v = (1 + rc.b1 * s * s) * v - rc.b2 * s * w + rc.b3 * s * s
                ok &= v >= 0
            lo, hi = (w, hi) if ok else (lo, w)
        assert lo <= bound
        assert lo <= schedules.diminishing_bound(rc, v0, steps) + 1e-12
