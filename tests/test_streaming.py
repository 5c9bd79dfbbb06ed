"""Populations outside device memory: streamed runs equal the all-on-device run bit for bit
(stateless, stateful and asynchronous algorithms; RAM and disk stores; procedural data), a
wrong cohort plan fails loudly, and the O(M) uniform plan runs a 10^9-client population."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import EvalSpec, NonFiniteError, simulate
from fedjax_sim.algorithms import CohortSpec, LocalSpec, area, fedavg, fedprox, scaffold
from fedjax_sim.algorithms.core import Stragglers
from fedjax_sim.algorithms.events import Aggregation, Arrivals, Events
from fedjax_sim.app.bench import workloads
from fedjax_sim.data import load_digits
from fedjax_sim.data.procedural import FedProxSynthetic, Population, UniformClassification
from fedjax_sim.data.store import (
    ClientStore,
    Dequantize,
    HostStore,
    RecordRows,
    write_client_store,
)
from fedjax_sim.models import logistic_regression, mlp
from fedjax_sim.run.streaming import (
    AlgorithmCohorts,
    EventCohorts,
    UniformCohorts,
    simulate_streamed,
)

C = 30
LOCAL = LocalSpec(steps=3, batch_size=8)
EVAL = EvalSpec(every=2, clients=False)


@pytest.fixture(scope="module")
def digits():
    return load_digits(num_clients=C)


def _same(h1, h2):
    assert h1.rounds == h2.rounds
    assert set(h1.metrics) == set(h2.metrics)
    for k in h1.metrics:
        np.testing.assert_array_equal(np.asarray(h1.metrics[k]), np.asarray(h2.metrics[k]), k)
    assert h1.evals == h2.evals


def _algorithms(model):
    cohort = CohortSpec(size=6)
    prop = CohortSpec(size=7, sampling="proportional")  # with replacement: duplicate ids
    ev = Events(Arrivals.bernoulli(0.2, num_clients=C), Aggregation.every(3), capacity=10)
    return {
        "fedavg": (fedavg(model.loss, local=LOCAL, cohort=cohort), cohort),
        "fedprox": (
            fedprox(model.loss, mu=0.1, local=LOCAL, cohort=prop, stragglers=Stragglers(0.3)),
            prop,
        ),
        "scaffold": (scaffold(model.loss, num_clients=C, local=LOCAL, cohort=cohort), cohort),
        "area": (area(model.loss, events=ev, local=LOCAL), ev),
    }


@pytest.mark.parametrize("name", ["fedprox", "scaffold", "area"])  # fedavg: tests below
def test_streamed_equals_on_device(digits, name):
    model = logistic_regression(digits.feature_shape, 10)
    alg, spec = _algorithms(model)[name]
    store = ClientStore.from_federated(digits.train)
    plan = EventCohorts(spec) if isinstance(spec, Events) else AlgorithmCohorts(spec, store.counts)
    key = jax.random.key(1)
    kw = dict(model=model, num_rounds=5, test=digits.test, evaluation=EVAL, progress=False)
    h1 = simulate(alg, digits.train, key, **kw)
    h2 = simulate_streamed(alg, store, key, plan=plan, prefetch=1, **kw)
    _same(h1, h2)
    assert h2.meta["streaming"]["chunks"] == 3


COUNTS = np.random.default_rng(0).integers(0, 9, 40)


def _fill(ids):
    r = np.random.default_rng(ids[0])
    x = r.integers(0, 256, (ids.size, 8, 12), dtype=np.uint8)
    y = r.integers(0, 3, (ids.size, 8)).astype(np.int32)
    return x, y, COUNTS[ids]


def _write(path, **kw):
    return write_client_store(
        path, 40, 8, (12,), _fill, num_classes=3, dequantize=1 / 255, block=16, progress=False, **kw
    )


def test_disk_store_uint8_equals_on_device(tmp_path):
    """A memory-mapped uint8 store decoded on device equals the decoded data on device."""
    store = _write(str(tmp_path / "pop"))
    assert store.rows.on_disk and isinstance(store.decode, Dequantize)
    np.testing.assert_array_equal(store.counts, COUNTS)
    data = store.to_federated()
    model = logistic_regression((12,), 3)
    cohort = CohortSpec(size=9)
    alg = fedavg(model.loss, local=LOCAL, cohort=cohort)
    key = jax.random.key(2)
    kw = dict(
        model=model, num_rounds=4, evaluation=EvalSpec(every=2, clients=False), progress=False
    )
    h1 = simulate(alg, data, key, **kw)
    h2 = simulate_streamed(alg, store, key, plan=AlgorithmCohorts(cohort, COUNTS), **kw)
    _same(h1, h2)


def test_array_record_store_equals_raw_store(tmp_path):
    """The same population as one array_record file (a record per client) gathers the same
    rows and streams the same run as the raw memory-mapped files."""
    pytest.importorskip("array_record")
    raw = _write(str(tmp_path / "raw"))
    records = _write(str(tmp_path / "records"), file_format="array_record")
    assert isinstance(records.rows, RecordRows) and records.max_count == 8
    np.testing.assert_array_equal(records.counts, COUNTS)
    ids = np.array([39, 3, 3, 17])
    for k, v in records.rows.gather(ids).items():
        np.testing.assert_array_equal(v, raw.rows.gather(ids)[k])
    model = logistic_regression((12,), 3)
    cohort = CohortSpec(size=9)
    alg = fedavg(model.loss, local=LOCAL, cohort=cohort)
    kw = dict(
        plan=AlgorithmCohorts(cohort, COUNTS),
        model=model,
        num_rounds=4,
        evaluation=EvalSpec(every=2, clients=False),
        progress=False,
    )
    key = jax.random.key(2)
    _same(simulate_streamed(alg, raw, key, **kw), simulate_streamed(alg, records, key, **kw))
    with pytest.raises(ValueError, match="file_format"):
        _write(str(tmp_path / "bad"), file_format="parquet")


def test_procedural_equals_materialized_and_bench_data():
    pop = Population(UniformClassification(input_dim=12, num_classes=3, per_client=8), 50, seed=4)
    data = pop.materialize()
    w = workloads.preset("tiny-lr").replace(clients=50)
    bench = workloads.make_data(w, seed=4)  # same numbers as the benchmark generator
    np.testing.assert_array_equal(np.asarray(data.x), np.asarray(bench.x))
    np.testing.assert_array_equal(np.asarray(data.y), np.asarray(bench.y))
    model = logistic_regression((12,), 3)
    cohort = CohortSpec(size=5)
    alg = fedavg(model.loss, local=LOCAL, cohort=cohort)
    key = jax.random.key(0)
    kw = dict(
        model=model, num_rounds=4, evaluation=EvalSpec(every=4, clients=False), progress=False
    )
    plan = AlgorithmCohorts(cohort, np.asarray(data.counts))
    _same(simulate(alg, data, key, **kw), simulate_streamed(alg, pop, key, plan=plan, **kw))


def test_fedprox_synthetic_generator_is_per_client():
    gen = FedProxSynthetic(alpha=0.5, beta=0.5, max_count=120)
    pop = Population(gen, 10**6)
    ids = jnp.array([3, 999_999, 17])
    x, y = jax.jit(pop.rows)(ids)
    x1, y1 = jax.jit(pop.rows)(ids[1:2])
    np.testing.assert_array_equal(np.asarray(x[1]), np.asarray(x1[0]))  # independent of batch
    counts = np.asarray(pop.counts(ids))
    assert x.shape == (3, 120, 60) and y.shape == (3, 120)
    assert counts.min() >= 50 and counts.max() <= 120
    assert 0 <= int(y.min()) and int(y.max()) < 10


def test_missing_cohort_id_fails_loudly(digits):
    model = mlp(digits.feature_shape, 10, hidden=(16,))
    alg = fedavg(model.loss, local=LOCAL, cohort=CohortSpec(size=6))
    store = ClientStore.from_federated(digits.train)
    wrong = AlgorithmCohorts(CohortSpec(size=3), store.counts)  # not the algorithm's cohort
    with pytest.raises(NonFiniteError, match="cohort plan"):
        simulate_streamed(
            alg,
            store,
            jax.random.key(0),
            plan=wrong,
            model=model,
            num_rounds=2,
            evaluation=EvalSpec(every=1, clients=False),
            progress=False,
        )


def test_billion_client_procedural_population_runs_in_cohort_memory():
    pop = Population(UniformClassification(input_dim=6, num_classes=2, per_client=4), 10**9)
    model = logistic_regression((6,), 2)
    alg = fedavg(model.loss, local=LocalSpec(steps=2, batch_size=2))  # cohort = population
    plan = UniformCohorts(pop.num_clients, 16)
    ids = plan.cohorts(jax.random.key(0), 0, 3)
    assert ids.shape == (3, 16) and all(len(set(r)) == 16 for r in ids) and ids.max() < 10**9
    np.testing.assert_array_equal(ids, plan.cohorts(jax.random.key(0), 0, 3))  # pure
    h = simulate_streamed(
        alg,
        pop,
        jax.random.key(0),
        plan=plan,
        model=model,
        num_rounds=3,
        evaluation=EvalSpec(every=3, clients=False),
        progress=False,
    )
    assert np.isfinite(h.metric("train_loss")).all() and h.metrics["participants"] == [16] * 3


def test_host_store_gather_scatter_and_errors(tmp_path):
    store = HostStore.create(str(tmp_path / "s"), 10, {"c": ((3,), np.float32)})
    ids = np.array([7, 2, 9])
    store.scatter(ids, {"c": np.arange(9, dtype=np.float32).reshape(3, 3)})
    store.flush()
    again = HostStore.open(str(tmp_path / "s"))
    np.testing.assert_array_equal(again.gather(np.array([9, 7]))["c"], [[6, 7, 8], [0, 1, 2]])
    np.testing.assert_array_equal(again.gather(np.array([0]))["c"], [[0, 0, 0]])
    with pytest.raises(ValueError, match="client ids must be in"):
        again.gather(np.array([10]))
    with pytest.raises(ValueError, match="disagree"):
        HostStore({"a": np.zeros((3, 1)), "b": np.zeros((4, 1))})
    with pytest.raises(ValueError, match="plan is for"):
        digits = load_digits(num_clients=5)
        model = mlp(digits.feature_shape, 10, hidden=(4,))
        simulate_streamed(
            fedavg(model.loss, cohort=CohortSpec(size=2)),
            ClientStore.from_federated(digits.train),
            jax.random.key(0),
            plan=UniformCohorts(6, 2),
            model=model,
            num_rounds=1,
            progress=False,
        )


def test_cohort_rows_round_trip_through_a_host_store():
    """State rows streamed: gather the cohort's rows, update some on device by real id,
    scatter back; equals the same update of the full [C, d] array."""
    from fedjax_sim.core.rows import Rows, gather_rows, scatter_rows

    full = np.arange(20 * 3, dtype=np.float32).reshape(20, 3)
    store = HostStore({"h": full.copy()})
    cohort = np.array([2, 5, 11, 17])
    rows = Rows({"h": jnp.asarray(store.gather(cohort)["h"])}, jnp.asarray(cohort))
    ids, mask = jnp.array([11, 2, 17]), jnp.array([True, True, False])
    np.testing.assert_array_equal(np.asarray(gather_rows(rows, ids)["h"]), full[[11, 2, 17]])
    new = jax.jit(lambda r: scatter_rows(r, ids, mask, {"h": -gather_rows(r, ids)["h"]}))(rows)
    store.scatter(cohort, {"h": np.asarray(new.value["h"])})
    expect = full.copy()
    expect[[11, 2]] *= -1
    np.testing.assert_array_equal(store.arrays["h"], expect)
