"""The asynchronous event engine (fedjax_sim.algorithms.events) against closed forms and
direct counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms.events import (
    Aggregation,
    Arrivals,
    Availability,
    Events,
    compact,
    normal_rates,
    staleness_bins,
)


def run_engine(events, iterations, seed=0):
    """Scans the engine alone; returns stacked (state before, tick) per iteration."""
    state = events.init(jax.random.key(seed))

    def body(state, k):
        tick = events.draw(state, jax.random.fold_in(jax.random.key(seed + 1), k))
        return events.advance(state, tick), (state, tick)

    scan = lambda s: jax.lax.scan(body, s, jnp.arange(iterations))
    # LLVM -O0: same IEEE results, less compile time (see algorithms/_async_reference.py)
    fast = {"xla_backend_optimization_level": 0}
    _, (before, ticks) = jax.jit(scan, compiler_options=fast)(state)
    return jax.device_get(before), jax.device_get(ticks)


@pytest.mark.parametrize("num", [7, 1057])
def test_compact_equals_nonzero(num):
    rng = np.random.default_rng(num)
    masks = jnp.asarray(rng.random((4, num)) < np.array([0.0, 0.05, 0.5, 1.0])[:, None])
    caps = (1, 3, num)

    @jax.jit
    def both(m):
        got = [compact(m, cap) for cap in caps]
        return got, [jnp.nonzero(m, size=cap, fill_value=num)[0] for cap in caps]

    for m in masks:
        got, expected = both(m)
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_array_equal(g, e)


def test_bernoulli_frequencies_and_staleness_bookkeeping():
    p = np.array([0.02, 0.05, 0.1, 0.3, 0.7, 1.0])
    events = Events(Arrivals.bernoulli(p), Aggregation.random(0.2), capacity=None)
    n_it = 20000
    before, ticks = run_engine(events, n_it)
    act, tau_it, tau = ticks.active, ticks.tau_iter, ticks.tau
    # firing frequency p_i and mean gap between events 1/p_i (geometric)
    np.testing.assert_allclose(act.mean(0), p, rtol=0.1)
    gaps = np.array([tau_it[act[:, i], i].mean() for i in range(len(p))])
    np.testing.assert_allclose(gaps, 1 / p, rtol=0.1)
    assert (tau >= 0).all() and (tau_it >= 1)[act].all()
    # staleness in versions = aggregations strictly between the read and the delivery:
    # reconstruct it from the recorded aggregation flags and read iterations
    agg = ticks.aggregate.astype(np.int64)
    ver_before = np.concatenate([[0], np.cumsum(agg)[:-1]])  # version at the start of it. k
    k_idx, clients = np.nonzero(act)
    read_it = before.read_iteration[k_idx, clients]  # iteration of the read (0 = init)
    read_ver = np.where(read_it > 0, ver_before[np.maximum(read_it - 1, 0)], 0)
    np.testing.assert_array_equal(tau[k_idx, clients], ver_before[k_idx] - read_ver)
    assert ((tau[k_idx, clients] == 0) == (ver_before[k_idx] == read_ver)).all()
    # the random server events are Bernoulli(p_s) and the time is k * dt
    assert abs(agg.mean() - 0.2) < 0.02
    np.testing.assert_allclose(ticks.t, np.arange(1, n_it + 1) * 1.0)


def test_categorical_probabilities_and_exponential_time():
    rates = np.array([1.0, 2.0, 3.0, 4.0])
    events = Events(Arrivals.categorical(rates), Aggregation.random(2.0))  # server rate 2
    n_it = 20000
    _, ticks = run_engine(events, n_it)
    j = np.where(ticks.server, 4, ticks.ids[:, 0])
    freq = np.bincount(j, minlength=5) / n_it
    np.testing.assert_allclose(freq, np.append(rates, 2.0) / 12.0, atol=0.01)
    assert (ticks.active.sum(1) + ticks.server == 1).all()  # exactly one event
    dt = np.diff(np.concatenate([[0.0], ticks.t]))
    assert abs(dt.mean() * 12.0 - 1.0) < 0.03 and abs(dt.std() * 12.0 - 1.0) < 0.05
    p, p_s = events.probabilities()
    np.testing.assert_allclose(np.append(p, p_s), np.append(rates, 2.0) / 12.0)


def test_count_rule_every_delta_deliveries():
    events = Events(Arrivals.bernoulli(0.3, num_clients=8), Aggregation.every(3), capacity=None)
    before, ticks = run_engine(events, 500)
    delivered = ticks.active.sum(1)
    count = before.count
    np.testing.assert_array_equal(ticks.aggregate, count + delivered >= 3)
    np.testing.assert_array_equal(count[1:], np.where(ticks.aggregate, 0, count + delivered)[:-1])


def test_time_rule_aggregates_when_crossing_multiples():
    events = Events(Arrivals.categorical(np.full(5, 2.0)), Aggregation.timer(0.7))
    _, ticks = run_engine(events, 400)
    t = np.concatenate([[0.0], ticks.t])
    np.testing.assert_array_equal(ticks.aggregate, np.floor(t[1:] / 0.7) > np.floor(t[:-1] / 0.7))
    assert ticks.aggregate.sum() == int(t[-1] // 0.7)


def test_capacity_overflow_is_deferred_and_served_first():
    events = Events(Arrivals.bernoulli(0.25, num_clients=12), Aggregation.every(1), capacity=3)
    before, ticks = run_engine(events, 400)
    assert ticks.overflow.sum() > 0
    assert (ticks.active.sum(1) <= 3).all()
    for k in range(400):
        it = k + 1
        overdue = np.flatnonzero(before.next_event[k] < it)
        due = np.flatnonzero(before.next_event[k] <= it)
        served = set(ticks.ids[k][ticks.active[k]].tolist())
        assert ticks.overflow[k] == len(due) - len(served)
        if len(overdue) <= 3:  # deferred clients go first
            assert set(overdue.tolist()) <= served
    per_client = np.bincount(ticks.ids[ticks.active], minlength=12) / 400
    np.testing.assert_allclose(per_client, 0.2, atol=0.08)  # deferred, not starved


def test_availability_trace_and_periodic_windows():
    c = 6
    trace = np.ones((c, 10), bool)
    trace[2, 3:] = False  # client 2 leaves for good after t = 3 (no wrap: last column holds)
    trace[4, ::2] = False
    events = Events(
        Arrivals.bernoulli(0.5, num_clients=c),
        availability=Availability.from_trace(trace, slot=2.0),
        capacity=None,
    )
    _, ticks = run_engine(events, 400)
    col = np.minimum(np.floor(ticks.t / 2.0).astype(int), 9)
    fired = ticks.active
    assert not fired[:, 2][ticks.t >= 6.0].any() and fired[:, 2][ticks.t < 6.0].any()
    assert (trace[4, col][fired[:, 4]]).all()
    assert ticks.lost.sum() > 0
    per = Availability.periodic(5.0, 0.4, np.linspace(0, 4, c), num_clients=c)
    events = Events(Arrivals.categorical(np.ones(c)), availability=per)
    _, ticks = run_engine(events, 2000)
    ids, act = ticks.ids[:, 0], ticks.active[:, 0]
    on = np.mod(ticks.t + np.linspace(0, 4, c)[ids], 5.0) < 2.0
    np.testing.assert_array_equal(act, on)  # thinning: exactly the available draws fire


def test_poisson_discretisation_and_normal_rates():
    rates = normal_rates(200, 10.0, 5.0, seed=3)
    assert rates.min() >= 0.1 and (rates == 0.1).any()  # N(10, 5) has negative draws: clipped
    arr = Arrivals.poisson(rates)
    np.testing.assert_allclose(arr.values.max(), 0.1)
    np.testing.assert_allclose(arr.values, 1 - np.exp(-rates * arr.dt))
    events = Events(arr)
    m = arr.values.sum()
    assert events.slots == int(np.ceil(m + 6 * np.sqrt(m) + 8))
    assert staleness_bins(5) == ["0", "1", "2-3", "4-7", "8+"]


def test_completion_times_distribution():
    keys = jax.random.split(jax.random.key(0), 20000)
    ids = jnp.arange(2)
    for events, mean in [
        (Events(Arrivals.categorical([0.5, 2.0])), [2.0, 0.5]),  # Exp(lambda_i)
        (Events(Arrivals.bernoulli([0.1, 0.5], dt=0.5)), [5.0, 1.0]),  # Geometric(p_i) * dt
    ]:
        times = np.asarray(jax.jit(jax.vmap(lambda k: events.completion_times(k, ids)))(keys))
        np.testing.assert_allclose(times.mean(0), mean, rtol=0.04)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Arrivals.bernoulli([0.5, 1.2]), "in \\(0, 1\\]"),
        (lambda: Arrivals.bernoulli([0.5, 0.0]), "in \\(0, 1\\]"),
        (lambda: Arrivals.bernoulli(-0.1, num_clients=3), "in \\(0, 1\\]"),
        (lambda: Arrivals.poisson([1.0, -2.0]), "rates must be > 0"),
        (lambda: Arrivals.categorical([1.0, -2.0]), "rates must be > 0"),
        (lambda: Arrivals.bernoulli([0.5, np.nan]), "non-finite"),
        (lambda: Aggregation.every(0), "Delta"),
        (lambda: Aggregation(rule="count", delta=2.5), "Delta"),
        (lambda: Aggregation.random(0.0), "server event"),
        (lambda: Aggregation.timer(-1.0), "interval"),
        (lambda: Events(Arrivals.bernoulli(0.5, num_clients=3), capacity=0), "capacity"),
        (lambda: Events(Arrivals.bernoulli(0.5, num_clients=3), Aggregation.random(2.0)), "p_s"),
        (lambda: normal_rates(5, 10.0, -1.0), "standard deviation"),
        (lambda: Availability.from_trace(np.ones((3, 4))), "boolean"),
        (lambda: Availability.periodic(1.0, 1.5, num_clients=3), "on_fraction"),
        (
            lambda: Events(
                Arrivals.bernoulli(0.5, num_clients=3),
                availability=Availability.from_trace(np.ones((4, 2), bool)),
            ),
            "covers 4 clients",
        ),
    ],
)
def test_bad_input_raises(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_forced_fire_masks():
    """`Arrivals.forced(mask)`: the clients that fire in iteration t are exactly mask[t]
    (rows repeat after T); default capacity = the largest row, so nothing is deferred."""
    rng = np.random.default_rng(0)
    mask = rng.random((7, 9)) < 0.4
    mask[3] = False  # an empty iteration
    mask[5] = True  # everyone
    events = Events(Arrivals.forced(mask), Aggregation.every(2))
    assert events.slots == 9
    _, ticks = run_engine(events, 14)
    fired = np.zeros((14, 9), bool)
    for t in range(14):
        fired[t, ticks.ids[t][ticks.active[t]]] = True
    np.testing.assert_array_equal(fired, np.concatenate([mask, mask]))
    assert (ticks.overflow == 0).all()
    np.testing.assert_allclose(ticks.t, np.arange(1, 15))
    with pytest.raises(ValueError, match="bool"):
        Arrivals.forced(np.ones((3, 4)))
