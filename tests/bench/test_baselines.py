"""The baselines compute the same FedAvg update as our engine (apples to apples).

One round of FedAvg (MLP, unequal client sizes, minibatches with replacement) from our
compiled `fedavg` step is compared with an independent NumPy implementation of the same loop
(always runs), with the per-client jitted-loop baseline, and with the PyTorch per-client loop
(skipped only when torch, an optional extra, is not installed). The minibatch indices come
from `baselines.batch_indices`; if they differed from what `fedavg` draws, the updates would
not agree. pfl-research's FedAvg (its own venv) is compared on a problem with equal client
sizes (pfl's benchmark weights users equally): ours equals the NumPy reference there always,
and pfl's update equals both when `.venv-pfl` exists (`.ci/run` builds it). fedjax 0.0.17's
FedAvg (its own venv, `.venv-fedjax`) is compared on the same problem (one round against ours
and the reference, two rounds against the reference) and on our CNN.
"""

import jax
import numpy as np
import pytest

from fedjax_sim.algorithms import fedavg
from fedjax_sim.algorithms.core import LocalSpec
from fedjax_sim.app.bench import baselines
from fedjax_sim.app.bench.workloads import CLIENT_LR, Workload, make_data, make_model, preset
from fedjax_sim.data import FederatedData

W = Workload(
    hidden=(7,), input_dim=5, num_classes=3, clients=4, local_steps=3, batch_size=4, per_client=6
)
COUNTS = np.array([6, 2, 5, 3], np.int32)


def one_round(counts):
    """Data, model, key, initial parameters and our FedAvg round's parameters (`ours`)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 6, 5)).astype(np.float32)
    y = rng.integers(0, 3, (4, 6)).astype(np.int32)
    data = FederatedData.create(x, y, counts, num_classes=3)
    model = make_model(W)
    key = jax.random.key(3)
    params = model.init(jax.random.key(1))
    alg = fedavg(
        model.loss,
        client_optimizer=CLIENT_LR,
        local=LocalSpec(steps=W.local_steps, batch_size=W.batch_size),
    )
    state, _ = jax.jit(alg.step)(alg.init(params, key), data, key)
    return {
        "x": x,
        "y": y,
        "data": data,
        "model": model,
        "key": key,
        "params": params,
        "ours": jax.device_get(state.params),
    }


@pytest.fixture(scope="module")
def problem():
    return one_round(COUNTS)


EQUAL = np.full(4, 6, np.int32)


@pytest.fixture(scope="module")
def equal():
    return one_round(EQUAL)


def numpy_fedavg(params, x, y, counts, indices, lr):
    """Independent reference: ReLU MLP, softmax cross-entropy (mean over the batch), manual
    backward pass, SGD, count-weighted average of the local models."""
    w0, b0 = (np.asarray(params["Dense_0"][k], np.float64) for k in ("kernel", "bias"))
    w1, b1 = (np.asarray(params["Dense_1"][k], np.float64) for k in ("kernel", "bias"))
    total = [np.zeros_like(a) for a in (w0, b0, w1, b1)]
    for i, n in enumerate(counts):
        p = [w0.copy(), b0.copy(), w1.copy(), b1.copy()]
        for idx in indices[i]:
            xb, yb = x[i][idx].astype(np.float64), y[i][idx]
            pre = xb @ p[0] + p[1]
            h = np.maximum(pre, 0.0)
            logits = h @ p[2] + p[3]
            prob = np.exp(logits - logits.max(1, keepdims=True))
            prob /= prob.sum(1, keepdims=True)
            dlogits = (prob - np.eye(3)[yb]) / len(idx)
            dh = dlogits @ p[2].T * (pre > 0)
            grads = [xb.T @ dh, dh.sum(0), h.T @ dlogits, dlogits.sum(0)]
            p = [a - lr * g for a, g in zip(p, grads, strict=True)]
        total = [t + n * a for t, a in zip(total, p, strict=True)]
    w0, b0, w1, b1 = (t / counts.sum() for t in total)
    return {"Dense_0": {"kernel": w0, "bias": b0}, "Dense_1": {"kernel": w1, "bias": b1}}


def assert_params_close(a, b, tol=1e-4):
    for (path, u), v in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
    ):
        np.testing.assert_allclose(
            np.asarray(u), np.asarray(v), atol=tol, rtol=0, err_msg=jax.tree_util.keystr(path)
        )


def test_batch_indices_in_range(problem):
    idx = baselines.batch_indices(problem["key"], COUNTS, W)
    assert idx.shape == (4, 3, 4)
    assert np.all(idx >= 0) and np.all(idx < COUNTS[:, None, None])


def test_numpy_reference_matches_ours(problem):
    idx = baselines.batch_indices(problem["key"], COUNTS, W)
    ref = numpy_fedavg(problem["params"], problem["x"], problem["y"], COUNTS, idx, CLIENT_LR)
    assert_params_close(problem["ours"], ref)
    # the round moved the model: the comparison is not trivially params == params
    moved = max(
        np.abs(np.asarray(a) - np.asarray(b)).max()
        for a, b in zip(
            jax.tree.leaves(problem["ours"]), jax.tree.leaves(problem["params"]), strict=True
        )
    )
    assert moved > 1e-3


def test_python_loop_baseline_matches_ours(problem):
    run = baselines.loop_round(
        problem["model"], problem["data"], problem["params"], problem["key"], W
    )
    assert_params_close(problem["ours"], run())


def test_torch_baseline_matches_ours(problem):
    pytest.importorskip(
        "torch", reason="torch is the optional extra 'peers' (the README test command installs it)"
    )
    idx = baselines.batch_indices(problem["key"], COUNTS, W)
    peer = baselines.TorchFedAvg(
        W, problem["params"], problem["x"], problem["y"], COUNTS, threads=1
    )
    assert_params_close(peer.params(), problem["params"], tol=0)  # same starting weights
    peer.round(indices=idx)
    assert_params_close(problem["ours"], peer.params())
    peer.round()  # the benchmark's own sampling runs too


@pytest.fixture(scope="module")
def cnn():
    """pfl's CIFAR CNN (`models.simple_cnn`) on `tiny-cnn`: the workload, model, data, key,
    initial parameters and our FedAvg round's parameters (`ours`)."""
    w = preset("tiny-cnn")
    model, data = make_model(w), make_data(w, seed=1)
    key, params = jax.random.key(3), model.init(jax.random.key(1))
    local = LocalSpec(steps=w.local_steps, batch_size=w.batch_size)
    alg = fedavg(model.loss, client_optimizer=CLIENT_LR, local=local)
    state, _ = jax.jit(alg.step)(alg.init(params, key), data, key)
    ours = jax.device_get(state.params)
    return {"w": w, "model": model, "data": data, "key": key, "params": params, "ours": ours}


