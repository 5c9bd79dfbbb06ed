"""Issue 36: gradients through federated rounds (`fedjax_sim.run.differentiate`).

Float64 throughout. Every finite-difference check is a central difference with relative
error <= 1e-6 and has a separation check: the gradient of a run whose randomness differs
(another key: other cohorts, minibatches, DP noise, fire masks) must miss the same tolerance,
so the comparison can fail. Closed forms: FedAvg with full-batch local GD on least squares
(x_T a polynomial in the learning rate, derived below), and the MAML / Reptile quantities
of the initial model on a quadratic problem.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import fedadam, fedavg, fedbuff, fedprox, scaffold
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.algorithms.privacy import dp_mean
from fedjax_sim.data import least_squares
from fedjax_sim.data.federated import ArrayData, FederatedData
from fedjax_sim.models import linear_regression
from fedjax_sim.run.differentiate import (
    array_schedule,
    central_loss,
    clients_loss,
    differentiable_run,
    remat_length,
)

DIM = 3
MODEL = linear_regression(DIM)
TOL = 1e-6
ROUNDS = 3


@pytest.fixture(scope="module")
def problem():
    return least_squares(num_clients=6, examples_per_client=[6, 9, 5, 8, 7, 10], dim=DIM, seed=3)


@pytest.fixture(scope="module")
def target(problem):
    """A validation objective: the loss on a central set drawn like the clients' data."""
    return ArrayData(x=problem.data.x.reshape(-1, DIM), y=problem.data.y.reshape(-1))


def start():
    return {"w": jnp.asarray([0.3, -0.2, 0.1], jnp.float64)}


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def central_difference(run, hp, name, data, key, eps_rel=1e-5):
    """(f(h + e) - f(h - e)) / 2e for the scalar hyper-parameter `name`."""
    h = float(hp[name])
    eps = eps_rel * abs(h)
    # the values of the compiled value-and-gradient program (one compilation per test)
    up = run.value_and_grad({**hp, name: h + eps}, start(), data, key)[0]
    down = run.value_and_grad({**hp, name: h - eps}, start(), data, key)[0]
    return (float(up) - float(down)) / (2 * eps)


def check_fd(run, hp, name, data, seed=1, other_seed=2):
    """AD gradient == central difference (rel <= 1e-6); a run with other randomness misses."""
    key, other = jax.random.key(seed), jax.random.key(other_seed)
    _, grads = run.value_and_grad(hp, start(), data, key)
    fd = central_difference(run, hp, name, data, key)
    assert rel_err(grads.hparams[name], fd) <= TOL, (float(grads.hparams[name]), fd)
    # separation: the gradient under another key (other cohorts / minibatches / noise)
    _, wrong = run.value_and_grad(hp, start(), data, other)
    assert rel_err(wrong.hparams[name], fd) > 100 * TOL, (float(wrong.hparams[name]), fd)
    return float(grads.hparams[name])


LOCAL = LocalSpec(steps=3, batch_size=4)  # minibatches with replacement: key-dependent
COHORT = CohortSpec(size=3)


# ------------------------------------------------------------------------------ finite differences
def test_fedavg_client_lr(x64, problem, target):
    def make(hp):
        return fedavg(MODEL.loss, client_optimizer=hp["lr"], local=LOCAL, cohort=COHORT)

    run = differentiable_run(make, central_loss(MODEL, target), num_rounds=ROUNDS, wrt="hparams")
    check_fd(run, {"lr": 0.05}, "lr", problem.data)


def test_fedprox_mu(x64, problem, target):
    def make(hp):
        return fedprox(MODEL.loss, mu=hp["mu"], client_optimizer=0.08, local=LOCAL, cohort=COHORT)

    run = differentiable_run(make, central_loss(MODEL, target), num_rounds=ROUNDS, wrt="hparams")
    check_fd(run, {"mu": 0.5}, "mu", problem.data)


def test_scaffold_client_lr(x64, problem, target):
    def make(hp):
        return scaffold(
            MODEL.loss, num_clients=6, client_optimizer=hp["lr"], local=LOCAL, cohort=COHORT
        )

    run = differentiable_run(make, central_loss(MODEL, target), num_rounds=ROUNDS, wrt="hparams")
    check_fd(run, {"lr": 0.05}, "lr", problem.data)


