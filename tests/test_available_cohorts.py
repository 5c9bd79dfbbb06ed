"""Availability-aware cohorts (`DeviceModel(cohort="available")`, issue 38 item 2): the
cohort is drawn among the clients online at the round's start, from `candidates` times as
many candidates; checked against a NumPy reference of the candidate rule, a chi-square bound
on the selection frequencies and full runs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import fedavg
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.algorithms.device_model import FIELDS, DeviceModel, Profile, TraceProfiles
from fedjax_sim.data import least_squares
from fedjax_sim.models import linear_regression
from fedjax_sim.run.simulate import EvalSpec, simulate

DIM = 3


def table(rng, rows, on_fraction=0.5):
    """`[rows]` profiles with period 1000 s, online windows of `on_fraction`, random phases,
    fast devices (a round takes a few seconds) and no dropout."""
    values = dict(
        speed=rng.uniform(5.0, 50.0, rows),
        uplink=rng.uniform(1e3, 1e4, rows),
        downlink=rng.uniform(1e3, 1e4, rows),
        period=np.full(rows, 1000.0),
        session=np.full(rows, 1000.0 * on_fraction),
        phase=rng.uniform(0.0, 1000.0, rows),
        dropout=np.zeros(rows),
    )
    return Profile(*(np.asarray(values[n], np.float64) for n in FIELDS))


def np_online(tab, ids, t):
    r = np.asarray(ids) % tab.speed.size
    return np.mod(t + tab.phase[r], tab.period[r]) < tab.session[r]


def draws(model, spec, counts, clock, keys):
    """`(ids [T, N], weights [T, N])` of `available_cohort` for each key."""
    fn = lambda k: model.available_cohort(jnp.asarray(clock), k, spec, counts)
    return jax.device_get(jax.jit(jax.vmap(fn))(keys))


# ------------------------------------------------------------------------------ the rule
def test_bad_values_raise_before_compilation():
    with pytest.raises(ValueError, match="cohort must be all|available"):
        DeviceModel(cohort="online")
    for bad in (0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="candidates"):
            DeviceModel(cohort="available", candidates=bad)
    with pytest.raises(ValueError, match="needs availability=True"):
        DeviceModel(cohort="available", availability=False)
    loss = linear_regression(DIM).loss
    aware = DeviceModel(cohort="available")
    with pytest.raises(ValueError, match="needs a CohortSpec with a cohort size"):
        fedavg(loss, device_model=aware)
    bern = CohortSpec(size=4, sampling="bernoulli", probability=0.5)
    with pytest.raises(ValueError, match="uniform or\n?.*proportional"):
        fedavg(loss, cohort=bern, device_model=aware)


@pytest.mark.parametrize("clock", [0.0, 371.5, 900.0])
def test_candidate_rule_against_numpy(clock, x64):
    """The first N online candidates in draw order, then the first offline ones; the
    candidates are the cohort sampler's draw of K = ceil(g N) from the same key."""
    c, n, g = 50, 4, 2.0  # K = 8 < C
    tab = table(np.random.default_rng(1), c, on_fraction=0.3)
    model = DeviceModel(TraceProfiles(tab), cohort="available", candidates=g)
    counts = jnp.arange(1, c + 1)
    spec = CohortSpec(size=n)
    keys = jax.random.split(jax.random.key(0), 64)
    ids, weights = draws(model, spec, counts, clock, keys)
    short = 0
    for key, got, w in zip(keys, ids, weights, strict=True):
        cand = np.asarray(CohortSpec(size=8).sample(key, counts)[0])
        on = np_online(tab, cand, clock)
        want = np.concatenate([cand[on], cand[~on]])[:n]
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(w, want + 1)  # counts weighting
        short += on.sum() < n
    assert 0 < short < len(keys)  # both cases occur


def test_all_clients_as_candidates_are_shuffled():
    """K >= C: all clients in a random order (not id order), still the first N online."""
    c, n = 12, 3
    tab = table(np.random.default_rng(2), c)
    model = DeviceModel(TraceProfiles(tab), cohort="available", candidates=8.0)
    ids, _ = draws(
        model, CohortSpec(size=n), jnp.ones(c), 0.0, jax.random.split(jax.random.key(1), 200)
    )
    on = np_online(tab, np.arange(c), 0.0)
    assert on.sum() >= n
    assert np_online(tab, ids, 0.0).all()
    assert all(len(set(r)) == n for r in ids.tolist())
    # not one fixed cohort: every ordered N-tuple of online clients occurs (here 4 online,
    # 24 tuples, 200 draws: each is missed with probability (23/24)^200 < 2e-4)
    assert on.sum() == 4
    assert len({tuple(r) for r in ids.tolist()}) == math.perm(int(on.sum()), n)