def test_torch_cnn_loop_computes_our_cnn_and_our_round(cnn):
    """The CNN in the PyTorch loop: the layouts round-trip, the torch module computes our
    model's logits, one FedAvg round equals ours."""
    pytest.importorskip("torch", reason="torch is the optional extra 'peers'")
    w, model, data, params = cnn["w"], cnn["model"], cnn["data"], cnn["params"]
    x, y, counts = (np.asarray(a) for a in (data.x, data.y, data.counts))
    peer = baselines.TorchFedAvg(w, jax.device_get(params), x, y, counts, threads=1)
    assert_params_close(peer.params(), params, tol=0)
    logits = peer.model(peer.x[0]).detach().numpy()
    np.testing.assert_allclose(logits, model.apply(params, data.x[0]), atol=1e-5)
    peer.round(indices=baselines.batch_indices(cnn["key"], counts, w))
    assert_params_close(cnn["ours"], peer.params(), tol=1e-5)


def test_equal_sizes_numpy_reference_matches_ours(equal):
    """The problem the pfl comparison uses: ours == the NumPy reference (always runs)."""
    idx = baselines.batch_indices(equal["key"], EQUAL, W)
    ref = numpy_fedavg(equal["params"], equal["x"], equal["y"], EQUAL, idx, CLIENT_LR)
    assert_params_close(equal["ours"], ref)


PFL, FEDJAX = baselines.VENV_PEERS["pfl"], baselines.VENV_PEERS["fedjax"]