def test_fedadam_server_lr(x64, problem, target):
    def make(hp):
        return fedadam(
            MODEL.loss, server_optimizer=hp["server_lr"], client_optimizer=0.05, local=LOCAL,
            cohort=COHORT,
        )  # fmt: skip

    run = differentiable_run(make, central_loss(MODEL, target), num_rounds=ROUNDS, wrt="hparams")
    check_fd(run, {"server_lr": 0.03}, "server_lr", problem.data)


def test_dp_clip_norm_with_noise_fixed_by_the_key(x64, problem, target):
    """DP-FedAvg (fixed clipping, z = 0.5): the clip norm binds (updates are longer), the
    Gaussian noise is a function of the key, so the objective is smooth in C."""
    cohort = CohortSpec(size=3, weighting="uniform")

    def make(hp):
        agg = dp_mean(0.5, hp["clip"], 3.0)
        return fedavg(MODEL.loss, client_optimizer=0.1, local=LOCAL, cohort=cohort, aggregator=agg)

    run = differentiable_run(make, central_loss(MODEL, target), num_rounds=ROUNDS, wrt="hparams")
    # (the clip state is in the default float dtype, float64 here: privacy.dp_mean)
    check_fd(run, {"clip": 0.05}, "clip", problem.data)


def test_fedbuff_client_and_server_lr(x64, problem, target):
    """Asynchronous FedBuff (Bernoulli arrivals, buffer of 2): the fire masks are functions
    of the key; the iterations are the rounds."""

    def make(hp):
        return fedbuff(
            MODEL.loss, num_clients=6, firing_probability=0.5, buffer_size=2,
            client_optimizer=hp["lr"], server_optimizer=hp["server_lr"], local=LOCAL,
        )  # fmt: skip

    run = differentiable_run(make, central_loss(MODEL, target), num_rounds=6, wrt="hparams")
    hp = {"lr": 0.05, "server_lr": 0.8}
    check_fd(run, hp, "lr", problem.data)
    check_fd(run, hp, "server_lr", problem.data)


# ------------------------------------------------------------------------------ closed forms
def poly_rounds(problem, x0, weights, steps, rounds):
    """FedAvg with full participation, `steps` full-batch GD steps and server lr 1 on
    f_i(w) = 1/2 w'H_i w - c_i'w: as a polynomial in the learning rate eta.

    A local step y <- y - eta (H_i y - c_i) maps a polynomial y(eta) = sum_j Y_j eta^j (Y_j
    in R^d) to sum_j (Y_j - H_i Y_{j-1}) eta^j + c_i eta; the server averages the clients'
    polynomials with the weights p_i. So x_T(eta) is a polynomial of degree T * steps whose
    coefficients are returned as `[T * steps + 1, d]` (lowest degree first)."""
    deg = rounds * steps
    x = np.zeros((deg + 1, DIM))
    x[0] = x0
    for _ in range(rounds):
        new = np.zeros_like(x)
        for h, c, p in zip(problem.hessians, problem.linear, weights, strict=True):
            y = x.copy()
            for _ in range(steps):
                shifted = np.zeros_like(y)
                shifted[1:] = y[:-1] @ h.T  # eta * H_i y
                shifted[1] -= c  # - eta * c_i
                y = y - shifted
            new += p * y
        x = new
    return x


