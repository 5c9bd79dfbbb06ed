"""Per-client state rows on the host (`simulate_streamed(state_rows="host")`): bit for bit the
all-on-device run (`simulate`'s history; the final state of the streamed run with rows on
device) for stateful (SCAFFOLD, FedDyn, error feedback, FGDRO) and asynchronous (MIFA: read
models and memories) algorithms, with clients repeated within and across chunks and a last
partial chunk; the device never holds a `[C, ...]` row; rows on disk equal rows in RAM; the
memory planner streams the rows when only the cohort fits."""

import functools

import jax
import numpy as np
import pytest

from fedjax_sim import EvalSpec, simulate
from fedjax_sim.algorithms import (
    CohortSpec,
    LocalSpec,
    fedavg,
    feddyn,
    fgdro_cvar,
    mifa,
    scaffold,
)
from fedjax_sim.algorithms.aggregators import error_feedback
from fedjax_sim.algorithms.compression import TopK
from fedjax_sim.algorithms.events import Aggregation, Arrivals, Events
from fedjax_sim.core.rows import Rows, gather_rows, is_rows, scatter_rows
from fedjax_sim.data import load_digits
from fedjax_sim.data.store import ClientStore
from fedjax_sim.models import logistic_regression
from fedjax_sim.run import streaming
from fedjax_sim.run.streaming import (
    AlgorithmCohorts,
    EventCohorts,
    UniformCohorts,
    simulate_streamed,
)
from fedjax_sim.runtime.parallel import fit_population

C, M, EVERY, ROUNDS = 24, 4, 3, 7  # chunks of 3, 3, 1 rounds; U = min(C, 3 M) = 12 rows
LOCAL = LocalSpec(steps=2, batch_size=8)
POPULATION_METRICS = {  # statistics over all C rows: not reported with host rows
    "ef": {"uplink_memory_rms"},
    "fgdro": {"cvar_objective", "cvar_active", "topk_mean_u", "u", "client_weights"},
}


@pytest.fixture(scope="module")
def digits():
    return load_digits(num_clients=C)


@pytest.fixture(scope="module")
def model(digits):
    return logistic_regression(digits.feature_shape, 10)


@functools.cache  # one algorithm object per name: the compiled chunks are shared by tests
def _algorithm(name, model):
    cohort = CohortSpec(size=M)
    ev = Events(Arrivals.bernoulli(0.2, num_clients=C), Aggregation.every(3), capacity=M)
    kw = dict(local=LOCAL)
    return {
        "scaffold": lambda: (scaffold(model.loss, num_clients=C, cohort=cohort, **kw), cohort),
        "feddyn": lambda: (feddyn(model.loss, num_clients=C, cohort=cohort, **kw), cohort),
        "ef": lambda: (
            fedavg(
                model.loss,
                num_clients=C,
                cohort=cohort,
                aggregator=error_feedback(TopK(k=64)),
                **kw,
            ),
            cohort,
        ),
        "fgdro": lambda: (fgdro_cvar(model.loss, num_clients=C, cohort=cohort, **kw), cohort),
        "mifa": lambda: (mifa(model.loss, events=ev, **kw), ev),
    }[name]()


def _repeats(plan, key):
    """(a client twice within one chunk, a client in two consecutive chunks)."""
    spans = [(r, min(ROUNDS, r + EVERY)) for r in range(0, ROUNDS, EVERY)]
    chunks = [plan.cohorts(key, r0, r1 - r0).reshape(-1) for r0, r1 in spans]
    within = any(np.unique(c).size < c.size for c in chunks)
    across = any(np.intersect1d(a, b).size for a, b in zip(chunks[:-1], chunks[1:], strict=True))
    return within, across


