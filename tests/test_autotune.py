"""ClientMap("auto") measures once, caches the winner on disk, and then maps exactly as the
chosen concrete mode does."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.runtime import autotune
from fedjax_sim.runtime.parallel import ClientMap


@pytest.fixture
def tuning(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDJAX_SIM_AUTOTUNE", "1")
    monkeypatch.setenv("FEDJAX_SIM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_MEMORY", {})
    return tmp_path


def _client(w):
    def fn(x, s):
        y = jnp.tanh(x @ w) * s
        return y, jnp.sum(y)

    return fn


def test_auto_uses_measured_choice_and_caches_it(tuning, monkeypatch):
    calls = []

    def fake(fn, xs, reduce, closed, out_tree, client_map, **kw):
        calls.append(reduce)
        return {"1": 3.0, "2": 1.0, "4": 2.0, "vmap": 5.0}

    monkeypatch.setattr(autotune, "measure", fake)
    w = jnp.linspace(-1, 1, 12).reshape(4, 3)
    x = jnp.linspace(0, 1, 9 * 4).reshape(9, 4)
    s = jnp.arange(9.0)

    run = jax.jit(lambda w, x, s: ClientMap("auto").map_sum(_client(w), x, s))
    auto = run(w, x, s)
    ref = jax.jit(lambda w, x, s: ClientMap("map", 2).map_sum(_client(w), x, s))(w, x, s)
    for a, b in zip(jax.tree.leaves(auto), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    table = json.loads((tuning / autotune.CACHE_FILE).read_text())
    (entry,) = table.values()
    assert (entry["mode"], entry["batch_size"], entry["num"]) == ("map", 2, 9)
    assert entry["jax"] == jax.__version__ and entry["device"].startswith("cpu")
    # another process (empty memory cache) reads the disk cache: no second measurement
    monkeypatch.setattr(autotune, "_MEMORY", {})
    jax.jit(lambda w, x, s: ClientMap("auto").map_sum(_client(w), x, s))(w + 1, x, s)
    assert calls == [True]
    # a different cohort size is another key
    jax.jit(lambda w, x, s: ClientMap("auto").map_sum(_client(w), x, s))(w, x[:5], s[:5])
    assert calls == [True, True]


def test_measure_times_every_candidate(tuning):
    w = jnp.ones((4, 3))
    x, s = jnp.ones((6, 4)), jnp.ones((6,))

    @jax.jit
    def run(w, x, s):
        key, closed, out_tree = autotune.cache_key(_client(w), (x, s), True)
        times = autotune.measure(
            _client(w), (x, s), True, closed, out_tree, ClientMap, candidates=(1, 2, 4, 8, 16, None)
        )
        assert set(times) == {"1", "2", "4", "vmap"}  # chunks >= the cohort are vmap
        assert all(t > 0 for t in times.values())
        return ClientMap("auto").map(lambda x: x * 2, x)

    np.testing.assert_array_equal(np.asarray(run(w, x, s)), 2 * np.ones((6, 4)))


def test_auto_measures_silently_and_reports_to_a_callback(tuning, capfd):
    """No progress bar from inside the library: a driver sees each choice through
    `reporting` (measured now: the seconds it took; from the cache: None)."""
    w = jnp.ones((4, 3))
    x, s = jnp.ones((6, 4)), jnp.ones((6,))
    seen = []
    with autotune.reporting(seen.append):
        for _ in range(2):
            jax.jit(lambda w, x, s: ClientMap("auto").map_sum(_client(w), x, s))(w, x, s)
    out, err = capfd.readouterr()
    assert out == err == ""
    assert [c.measured_seconds is None for c in seen] == [False, True]
    assert seen[0].measured_seconds > 0 and seen[0][:4] == seen[1][:4] and seen[0].num == 6


def _digits_fedavg(client_optimizer=0.1, hidden=(16,), client_map=None):
    from fedjax_sim import data, fedavg, models
    from fedjax_sim.algorithms import CohortSpec, LocalSpec

    ds = data.load_digits(num_clients=10)
    model = models.mlp(ds.feature_shape, ds.num_classes, hidden=hidden)
    alg = fedavg(
        model.loss,
        client_optimizer=client_optimizer,
        local=LocalSpec(steps=2, batch_size=8),
        cohort=CohortSpec(size=4),
        client_map=client_map or ClientMap(),
    )
    key = jax.random.key(0)
    return alg, alg.init(model.init(key), key), ds.train, key


def _fake_measure(calls, best="4"):
    def fake(fn, xs, reduce, closed, out_tree, client_map, **kw):
        calls.append(reduce)
        return {c: (1.0 if c == best else 2.0) for c in ("1", "4", "vmap")}

    return fake


def test_cache_key_ignores_hyper_parameter_values(tuning, monkeypatch):
    """A static grid over the learning rate measures once; another model is another key."""
    monkeypatch.setattr(autotune, "measure", _fake_measure([]))
    keys = {}
    for name, kw in {
        "lr 0.1": {},
        "lr 0.03": dict(client_optimizer=0.03),
        "hidden 32": dict(hidden=(32,)),
    }.items():
        alg, state, train, key = _digits_fedavg(**kw)
        seen = []
        with autotune.reporting(seen.append):
            jax.eval_shape(alg.step, state, train, key)
        (keys[name],) = {c.key for c in seen}
    assert keys["lr 0.1"] == keys["lr 0.03"]
    assert keys["hidden 32"] != keys["lr 0.1"]


def test_auto_under_disable_jit_uses_the_static_rule(tuning, monkeypatch):
    """Debugging with `jax.disable_jit()`: nothing can be compiled, so nothing is measured;
    the step equals the step with the static rule's explicit mode."""

    def refuse(*args, **kw):
        raise AssertionError("measured under disable_jit")

    monkeypatch.setattr(autotune, "measure", refuse)
    (mode, bs) = ClientMap("auto").resolve(4)
    steps = []
    for cmap in (ClientMap(), ClientMap(mode, bs)):
        alg, state, train, key = _digits_fedavg(client_map=cmap)
        with jax.disable_jit():
            steps.append(alg.step(state, train, key)[0].params)
    for a, b in zip(*map(jax.tree.leaves, steps), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_recorded_mode_reproduces_the_auto_run(tuning, monkeypatch, tmp_path, capsys):
    """`fedjax-sim run` records the measured mode (history.json, summary line); passing it
    explicitly reproduces the run bit for bit. The evaluation follows the round's mode (one
    measurement, not two)."""
    from fedjax_sim.app import cli

    calls = []
    monkeypatch.setattr(autotune, "measure", _fake_measure(calls, best="4"))
    base = ["run", "--rounds", "4", "--eval-every", "2", "--no-progress"]
    assert cli.main([*base, "--out", str(tmp_path / "auto")]) == 0
    assert "(client map map:4); results in" in capsys.readouterr().out
    assert calls == [True]
    flags = ["--client-map", "map", "--map-batch-size", "4"]
    assert cli.main([*base, *flags, "--out", str(tmp_path / "pinned")]) == 0
    auto, pinned = (
        json.loads((tmp_path / d / "history.json").read_text()) for d in ("auto", "pinned")
    )
    assert auto["meta"]["client_map"] == pinned["meta"]["client_map"] == "map:4"
    assert auto["metrics"] == pinned["metrics"] and auto["eval"] == pinned["eval"]


def test_auto_without_measuring_is_the_static_rule(monkeypatch):
    monkeypatch.setenv("FEDJAX_SIM_AUTOTUNE", "0")
    assert not autotune.enabled()
    assert ClientMap("auto").resolve(100) == ("map", 8)


def test_fit_population_chooses_device_then_streamed():
    from fedjax_sim.runtime.parallel import fit_population

    kw = dict(data_bytes_per_client=1000, per_client_bytes=100, backend="gpu")
    small = fit_population(1000, 10, budget_bytes=20_000_000, **kw)
    assert small.placement == "device" and small.device_bytes == 1_000_000
    assert small.client_map.mode == "vmap"
    big = fit_population(10**6, 10, budget_bytes=20_000_000, **kw)  # 1 GB of data
    assert big.placement == "streamed" and big.device_bytes == 3 * 10 * 1000 + 8 * 10**6
    assert big.client_map.mode == "vmap"
    rows = fit_population(10**6, 10, budget_bytes=20_000_000, state_bytes_per_client=20, **kw)
    assert rows.placement == "streamed" and rows.state_rows == "host"  # tests/test_streaming_rows
    with pytest.raises(ValueError, match="no placement fits"):
        fit_population(10**7, 10, budget_bytes=20_000_000, state_bytes_per_client=20, **kw)