def test_fedavg_full_batch_least_squares_is_a_polynomial_in_the_lr(x64, problem):
    steps, rounds, lr = 3, 4, 0.07
    weights = problem.weights("counts")  # full participation, weights n_i / N
    coeffs = poly_rounds(problem, np.asarray(start()["w"]), weights, steps, rounds)
    powers = lr ** np.arange(coeffs.shape[0])
    x_t = powers @ coeffs
    dx_t = (np.arange(1, coeffs.shape[0]) * powers[:-1]) @ coeffs[1:]
    target = np.array([1.0, -1.0, 0.5])

    def make(hp):
        return fedavg(
            MODEL.loss, client_optimizer=hp["lr"], local=LocalSpec(steps=steps, sampling="full")
        )

    objective = lambda state: 0.5 * jnp.sum((state.params["w"] - target) ** 2)  # noqa: E731
    run = differentiable_run(make, objective, num_rounds=rounds, wrt="hparams")
    value, grads = run.value_and_grad({"lr": lr}, start(), problem.data, jax.random.key(0))
    np.testing.assert_allclose(float(value), 0.5 * np.sum((x_t - target) ** 2), rtol=1e-12)
    np.testing.assert_allclose(float(grads.hparams["lr"]), (x_t - target) @ dx_t, rtol=1e-10)
    # separation: the polynomial of another learning rate, or one round fewer, is far off
    assert rel_err(grads.hparams["lr"], (x_t - target) @ dx_t) <= 1e-10
    wrong = poly_rounds(problem, np.asarray(start()["w"]), weights, steps, rounds - 1)
    wrong_x = (lr ** np.arange(wrong.shape[0])) @ wrong
    assert abs(float(value) - 0.5 * np.sum((wrong_x - target) ** 2)) > 1e-4


def quadratic_tasks(num=3, seed=0):
    """Tasks f_i(w) = 1/2 (w - m_i)' H_i (w - m_i) as least squares with exact closed forms
    (H_i, c_i = H_i m_i from the data actually used)."""
    return least_squares(num_clients=num, examples_per_client=8, dim=DIM, seed=seed)


def adaptation(h, c, a, k, x0):
    """(M_i, m_i, U_i(x0)): K GD steps of size a on 1/2 w'Hw - c'w map x0 to
    m + M (x0 - m) with M = (I - a H)^K and m = H^-1 c."""
    m = np.linalg.solve(h, c)
    mk = np.linalg.matrix_power(np.eye(DIM) - a * h, k)
    return mk, m, m + mk @ (x0 - m)


def test_initial_model_gradient_is_maml_meta_gradient(x64):
    """One round with the single client i and K full-batch GD steps is task i's inner
    adaptation U_i(x0). The gradient of f_i(U_i(x0)) w.r.t. the initial model, averaged over
    tasks, is MAML's meta-gradient mean_i M_i' (H_i U_i(x0) - c_i) (Finn et al. 2017; exact
    for quadratics)."""
    tasks = quadratic_tasks()
    a, k = 0.1, 4
    x0 = np.asarray(start()["w"])

    def make(hp):
        return fedavg(MODEL.loss, client_optimizer=a, local=LocalSpec(steps=k, sampling="full"))

    grads = []
    for i in range(tasks.num_clients):
        one = FederatedData.create(
            tasks.data.x[i : i + 1], tasks.data.y[i : i + 1], tasks.data.counts[i : i + 1]
        )
        run = differentiable_run(
            make, clients_loss(MODEL, one.x, one.y, one.counts), num_rounds=1, wrt="params"
        )
        _, g = run.value_and_grad({}, start(), one, jax.random.key(0))
        grads.append(np.asarray(g.params["w"]))
    meta = np.mean(grads, axis=0)
    expected, first_order = [], []
    for h, c in zip(tasks.hessians, tasks.linear, strict=True):
        mk, _, u = adaptation(h, c, a, k, x0)
        expected.append(mk.T @ (h @ u - c))
        first_order.append(h @ u - c)
    np.testing.assert_allclose(meta, np.mean(expected, axis=0), rtol=1e-10, atol=1e-12)
    # separation: first-order MAML (the Jacobians M_i dropped) is not what we computed
    assert rel_err(meta, np.mean(first_order, axis=0)) > 1e-3