@pytest.mark.skipif(
    PFL.python() is None,
    reason="pfl-research lives in its own venv (.venv-pfl, benchmarks/peers/pfl_venv.sh), "
    "which .ci/run builds (best effort) and this checkout lacks",
)
def test_pfl_fedavg_matches_ours_and_numpy(equal, tmp_path):
    """pfl's FederatedAveraging + SimulatedBackend + PyTorchModel from the same weights, on
    the same minibatch rows (fed to pfl as each user's dataset, in order): one round."""
    idx = baselines.batch_indices(equal["key"], EQUAL, W)
    p = equal["params"]
    torch_order = [p["Dense_0"]["kernel"].T, p["Dense_0"]["bias"]]
    torch_order += [p["Dense_1"]["kernel"].T, p["Dense_1"]["bias"]]
    fixed = tmp_path / "fixed.npz"
    arrays = {f"p{i}": np.asarray(a) for i, a in enumerate(torch_order)}
    np.savez(fixed, x=equal["x"], y=equal["y"], indices=idx, **arrays)
    spec = baselines.peer_spec(W, rounds=1, threads=1)
    spec.update(fixed=str(fixed), out=str(tmp_path / "out.npz"))
    PFL.run(spec, PFL.python())
    out = np.load(spec["out"])
    theirs = {
        f"Dense_{i}": {"kernel": out[f"p{2 * i}"].T, "bias": out[f"p{2 * i + 1}"]} for i in range(2)
    }
    assert_params_close(equal["ours"], theirs, tol=1e-5)
    ref = numpy_fedavg(p, equal["x"], equal["y"], EQUAL, idx, CLIENT_LR)
    assert_params_close(ref, theirs, tol=1e-5)


def run_fedjax(w, params, x, y, indices, rounds, tmp_path):
    """fedjax's FedAvg (`benchmarks/peers/fedjax_fedavg.py` in `.venv-fedjax`) from `params`
    for `rounds` rounds, each client training on its `indices` rows in order every round;
    the parameters after them, in our layout (haiku's kernels are flax's)."""
    layers = sorted(params)  # Conv_0, Conv_1, Dense_0, ...: the model's order
    arrays = {}
    for i, name in enumerate(layers):
        arrays[f"p{2 * i}"] = np.asarray(params[name]["kernel"])
        arrays[f"p{2 * i + 1}"] = np.asarray(params[name]["bias"])
    fixed = tmp_path / "fixed.npz"
    np.savez(fixed, x=np.asarray(x), y=np.asarray(y), indices=indices, **arrays)
    spec = baselines.peer_spec(w, rounds=rounds)
    spec.update(fixed=str(fixed), out=str(tmp_path / "out.npz"))
    FEDJAX.run(spec, FEDJAX.python())
    out = np.load(spec["out"])
    return {
        name: {"kernel": out[f"p{2 * i}"], "bias": out[f"p{2 * i + 1}"]}
        for i, name in enumerate(layers)
    }


NO_FEDJAX = pytest.mark.skipif(
    FEDJAX.python() is None,
    reason="fedjax 0.0.17 lives in its own venv (.venv-fedjax, made by "
    "benchmarks/peers/fedjax_venv.sh: it needs jax < 0.6), which this checkout lacks",
)


@NO_FEDJAX
def test_fedjax_fedavg_matches_ours_and_numpy(equal, tmp_path):
    """fedjax's federated_averaging (haiku MLP, client SGD, server SGD at 1, for_each_client)
    from the same weights on the same minibatches: one round equals ours and the NumPy
    reference; two rounds (the same minibatches again) equal the reference applied twice."""
    idx = baselines.batch_indices(equal["key"], EQUAL, W)
    p, x, y = equal["params"], equal["x"], equal["y"]
    one = run_fedjax(W, p, x, y, idx, 1, tmp_path)
    assert_params_close(equal["ours"], one, tol=1e-5)
    ref = numpy_fedavg(p, x, y, EQUAL, idx, CLIENT_LR)
    assert_params_close(ref, one, tol=1e-5)
    two = run_fedjax(W, p, x, y, idx, 2, tmp_path)
    assert_params_close(numpy_fedavg(ref, x, y, EQUAL, idx, CLIENT_LR), two, tol=1e-5)


@NO_FEDJAX
def test_fedjax_cnn_is_our_cnn(cnn, tmp_path):
    """fedjax's haiku CNN (conv, conv, max-pool, dense, dense) from our CNN's weights: one
    FedAvg round equals ours (same function, layouts and flatten order)."""
    w, data = cnn["w"], cnn["data"]
    idx = baselines.batch_indices(cnn["key"], np.asarray(data.counts), w)
    theirs = run_fedjax(w, jax.device_get(cnn["params"]), data.x, data.y, idx, 1, tmp_path)
    assert_params_close(cnn["ours"], theirs, tol=1e-5)
