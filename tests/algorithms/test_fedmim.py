"""FedMIM (Algorithm 1) against exact reductions, a NumPy replay, the paper's Lemmas 5/6 and
closed forms (spec docs/specs/fedmim.md section 8), plus FedCM, C_t and validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import (
    client_sgd,
    fedavg,
    fedcm,
    feddyn,
    fedmim,
    fedsam,
    round_decay,
    scaffold,
)
from fedjax_sim.algorithms.core import COHORT, CohortSpec, LocalSpec, round_key
from fedjax_sim.algorithms.fedadam import adam_without_bias_correction
from fedjax_sim.data import least_squares, pack
from fedjax_sim.models import linear_regression
from fedjax_sim.models.base import masked_mean

MODEL = linear_regression(4)


def run(alg, params, data, rounds, key):
    """`rounds` jitted steps; returns the final state, last metrics and every state."""
    state = alg.init(params, key)
    step = jax.jit(alg.step)
    states = [state]
    for _ in range(rounds):
        state, metrics = step(state, data, key)
        states.append(state)
    return state, metrics, states


def scan_rounds(alg, params, data, rounds, key):
    """`rounds` steps under one `lax.scan`; returns the final state and stacked metrics."""
    run_all = jax.jit(lambda s: jax.lax.scan(lambda s, _: alg.step(s, data, key), s, length=rounds))
    return run_all(alg.init(params, key))


def test_zero_weights_equal_fedavg_bitwise():
    """alpha = beta = 0 (J = 2, and J = 0, which is valid): same bits as FedAvg, with
    stochastic minibatches, partial participation, per-round lr decay and optax weight
    decay."""
    problem = least_squares(num_clients=9, examples_per_client=np.arange(5, 14), dim=4, seed=1)
    sched = round_decay(0.1, 0.998)
    kw = dict(local=LocalSpec(steps=4, batch_size=3), cohort=CohortSpec(size=4))
    key = jax.random.key(3)
    w0 = {"w": jnp.array([0.5, -1.0, 0.25, 2.0])}
    ref, _, _ = run(
        fedavg(MODEL.loss, client_optimizer=client_sgd(sched, 1e-3), **kw), w0, problem.data, 6, key
    )
    for alpha in [(0.0, 0.0), ()]:
        alg = fedmim(
            MODEL.loss,
            momentum=alpha,
            lookahead=alpha,
            client_optimizer=sched,
            weight_decay=1e-3,
            **kw,
        )
        state, _, _ = run(alg, w0, problem.data, 6, key)
        np.testing.assert_array_equal(state.params["w"], ref.params["w"])
        assert state.hooks["multistep_inertia"]["w"].shape == (len(alpha), 4)  # J = 0: stays empty


def test_single_inertial_step_equals_fedcm(x64):
    """J = 1, alpha_0 = 0.9, beta = 0, constant lr == FedCM(a = 0.1) (spec 8 item 2)."""
    problem = least_squares(num_clients=8, examples_per_client=10, dim=4, seed=2)
    kw = dict(
        client_optimizer=0.05, local=LocalSpec(steps=5, batch_size=4), cohort=CohortSpec(size=3)
    )
    key = jax.random.key(4)
    w0 = {"w": jnp.zeros(4)}
    s_mim, _, _ = run(
        fedmim(MODEL.loss, momentum=0.9, lookahead=None, **kw), w0, problem.data, 7, key
    )
    s_cm, _, _ = run(fedcm(MODEL.loss, momentum=0.9, **kw), w0, problem.data, 7, key)
    np.testing.assert_allclose(s_mim.params["w"], s_cm.params["w"], rtol=1e-11, atol=1e-13)
    # FedCM's D_t (gradient units) is FedMIM's delta_t / eta (parameter units)
    np.testing.assert_allclose(
        s_mim.hooks["multistep_inertia"]["w"][0] / 0.05,
        s_cm.hooks["client_momentum"]["w"],
        rtol=1e-10,
        atol=1e-12,
    )
    assert np.linalg.norm(s_cm.params["w"]) > 0.1


def test_algorithm1_replay_and_lemmas_5_6_every_round(x64):
    """Each round of the JAX FedMIM (J = 3, random alpha/beta, lr decay, partial participation)
    is replayed in NumPy from its own x_t and history: x_{t+1} matches Algorithm 1, the newest
    history entry satisfies Lemma 6, and u_t of Lemma 5 moves by exactly
    -(eta_l(t)/S) sum_i sum_k g_{i,k}."""
    rng = np.random.default_rng(7)
    alpha = tuple(rng.dirichlet(np.ones(3)) * 0.85)
    beta = tuple(rng.uniform(0, 0.8, 3))
    damping, steps, size = 1 - sum(alpha), 5, 3
    problem = least_squares(num_clients=8, examples_per_client=6, dim=4, seed=5)
    h, c = problem.hessians, problem.linear
    sched = round_decay(0.08, 0.97)
    cohort = CohortSpec(size=size, weighting="uniform")
    alg = fedmim(
        MODEL.loss,
        momentum=alpha,
        lookahead=beta,
        client_optimizer=sched,
        local=LocalSpec(steps=steps, sampling="full"),
        cohort=cohort,
    )
    key = jax.random.key(11)
    _, _, states = run(alg, {"w": jnp.array([1.0, -2.0, 0.5, 0.0])}, problem.data, 10, key)
    tails = np.cumsum(np.array(alpha)[::-1])[::-1]  # sum_{s=j}^{J-1} alpha_s

    def u(state):
        x, hist = np.asarray(state.params["w"]), np.asarray(state.hooks["multistep_inertia"]["w"])
        return x - (steps / damping) * tails @ hist

    for t, (state, new) in enumerate(zip(states[:-1], states[1:], strict=True)):
        x, hist = np.asarray(state.params["w"]), np.asarray(state.hooks["multistep_inertia"]["w"])
        eta = float(sched(t))
        inertia, lookahead = np.array(alpha) @ hist, np.array(beta) @ hist
        ids = np.asarray(
            cohort.sample(round_key(key, jnp.int32(t), COHORT), problem.data.counts)[0]
        )
        grad_sum, finals = np.zeros(4), []
        for i in ids:
            xi = x.copy()
            for _ in range(steps):
                g = h[i] @ (xi - lookahead) - c[i]
                grad_sum += g
                xi = xi - inertia - damping * eta * g
            finals.append(xi)
        new_x, new_hist = (
            np.asarray(new.params["w"]),
            np.asarray(new.hooks["multistep_inertia"]["w"]),
        )
        np.testing.assert_allclose(new_x, np.mean(finals, axis=0), rtol=1e-12, atol=1e-12)
        delta_tilde = eta * grad_sum / (size * steps)
        np.testing.assert_allclose(new_hist[0], damping * delta_tilde + inertia, atol=1e-12)
        np.testing.assert_array_equal(new_hist[1:], hist[:-1])
        np.testing.assert_allclose(u(new) - u(state), -(eta / size) * grad_sum, atol=1e-11)
    assert (
        np.abs(states[-1].hooks["multistep_inertia"]["w"]).min() > 0
    )  # the history is really in use


def test_first_round_is_fedavg_with_damped_lr(x64):
    """Zero history: round 0 of FedMIM equals one FedAvg round with lr A * eta_l."""
    problem = least_squares(num_clients=6, examples_per_client=9, dim=4, seed=3)
    kw = dict(local=LocalSpec(steps=6, batch_size=4), cohort=CohortSpec(size=4))
    key, w0 = jax.random.key(2), {"w": jnp.array([0.3, 0.1, -0.4, 1.0])}
    s_mim, _, _ = run(
        fedmim(MODEL.loss, momentum=(0.6, 0.3), lookahead=(0.9, 0.1), client_optimizer=0.2, **kw),
        w0,
        problem.data,
        1,
        key,
    )
    s_avg, _, _ = run(
        fedavg(MODEL.loss, client_optimizer=0.1 * 0.2, **kw), w0, problem.data, 1, key
    )
    np.testing.assert_allclose(s_mim.params["w"], s_avg.params["w"], rtol=1e-13)
    assert not np.allclose(s_mim.params["w"], w0["w"])


@pytest.mark.parametrize("alpha,beta", [((0.6, 0.3), (0.9, 0.1)), ((0.3, 0.3, 0.3), None)])
def test_linear_loss_displacement_converges_geometrically(x64, alpha, beta):
    """f_i(x) = <c_i, x>: the per-round displacement tends to -eta K mean(c_i) (inertia does not
    change the effective lr), with error ratio the largest root modulus of
    z^J - sum_j alpha_j z^(J-1-j) (spec 8 item 7)."""
    lin = np.array([[1.0, -2.0, 0.5, 0.0], [3.0, 0.0, -1.0, 2.0]])
    data = pack(np.repeat(lin, 3, axis=0), np.zeros(6), np.repeat([0, 1], 3), 2)
    loss = lambda params, batch: masked_mean(batch.x @ params["w"], batch.mask)
    eta, steps, rounds = 0.05, 3, 700
    alg = fedmim(
        loss,
        momentum=alpha,
        lookahead=beta,
        client_optimizer=eta,
        local=LocalSpec(steps, batch_size=2),
    )
    state, metrics = scan_rounds(alg, {"w": jnp.zeros(4)}, data, rounds, jax.random.key(0))
    del state
    limit = -eta * steps * lin.mean(axis=0)
    # displacement of round t is -K * delta_{t+1}, and update_norm = ||displacement||
    norms = np.asarray(metrics["update_norm"])
    np.testing.assert_allclose(norms[-1], np.linalg.norm(limit), rtol=1e-10)
    root = np.abs(np.roots([1.0, *(-np.array(alpha))])).max()
    err = np.abs(norms - np.linalg.norm(limit))
    t = int(np.log(1e-7) / np.log(root))  # well inside the asymptotic regime, far from round-off
    np.testing.assert_allclose(err[t + 1] / err[t], root, rtol=2e-2)


def _closed_form_consistency(problem, x, lr, steps):
    """C = mean_i ||x_{i,K} - mean_j x_{j,K}||^2 for full-batch GD from x (equal weights)."""
    finals = []
    for hi, ci in zip(problem.hessians, problem.linear, strict=True):
        xi = x.copy()
        for _ in range(steps):
            xi = xi - lr * (hi @ xi - ci)
        finals.append(xi)
    finals = np.array(finals)
    return np.mean(np.sum((finals - finals.mean(0)) ** 2, axis=1))


def test_fixed_point_is_fedavg_fixed_point_with_damped_lr_and_closer_to_optimum(x64):
    """Full batch, full participation: FedMIM's limit is FedAvg's fixed point with lr A*eta
    (closed form), which is closer to the optimum than FedAvg(eta)'s, and its logged
    consistency C_t equals the closed form there and is smaller than FedAvg's."""
    problem = least_squares(num_clients=8, examples_per_client=30, dim=4, heterogeneity=1.5)
    eta, steps = 0.1, 5
    local = LocalSpec(steps=steps, sampling="full")
    key = jax.random.key(0)
    mim = fedmim(
        MODEL.loss, momentum=(0.6, 0.3), lookahead=(0.9, 0.1), client_optimizer=eta, local=local
    )
    s_mim, m_mim = scan_rounds(mim, {"w": jnp.zeros(4)}, problem.data, 1500, key)
    s_avg, m_avg = scan_rounds(
        fedavg(MODEL.loss, client_optimizer=eta, local=local),
        {"w": jnp.zeros(4)},
        problem.data,
        600,
        key,
    )
    fp_mim = problem.fedavg_fixed_point(0.1 * eta, steps)
    fp_avg = problem.fedavg_fixed_point(eta, steps)
    opt = problem.optimum()
    np.testing.assert_allclose(s_mim.params["w"], fp_mim, atol=1e-10)
    np.testing.assert_allclose(s_avg.params["w"], fp_avg, atol=1e-10)
    np.testing.assert_allclose(s_mim.hooks["multistep_inertia"]["w"], 0.0, atol=1e-12)
    assert np.linalg.norm(fp_mim - opt) < np.linalg.norm(fp_avg - opt)
    c_mim = _closed_form_consistency(problem, fp_mim, 0.1 * eta, steps)
    c_avg = _closed_form_consistency(problem, fp_avg, eta, steps)
    np.testing.assert_allclose(m_mim["consistency"][-1], c_mim, rtol=1e-8)
    np.testing.assert_allclose(m_avg["consistency"][-1], c_avg, rtol=1e-8)
    assert c_mim < c_avg