@pytest.mark.parametrize("name", ["scaffold", "feddyn", "ef", "fgdro", "mifa"])
def test_host_rows_equal_on_device(digits, model, name, monkeypatch):
    alg, spec = _algorithm(name, model)
    store = ClientStore.from_federated(digits.train)
    plan = EventCohorts(spec) if isinstance(spec, Events) else AlgorithmCohorts(spec, store.counts)
    key = jax.random.key(3)
    assert _repeats(plan, key) == (True, True)
    kw = dict(
        plan=plan,
        model=model,
        num_rounds=ROUNDS,
        evaluation=EvalSpec(every=EVERY, clients=False),
        progress=False,
        return_state=True,
    )
    seen = []  # the states the compiled chunks receive
    compiled = streaming._compiled_stream_chunk

    def spy(*args):
        run = compiled(*args)
        return lambda state, *rest: (seen.append(state), run(state, *rest))[1]

    h_sim = simulate(
        alg,
        digits.train,
        key,
        **{k: kw[k] for k in ("model", "num_rounds", "evaluation", "progress")},
    )
    h_dev, s_dev = simulate_streamed(alg, store, key, state_rows="device", **kw)
    monkeypatch.setattr(streaming, "_compiled_stream_chunk", spy)
    h_host, s_host = simulate_streamed(alg, store, key, state_rows="host", **kw)

    missing = POPULATION_METRICS.get(name, set())
    assert set(h_sim.metrics) - set(h_host.metrics) == missing
    assert h_sim.rounds == h_host.rounds and h_sim.evals == h_host.evals
    for k in h_host.metrics:
        np.testing.assert_array_equal(np.asarray(h_sim.metrics[k]), np.asarray(h_host.metrics[k]))
    for a, b in zip(jax.tree.leaves(s_dev), jax.tree.leaves(s_host), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    stats = h_host.meta["streaming"]
    assert stats["chunks"] == 3 and stats["bytes_returned"] > 0

    # the device holds U = 12 rows per row leaf, never the [C, ...] rows
    assert len(seen) == 3
    for state in seen:
        tables = [r for r in jax.tree.leaves(state, is_leaf=is_rows) if is_rows(r)]
        assert tables and all(t.slot_ids.shape == (EVERY * M,) for t in tables)
        for path, leaf in jax.tree_util.tree_leaves_with_path(state):
            if np.ndim(leaf) and leaf.shape[0] == C:  # only the event engine's [C] clocks
                assert "events" in jax.tree_util.keystr(path), jax.tree_util.keystr(path)


def test_host_rows_on_disk_and_argument_errors(digits, model, tmp_path):
    """Memory-mapped rows under `rows_dir` equal rows in RAM; bad settings are errors."""
    alg, cohort = _algorithm("scaffold", model)
    store = ClientStore.from_federated(digits.train)
    kw = dict(
        plan=AlgorithmCohorts(cohort, store.counts),
        model=model,
        num_rounds=ROUNDS,
        evaluation=EvalSpec(every=EVERY, clients=False),
        progress=False,
        state_rows="host",
        return_state=True,
    )
    key = jax.random.key(0)
    h_ram, s_ram = simulate_streamed(alg, store, key, **kw)
    h_disk, s_disk = simulate_streamed(alg, store, key, rows_dir=str(tmp_path / "rows"), **kw)
    assert h_ram.metrics.keys() == h_disk.metrics.keys()
    for k in h_ram.metrics:
        np.testing.assert_array_equal(np.asarray(h_ram.metrics[k]), np.asarray(h_disk.metrics[k]))
    rows = s_disk.rows["control_variates"]
    assert all(isinstance(a, np.memmap) and a.shape[0] == C for a in jax.tree.leaves(rows))
    for a, b in zip(jax.tree.leaves(s_ram), jax.tree.leaves(s_disk), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="state_rows must be"):
        simulate_streamed(alg, store, key, **{**kw, "state_rows": "disk"})
    with pytest.raises(ValueError, match="exact cohort plan"):
        simulate_streamed(alg, store, key, **{**kw, "plan": UniformCohorts(C, M)})
    with pytest.raises(ValueError, match="rows_dir"):
        simulate_streamed(alg, store, key, **{**kw, "state_rows": "device"}, rows_dir="x")


def test_cohort_rows_scatter_drops_masked_and_padding_slots():
    """Padding id C reads row C - 1 (as `gather_rows` on `[C, ...]`); a masked slot that
    shares a row with an active one writes nothing."""
    rows = Rows(jax.numpy.arange(4.0), jax.numpy.array([1, 3, 5, 9]), num_clients=10)
    ids = jax.numpy.array([9, 10, 3])  # 10 = C: padding, clamped to client 9
    np.testing.assert_array_equal(np.asarray(gather_rows(rows, ids)), [3.0, 3.0, 1.0])
    active, values = jax.numpy.array([True, False, True]), jax.numpy.array([7.0, 8.0, 6.0])
    new = scatter_rows(rows, ids, active, values)
    np.testing.assert_array_equal(np.asarray(new.value), [0.0, 6.0, 2.0, 7.0])


def test_planner_streams_state_rows_when_only_the_cohort_fits():
    """Closed-form bytes: C = 10^6 clients with 1000 B of data and 20 B of state rows each,
    a 20 MB budget: the rows alone (20 MB) do not fit, the cohort's do."""
    kw = dict(data_bytes_per_client=1000, per_client_bytes=100, backend="gpu")
    rows_on_device = fit_population(
        10**6, 10, budget_bytes=40_000_000, state_bytes_per_client=20, **kw
    )
    assert (rows_on_device.placement, rows_on_device.state_rows) == ("streamed", "device")
    assert rows_on_device.device_bytes == 3 * 10 * 1000 + 10**6 * (20 + 8)
    plan = fit_population(10**6, 10, budget_bytes=20_000_000, state_bytes_per_client=20, **kw)
    assert (plan.placement, plan.state_rows) == ("streamed", "host")
    # in flight: 3 chunks of 10 clients' data and rows, the previous chunk's rows; 8 B/client
    assert plan.device_bytes == 3 * 10 * (1000 + 20) + 10 * 20 + 8 * 10**6
    with pytest.raises(ValueError, match="no placement fits"):
        fit_population(10**7, 10, budget_bytes=20_000_000, state_bytes_per_client=20, **kw)
