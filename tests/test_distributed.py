"""Sharded and multi-process runs equal the single-device run (CPU devices in subprocesses)."""

import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from fedjax_sim.algorithms import CohortSpec, LocalSpec, fedprox, scaffold
from fedjax_sim.core.rows import Rows
from fedjax_sim.data import least_squares
from fedjax_sim.models import linear_regression
from fedjax_sim.runtime import distributed
from fedjax_sim.runtime.parallel import ClientMap, client_mesh

WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")
CASES = [
    ("fedavg", "cohort8", "vmap"),
    ("fedprox", "cohort10", "vmap"),
    ("fedprox", "cohort10", "map2"),
    ("fedprox", "full", "map2"),
]
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _worker_results(tmp_path_factory, mode: str) -> dict:
    """The arrays `distributed_worker.py MODE OUT.npz` writes, run in a subprocess."""
    out = str(tmp_path_factory.mktemp(mode) / "out.npz")
    proc = subprocess.run(
        [sys.executable, WORKER, mode, out], capture_output=True, text=True, timeout=900, env=ENV
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(out))


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    return _worker_results(tmp_path_factory, "sharded")


@pytest.mark.parametrize("name, cohort, cmap", CASES)
def test_sharded_equals_unsharded(sharded_results, name, cohort, cmap):
    """4 devices; cohort 10 is padded to 12 with masked clients."""
    r = sharded_results
    plain, shard = r[f"{name}/{cohort}/{cmap}/plain"], r[f"{name}/{cohort}/{cmap}/sharded"]
    np.testing.assert_allclose(shard, plain, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["scaffold", "area", "fedbuff"])
