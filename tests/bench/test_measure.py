"""FLOP counting against analytic counts; the result-row schema; the client-map heuristic.

Tolerances: XLA counts a dot of [m,k]x[k,n] as exactly 2mkn; a `lax.scan` adds one int32
add per iteration for its counter, so loop programs are compared to 2mkn x trips with an
absolute slack of a few flops per iteration. For an MLP step, the analytic count covers the
matmuls exactly (`dense_step_flops`); the rest (bias adds, ReLU, softmax cross-entropy, the
SGD update, minibatch sampling) is elementwise, O(P + B * sum(widths)) flops, which we bound
by 10 flops per parameter and per activation (< 8% of the matmuls for 784-200-200-10 at
B=32). A count that ignored loop trips or used the `6 x B x P` convention would fall
outside these bounds.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from fedjax_sim.app.bench import measure, runner
from fedjax_sim.app.bench.results import validate_row
from fedjax_sim.app.bench.workloads import (
    Workload,
    dense_step_flops,
    make_model,
    model_flops,
)
from fedjax_sim.data import Batch
from fedjax_sim.runtime.parallel import CPU_CHUNK_BYTES, ClientMap, fit_client_map


def test_matmul_flops_exact():
    a, b = jnp.ones((48, 96)), jnp.ones((96, 40))
    flops, method = measure.loop_aware_flops(jnp.matmul, a, b)
    assert flops == 2 * 48 * 96 * 40
    assert "scan-corrected" in method


def test_scan_and_chunked_map_flops_multiply_by_trip_counts():
    a = jnp.ones((32, 32))
    one = 2 * 32**3

    def scanned(a):
        return lax.scan(lambda x, _: (x @ a, None), a, None, length=7)[0]

    def mapped(a):  # 10 items in chunks of 3 (3 scan trips + a remainder of 1), 4 steps each
        inner = lambda x: lax.scan(lambda c, _: (c @ a, None), x, None, length=4)[0]
        return lax.map(inner, jnp.stack([a] * 10), batch_size=3)

    # XLA itself counts each loop body once
    assert measure.xla_flops(jax.jit(scanned).lower(a).compile()) < 2 * one
    flops, _ = measure.loop_aware_flops(scanned, a)
    assert 7 * one <= flops <= 7 * one + 7 * 4
    flops, _ = measure.loop_aware_flops(mapped, a)
    assert 40 * one <= flops <= 40 * one + 64


def _mlp_step(model, opt):
    def step(params, batch):
        grads = jax.grad(model.loss)(params, batch)
        updates, _ = opt.update(grads, opt.init(params), params)
        return optax.apply_updates(params, updates)

    return step


def test_mlp_step_flops_match_analytic():
    w = Workload(hidden=(200, 200), input_dim=784, num_classes=10, batch_size=32)
    model = make_model(w)
    params = model.init(jax.random.key(0))
    b = w.batch_size
    batch = Batch(jnp.ones((b, 784)), jnp.zeros((b,), jnp.int32), jnp.ones((b,)))
    flops, _ = measure.loop_aware_flops(_mlp_step(model, optax.sgd(0.1)), params, batch)
    dots = dense_step_flops(w.widths, b)
    n_params = sum(p.size for p in jax.tree.leaves(params))
    elementwise_bound = 10 * (n_params + b * sum(w.widths[1:]))
    assert dots <= flops <= dots + elementwise_bound
    assert elementwise_bound / dots < 0.08
    # the 6 x B x P convention over-counts (no input gradient of the first layer)
    assert flops < 6 * b * sum(a * c for a, c in zip(w.widths, w.widths[1:], strict=False))


# ------------------------------------------------------------------------------ schema
# an MLP round in map mode with chunks and a remainder (5 clients in chunks of 2), small but
# with matmuls dominating, so that its FLOP count checks the loop correction at both levels
TINY = Workload(
    "tiny",
    hidden=(32,),
    input_dim=64,
    num_classes=10,
    clients=5,
    local_steps=2,
    batch_size=8,
    per_client=10,
    map_batch=2,
)
PEAK = {"matmul_n": 8, "peak_flops_per_s": 1e9}


@pytest.fixture(scope="module")
def engine_row():
    return runner.measure_engine(TINY, repeats=3, suite="test", peak=PEAK)


def test_round_row_schema_and_values(engine_row):
    row = json.loads(json.dumps(engine_row))  # JSON lines round trip
    validate_row(row, stamped=False)
    assert row["kind"] == "round" and row["engine"] == "fedjax_sim"
    assert row["mode"] == "map(batch_size=2)" and row["clients"] == 5
    assert len(row["round_s"]) == 3 and row["round_s_min"] <= row["round_s_median"]
    med = row["round_s_median"]
    assert row["client_steps_per_s"] == pytest.approx(10 / med, rel=1e-3)
    assert row["examples_per_s"] == pytest.approx(80 / med, rel=1e-3)
    assert row["flops_model"] == model_flops(TINY) == 6 * 80 * (64 * 32 + 32 * 10)
    assert row["roofline_ratio"] == pytest.approx(row["flops_xla"] / med / 1e9, rel=1e-2)
    assert row["peak_memory_bytes"] > 0 and row["memory_source"] == "process_peak_rss"
    assert row["machine"]["jax"] == jax.__version__ and row["machine"]["device_kind"]
    assert row["clients_per_step"] == 5.0


def test_round_flops_count_every_client_and_step(engine_row):
    """clients x steps MLP steps (matmuls exact, elementwise bounded as above, plus the
    aggregation's few flops per parameter and client); counting each loop body once, as
    XLA does, would give about one chunk's single step."""
    dots = TINY.client_steps * dense_step_flops(TINY.widths, TINY.batch_size)
    n_params = 64 * 32 + 32 + 32 * 10 + 10
    per_step = 10 * (n_params + TINY.batch_size * (32 + 10))
    bound = TINY.client_steps * per_step + 10 * TINY.clients * n_params
    assert dots <= engine_row["flops_xla"] <= dots + bound
    assert bound < 0.6 * dots


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.pop("compile_s"), "lacks field 'compile_s'"),
        (lambda r: r.update(round_s_median="fast"), "'round_s_median' has type str"),
        (lambda r: r.update(roofline_ratio=float("nan")), "not finite"),
        (lambda r: r.update(round_s=r["round_s"][:2]), "repeats"),
        (lambda r: r["machine"].pop("jax"), "lacks 'jax'"),
        (lambda r: r.update(kind="nope"), "row kind"),
    ],
)
def test_schema_rejects_bad_rows(engine_row, mutate, message):
    row = json.loads(json.dumps(engine_row))
    mutate(row)
    with pytest.raises(ValueError, match=message):
        validate_row(row, stamped=False)