@pytest.mark.parametrize(
    ("candidates", "sampling"), [(2.0, "uniform"), (100.0, "uniform"), (2.0, "proportional")]
)
def test_selection_is_uniform_among_online_clients(candidates, sampling):
    """Over T keys, each online client's selection count: chi-square against equal
    frequencies. Without replacement the statistic's mean is below its degrees of freedom
    d = |online| - 1 and its variance below 2d, so d + 6 sqrt(2d) bounds it."""
    c, n, t = 40, 5, 4000
    tab = table(np.random.default_rng(3), c, on_fraction=0.5)
    model = DeviceModel(TraceProfiles(tab), cohort="available", candidates=candidates)
    spec = CohortSpec(size=n, sampling=sampling)
    ids, _ = draws(model, spec, jnp.ones(c, jnp.int32), 0.0, jax.random.split(jax.random.key(5), t))
    on = np_online(tab, np.arange(c), 0.0)
    kept_on = np_online(tab, ids, 0.0)
    # online clients first (a kept offline one means fewer than N online candidates: with
    # g = 2 some rounds; uniformity among the kept online ones holds all the same)
    assert (np.diff(kept_on.astype(int), axis=1) <= 0).all()
    counts = np.bincount(ids[kept_on], minlength=c)
    expected = counts.sum() / on.sum()
    stat = (((counts[on] - expected) ** 2) / expected).sum()
    dof = on.sum() - 1
    assert stat < dof + 6 * math.sqrt(2 * dof), (stat, dof)


# ------------------------------------------------------------------------------ in runs
def problem(c):
    return least_squares(num_clients=c, examples_per_client=np.full(c, 8), dim=DIM, seed=1)


def history(data, model, device, size=6, rounds=6, key=3):
    alg = fedavg(
        model.loss, cohort=CohortSpec(size=size), local=LocalSpec(steps=2), report_cohort=True,
        device_model=device,
    )  # fmt: skip
    every = EvalSpec(every=rounds, train=True)
    return simulate(
        alg, data, jax.random.key(key), model=model, num_rounds=rounds, evaluation=every
    )


@pytest.mark.parametrize("extra", [{}, {"over_selection": 1.5, "deadline": 0.2}])
def test_kept_clients_are_online_and_none_unavailable(extra):
    """Every kept client is online at its round's start (the clock before the round);
    `unavailable == 0` whenever N candidates were online (the candidate rule, replayed);
    over-selection and deadlines still apply to the drawn cohort."""
    c = 80
    tab = table(np.random.default_rng(4), c, on_fraction=0.4)
    data, model = problem(c).data, linear_regression(DIM)
    device = DeviceModel(TraceProfiles(tab), cohort="available", **extra)
    h = history(data, model, device)
    clock = np.concatenate([[0.0], h.metric("virtual_time")[:-1]])
    ids, weights = h.metric("cohort_ids"), h.metric("cohort_weights")
    for r in range(len(clock)):
        on = np_online(tab, ids[r], clock[r])
        assert on[weights[r] > 0].all()
    assert (h.metric("unavailable") == 0).all()
    assert (h.metric("participants") <= 6).all()
    if extra:
        assert ids.shape == (6, 6)  # the 6 first to finish of the 9 drawn
        assert (h.metric("round_time") <= 0.2 + 1e-6).all()


def test_aware_cohorts_report_more_clients_than_the_default():
    c = 60
    tab = table(np.random.default_rng(6), c, on_fraction=0.3)
    data, model = problem(c).data, linear_regression(DIM)
    plain = history(data, model, DeviceModel(TraceProfiles(tab)), rounds=8)
    aware = history(data, model, DeviceModel(TraceProfiles(tab), cohort="available"), rounds=8)
    assert plain.metric("unavailable").sum() > 0
    assert (aware.metric("unavailable") == 0).all()
    assert aware.metric("participants").mean() >= 5.5
    assert plain.metric("participants").mean() < 4


def test_sweep_run_r_equals_the_single_run():
    """In a sweep (runs vmapped) each run's aware cohorts, clock and metrics are those of the
    single run of its seed."""
    from fedjax_sim.run.sweep import sweep

    c = 40
    tab = table(np.random.default_rng(7), c, on_fraction=0.4)
    data, model = problem(c).data, linear_regression(DIM)
    alg = fedavg(model.loss, cohort=CohortSpec(size=5), local=LocalSpec(steps=2),
                 report_cohort=True,
                 device_model=DeviceModel(TraceProfiles(tab), cohort="available"))  # fmt: skip
    kw = dict(model=model, num_rounds=4, evaluation=EvalSpec(every=4, train=True))
    result = sweep(lambda hp: alg, data, seeds=[3, 4], progress=False, **kw)
    for run_ in result.runs:
        single = simulate(alg, data, jax.random.key(run_.seed), progress=False, **kw)
        swept = result.histories[run_.index]
        np.testing.assert_array_equal(swept.metric("cohort_ids"), single.metric("cohort_ids"))
        for k in ("virtual_time", "participants", "unavailable", "train_loss"):
            np.testing.assert_allclose(swept.metric(k), single.metric(k), rtol=1e-5, err_msg=k)
    ids = [result.histories[r.index].metric("cohort_ids") for r in result.runs]
    assert not np.array_equal(*ids)  # the seeds draw different cohorts
