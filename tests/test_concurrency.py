"""A concurrency cap on the asynchronous event engine (`Events(concurrency=K)`,
`device_model.event_model(concurrency=K)`): at most K clients train at any moment; checked
against the closed-form delivery rate, an exact small case and a run of FedBuff."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import fedbuff
from fedjax_sim.algorithms.core import LocalSpec
from fedjax_sim.algorithms.device_model import PROFILES, ProceduralProfiles, event_model
from fedjax_sim.algorithms.events import NEVER, Aggregation, Arrivals, Events
from fedjax_sim.data import least_squares
from fedjax_sim.models import linear_regression


def replay(events, iterations, seed=0):
    """The engine alone: per iteration `(fired, training, tau_iter_max, ids, active)` and
    the number of clients with a scheduled arrival after it."""
    key = jax.random.key(seed)

    def body(st, k):
        tick = events.draw(st, jax.random.fold_in(key, k))
        st = events.advance(st, tick)
        busy = jnp.sum(st.next_event < NEVER)
        return st, (
            jnp.sum(tick.active),
            tick.training,
            jnp.max(tick.tau_iter),
            tick.ids,
            tick.active,
            busy,
        )

    state = events.init(key)
    busy0 = jnp.sum(state.next_event < NEVER)
    _, out = jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(iterations)))(state)
    return int(busy0), jax.device_get(out)


def test_bad_caps_are_refused():
    arrivals = Arrivals.bernoulli(0.1, num_clients=5)
    for bad in (0, 6, 2.5, True):
        with pytest.raises(ValueError, match="concurrency must be an integer in"):
            Events(arrivals, concurrency=bad)
    with pytest.raises(ValueError, match="concurrency needs bernoulli"):
        Events(Arrivals.categorical(np.ones(5)), concurrency=2)
    with pytest.raises(ValueError, match="concurrency needs bernoulli"):
        Events(Arrivals.forced(np.ones((2, 5), bool)), concurrency=2)


def test_delivery_rate_is_k_p_for_identical_clients():
    """K of C identical clients train, each finishing with probability p per iteration and
    replaced at once: deliveries per iteration ~ Binomial(K, p), so over T iterations the
    total is T K p within 5 standard deviations sqrt(T K p (1 - p)); K stay busy."""
    c, k, p, t = 200, 10, 0.1, 4000
    events = Events(Arrivals.bernoulli(p, num_clients=c), Aggregation.every(2), concurrency=k)
    busy0, (fired, training, _, ids, active, busy) = replay(events, t)
    assert busy0 == k
    np.testing.assert_array_equal(training, k)
    np.testing.assert_array_equal(busy, k)
    mean, sd = t * k * p, math.sqrt(t * k * p * (1 - p))
    assert abs(fired.sum() - mean) < 5 * sd, (fired.sum(), mean, sd)
    # without the cap all C clients fire: C p per iteration
    _, (free, *_) = replay(Events(Arrivals.bernoulli(p, num_clients=c)), 200)
    assert free.mean() > 10 * k * p
    # every client gets its turn (starts are drawn among the idle ones)
    assert len(np.unique(ids[active])) > 0.9 * c


def test_exact_small_case():
    """C = 3, K = 1, p = 1: one delivery per iteration, by the client started in the
    previous one (staleness in iterations exactly 1), each client a third of the time."""
    events = Events(Arrivals.bernoulli(1.0, num_clients=3), Aggregation.every(1), concurrency=1)
    _, (fired, training, tau_iter, ids, active, busy) = replay(events, 3000, seed=4)
    np.testing.assert_array_equal(fired, 1)
    np.testing.assert_array_equal(training, 1)
    np.testing.assert_array_equal(tau_iter, 1)
    share = np.bincount(ids[active], minlength=3) / 3000
    assert np.abs(share - 1 / 3).max() < 5 * math.sqrt(2 / 9 / 3000)


def test_event_model_cap_and_fedbuff_run():
    """Identical devices (homogeneous profiles): delivery rate K (1 - exp(-dt / time)) / dt
    per virtual second with the cap; FedBuff runs on it with `training` = K."""
    c, k = 100, 5
    profiles = ProceduralProfiles(0, **PROFILES["homogeneous"])
    kw = dict(steps=4, bytes_down=1e5, bytes_up=1e5)
    events = event_model(profiles, c, concurrency=k, **kw)
    time = 1e5 / 5e6 + 4 / 2.0 + 1e5 / 1e6
    dt = events.arrivals.dt
    p = -math.expm1(-dt / time)
    np.testing.assert_allclose(events.arrivals.values, p, rtol=1e-6)
    t = 3000
    _, (fired, training, *_) = replay(events, t, seed=2)
    np.testing.assert_array_equal(training, k)
    rate = fired.sum() / (t * dt)
    want, sd = k * p / dt, math.sqrt(t * k * p * (1 - p)) / (t * dt)
    assert abs(rate - want) < 5 * sd
    data = least_squares(num_clients=c, examples_per_client=np.full(c, 6), dim=3, seed=0).data
    model = linear_regression(3)
    alg = fedbuff(
        model.loss, events=event_model(profiles, c, concurrency=k, **kw), local=LocalSpec(steps=4)
    )
    state = alg.init({"w": jnp.zeros(3)}, jax.random.key(0))
    step = jax.jit(alg.step)
    for _ in range(20):
        state, metrics = step(state, data, jax.random.key(1))
        assert int(metrics["training"]) == k and int(metrics["fired"]) <= k


def test_sweep_run_r_equals_the_single_run():
    """FedBuff with a cap in a sweep: each run's deliveries, `training` and virtual time are
    those of the single run of its seed."""
    from fedjax_sim.run.simulate import EvalSpec, simulate
    from fedjax_sim.run.sweep import sweep

    c = 30
    profiles = ProceduralProfiles(0, **PROFILES["homogeneous"])
    events = event_model(profiles, c, steps=2, bytes_down=1e5, bytes_up=1e5, concurrency=4)
    data = least_squares(num_clients=c, examples_per_client=np.full(c, 6), dim=3, seed=0).data
    model = linear_regression(3)
    alg = fedbuff(model.loss, events=events, local=LocalSpec(steps=2))
    kw = dict(model=model, num_rounds=8, evaluation=EvalSpec(every=8, train=True))
    result = sweep(lambda hp: alg, data, seeds=[1, 2], progress=False, **kw)
    for run_ in result.runs:
        single = simulate(alg, data, jax.random.key(run_.seed), progress=False, **kw)
        swept = result.histories[run_.index]
        for k in ("fired", "training", "virtual_time", "train_loss"):
            np.testing.assert_allclose(swept.metric(k), single.metric(k), rtol=1e-5, err_msg=k)
        np.testing.assert_array_equal(swept.metric("training"), 4)