@pytest.mark.parametrize("cmap", ["vmap", "map2"])
def test_sharded_per_client_state_and_async_equal_unsharded(sharded_results, name, cmap):
    """SCAFFOLD's `[C, d]` control variates, AREA's / FedBuff's per-client memories and event
    bookkeeping sharded over 4 devices; cohort 10 and 7 event slots padded to 12 / 8."""
    r = sharded_results
    plain = r[f"{name}/stateful/{cmap}/plain"]
    shard = r[f"{name}/stateful/{cmap}/sharded"]
    assert np.abs(plain - 1.0).max() > 1e-3  # the runs moved the model
    np.testing.assert_allclose(shard, plain, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def clock_results(tmp_path_factory):
    return _worker_results(tmp_path_factory, "clock")


@pytest.mark.parametrize("name", ["fedavg_clock", "fedavg_available", "fedbuff_capped"])
@pytest.mark.parametrize("cmap", ["vmap", "map2"])
def test_sharded_clock_equals_unsharded(clock_results, name, cmap):
    """The virtual clock on 4 devices (issue 38): FedAvg with over-selection and a deadline
    with partial work, FedAvg with cohorts drawn among the online clients, FedBuff with at
    most 4 clients training; the final model equals the one-device run's, and it trained."""
    plain, shard = clock_results[f"{name}/{cmap}/plain"], clock_results[f"{name}/{cmap}/sharded"]
    assert np.isfinite(plain).all() and np.abs(plain - 1.0).max() > 1e-3
    np.testing.assert_allclose(shard, plain, rtol=1e-6, atol=1e-6)


PERSONALIZED = ["ditto", "apfl", "pfedme", "per_fedavg_hf", "fedavg_ft", "fedper", "lg_fedavg"]
PERSONALIZED += ["fedrep", "fedbabu"]
# every preset vmapped; Ditto's rows and FedPer's partition also mapped in groups of 2
PERSONALIZED_CASES = [
    *((name, "vmap") for name in PERSONALIZED),
    ("ditto", "map2"),
    ("fedper", "map2"),
]


@pytest.fixture(scope="module")
def personalized_results(tmp_path_factory):
    return _worker_results(tmp_path_factory, "personalized")


@pytest.mark.parametrize("name, cmap", PERSONALIZED_CASES)
def test_sharded_personalized_equal_unsharded(personalized_results, name, cmap):
    """Every personalized preset (issue 37) sharded over 4 devices, cohort 10 padded to 12:
    the global params (`w` and `z` of `x @ (w * z)`) and the 16 clients' personal models
    (`personalize`: Ditto's / APFL's / pFedMe's rows, FedPer's / FedRep's heads and LG-FedAvg's
    bodies merged with the global part, Per-FedAvg's / FedAvg-FT's / FedBABU's fine-tuning)
    equal the one-device run's."""
    r = personalized_results
    key = f"{name}/personal/{cmap}"
    for part in ("params", "models"):
        plain, shard = r[f"{key}/plain/{part}"], r[f"{key}/sharded/{part}"]
        assert np.isfinite(plain).all(), part
        np.testing.assert_allclose(shard, plain, rtol=1e-6, atol=1e-6, err_msg=part)
    assert np.abs(r[f"{key}/plain/params"] - r["personal/init"]).max() > 1e-3  # it trained
    assert np.ptp(r[f"{key}/plain/models"], axis=0).max() > 1e-3  # the clients' models differ


def test_replicated_params_pitfall_is_handled(sharded_results):
    r = sharded_results
    # without pcast, gradients of the replicated params are summed over the 4 devices
    assert np.abs(r["pitfall/naive"] - r["pitfall/reference"]).max() > 1e-3
    np.testing.assert_allclose(r["pitfall/clientmap"], r["pitfall/reference"], rtol=1e-6)


def test_simulate_with_mesh_equals_plain(sharded_results):
    r = sharded_results
    np.testing.assert_allclose(r["simulate/sharded"], r["simulate/plain"], rtol=1e-6)
    np.testing.assert_allclose(r["simulate/sharded_eval"], r["simulate/plain_eval"], rtol=1e-6)


def test_sweep_with_runs_sharded_equals_one_device(sharded_results):
    """5 SCAFFOLD runs (per-client state) sharded over 4 devices, padded to 8 runs whose
    copies are dropped: the same per-run histories and final models as on one device
    (float32 round-off: the per-device groups vmap other numbers of runs)."""
    r = sharded_results
    assert int(r["sweep/sharded/devices"]) == 4 and int(r["sweep/plain/devices"]) == 1
    plain, shard = r["sweep/plain/w"], r["sweep/sharded/w"]
    assert shard.shape == plain.shape == (5, 3)
    assert np.abs(np.diff(plain, axis=0)).max() > 1e-4  # the seeds differ
    np.testing.assert_allclose(shard, plain, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        r["sweep/sharded/train_loss"], r["sweep/plain/train_loss"], rtol=1e-5, atol=1e-6
    )
    # a sharded sweep interrupted at round 3 and resumed is the uninterrupted sharded sweep
    np.testing.assert_array_equal(r["sweep/resumed/w"], shard)
    np.testing.assert_array_equal(r["sweep/resumed/train_loss"], r["sweep/sharded/train_loss"])


def test_placement_shards_declared_rows_only(tmp_path):
    """2 devices, 16 clients: the model parameter `w` `[16]` (first dimension C by chance) is
    replicated; SCAFFOLD's control variates `[C, 16]` (declared as `Rows`) and the data rows
    are sharded over the clients axis; the run equals the one-device run."""
    out = str(tmp_path / "placement.npz")
    proc = subprocess.run(
        [sys.executable, WORKER, "placement", out],
        capture_output=True,
        text=True,
        timeout=900,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = np.load(out)
    replicated, by_client = str(P()), str(P("clients"))
    assert str(r["spec/params"]) == replicated
    assert str(r["spec/server_control"]) == replicated
    for name in ("control_variates", "data_x", "data_counts"):
        assert str(r[f"spec/{name}"]) == by_client, name
    assert np.abs(r["w/plain"] - 1.0).max() > 1e-3  # the runs moved the model
    np.testing.assert_allclose(r["w/sharded"], r["w/plain"], rtol=1e-6, atol=1e-6)


def test_declared_rows_must_be_per_client():
    """A leaf declared per-client must have C rows; undeclared leaves are never sharded."""
    mesh = client_mesh(1)
    placed = distributed.place({"w": jnp.ones((4, 3))}, mesh, 4)
    assert placed["w"].sharding.spec == P()
    placed = distributed.place({"w": Rows(jnp.ones((4, 3)))}, mesh, 4)
    assert placed["w"].value.sharding.spec == P("clients")
    placed = distributed.place({"w": jnp.ones((4, 3))}, mesh, 4, all_rows=True)
    assert placed["w"].sharding.spec == P("clients")
    with pytest.raises(ValueError, match=r"declared per-client has shape \(3,\), not \[4"):
        distributed.place({"w": Rows(jnp.ones(3))}, mesh, 4)
    with pytest.raises(ValueError, match=r"declared per-client has shape \(3,\), not \[4"):
        distributed.place({"w": jnp.ones(3)}, mesh, 4, all_rows=True)


def test_parameter_with_c_rows_is_replicated_rows_are_sharded():
    """Placement by type, not by shape (one device, in process): SCAFFOLD with C = 4 and a
    model `w [4, 3]` whose first dimension equals C by chance. `w`, the server control
    variate (also `[4, 3]`) and the server step are replicated; only the clients' control
    variates `Rows [C, 4, 3]` and the data's rows are sharded over the clients axis."""
    c = 4
    data = least_squares(num_clients=c, examples_per_client=np.full(c, 5), dim=3, seed=0)
    alg = scaffold(lambda p, b: jnp.float32(0.0), num_clients=c, cohort=CohortSpec(size=2))
    state = alg.init({"w": jnp.ones((c, 3))}, jax.random.key(0))
    state, placed_data = distributed.place_run(state, data.data, client_mesh(1))
    replicated, by_client = P(), P("clients")
    assert state.params["w"].shape == (c, 3) and state.params["w"].sharding.spec == replicated
    assert state.hooks["control_variates"]["w"].sharding.spec == replicated
    assert state.round.sharding.spec == replicated
    rows = state.rows["control_variates"]
    assert isinstance(rows, Rows) and rows["w"].shape == (c, c, 3)
    assert rows["w"].sharding.spec == by_client
    assert placed_data.x.sharding.spec == by_client


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_process_run_equals_single_process(tmp_path):
    """Two processes x 2 CPU devices, jax.distributed with a local coordinator and gloo
    collectives, each process holding only its 8 of the 16 clients."""
    out = str(tmp_path / "mp.npz")
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "process", str(pid), "2", str(port), out],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for pid in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
    res = np.load(out)
    assert int(res["devices"]) == 4 and int(res["processes"]) == 2

    problem = least_squares(num_clients=16, examples_per_client=np.arange(3, 19), dim=3, seed=2)
    model = linear_regression(3)
    alg = fedprox(
        model.loss,
        mu=0.1,
        client_optimizer=__import__("optax").sgd(0.05, momentum=0.5),
        local=LocalSpec(epochs=2, batch_size=4),
        cohort=CohortSpec(size=10),
        client_map=ClientMap("vmap"),
    )
    key = jax.random.key(0)
    state = alg.init({"w": jnp.ones(3)}, key)
    losses = []
    for _ in range(4):
        state, m = jax.jit(alg.step)(state, problem.data, key)
        losses.append(float(m["train_loss"]))
    np.testing.assert_allclose(res["w"], np.asarray(state.params["w"]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(res["train_loss"], losses, rtol=1e-5)