def test_bernoulli_participation_full_and_empty_rounds():
    """Bernoulli p = 1 equals full participation bit for bit; a round where nobody is drawn
    keeps x_t, pushes delta = 0 into the history and counts no participant."""
    problem = least_squares(num_clients=6, examples_per_client=8, dim=4, seed=4)
    kw = dict(
        momentum=(0.5, 0.2),
        lookahead=(0.4, 0.4),
        client_optimizer=0.05,
        local=LocalSpec(3, batch_size=4),
    )
    key, w0 = jax.random.key(9), {"w": jnp.ones(4)}
    s_full, _, _ = run(fedmim(MODEL.loss, **kw), w0, problem.data, 4, key)
    s_bern, _, _ = run(
        fedmim(MODEL.loss, cohort=CohortSpec(sampling="bernoulli", probability=1.0), **kw),
        w0,
        problem.data,
        4,
        key,
    )
    np.testing.assert_array_equal(s_bern.params["w"], s_full.params["w"])
    never = fedmim(MODEL.loss, cohort=CohortSpec(3, sampling="bernoulli", probability=1e-12), **kw)
    state, metrics = jax.jit(never.step)(s_full, problem.data, key)
    np.testing.assert_array_equal(state.params["w"], s_full.params["w"])
    np.testing.assert_array_equal(state.hooks["multistep_inertia"]["w"][0], np.zeros(4))
    np.testing.assert_array_equal(
        state.hooks["multistep_inertia"]["w"][1], s_full.hooks["multistep_inertia"]["w"][0]
    )
    assert int(metrics["participants"]) == 0 and int(state.round) == 5


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda: fedmim(MODEL.loss, momentum=(0.6, 0.4)), "sum\\(momentum\\) < 1"),
        (lambda: fedmim(MODEL.loss, momentum=(1.2,), lookahead=None), "sum\\(momentum\\) < 1"),
        (lambda: fedmim(MODEL.loss, momentum=(0.5, -0.1)), "momentum weights must be"),
        (
            lambda: fedmim(MODEL.loss, momentum=(0.5, 0.1), lookahead=(0.5, -1.0)),
            "lookahead weights",
        ),
        (lambda: fedmim(MODEL.loss, momentum=(0.5,), lookahead=(0.5, 0.1)), "same length J"),
        (lambda: fedmim(MODEL.loss, momentum=(), lookahead=(0.5,)), "same length J"),
        (lambda: fedmim(MODEL.loss, momentum=(float("nan"),)), "momentum weights must be"),
        (lambda: fedmim(MODEL.loss, client_optimizer=0.0), "client_optimizer"),
        (
            lambda: fedmim(MODEL.loss, client_optimizer=round_decay(0.1, 0.998), weight_decay=-1),
            "weight",
        ),
        (lambda: fedcm(MODEL.loss, momentum=1.0), "momentum"),
        (lambda: fedcm(MODEL.loss, momentum=-0.5), "momentum"),
        (lambda: feddyn(MODEL.loss, num_clients=4, regularization=0.0), "FedDyn regularization"),
        (lambda: scaffold(MODEL.loss, num_clients=0), "num_clients"),
        (lambda: fedsam(MODEL.loss, rho=-0.1), "rho"),
        (lambda: adam_without_bias_correction(0.1, b1=1.0), "b1"),
        (lambda: adam_without_bias_correction(0.1, eps=0.0), "eps"),
        (lambda: round_decay(0.1, 1.5), "decay"),
        (lambda: CohortSpec(sampling="bernoulli"), "probability"),
        (lambda: CohortSpec(sampling="bernoulli", probability=0.0), "probability"),
        (lambda: CohortSpec(size=3, probability=0.5), "only used by"),
    ],
)
def test_invalid_configs_raise_clear_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()
