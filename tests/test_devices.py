"""Device profiles and the virtual clock (fedjax_sim.algorithms.device_model, issue 38 items
1-2) against hand-derived closed forms, NumPy references and sampling error."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import fedavg, fedbuff
from fedjax_sim.algorithms.aggregators import compressed
from fedjax_sim.algorithms.compression import TopK
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.algorithms.device_model import (
    FIELDS,
    DeviceModel,
    ProceduralProfiles,
    Profile,
    TraceProfiles,
    bundled_trace,
    constant,
    event_model,
    load_trace,
    lognormal,
    online,
    read_trace,
    save_trace,
    uniform,
)
from fedjax_sim.data import least_squares
from fedjax_sim.models import linear_regression
from fedjax_sim.run.simulate import EvalSpec, simulate

DIM = 5
ALWAYS = dict(period=100.0, session=100.0, phase=0.0, dropout=0.0)  # online, never vanishes


def table(rng, rows, **fixed):
    """A random profile table `[rows]` (float64); `fixed` fields overridden."""
    values = dict(
        speed=rng.uniform(0.5, 5.0, rows),
        uplink=rng.uniform(1e2, 1e3, rows),
        downlink=rng.uniform(1e2, 1e3, rows),
        period=np.full(rows, 1000.0),
        session=rng.uniform(100.0, 900.0, rows),
        phase=rng.uniform(0.0, 1000.0, rows),
        dropout=np.zeros(rows),
    )
    values.update(fixed)
    return Profile(*(np.array(np.broadcast_to(values[n], (rows,)), np.float64) for n in FIELDS))


def plan(model, ids, steps, *, keep=None, clock=0.0, down=200.0, up=300.0, weights=None):
    ids = jnp.asarray(ids, jnp.int32)
    w = jnp.ones(ids.shape) if weights is None else jnp.asarray(weights)
    fast = jax.jit(model.plan, static_argnames=("keep", "bytes_down", "bytes_up"))
    return jax.device_get(
        fast(
            jnp.asarray(clock),
            jax.random.key(7),
            ids,
            w,
            jnp.asarray(steps, jnp.int32),
            keep=ids.shape[0] if keep is None else keep,
            bytes_down=down,
            bytes_up=up,
        )
    )


def np_times(tab, ids, steps, down=200.0, up=300.0):
    r = np.asarray(ids) % tab.speed.size
    return down / tab.downlink[r] + np.asarray(steps) / tab.speed[r] + up / tab.uplink[r]


# ------------------------------------------------------------------------------ the clock
def test_round_time_is_the_slowest_clients_closed_form(x64):
    tab = table(np.random.default_rng(0), 8, **ALWAYS)
    ids, steps = np.array([3, 9, 14, 0, 6]), np.array([4, 1, 7, 2, 5])  # 9 -> row 1, 14 -> 6
    p = plan(DeviceModel(TraceProfiles(tab)), ids, steps, clock=12.5)
    t = np_times(tab, ids, steps)
    np.testing.assert_allclose(p.times, t, rtol=1e-14)
    assert p.round_time == pytest.approx(t.max(), rel=1e-14)
    assert p.clock == pytest.approx(12.5 + t.max(), rel=1e-14)
    np.testing.assert_array_equal(p.weights, 1.0)
    np.testing.assert_array_equal(p.num_steps, steps)


def test_deadline_drops_exactly_the_late_clients(x64):
    tab = table(np.random.default_rng(1), 50, **ALWAYS)
    ids = np.arange(50)
    steps = np.random.default_rng(2).integers(1, 10, 50)
    t = np_times(tab, ids, steps)
    deadline = float(np.median(t))
    p = plan(DeviceModel(TraceProfiles(tab), deadline=deadline), ids, steps)
    late = t > deadline
    assert 0 < late.sum() < 50
    np.testing.assert_array_equal(p.weights > 0, ~late)
    assert p.metrics["late"] == late.sum()
    assert p.round_time == deadline  # some did not report: the server waited for the deadline
    # everyone in time: the round is the slowest client's time
    p = plan(DeviceModel(TraceProfiles(tab), deadline=float(t.max()) + 1), ids, steps)
    assert p.round_time == pytest.approx(t.max(), rel=1e-14)


def test_partial_work_is_the_steps_that_fit(x64):
    tab = table(np.random.default_rng(3), 40, **ALWAYS)
    tab.uplink[:5] = 30.0  # 10 s of upload: no step fits
    ids, steps = np.arange(40), np.full(40, 12)
    t = np_times(tab, ids, steps)
    comm = 200.0 / tab.downlink + 300.0 / tab.uplink
    deadline = float(np.quantile(t, 0.4))
    p = plan(DeviceModel(TraceProfiles(tab), deadline=deadline, late="partial"), ids, steps)
    late = t > deadline
    fit = np.clip(np.floor((deadline - comm) * tab.speed), 0, steps).astype(int)
    np.testing.assert_array_equal(p.num_steps, np.where(late, fit, steps))
    reports = ~late | (fit >= 1)
    assert (~reports).any() and (late & reports).any()  # both cases occur
    np.testing.assert_array_equal(p.weights > 0, reports)
    assert np.all(p.times[reports] <= deadline)


def test_over_selection_keeps_the_m_fastest(x64):
    tab = table(np.random.default_rng(4), 30, **ALWAYS)
    ids = np.random.default_rng(5).permutation(1000)[:13]  # ceil(1.3 * 10) drawn
    steps = np.random.default_rng(6).integers(1, 8, 13)
    p = plan(DeviceModel(TraceProfiles(tab), over_selection=1.3), ids, steps, keep=10)
    t = np_times(tab, ids, steps)
    fastest = np.argsort(t, kind="stable")[:10]
    np.testing.assert_array_equal(np.sort(p.slots), np.sort(fastest))
    assert p.round_time == pytest.approx(np.sort(t)[9], rel=1e-14)
    assert p.downloads == 13
    assert DeviceModel(over_selection=1.3).selection_size(10) == 13
    assert DeviceModel(over_selection=1.5).selection_size(10) == 15


def test_availability_against_numpy(x64):
    tab = table(np.random.default_rng(7), 64)
    prof = TraceProfiles(tab)(jnp.arange(64))
    for t0 in (0.0, 123.4, 999.9, 5e4 + 17.0):
        want = np.mod(t0 + tab.phase, tab.period) < tab.session
        np.testing.assert_array_equal(np.asarray(online(prof, jnp.asarray(t0))), want)
    # in a round: offline clients do not take part; a client whose window closes before it
    # finishes drops out
    ids, steps, t0 = np.arange(64), np.full(64, 100), 400.0
    p = plan(DeviceModel(TraceProfiles(tab)), ids, steps, clock=t0)
    pos = np.mod(t0 + tab.phase, tab.period)
    t = np_times(tab, ids, steps)
    on, finishes = pos < tab.session, pos + t <= tab.session
    assert (~on).any() and (on & ~finishes).any()
    np.testing.assert_array_equal(p.weights > 0, on & finishes)
    assert p.metrics["unavailable"] == (~on).sum()
    assert p.metrics["dropouts"] == (on & ~finishes).sum()
    assert p.downloads == on.sum()


def test_dropout_probability_and_reproducibility():
    tab = table(np.random.default_rng(8), 1, **{**ALWAYS, "dropout": 0.3})
    model = DeviceModel(TraceProfiles(tab))
    p = plan(model, np.arange(20000), np.ones(20000))
    frac = p.metrics["dropouts"] / 20000
    assert abs(frac - 0.3) < 5 * math.sqrt(0.3 * 0.7 / 20000)
    q = plan(model, np.arange(20000), np.ones(20000))
    np.testing.assert_array_equal(p.weights, q.weights)
    # a client's draw depends on its id, not on its slot
    perm = np.random.default_rng(0).permutation(20000)
    r = plan(model, perm, np.ones(20000))
    np.testing.assert_array_equal(r.weights, p.weights[perm])


def test_nobody_reports_lasts_idle_or_the_deadline():
    tab = table(np.random.default_rng(9), 4, period=10.0, session=1.0, phase=5.0, dropout=0.0)
    p = plan(DeviceModel(TraceProfiles(tab), idle=42.0), np.arange(4), np.ones(4))
    assert p.metrics["unavailable"] == 4 and p.round_time == 42.0
    p = plan(DeviceModel(TraceProfiles(tab), deadline=9.0), np.arange(4), np.ones(4))
    assert p.round_time == 9.0


# ------------------------------------------------------------------------------ in a round
def problem():
    return least_squares(num_clients=12, examples_per_client=np.arange(5, 17), dim=DIM, seed=1)


def run(alg, data, rounds=3, seed=0):
    state = alg.init({"w": jnp.zeros(DIM)}, jax.random.key(seed))
    step, out = jax.jit(alg.step), []
    for _ in range(rounds):
        state, metrics = step(state, data, jax.random.key(seed))
        out.append(jax.device_get(metrics))
    return state, out


def test_device_path_trains_as_the_default_when_nobody_is_lost():
    """Always-online profiles, no dropout, no deadline: the same params bit for bit as
    without the device model (the clock only measures)."""
    data = problem().data
    loss = linear_regression(DIM).loss
    kw = dict(cohort=CohortSpec(size=5), local=LocalSpec(steps=3), report_cohort=True)
    tab = table(np.random.default_rng(10), 5, **ALWAYS)
    plain, _ = run(fedavg(loss, **kw), data)
    timed, metrics = run(fedavg(loss, device_model=DeviceModel(TraceProfiles(tab)), **kw), data)
    np.testing.assert_array_equal(np.asarray(plain.params["w"]), np.asarray(timed.params["w"]))
    assert plain.clock is None
    assert float(timed.clock) == pytest.approx(sum(float(m["round_time"]) for m in metrics))
    for m in metrics:  # the uncompressed float32 model both ways
        assert m["bytes_down"] == 5 * 4 * DIM and m["bytes_up"] == 5 * 4 * DIM
        t = np_times(tab, m["cohort_ids"], m["cohort_steps"], 4 * DIM, 4 * DIM)
        assert m["round_time"] == pytest.approx(t.max(), rel=1e-6)


def test_round_time_uses_the_bytes_the_round_sends(x64):
    """Compression shortens the upload: the clock uses the compressed payload."""
    aggregator = compressed(TopK(k=2))
    data = problem().data
    tab = table(np.random.default_rng(11), 7, **ALWAYS)
    alg = fedavg(
        linear_regression(DIM).loss,
        cohort=CohortSpec(size=6),
        local=LocalSpec(steps=4),
        aggregator=aggregator,
        device_model=DeviceModel(TraceProfiles(tab)),
        report_cohort=True,
    )
    _, metrics = run(alg, data, rounds=2)
    for m in metrics:
        down = m["bytes_down"] / 6  # per client
        up = m["bytes_up"] / m["participants"]
        assert down == 8 * DIM  # the float64 model
        assert up == TopK(k=2).payload_bytes(DIM, 8) < 8 * DIM
        t = np_times(tab, m["cohort_ids"], m["cohort_steps"], down, up)
        assert m["round_time"] == pytest.approx(t.max(), rel=1e-12)


def test_secure_aggregation_round_trips_on_the_clock():
    """With secure aggregation, a client's time is its transfers (the protocol's payload in
    bytes_up) + its steps + 3 extra round trips x round_trip_latency: closed form."""
    from fedjax_sim.algorithms.secure_aggregation import ROUND_TRIPS, payload_bytes
    from fedjax_sim.algorithms.secure_aggregation import secure_aggregation as secagg

    data = problem().data
    m, bits, latency = 5, 16, 0.25
    tab = table(np.random.default_rng(13), 7, **ALWAYS)
    cohort = CohortSpec(size=m, weighting="uniform")

    def alg(aggregator, latency):
        model = DeviceModel(TraceProfiles(tab), round_trip_latency=latency)
        return fedavg(
            linear_regression(DIM).loss,
            cohort=cohort,
            local=LocalSpec(steps=3),
            aggregator=aggregator,
            device_model=model,
            report_cohort=True,
        )

    agg = secagg(neighbours=m - 1, bits=bits, clip=10.0)
    assert agg.round_trips == ROUND_TRIPS == 4
    _, metrics = run(alg(agg, latency), data, rounds=2)
    _, without = run(alg(agg, 0.0), data, rounds=2)
    for mt, m0 in zip(metrics, without, strict=True):
        up = payload_bytes(DIM, bits, m - 1)
        assert mt["bytes_up"] == mt["participants"] * up
        t = np_times(tab, mt["cohort_ids"], mt["cohort_steps"], 4 * DIM, up)
        assert mt["round_time"] == pytest.approx(t.max() + 3 * latency, rel=1e-6)
        assert mt["round_time"] - m0["round_time"] == pytest.approx(3 * latency, rel=1e-5)
    # the plain upload is one round trip: the latency parameter does not change its clock
    _, plain = run(alg(None, latency), data, rounds=1)
    _, plain0 = run(alg(None, 0.0), data, rounds=1)
    assert plain[0]["round_time"] == plain0[0]["round_time"]


def test_over_selection_in_a_round_and_history_column():
    data, model = problem().data, linear_regression(DIM)
    tab = table(np.random.default_rng(12), 12, **ALWAYS)
    alg = fedavg(
        model.loss,
        cohort=CohortSpec(size=4),
        device_model=DeviceModel(TraceProfiles(tab), over_selection=1.5),
        report_cohort=True,
    )
    every = EvalSpec(every=2, train=True)
    history = simulate(alg, data, jax.random.key(3), model=model, num_rounds=4, evaluation=every)
    hours, loss = history.eval_series("train_objective", x="virtual_hours")
    rounds, same = history.eval_series("train_objective")
    np.testing.assert_array_equal(loss, same)
    clock = np.concatenate([[0.0], history.metric("virtual_time")])
    np.testing.assert_allclose(hours, clock[rounds] / 3600.0)
    np.testing.assert_array_equal(history.metric("participants"), 4)
    np.testing.assert_allclose(
        history.metric("virtual_time"), np.cumsum(history.metric("round_time")), rtol=1e-6
    )
    assert history.metric("cohort_ids").shape == (4, 4)
    np.testing.assert_allclose(history.metric("bytes_down"), 6 * 4 * DIM)  # 6 downloaded


# ------------------------------------------------------------------------------ asynchronous
def test_event_model_fires_from_the_profiles(x64):
    tab = table(np.random.default_rng(15), 10, dropout=np.linspace(0.0, 0.5, 10))
    events = event_model(TraceProfiles(tab), 30, steps=5, bytes_down=200.0, bytes_up=300.0)
    ids = np.arange(30)
    lam = (1.0 - tab.dropout[ids % 10]) / np_times(tab, ids, np.full(30, 5))
    dt = events.arrivals.dt
    np.testing.assert_allclose(events.arrivals.values, -np.expm1(-lam * dt), rtol=1e-12)
    assert events.arrivals.values.max() == pytest.approx(0.1)  # dt: max probability 0.1
    prof = TraceProfiles(tab)(jnp.arange(30))
    for t in (0.0, 250.0, 731.5):
        np.testing.assert_array_equal(
            np.asarray(events.availability.at(jnp.asarray(t), jnp.arange(30))),
            np.asarray(online(prof, jnp.asarray(t))),
        )
    # an asynchronous algorithm runs on it (3 iterations), time in seconds
    data = problem().data
    model = linear_regression(DIM)
    events = event_model(TraceProfiles(tab), 12, steps=2, bytes_down=40.0, bytes_up=40.0)
    alg = fedbuff(model.loss, events=events, local=LocalSpec(steps=2))
    _, metrics = run(alg, data, rounds=3)
    np.testing.assert_allclose([m["t"] for m in metrics], events.arrivals.dt * np.arange(1, 4))
    assert [m["virtual_time"] for m in metrics] == [m["t"] for m in metrics]  # seconds
    plain = fedbuff(model.loss, num_clients=12, local=LocalSpec(steps=2))
    assert "virtual_time" not in run(plain, data, rounds=1)[1][0]  # Bernoulli: iterations
    with pytest.raises(ValueError, match="steps"):
        event_model(TraceProfiles(tab), 12, steps=0, bytes_down=1.0, bytes_up=1.0)


# ------------------------------------------------------------------------------ profiles
def test_procedural_profiles_deterministic_and_o_cohort():
    prof = ProceduralProfiles(seed=3)
    ids = jnp.asarray([0, 5, 999_999_999, 2**31 - 1], jnp.int32)
    a = jax.jit(prof)(ids)
    b = prof(ids[::-1])
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y)[::-1])
    assert not np.array_equal(np.asarray(a.speed), np.asarray(ProceduralProfiles(4)(ids).speed))
    # nothing of size C: the step's program holds only [B] arrays
    jaxpr = jax.make_jaxpr(prof)(ids)
    sizes = [math.prod(v.aval.shape) for e in jaxpr.eqns for v in e.outvars]
    assert max(sizes) <= 4 * 2  # [B] (and [B, 2] key data)


def test_procedural_profiles_match_their_distributions():
    n = 100_000
    prof = ProceduralProfiles(
        seed=1,
        speed=lognormal(2.0, 0.8),
        session=uniform(3600.0, 7200.0),
        dropout=uniform(0.0, 0.1),
        period=constant(86400.0),
    )
    p = jax.device_get(jax.jit(prof)(jnp.arange(n)))
    logs = np.log(p.speed)
    assert abs(logs.mean() - math.log(2.0)) < 5 * 0.8 / math.sqrt(n)
    assert abs(logs.std() - 0.8) < 5 * 0.8 / math.sqrt(2 * n)
    d = prof.session
    assert abs(p.session.mean() - d.mean()) < 5 * math.sqrt(d.variance() / n)
    assert abs(p.session.var() / d.variance() - 1) < 0.02
    assert p.session.min() >= 3600.0 and p.session.max() <= 7200.0
    np.testing.assert_array_equal(p.period, 86400.0)
    assert abs(p.dropout.mean() - 0.05) < 5 * 0.1 / math.sqrt(12 * n)
    # speed's own mean against the log-normal's closed form
    dist = prof.speed
    assert abs(p.speed.mean() - dist.mean()) < 5 * math.sqrt(dist.variance() / n)


def test_trace_assignment_modulo_and_hash():
    tab = table(np.random.default_rng(13), 7)
    ids = jnp.asarray([0, 6, 7, 13, 700], jnp.int32)
    np.testing.assert_array_equal(TraceProfiles(tab).row_of(ids), np.asarray(ids) % 7)
    hashed = TraceProfiles(tab, "hash", seed=2)
    rows = np.asarray(hashed.row_of(jnp.arange(7000)))
    assert rows.min() >= 0 and rows.max() < 7
    np.testing.assert_allclose(np.bincount(rows, minlength=7) / 7000, 1 / 7, atol=0.02)
    np.testing.assert_array_equal(hashed.row_of(ids), hashed.row_of(ids))


# ------------------------------------------------------------------------------ the CSV format
def test_trace_round_trip_and_bundled(tmp_path, x64):
    tab = table(np.random.default_rng(14), 9)
    path = tmp_path / "t.csv"
    save_trace(tab, path, comment="a test trace")
    back = read_trace(path)
    for x, y in zip(tab, back, strict=True):
        np.testing.assert_array_equal(x, y)
    bundled = load_trace(bundled_trace())
    assert bundled.rows == 64 and bundled.assignment == "modulo"
    assert bundled_trace().read_bytes().__len__() < 8000


GOOD = "client,speed,uplink,downlink,period,session,phase,dropout\n"
ROW = "{c},2,1e6,5e6,86400,3600,0,0.01\n"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("client,speed\n0,1\n", r"line 1: the header must name .*missing \['downlink'"),
        (GOOD + ROW.format(c=0) + "1,-2,1e6,5e6,86400,3600,0,0\n", r"line 3, column 'speed'.*> 0"),
        (GOOD + "0,2,fast,5e6,86400,3600,0,0\n", r"line 2, column 'uplink': not a number"),
        (GOOD + "0,2,1e6,5e6,86400,3600,0,1.5\n", r"line 2, column 'dropout'.*\[0, 1\)"),
        (GOOD + "0,2,1e6,5e6,86400,inf,0,0\n", r"line 2, column 'session'.*finite"),
        (GOOD + ROW.format(c=0) + ROW.format(c=0), r"line 3, column 'client': client 0 appears"),
        (GOOD + ROW.format(c=0) + ROW.format(c=2), r"column 'client': the ids must be 0..1"),
        (GOOD + "0,2,1e6\n", r"line 2: 3 values for 8 columns"),
        (GOOD + ROW.format(c="x"), r"line 2, column 'client': a client id"),
        ("# only a comment\n", r"no header"),
    ],
)
def test_malformed_traces_are_refused_naming_line_and_column(tmp_path, text, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_trace(path)


# ------------------------------------------------------------------------------ checks
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(deadline=-1.0),
        dict(deadline=0.0),
        dict(deadline=float("inf")),
        dict(deadline=float("nan")),
        dict(over_selection=0.5),
        dict(over_selection=float("nan")),
        dict(over_selection=float("inf")),
        dict(idle=0.0),
        dict(late="wait"),
        dict(round_trip_latency=-0.1),
        dict(round_trip_latency=float("inf")),
    ],
)
def test_bad_hyper_parameters_raise_before_compilation(kwargs):
    with pytest.raises(ValueError):
        DeviceModel(**kwargs)


def test_bad_compositions_and_distributions_raise():
    loss = linear_regression(DIM).loss
    over = DeviceModel(over_selection=1.3)
    with pytest.raises(ValueError, match="over_selection needs a CohortSpec with a cohort size"):
        fedavg(loss, device_model=over)
    bern = CohortSpec(size=4, sampling="bernoulli", probability=0.5)
    with pytest.raises(ValueError, match="uniform or proportional"):
        fedavg(loss, cohort=bern, device_model=over)
    with pytest.raises(ValueError):
        lognormal(-1.0, 0.5)
    with pytest.raises(ValueError):
        uniform(2.0, 1.0)
    with pytest.raises(ValueError):
        ProceduralProfiles(speed=uniform(0.0, 1.0))
    with pytest.raises(ValueError):
        ProceduralProfiles(dropout=constant(1.0))
    with pytest.raises(ValueError, match="trace row 1, speed must be > 0"):
        TraceProfiles(Profile(*([np.array([1.0, -1.0])] + [np.ones(2)] * 6)))


# ------------------------------------------------------------------------------ streamed runs
def test_streamed_run_with_a_device_model_equals_on_device():
    """`simulate_streamed` on the exact plan of the drawn cohort (ceil(f M) under
    over-selection) equals `simulate` bit for bit, clock included."""
    from fedjax_sim.data import load_digits
    from fedjax_sim.data.store import ClientStore
    from fedjax_sim.models import logistic_regression
    from fedjax_sim.run.streaming import AlgorithmCohorts, simulate_streamed

    digits = load_digits(num_clients=30)
    model = logistic_regression(digits.feature_shape, 10)
    device = DeviceModel(load_trace(bundled_trace()), deadline=8.0, over_selection=1.5)
    alg = fedavg(
        model.loss, local=LocalSpec(steps=3, batch_size=8), cohort=CohortSpec(size=6),
        device_model=device,
    )  # fmt: skip
    store = ClientStore.from_federated(digits.train)
    plan = AlgorithmCohorts(CohortSpec(size=device.selection_size(6)), store.counts)
    key = jax.random.key(1)
    every = EvalSpec(every=2, clients=False)
    kw = dict(model=model, num_rounds=4, test=digits.test, evaluation=every, progress=False)
    h1 = simulate(alg, digits.train, key, **kw)
    h2 = simulate_streamed(alg, store, key, plan=plan, prefetch=1, **kw)
    assert h1.rounds == h2.rounds and set(h1.metrics) == set(h2.metrics)
    for k in h1.metrics:
        np.testing.assert_array_equal(np.asarray(h1.metrics[k]), np.asarray(h2.metrics[k]), k)
    assert h1.evals == h2.evals
    assert np.all(np.diff(h2.metric("virtual_time")) > 0)