def test_skipped_row_schema():
    row = runner.skipped_row("test", "x", TINY, "too big")
    validate_row(json.loads(json.dumps(row)), stamped=False)
    del row["reason"]
    with pytest.raises(ValueError, match="reason"):
        validate_row(row, stamped=False)


# ------------------------------------------------------------------------------ fit heuristic
def test_fit_client_map_heuristic():
    mib = 2**20
    # CPU: cache-sized chunks, capped by the cohort and the budget
    assert fit_client_map(1000, 2 * mib, 10 * 2**30, backend="cpu") == ClientMap(
        "map", CPU_CHUNK_BYTES // (2 * mib)
    )
    assert fit_client_map(3, 1024, 2**30, backend="cpu") == ClientMap("map", 3)
    assert fit_client_map(1000, 2 * mib, 5 * mib, backend="cpu") == ClientMap("map", 2)
    # accelerators: vmap while the whole cohort fits, else the largest chunk that fits
    assert fit_client_map(1000, mib, 2000 * mib, backend="gpu") == ClientMap("vmap")
    assert fit_client_map(10**6, mib, 2000 * mib, backend="gpu") == ClientMap("map", 2000)
    with pytest.raises(ValueError, match="more than the memory budget"):
        fit_client_map(10, 4 * mib, mib, backend="cpu")


def test_matmul_peak_and_machine_info():
    peak = measure.matmul_peak(n=64, repeats=2)
    assert peak["peak_flops_per_s"] >= peak["matmul_flops_per_s_median"] > 0
    info = measure.machine_info()
    assert info["backend"] == jax.default_backend() and info["cpu_count"] >= 1
    assert np.isfinite(info["load_avg_1m"])


@pytest.mark.parametrize("block_bytes", [10**9, 4 * 3 * 13 * 2])  # one block; 2 clients each
def test_generated_rows_depend_only_on_the_client_id(monkeypatch, block_bytes):
    """Blocked generation (the last block shifted back over rows already written) gives each
    client the rows of the one-client-at-a-time reference `one(fold_in(key, i))`."""
    from fedjax_sim.app.bench import workloads

    monkeypatch.setattr(workloads, "GEN_BLOCK_BYTES", block_bytes)
    w = Workload(model="logistic", input_dim=12, num_classes=3, clients=5, per_client=3)
    data = workloads.make_data(w, seed=4)
    key = jax.random.key(4)
    for i in range(w.clients):
        kx, ky = jax.random.split(jax.random.fold_in(key, i))
        np.testing.assert_array_equal(data.x[i], jax.random.uniform(kx, (3, 12), jnp.float32))
        np.testing.assert_array_equal(data.y[i], jax.random.randint(ky, (3,), 0, 3, jnp.int32))
