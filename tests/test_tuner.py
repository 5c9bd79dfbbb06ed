"""Issue 36: the online hypergradient tuner (`fedjax_sim.run.tuner`) moves a 10x-too-small
learning rate up and a 10x-too-large one down, two tuners in one compiled vmap; its
accept / reject rule undoes a window exactly and revives a start that kills the network;
R tuners through the sweep engine equal the single tuners."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import data
from fedjax_sim.algorithms import fedavg
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.data import least_squares
from fedjax_sim.data.federated import ArrayData
from fedjax_sim.models import linear_regression, mlp
from fedjax_sim.run.differentiate import central_loss, initial_params
from fedjax_sim.run.simulate import evaluate_central
from fedjax_sim.run.tuner import TunerSpec, hypergradient_tuner

DIM = 4
MODEL = linear_regression(DIM)


def make(hp):
    return fedavg(
        MODEL.loss,
        client_optimizer=hp["client_lr"],
        server_optimizer=hp["server_lr"],
        local=LocalSpec(steps=5, batch_size=4),
        cohort=CohortSpec(size=4),
    )


def test_tuner_moves_too_small_lr_up_and_too_large_lr_down():
    """Least squares with Hessian eigenvalues in [0.09, 3.1]: a client lr of 0.05 is good, 0.005
    is 10x too small, 0.5 is 10x too large (a few local steps from divergence, 2 / 3.1)."""
    problem = least_squares(num_clients=8, examples_per_client=10, dim=DIM, seed=1)
    val = ArrayData(x=problem.data.x.reshape(-1, DIM), y=problem.data.y.reshape(-1))
    # the earlier safeguard (`tolerance=9`: reject non-finite windows or a 10x rise), under
    # which the hypergradient's direction is seen undisturbed by backtracking (outputs equal
    # the code before the accept / reject rule bit for bit)
    spec = TunerSpec(step_size=0.1, tolerance=9.0)
    tuner = hypergradient_tuner(make, central_loss(MODEL, val), num_rounds=30, spec=spec)
    # 0.005 is 10x too small, 0.5 10x too large, 5.0 diverges in its first round
    start = {"client_lr": jnp.array([0.005, 0.5, 5.0]), "server_lr": jnp.ones(3)}
    keys = jax.vmap(jax.random.key)(jnp.arange(3))
    result = tuner.many(start, MODEL.init(None), problem.data, keys)
    lr = np.asarray(result.trace["hparams"]["client_lr"] * result.trace["hparams"]["server_lr"])
    assert lr.shape == (3, 30)
    assert lr[0, 0] == pytest.approx(0.005) and lr[1, 0] == pytest.approx(0.5)
    # the effective step (client lr x server lr) moves by more than 2x toward the good range
    assert lr[0, -1] > 2 * 0.005 and lr[1, -1] < 0.5 / 2
    obj = np.asarray(result.trace["objective"])
    diverged = np.asarray(result.trace["rejected"])
    assert np.all(np.isfinite(obj[:2])) and not diverged[:2].any()
    # ... and the tuned runs end with a lower validation loss than they started with
    assert np.all(obj[:2, -5:].mean(axis=1) < obj[:2, 0])
    # the diverging start: its windows are undone and the values halved until it trains
    assert diverged[2, 0] and not diverged[2, -10:].any() and lr[2, -1] < 0.5
    assert np.isfinite(obj[2, -1]) and obj[2, -1] < obj[1, 0]
    assert np.all(np.isfinite(np.asarray(result.state.params["w"])))


def test_tuner_errors():
    obj = lambda state: jnp.sum(state.params["w"])  # noqa: E731
    with pytest.raises(ValueError, match="multiple of the tuner's window 4"):
        hypergradient_tuner(make, obj, num_rounds=10, spec=TunerSpec(window=4))
    with pytest.raises(ValueError, match="step_size must be > 0"):
        TunerSpec(step_size=0.0)
    with pytest.raises(ValueError, match="tolerance must be a finite number >= 0"):
        TunerSpec(tolerance=-0.5)
    with pytest.raises(ValueError, match="tolerance must be a finite number >= 0"):
        TunerSpec(tolerance=float("inf"))
    with pytest.raises(ValueError, match="backoff must be > 1"):
        TunerSpec(backoff=1.0)
    with pytest.raises(ValueError, match="need 0 < lower < upper"):
        TunerSpec(lower=1.0, upper=0.5)
    # remat: rounds per checkpointed chunk inside a window, as differentiable_run's
    spec = TunerSpec(window=4)
    with pytest.raises(ValueError, match=r"remat \(rounds per checkpointed chunk\) must be in "
                                         r"\[1, 4\], got 0"):  # fmt: skip
        hypergradient_tuner(make, obj, num_rounds=8, spec=spec, remat=0)
    with pytest.raises(ValueError, match=r"must be in \[1, 4\], got 5"):
        hypergradient_tuner(make, obj, num_rounds=8, spec=spec, remat=5)
    with pytest.raises(ValueError, match="remat must be None, an int or 'sqrt'"):
        hypergradient_tuner(make, obj, num_rounds=8, spec=spec, remat="log")
    assert hypergradient_tuner(make, obj, num_rounds=8, spec=spec, remat="sqrt").remat == 2
    assert hypergradient_tuner(make, obj, num_rounds=8, spec=spec).remat == 1  # the default
    tuner = hypergradient_tuner(make, obj, num_rounds=2)
    problem = least_squares(num_clients=4, examples_per_client=5, dim=DIM)
    with pytest.raises(ValueError, match="must be > 0"):
        tuner(
            {"client_lr": -0.1, "server_lr": 1.0}, MODEL.init(None), problem.data, jax.random.key(0)
        )
    with pytest.raises(ValueError, match="must be a real number"):
        tuner(
            {"client_lr": "0.1", "server_lr": 1.0},
            MODEL.init(None),
            problem.data,
            jax.random.key(0),
        )


def test_a_rejected_window_is_undone_bit_for_bit_and_the_values_backed_off():
    """An objective that rises every round (the round counter) rejects every window: the
    final state is the initial state bit for bit, Adam never steps, and the k-th window
    uses the start values / backoff^k (log-space arithmetic: float32 round-off)."""
    problem = least_squares(num_clients=8, examples_per_client=10, dim=DIM, seed=1)
    rising = lambda state: state.round.astype(jnp.float32)  # noqa: E731
    spec = TunerSpec(window=2, backoff=4.0, lower=1e-9)
    tuner = hypergradient_tuner(make, rising, num_rounds=8, spec=spec)
    params, key = MODEL.init(None), jax.random.key(3)
    result = tuner({"client_lr": 0.05, "server_lr": 0.5}, params, problem.data, key)
    assert np.asarray(result.trace["rejected"]).all()
    assert np.asarray(result.trace["objective"]) == pytest.approx(2.0)  # one window: 2 rounds
    initial = make({"client_lr": 0.05, "server_lr": 0.5}).init(params, key)
    for a, b in zip(jax.tree.leaves(result.state), jax.tree.leaves(initial), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    used = np.asarray(result.trace["hparams"]["client_lr"])
    np.testing.assert_allclose(used, 0.05 / 4.0 ** np.arange(4), rtol=1e-6)
    np.testing.assert_allclose(result.hparams["server_lr"], 0.5 / 4.0**4, rtol=1e-6)
    # accepted windows (a falling objective) are never undone and the values move by Adam
    falling = lambda state: -state.round.astype(jnp.float32)  # noqa: E731
    tuner = hypergradient_tuner(make, falling, num_rounds=8, spec=spec)
    result = tuner({"client_lr": 0.05, "server_lr": 0.5}, params, problem.data, key)
    assert not np.asarray(result.trace["rejected"]).any()
    assert int(result.state.round) == 8


def test_the_rule_revives_a_start_that_kills_the_network():
    """Digits, Dirichlet 0.1, MLP 64: the best fixed client lr is 0.3, and 3.0 kills the ReLU
    network in its first round while the validation loss rises by 0.4-12 % (5 seeds). With the
    default rule the tuner backs off and trains; with the earlier safeguard (`tolerance=9`:
    only a 10x rise or a non-finite window) it ends at chance with no window rejected."""
    ds = data.load("digits", num_clients=100, partitioner="dirichlet", alpha=0.1, seed=0)
    model = mlp(ds.feature_shape, ds.num_classes, hidden=(64,))
    val = ArrayData(x=ds.test.x[0::2], y=ds.test.y[0::2])
    test = ArrayData(x=ds.test.x[1::2], y=ds.test.y[1::2])

    def make_mlp(hp):
        return fedavg(model.loss, client_optimizer=hp["client_lr"],
                      server_optimizer=hp["server_lr"], local=LocalSpec(steps=10, batch_size=16),
                      cohort=CohortSpec(size=10))  # fmt: skip

    key = jax.random.key(0)
    start = {"client_lr": 3.0, "server_lr": 1.0}
    accuracy, rejected = {}, {}
    for tolerance in (0.01, 9.0):
        spec = TunerSpec(step_size=0.1, tolerance=tolerance)
        tuner = hypergradient_tuner(make_mlp, central_loss(model, val), num_rounds=20, spec=spec)
        result = tuner(start, initial_params(model, key), ds.train, key)
        accuracy[tolerance] = float(
            evaluate_central(model, result.state.params, test)["test_accuracy"]
        )
        rejected[tolerance] = np.asarray(result.trace["rejected"])
    assert accuracy[9.0] < 0.15 and not rejected[9.0].any()  # dead: chance is 0.1
    assert accuracy[0.01] > 0.5 and rejected[0.01][0]  # 0.63 in 20 rounds


def test_tuners_through_the_sweep_engine_equal_the_single_tuners():
    """`Tuner.sweep` runs starts x seeds with `sweep.map_runs`: run r equals the single tuner
    of its start and seed (initial model `initial_params(model, key(seed))`) to float32
    round-off (1 ulp seen when the runs are `lax.map`-ed one at a time: another program)."""
    problem = least_squares(num_clients=8, examples_per_client=10, dim=DIM, seed=1)
    val = ArrayData(x=problem.data.x.reshape(-1, DIM), y=problem.data.y.reshape(-1))
    tuner = hypergradient_tuner(make, central_loss(MODEL, val), num_rounds=6,
                                spec=TunerSpec(step_size=0.1, window=2))  # fmt: skip
    starts = {"client_lr": [0.005, 0.5], "server_lr": [1.0]}
    # a random initial model per seed (linear_regression's is zeros)
    model = dataclasses.replace(MODEL, init=lambda key: {"w": jax.random.normal(key, (DIM,))})
    runs, mapped = tuner.sweep(starts, problem.data, seeds=[3, 7], model=model, runs_per_group=1)
    _, vmapped = tuner.sweep(starts, problem.data, seeds=[3, 7], model=model)
    assert [(r.hparams["client_lr"], r.seed) for r in runs] == [
        (0.005, 3), (0.005, 7), (0.5, 3), (0.5, 7)
    ]  # fmt: skip
    for r, spec in enumerate(runs):
        key = jax.random.key(spec.seed)
        single = tuner(spec.hparams, initial_params(model, key), problem.data, key)
        for a, b, c in zip(*(jax.tree.leaves(x) for x in (single, mapped, vmapped)), strict=True):
            np.testing.assert_allclose(np.asarray(b[r]), np.asarray(a), rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(np.asarray(c[r]), np.asarray(a), rtol=1e-5, atol=1e-6)
    # `many` maps the same way: shared initial model, stacked starts and keys
    keys = jax.vmap(jax.random.key)(jnp.asarray([3, 7]))
    hp = {"client_lr": jnp.asarray([0.005, 0.5]), "server_lr": jnp.ones(2)}
    many = tuner.many(hp, MODEL.init(None), problem.data, keys, runs_per_group=1)
    single = tuner({"client_lr": 0.5, "server_lr": 1.0}, MODEL.init(None), problem.data, keys[1])
    np.testing.assert_allclose(many.state.params["w"][1], single.state.params["w"], rtol=1e-6)
    with pytest.raises(ValueError, match="needs one of model"):
        tuner.sweep(starts, problem.data, seeds=2)