def test_initial_model_gradient_of_a_fedavg_round_is_reptiles_jacobian(x64):
    """Reptile (Nichol et al. 2018) moves x0 along x0 - mean_i U_i(x0); one FedAvg round (full
    participation, uniform weights, K GD steps, server lr 1) returns x1 = mean_i U_i(x0), so
    x0 - x1 is the Reptile direction, and the gradient of <v, x1> w.r.t. x0 is
    mean_i M_i' v, the Jacobian of Reptile's average adaptation; for quadratics Reptile's
    direction is also the gradient of Q(x0) = mean_i 1/2 (x0 - m_i)'(I - M_i)(x0 - m_i)."""
    tasks = quadratic_tasks(seed=5)
    a, k = 0.1, 3
    x0 = np.asarray(start()["w"])
    v = np.array([0.4, -1.0, 2.0])

    def make(hp):
        return fedavg(
            MODEL.loss, client_optimizer=a, local=LocalSpec(steps=k, sampling="full"),
            cohort=CohortSpec(weighting="uniform"),
        )  # fmt: skip

    objective = lambda state: jnp.dot(state.params["w"], v)  # noqa: E731
    for mode in ("reverse", "forward"):
        run = differentiable_run(make, objective, num_rounds=1, wrt="params", mode=mode)
        value, grads = run.value_and_grad({}, start(), tasks.data, jax.random.key(0))
        ms, optima, us = zip(
            *(
                adaptation(h, c, a, k, x0)
                for h, c in zip(tasks.hessians, tasks.linear, strict=True)
            ),
            strict=True,
        )
        reptile = x0 - np.mean(us, axis=0)
        np.testing.assert_allclose(float(value), v @ np.mean(us, axis=0), rtol=1e-12)
        np.testing.assert_allclose(
            grads.params["w"], np.mean([m.T @ v for m in ms], axis=0), rtol=1e-10
        )
        q_grad = np.mean([(np.eye(DIM) - m) @ (x0 - o) for m, o in zip(ms, optima, strict=True)], 0)
        np.testing.assert_allclose(reptile, q_grad, rtol=1e-10)
        state = run.final_state({}, start(), tasks.data, jax.random.key(0))
        np.testing.assert_allclose(x0 - np.asarray(state.params["w"]), reptile, rtol=1e-10)


# ------------------------------------------------------------------------------ remat, truncation
def make_scheduled(hp):
    return fedavg(
        MODEL.loss, client_optimizer=array_schedule(hp["lrs"]), server_optimizer=hp["server_lr"],
        local=LOCAL, cohort=COHORT,
    )  # fmt: skip


def test_per_round_schedule_remat_truncation_and_forward_mode(x64, problem, target):
    rounds = 5
    objective = central_loss(MODEL, target)
    hp = {"lrs": jnp.linspace(0.03, 0.08, rounds), "server_lr": 0.9}
    key = jax.random.key(4)
    full = differentiable_run(make_scheduled, objective, num_rounds=rounds, remat=None)
    value, grads = full.value_and_grad(hp, start(), problem.data, key)
    assert grads.hparams["lrs"].shape == (rounds,) and np.all(grads.hparams["lrs"] != 0)
    # one schedule entry against a central difference
    t, eps = 2, 1e-6
    e = jnp.zeros(rounds).at[t].set(eps)
    up = full.value_and_grad({**hp, "lrs": hp["lrs"] + e}, start(), problem.data, key)[0]
    down = full.value_and_grad({**hp, "lrs": hp["lrs"] - e}, start(), problem.data, key)[0]
    assert rel_err(grads.hparams["lrs"][t], (up - down) / (2 * eps)) <= TOL
    # remat in chunks of 2 (and a last chunk of 1) with window W = T, and the default (every
    # round checkpointed) == no remat, no window: 0 ulp measured, 8 allowed
    for kw in ({"remat": 2, "window": rounds}, {}):
        v2, g2 = differentiable_run(
            make_scheduled, objective, num_rounds=rounds, **kw
        ).value_and_grad(hp, start(), problem.data, key)
        assert float(v2) == float(value)
        for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=8 * np.finfo(np.float64).eps, atol=0)
    # truncation W = 1: the last lr's gradient is exact, the earlier ones and the initial
    # model's are zero, the server lr's (used in every round) is truncated
    v1, g1 = differentiable_run(
        make_scheduled, objective, num_rounds=rounds, window=1, remat=2
    ).value_and_grad(hp, start(), problem.data, key)
    np.testing.assert_allclose(float(v1), float(value), rtol=1e-14)
    np.testing.assert_allclose(g1.hparams["lrs"][-1], grads.hparams["lrs"][-1], rtol=1e-12)
    assert np.all(np.asarray(g1.hparams["lrs"][:-1]) == 0)
    assert np.all(np.asarray(g1.params["w"]) == 0)
    assert rel_err(g1.hparams["server_lr"], grads.hparams["server_lr"]) > 1e-3
    # forward mode (one jvp per scalar) == reverse mode
    vf, gf = differentiable_run(
        make_scheduled, objective, num_rounds=rounds, mode="forward", wrt="hparams"
    ).value_and_grad(hp, start(), problem.data, key)
    np.testing.assert_allclose(float(vf), float(value), rtol=1e-14)
    assert gf.params is None
    for a, b in zip(jax.tree.leaves(gf.hparams), jax.tree.leaves(grads.hparams), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12)


