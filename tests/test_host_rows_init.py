"""Host state rows built block by block (`simulate_streamed(state_rows="host")`,
`streaming.init_blocks`, issue 37 item 6): for every registered algorithm with per-client rows,
the blocks hold exactly `algorithm.init`'s rows and the non-row state is `algorithm.init`'s,
bit for bit; the compiled block function needs no `[C, ...]` buffer (XLA slices through the
init's broadcast rows), so initialising 10^5 clients' rows on disk takes O(block) memory;
the streamed runs with rows in RAM, on disk and on device are the same run."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import EvalSpec, algorithms
from fedjax_sim.algorithms import CohortSpec, LocalSpec, ditto
from fedjax_sim.app.config import RunConfig, algorithm_kwargs, hyper_parameters
from fedjax_sim.core.rows import Rows, is_rows
from fedjax_sim.data import least_squares, load_digits
from fedjax_sim.data.store import ClientStore, HostStore
from fedjax_sim.models import Model, linear_regression, logistic_regression
from fedjax_sim.run import streaming
from fedjax_sim.run.streaming import AlgorithmCohorts, init_blocks, simulate_streamed
from fedjax_sim.runtime.parallel import ClientMap

# presets with a body and a head (they take `head=`) run a two-layer linear model
TWO_LAYERS = Model(
    init=lambda key: {f"layer_{i}": {"w": jnp.linspace(-1.0, 1.0, 3) + i} for i in (0, 1)},
    apply=lambda p, x: x @ (p["layer_0"]["w"] * p["layer_1"]["w"]),
    loss_kind="squared",
)
HPARAMS = {"firing_probability": 1.0, "buffer_size": 2, "temperature": 50.0, "head_steps": 1}
BIG = 100_000


@functools.cache
def _build(name, num_clients):
    takes = hyper_parameters(algorithms.ALGORITHMS[name])
    cfg = RunConfig(
        algorithm=name,
        num_clients=num_clients,
        cohort_size=4,
        local_steps=3,
        batch_size=4,
        client_lr=0.05,
        hparams=tuple(f"{k}={v}" for k, v in HPARAMS.items() if k in takes),
    )
    data = least_squares(num_clients=num_clients, examples_per_client=5, dim=3, seed=0).data
    kwargs = algorithm_kwargs(cfg, set(), data=data, client_map=ClientMap("vmap"))
    model = TWO_LAYERS if "head" in takes else linear_regression(3)
    alg = algorithms.ALGORITHMS[name](model.loss, **kwargs)
    params = model.init(jax.random.key(0)) if "head" in takes else {"w": jnp.linspace(-1, 1, 3)}
    return alg, params


def _has_rows(name):
    alg, params = _build(name, 6)
    shapes = jax.eval_shape(alg.init, params, jax.random.key(1))
    return any(is_rows(n) for n in jax.tree.leaves(shapes, is_leaf=is_rows))


WITH_ROWS = [n for n in sorted(algorithms.ALGORITHMS) if _has_rows(n)]


def test_the_algorithms_with_rows_are_covered():
    assert {"ditto", "scaffold", "feddyn", "mifa", "apfl", "ef_fedavg"} <= set(WITH_ROWS)


@pytest.mark.parametrize("name", WITH_ROWS)
def test_init_blocks_equal_init_and_need_no_population_buffer(name):
    c, key = 7, jax.random.key(1)
    alg, params = _build(name, c)
    state = alg.init(params, key)
    nodes = jax.tree.flatten(state, is_leaf=is_rows)[0]
    want = [np.asarray(a) for n in nodes if is_rows(n) for a in jax.tree.leaves(n.value)]
    row_bytes = sum(a[0].nbytes for a in want)
    for rows_per_block in (1, 3, 7):  # 3: the last block overlaps the one before
        init = init_blocks(alg, params, key, c, block_bytes=rows_per_block * row_bytes)
        assert init.block == rows_per_block
        got = {n: np.full(s.shape, np.nan, s.dtype) for n, s in init.spec.items()}
        for start, rows in init.blocks():
            for n, r in rows.items():
                got[n][start : start + r.shape[0]] = r
        for a, b in zip(want, got.values(), strict=True):
            np.testing.assert_array_equal(a, b)
            assert a.dtype == b.dtype
        rest = [n for n in init.nodes if not is_rows(n)]
        for a, b in zip([n for n in nodes if not is_rows(n)], rest, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # 10^5 clients: the block function's scratch memory is not O(C x row)
    alg, params = _build(name, BIG)
    init = init_blocks(alg, params, key, BIG, block_bytes=64 * row_bytes)
    assert init.block == 64, init.temp_bytes
    assert init.temp_bytes is not None and init.temp_bytes <= 2 * 64 * row_bytes


def test_rows_init_falls_back_to_one_block_when_rows_cannot_be_sliced():
    """Rows XLA cannot compute a block at a time (a sort over the clients): one block."""
    c = 5000

    def init(params, key):
        noise = jnp.sort(jax.random.normal(key, (c, 64)), axis=0)
        return {"params": params, "rows": Rows({"r": noise})}

    alg = algorithms.Algorithm(init, None)
    params, key = {"w": jnp.ones(3)}, jax.random.key(0)
    init_ = init_blocks(alg, params, key, c, block_bytes=100 * 64 * 4)
    assert init_.block == c
    (start, rows), *more = list(init_.blocks())
    assert start == 0 and not more
    np.testing.assert_array_equal(rows["leaf1_0"], np.asarray(init(params, key)["rows"]["r"]))


def test_ditto_runs_equal_with_rows_on_disk_in_ram_and_on_device(tmp_path):
    """Ditto streamed with its personal models on disk (written block by block), in RAM and
    on device: the same history and final state; the disk store's files hold init's rows."""
    num_clients, m, every = 24, 4, 3
    digits = load_digits(num_clients=num_clients)
    model = logistic_regression(digits.feature_shape, 10)
    cohort = CohortSpec(size=m)
    alg = ditto(
        model.loss,
        num_clients=num_clients,
        cohort=cohort,
        local=LocalSpec(steps=2, batch_size=8),
    )
    store = ClientStore.from_federated(digits.train)
    key = jax.random.key(5)
    kw = dict(
        plan=AlgorithmCohorts(cohort, store.counts),
        model=model,
        num_rounds=7,
        evaluation=EvalSpec(every=every, clients=False),
        progress=False,
        return_state=True,
    )
    # the store a run starts from: init's rows, written in blocks of 5 clients
    params = model.init(jax.random.fold_in(key, streaming.INIT_PURPOSE))
    want = alg.init(params, key).rows
    row_bytes = sum(a[0].nbytes for a in jax.tree.leaves(want))
    streaming._RowStore.init(alg, params, key, num_clients, str(tmp_path / "r0"), 5 * row_bytes)
    ram0 = streaming._RowStore.init(alg, params, key, num_clients, None)
    opened = HostStore.open(str(tmp_path / "r0"))
    for name, a in zip(ram0.names, jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(opened.arrays[name], np.asarray(a))
        np.testing.assert_array_equal(ram0.store.arrays[name], np.asarray(a))

    runs = {
        "device": simulate_streamed(alg, store, key, state_rows="device", **kw),
        "ram": simulate_streamed(alg, store, key, state_rows="host", **kw),
        "disk": simulate_streamed(
            alg, store, key, state_rows="host", rows_dir=str(tmp_path / "rows"), **kw
        ),
    }
    h_dev, s_dev = runs["device"]
    for mode in ("ram", "disk"):
        h, s = runs[mode]
        assert h.metrics.keys() == h_dev.metrics.keys() and h.evals == h_dev.evals
        for k in h.metrics:
            np.testing.assert_array_equal(np.asarray(h.metrics[k]), np.asarray(h_dev.metrics[k]))
        for a, b in zip(jax.tree.leaves(s_dev), jax.tree.leaves(s), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(  # the personal models moved
        np.asarray(jax.tree.leaves(runs["disk"][1].rows)[0]), np.asarray(jax.tree.leaves(want)[0])
    )


def test_disk_store_reads_and_writes_files_like_a_ram_store(tmp_path):
    """A store on disk (`pread` / `pwrite`, not the mapping) gathers and scatters as one in
    RAM: duplicated ids keep their last row, runs and single ids, the mapping sees the
    writes, a reopened store the same rows; touching rows adds no mapped pages."""
    rng = np.random.default_rng(0)
    c, spec = 4000, {"a": ((16, 8), np.float32), "b": ((3,), np.int32)}
    disk = HostStore.create(str(tmp_path / "s"), c, spec)
    ram = HostStore({n: np.zeros((c, *s), d) for n, (s, d) in spec.items()})
    full = {n: rng.normal(size=(c, *s)).astype(d) for n, (s, d) in spec.items()}
    for store in (disk, ram):
        store.write_rows(0, full)
    for ids in ([5, 6, 7, 100, 3999, 6, 0], [17], list(range(50, 90)), []):
        ids = np.asarray(ids, np.int64)
        rows = {n: rng.normal(size=(ids.size, *s)).astype(d) for n, (s, d) in spec.items()}
        for store in (disk, ram):
            store.scatter(ids, rows)
        probe = np.array([0, 6, 17, 60, 3999, 1234, 6])
        for n in spec:
            np.testing.assert_array_equal(disk.gather(probe)[n], ram.gather(probe)[n])
            np.testing.assert_array_equal(np.asarray(disk.arrays[n]), ram.arrays[n])
    disk.flush()
    again = HostStore.open(str(tmp_path / "s"))
    for n in spec:
        np.testing.assert_array_equal(np.asarray(again.arrays[n]), ram.arrays[n])
    mapped = HostStore.create(str(tmp_path / "t"), c, spec)
    mapped.write_rows(0, full)
    before = _mapped_kib(str(tmp_path / "t"))
    ids = np.arange(0, c, 40)
    mapped.scatter(ids, mapped.gather(ids))
    assert _mapped_kib(str(tmp_path / "t")) == before == 0


def _mapped_kib(path):
    """Resident kB of this process's mappings of files under `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = len(head) >= 6 and head[5].startswith(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total