# ------------------------------------------------------------------------------ errors
def test_bad_settings_are_refused_before_compiling(problem):
    obj = lambda state: jnp.sum(state.params["w"])  # noqa: E731
    for kwargs, match in [
        ({"num_rounds": 0}, "num_rounds must be >= 1"),
        ({"num_rounds": 2.5}, "num_rounds must be an int"),
        ({"num_rounds": 3, "window": 4}, r"window must be in \[1, 3\]"),
        ({"num_rounds": 3, "window": 0}, "window must be in"),
        ({"num_rounds": 3, "remat": 0}, "remat"),
        ({"num_rounds": 3, "remat": "log"}, "remat must be None, an int or 'sqrt'"),
        ({"num_rounds": 3, "mode": "backward"}, "mode must be"),
        ({"num_rounds": 3, "wrt": ("lr",)}, "wrt must name"),
        ({"num_rounds": 3, "wrt": ()}, "wrt must name"),
    ]:
        with pytest.raises(ValueError, match=match):
            differentiable_run(make_scheduled, obj, **kwargs)
    with pytest.raises(ValueError, match="make_algorithm must be a callable"):
        differentiable_run(None, obj, num_rounds=3)
    assert remat_length("sqrt", 1000) == 32 and remat_length(None, 5) is None
    run = differentiable_run(make_scheduled, obj, num_rounds=3)
    assert run.remat == 1  # the default: every round checkpointed (docs/design.md)
    data, key = problem.data, jax.random.key(0)
    for hp, match in [
        ({"lrs": jnp.full(4, 0.1), "server_lr": 1.0}, r"hparams\['lrs'\] has 4 entries"),
        ({"lrs": jnp.full(3, 0.1), "server_lr": "1.0"}, "must be a real number or array, got str"),
        ({"lrs": jnp.full(3, 0.1), "server_lr": True}, "must be a real number"),
        ({"lrs": jnp.full(3, 1, jnp.int32), "server_lr": 1.0}, "dtype int32"),
        ({"lrs": jnp.full(3, 0.1), "server_lr": float("nan")}, "non-finite"),
        ({}, "hparams is empty"),
    ]:
        with pytest.raises(ValueError, match=match):
            run.value_and_grad(hp, start(), data, key)
    with pytest.raises(ValueError, match=r"params\['w'\] has dtype int32"):
        run.value_and_grad(
            {"lrs": jnp.full(3, 0.1), "server_lr": 1.0}, {"w": jnp.zeros(3, jnp.int32)}, data, key
        )
    static = differentiable_run(
        lambda hp: fedavg(MODEL.loss, local=LocalSpec(steps=hp["steps"])), obj, num_rounds=3
    )
    with pytest.raises(ValueError, match=r"does not accept traced hyper-parameters \["):
        static.value({"steps": 2.0}, start(), data, key)
    bad = differentiable_run(make_scheduled, lambda s: s.params["w"], num_rounds=3)
    with pytest.raises(ValueError, match="the objective must return a real scalar"):
        bad.value({"lrs": jnp.full(3, 0.1), "server_lr": 1.0}, start(), data, key)


def test_readme_gradients_example_runs():
    """The README's example of `differentiable_run` runs as written (its python block)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("### Gradients through rounds", 1)[1].split("\n### ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    grads, loss = namespace["grads"], namespace["loss"]
    assert grads.hparams["lrs"].shape == (10,) and np.isfinite(float(loss))
    assert np.all(np.isfinite(np.asarray(grads.hparams["lrs"])))
    assert float(grads.hparams["lrs"][0]) < 0  # a larger early lr lowers the loss
