"""FGDRO-CVaR / FGDRO-KL / FGDRO-KL-Adam / LocalAdam (spec fgdro.md, section 8).

Independent NumPy references of Algorithms 1-4 (full-batch, float64), closed forms of the
CVaR and KL objectives, exact reductions to FedAvg / LocalAdam, estimator statistics, and the
paper's qualitative robustness claim on a shifted-minority problem."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from scipy.optimize import linprog

from fedjax_sim.algorithms import fedavg
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.algorithms.fgdro import (
    cvar_objective,
    cvar_weights,
    fgdro_cvar,
    fgdro_kl,
    fgdro_kl_adam,
    kl_objective,
    kl_weighting,
    kl_weights,
    local_adam,
    topk_mean,
)
from fedjax_sim.data import Batch, least_squares
from fedjax_sim.data.builtin import load_shifted_minority
from fedjax_sim.models import linear_regression, logistic_regression
from fedjax_sim.run.simulate import client_stats
from fedjax_sim.runtime.parallel import ClientMap

VMAP = ClientMap("vmap")


@functools.partial(jax.jit, static_argnums=(0, 4))
def run(step, state, data, key, rounds):
    """`rounds` steps under one compiled `lax.scan`; returns (state, stacked metrics)."""
    return lax.scan(lambda s, _: step(s, data, key), state, None, length=rounds)


# ------------------------------------------------------------------------------ NumPy references
class Quadratic:
    """Full-batch losses/gradients of the least-squares clients, in float64 NumPy."""

    def __init__(self, data):
        counts = np.asarray(data.counts)
        x, y = np.asarray(data.x, np.float64), np.asarray(data.y, np.float64)
        self.a = [x[i, : counts[i]] for i in range(len(counts))]
        self.b = [y[i, : counts[i]] for i in range(len(counts))]

    def __call__(self, i, w):
        r = self.a[i] @ w - self.b[i]
        return 0.5 * np.mean(r**2), self.a[i].T @ r / len(r)


def np_cvar(f, n, w0, rounds, steps, *, k, eta1, eta2, beta1):
    w_bar, s_bar, u = np.array(w0, np.float64), 0.0, np.zeros(n)
    for _ in range(rounds):
        ws, ss = [], []
        for i in range(n):
            w, s = w_bar.copy(), s_bar
            for _ in range(steps):
                loss, g = f(i, w)
                u[i] = (1 - beta1) * u[i] + beta1 * loss
                d = float(u[i] - s > 0)
                s = s - eta2 * (-d + k / n)
                w = w - eta1 * d * g
            ws.append(w)
            ss.append(s)
        w_bar, s_bar = np.mean(ws, 0), np.mean(ss)
    return w_bar, s_bar, u


def np_kl(f, n, w0, rounds, steps, *, lam, eta, b1, b2, b3, adam=None, erm=False):
    """Algorithms 2 (adam=None), 3 (adam=(b4, tau)) and 4 (erm=True), literal v."""
    w_bar = np.array(w0, np.float64)
    m_bar, q_bar, v_bar, u = np.zeros_like(w_bar), np.zeros_like(w_bar), 1.0, np.zeros(n)
    for _ in range(rounds):
        ws, ms, qs, vs = [], [], [], []
        for i in range(n):
            w, m, q, v = w_bar.copy(), m_bar.copy(), q_bar.copy(), v_bar
            for _ in range(steps):
                loss, g = f(i, w)
                if erm:
                    h = g
                else:
                    u[i] = (1 - b1) * u[i] + b1 * loss
                    e = np.exp(u[i] / lam)
                    v = (1 - b2) * v + b2 * e
                    h = e / v * g
                m = (1 - b3) * m + b3 * h
                if adam is None:
                    w = w - eta * m
                else:
                    q = (1 - adam[0]) * q + adam[0] * h**2
                    w = w - eta * m / (np.sqrt(q) + adam[1])
            ws.append(w)
            ms.append(m)
            qs.append(q)
            vs.append(v)
        w_bar, m_bar, q_bar, v_bar = np.mean(ws, 0), np.mean(ms, 0), np.mean(qs, 0), np.mean(vs)
    return w_bar, m_bar, q_bar, v_bar, u


# ------------------------------------------------------------------------------ state parts
def threshold(state):
    return state.hooks["cvar"]


def u_of(state):
    return state.rows["cvar" if "cvar" in state.rows else "kl"].value


def m_of(state):
    return state.hooks["moments"][0]


def q_of(state):
    return state.hooks["moments"][1]


def log_v(state, log_domain=True):
    return state.hooks["kl"] if log_domain else jnp.log(state.hooks["kl"])


FULL = LocalSpec(steps=4, sampling="full")
SIZES = [6, 9, 4, 12, 7]
FULL_COMMON = dict(num_clients=5, local=FULL, client_map=VMAP)
KL_HP = dict(client_optimizer=0.02, beta1=0.3, beta2=0.2, beta3=0.5, temperature=2.0)
ADAM_HP = dict(beta4=0.05, eps=1e-3)


@functools.cache
def _local_adam_full():
    """LocalAdam of the reference test, shared with the lambda -> infinity test (one compile)."""
    return local_adam(
        linear_regression(3).loss, client_optimizer=0.02, beta3=0.5, **ADAM_HP, **FULL_COMMON
    )


def _problem():
    return least_squares(num_clients=5, examples_per_client=SIZES, dim=3, heterogeneity=1.5)


# ------------------------------------------------------------------------------ objectives
@pytest.mark.parametrize("seed", range(3))
def test_cvar_identity_lp_and_grid(x64, seed):
    """max{p.l : p in simplex, p <= 1/K} (LP) = top-K mean, and min_s of the s-form (grid)
    = top-K sum / N with argmin interval [l_[K+1], l_[K]]; the library's topk_mean,
    cvar_objective and cvar_weights agree (checked for the first seed: one compile per K)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 51))
    losses = rng.normal(size=n) * 2.0
    srt = np.sort(losses)[::-1]
    for k in sorted({1, n // 3 + 1, n}):
        lp = linprog(-losses, A_eq=np.ones((1, n)), b_eq=[1.0], bounds=[(0, 1 / k)] * n)
        top = srt[:k].mean()
        assert -lp.fun == pytest.approx(top, abs=1e-8)
        grid = np.linspace(srt.min() - 1, srt.max() + 1, 20001)
        vals = np.maximum(losses[None] - grid[:, None], 0).mean(1) + k / n * grid
        assert vals.min() == pytest.approx(srt[:k].sum() / n, abs=1e-6)
        lo = srt[k] if k < n else -np.inf
        argmin = grid[vals <= vals.min() + 1e-9]
        assert argmin.min() >= lo - 1e-3 and argmin.max() <= srt[k - 1] + 1e-3
        if seed == 0:
            jl = jnp.asarray(losses)
            assert float(topk_mean(jl, k)) == pytest.approx(top, abs=1e-12)
            s_star = grid[np.argmin(vals)]
            assert float(cvar_objective(jl, s_star, k)) == pytest.approx(vals.min(), abs=1e-12)
            w = np.asarray(cvar_weights(jl, k))
            assert w.sum() == pytest.approx(1.0) and w @ losses == pytest.approx(top, abs=1e-12)


def test_kl_closed_form_vs_numeric_maximisation(x64):
    """Exponentiated-gradient ascent of p.l - lam sum p log(N p) on the simplex reaches
    lam log mean exp(l/lam) at softmax(l/lam); bounds max(mean, max - lam log N) <= F <= max."""
    rng = np.random.default_rng(0)
    losses = rng.uniform(0, 3, size=12)
    n = len(losses)
    for lam in (0.1, 0.5, 5.0):
        p = np.full(n, 1 / n)
        for _ in range(3000):
            grad = losses - lam * (np.log(n * p) + 1)
            p = p * np.exp(0.5 / (1 + lam) * grad)
            p /= p.sum()
        value = p @ losses - lam * np.sum(p * np.log(n * p))
        closed = float(kl_objective(jnp.asarray(losses), lam))
        assert closed == pytest.approx(value, rel=1e-9)
        np.testing.assert_allclose(kl_weights(jnp.asarray(losses), lam), p, atol=1e-9)
        assert max(losses.mean(), losses.max() - lam * np.log(n)) <= closed <= losses.max()


# ------------------------------------------------------------------------------ vs NumPy
def test_fgdro_cvar_matches_numpy_and_payload(x64):
    """Algorithm 1 step by step (full batch), incl. averaging of w and s and local u."""
    problem = _problem()
    f = Quadratic(problem.data)
    model = linear_regression(3)
    w0 = np.array([0.3, -0.5, 0.2])
    kw = dict(k=2, eta1=0.05, eta2=0.3, beta1=0.4)
    alg = fgdro_cvar(
        model.loss,
        num_clients=5,
        k=2,
        client_optimizer=0.05,
        threshold_lr=0.3,
        beta1=0.4,
        local=FULL,
        client_map=VMAP,
    )
    key = jax.random.key(0)
    state, metrics = run(alg.step, alg.init({"w": jnp.asarray(w0)}, key), problem.data, key, 6)
    w, s, u = np_cvar(f, 5, w0, 6, 4, **kw)
    np.testing.assert_allclose(state.params["w"], w, rtol=1e-10, atol=1e-12)
    assert float(threshold(state)) == pytest.approx(s, rel=1e-10)
    np.testing.assert_allclose(u_of(state), u, rtol=1e-10)
    assert len(np.unique(np.round(u, 6))) == 5  # u stays local: differs across clients
    # payload per client per round: w (d) + s (1), float64 here
    np.testing.assert_array_equal(metrics["bytes_up"], 5 * (3 + 1) * 8)
    np.testing.assert_array_equal(metrics["bytes_down"], 5 * (3 + 1) * 8)
    assert int(metrics["cvar_active"][-1]) == int(np.sum(u > s))


@pytest.mark.parametrize("variant", ["kl_log", "kl_adam", "local_adam"])
def test_kl_family_matches_numpy_and_payload(x64, variant):
    """Algorithms 2-4 against the literal (linear-v) NumPy reference: the log-domain v equals
    the naive one in float64 (1e-10); averaged m, q, v and local u; payload 2d+1 / 3d+1 / 3d.
    (The library's naive-v path is checked against FedAvg and the log domain below.)"""
    problem = _problem()
    f = Quadratic(problem.data)
    model = linear_regression(3)
    w0 = np.array([0.3, -0.5, 0.2])
    if variant == "local_adam":
        alg = _local_adam_full()
    elif variant == "kl_adam":
        alg = fgdro_kl_adam(model.loss, **KL_HP, **ADAM_HP, **FULL_COMMON)
    else:
        alg = fgdro_kl(model.loss, **KL_HP, **FULL_COMMON)
    key = jax.random.key(0)
    state, metrics = run(alg.step, alg.init({"w": jnp.asarray(w0)}, key), problem.data, key, 5)
    w, m, q, v, u = np_kl(
        f,
        5,
        w0,
        5,
        4,
        lam=2.0,
        eta=0.02,
        b1=0.3,
        b2=0.2,
        b3=0.5,
        adam=None if variant == "kl_log" else (0.05, 1e-3),
        erm=variant == "local_adam",
    )
    np.testing.assert_allclose(state.params["w"], w, rtol=1e-10)
    np.testing.assert_allclose(m_of(state)["w"], m, rtol=1e-10)
    d = 3
    floats = {"kl_log": 2 * d + 1, "kl_adam": 3 * d + 1, "local_adam": 3 * d}
    np.testing.assert_array_equal(metrics["bytes_up"], 5 * floats[variant] * 8)
    np.testing.assert_array_equal(metrics["bytes_down"], 5 * floats[variant] * 8)
    if variant != "local_adam":
        np.testing.assert_allclose(float(log_v(state)), np.log(v), rtol=1e-10)
        np.testing.assert_allclose(u_of(state), u, rtol=1e-10)
        assert len(np.unique(np.round(u, 6))) == 5
        np.testing.assert_allclose(metrics["client_weights"][-1], kl_weights(u_of(state), 2.0))
    if variant in ("kl_adam", "local_adam"):
        np.testing.assert_allclose(q_of(state)["w"], q, rtol=1e-10)


# ------------------------------------------------------------------------------ reductions
def _stochastic_setup():
    problem = least_squares(num_clients=6, examples_per_client=[5, 9, 12, 7, 20, 3], dim=4)
    model = linear_regression(4)
    local = LocalSpec(steps=3, batch_size=4)
    return problem.data, model, local


@functools.cache
def _fedavg_uniform():
    data, model, local = _stochastic_setup()
    return fedavg(
        model.loss,
        client_optimizer=0.05,
        local=local,
        cohort=CohortSpec(weighting="uniform"),
        client_map=VMAP,
    )


def _run_pair(alg_a, alg_b, rounds=5):
    data, model, _ = _stochastic_setup()
    key = jax.random.key(3)
    params = {"w": jnp.array([0.5, -0.2, 0.1, 0.3])}
    sa, ma = run(alg_a.step, alg_a.init(params, key), data, key, rounds)
    sb, mb = run(alg_b.step, alg_b.init(params, key), data, key, rounds)
    return sa, sb


def test_cvar_with_k_equal_n_is_fedavg():
    """K = N, s0 = 0, positive losses: every d_i = 1 and v_i = 0, so s stays exactly 0 and the
    model follows local SGD with uniform averaging (FedAvg) on the same minibatches."""
    data, model, local = _stochastic_setup()
    cvar = fgdro_cvar(
        model.loss,
        num_clients=6,
        k=6,
        client_optimizer=0.05,
        beta1=0.3,
        local=local,
        client_map=VMAP,
    )
    s_cvar, s_avg = _run_pair(cvar, _fedavg_uniform())
    assert float(threshold(s_cvar)) == 0.0
    assert float(jnp.min(u_of(s_cvar))) > 0
    np.testing.assert_allclose(s_cvar.params["w"], s_avg.params["w"], rtol=1e-6)


def test_kl_with_huge_lambda_is_fedavg():
    """lambda = 1e12, v0 = 1, beta3 = 1 (paper's linear v): e_i = v_i = 1 exactly in float32,
    so FGDRO-KL is FedAvg (uniform) on the same minibatches."""
    data, model, local = _stochastic_setup()
    kl = fgdro_kl(
        model.loss,
        num_clients=6,
        temperature=1e12,
        client_optimizer=0.05,
        beta3=1.0,
        log_domain=False,
        local=local,
        client_map=VMAP,
    )
    s_kl, s_avg = _run_pair(kl, _fedavg_uniform())
    np.testing.assert_allclose(s_kl.params["w"], s_avg.params["w"], rtol=1e-6)


def test_kl_adam_with_huge_lambda_is_local_adam(x64):
    """FGDRO-KL-Adam with lambda = 1e12 equals LocalAdam (same beta3, beta4, tau), with the
    default log-domain v (float64: exp(u/lambda - log v) = 1 up to 1e-12)."""
    problem = _problem()
    model = linear_regression(3)
    hp = {**KL_HP, "temperature": 1e12}
    kl_adam = fgdro_kl_adam(model.loss, **hp, **ADAM_HP, **FULL_COMMON)
    ladam = _local_adam_full()
    key = jax.random.key(0)
    w0 = {"w": jnp.array([0.3, -0.5, 0.2])}
    s_kl, _ = run(kl_adam.step, kl_adam.init(w0, key), problem.data, key, 5)
    s_ad, _ = run(ladam.step, ladam.init(w0, key), problem.data, key, 5)
    np.testing.assert_allclose(s_kl.params["w"], s_ad.params["w"], rtol=1e-6)
    np.testing.assert_allclose(q_of(s_kl)["w"], q_of(s_ad)["w"], rtol=1e-6)
    assert np.abs(np.asarray(s_ad.params["w"]) - np.asarray(w0["w"])).max() > 1e-2


# ------------------------------------------------------------------------------ tracking
def _spread_problem():
    """Least squares with clearly separated client losses at w = 0: l_i = 0.5 mean(b_i^2)."""
    problem = least_squares(num_clients=8, examples_per_client=10, dim=3, seed=1)
    scale = np.linspace(0.5, 2.5, 8)[:, None]
    data = problem.data.replace(y=problem.data.y * scale.astype(np.float32))
    return data


def test_threshold_tracking(x64):
    """Fixed w (eta1 = 0), deterministic losses, beta1 = 1: the averaged threshold settles in
    [l_[K+1] - eta2 I, l_[K] + eta2 I], exactly K clients lie above it and the s-form
    objective matches top-K sum / N within O(eta2 I)."""
    data = _spread_problem()
    model = linear_regression(3)
    k, eta2, steps = 3, 0.01, 4
    alg = fgdro_cvar(
        model.loss,
        num_clients=8,
        k=k,
        client_optimizer=optax.sgd(0.0),  # w frozen
        threshold_lr=eta2,
        beta1=1.0,
        local=LocalSpec(steps=steps, sampling="full"),
        client_map=VMAP,
    )
    key = jax.random.key(0)
    state, metrics = run(alg.step, alg.init(model.init(key), key), data, key, 600)
    stats = client_stats(model, state.params, data.x, data.y, data.counts, VMAP)
    losses = np.sort(np.asarray(stats["loss"] / stats["count"]))[::-1]
    s = float(threshold(state))
    assert losses[k] - eta2 * steps <= s <= losses[k - 1] + eta2 * steps
    assert int(np.sum(np.asarray(u_of(state)) > s)) == k
    top = losses[:k].sum() / 8
    assert float(metrics["cvar_objective"][-1]) == pytest.approx(top, abs=2 * eta2 * steps)
    assert losses[k - 1] - losses[k] > 4 * eta2 * steps  # the interval is not trivial


def test_kl_gradient_tracking_limits(x64):
    """eta = 0, full batch, beta2 = 1e-3, I = 4: u -> l_i(w), v -> mean exp(l/lambda)
    (rel 1e-3) and m -> sum_j p_j* grad l_j (rel O(beta2 I)); with beta2 = 1 the local v drift
    makes every weight 1 and m tracks the uniform mean gradient instead."""
    data = _spread_problem()
    model = linear_regression(3)
    w = {"w": jnp.array([0.2, -0.1, 0.3])}
    f = Quadratic(data)
    lam = 1.0
    losses, grads = zip(*(f(i, np.asarray(w["w"])) for i in range(8)), strict=True)
    losses, grads = np.array(losses), np.array(grads)
    p = np.exp(losses / lam) / np.exp(losses / lam).sum()
    target, uniform = p @ grads, grads.mean(0)
    assert np.linalg.norm(target - uniform) > 0.2 * np.linalg.norm(target)
    key = jax.random.key(0)
    for beta2, rounds in ((1e-3, 2500), (1.0, 40)):
        alg = fgdro_kl(
            model.loss,
            num_clients=8,
            temperature=lam,
            client_optimizer=optax.sgd(0.0),  # w frozen
            beta1=0.5,
            beta2=beta2,
            beta3=0.1,
            local=LocalSpec(steps=4, sampling="full"),
            client_map=VMAP,
            client_metrics=False,
        )
        state, _ = run(alg.step, alg.init(w, key), data, key, rounds)
        m = np.asarray(m_of(state)["w"])
        if beta2 < 1:
            np.testing.assert_allclose(u_of(state), losses, rtol=1e-10)
            v = np.exp(float(log_v(state)))
            assert v == pytest.approx(np.exp(losses / lam).mean(), rel=1e-3)
            assert np.linalg.norm(m - target) <= 10 * beta2 * 4 * np.linalg.norm(target)
        else:
            np.testing.assert_allclose(m, uniform, rtol=1e-6)


def test_moving_average_variance():
    """Fixed w, iid minibatch losses with variance sigma^2 (B = 1 with replacement): the
    stationary variance of u is beta1 sigma^2 / (2 - beta1) and its mean the client loss."""
    problem = least_squares(num_clients=1, examples_per_client=40, dim=2, seed=4)
    x = np.repeat(np.asarray(problem.data.x), 32, axis=0)
    y = np.repeat(np.asarray(problem.data.y), 32, axis=0)
    data = problem.data.replace(x=jnp.asarray(x), y=jnp.asarray(y), counts=jnp.full(32, 40))
    model = linear_regression(2)
    w = {"w": jnp.array([1.0, -1.0])}
    per_example = 0.5 * (x[0] @ np.asarray(w["w"]) - y[0]) ** 2
    beta1 = 0.3
    alg = fgdro_cvar(
        model.loss,
        num_clients=32,
        k=1,
        client_optimizer=optax.sgd(0.0),  # w frozen
        threshold_lr=0.0,  # eta2 = eta1 = 0
        beta1=beta1,
        local=LocalSpec(steps=1, batch_size=1),
        client_map=VMAP,
    )
    key = jax.random.key(1)
    _, metrics = run(alg.step, alg.init(w, key), data, key, 800)
    u = np.asarray(metrics["u"])[100:]  # [rounds, clients] after burn-in
    expected = beta1 * per_example.var() / (2 - beta1)
    assert u.var() == pytest.approx(expected, rel=0.15)
    assert u.mean() == pytest.approx(per_example.mean(), rel=0.05)


# ------------------------------------------------------------------------------ log domain
def test_log_domain_equals_naive_and_survives_overflow():
    """float32: log-domain and naive v agree to ~1e-6 * u/lambda at u/lambda ~ 20, and at
    l/lambda ~ 200 the naive exp overflows (NaN model) while the log domain stays finite."""
    problem = least_squares(num_clients=4, examples_per_client=10, dim=3, seed=2)
    model = linear_regression(3)
    lam = 0.3
    local = LocalSpec(steps=3, sampling="full")
    hp = dict(
        num_clients=4, temperature=lam, client_optimizer=1e-3, beta1=0.5, beta2=0.5, local=local
    )
    hp["client_map"] = VMAP
    algs = {d: fgdro_kl(model.loss, log_domain=d, **hp) for d in (True, False)}
    key = jax.random.key(0)
    w = {"w": jnp.zeros(3)}
    out = {}
    for scale in (1.0, 3.2):  # mean losses ~1 and ~10: u/lambda ~ 20 and ~ 200
        data = problem.data.replace(y=problem.data.y * scale)
        for log_domain, alg in algs.items():
            out[scale, log_domain] = run(alg.step, alg.init(w, key), data, key, 4)
    z = float(jnp.max(u_of(out[1.0, True][0]))) / lam
    assert 5 < z < 88  # in range for the naive form
    ref, naive = out[1.0, True][0], out[1.0, False][0]
    np.testing.assert_allclose(naive.params["w"], ref.params["w"], rtol=1e-6 * z)
    np.testing.assert_allclose(log_v(naive, log_domain=False), log_v(ref), rtol=1e-6 * z)
    big_log, big_naive = out[3.2, True][0], out[3.2, False][0]
    assert float(jnp.max(u_of(big_log))) / lam > 150
    assert np.isfinite(np.asarray(big_log.params["w"])).all() and np.isfinite(big_log.hooks["kl"])
    assert not np.isfinite(np.asarray(big_naive.params["w"])).all()


# ------------------------------------------------------------------------------ estimator bias
def test_kl_estimate_has_smaller_bias_than_plugin_at_batch_one(x64):
    """B = 1: FGDRO-KL's exp(u/lambda) g with a slow loss average (beta1 = 0.05) estimates
    exp(l/lambda) grad l with a smaller bias than DR-DSGD's plug-in exp(l_B/lambda) g_B
    (whose bias vs batch size is checked in test_dro_baselines)."""
    problem = least_squares(num_clients=1, examples_per_client=30, dim=2, seed=5)
    model = linear_regression(2)
    x, y = problem.data.x[0, :30], problem.data.y[0, :30]
    w = {"w": jnp.array([0.8, -0.6])}
    f = Quadratic(problem.data)
    lam = 1.0
    loss, grad = f(0, np.asarray(w["w"]))
    target = np.exp(loss / lam) * grad
    vg = jax.value_and_grad(model.loss)
    hook = kl_weighting(lam, 0.05, 1e-12).direction  # as beta3 = 1: m = h
    chains, steps, burn = 2000, 300, 100

    def chain(key):
        def body(aux, k):
            i = jax.random.randint(k, (1,), 0, 30)
            batch = Batch(x[i], y[i], jnp.ones(1))
            _, direction, aux = hook(vg, w, batch, aux, None)
            plugin = jnp.exp(model.loss(w, batch) / lam) * vg(w, batch)[1]["w"]
            return aux, (direction["w"] * jnp.exp(aux[1]), plugin)  # undo v (~1)

        aux0 = (jnp.float64(loss), jnp.float64(0.0))
        _, (est, plug) = lax.scan(body, aux0, jax.random.split(key, steps))
        return est[burn:].mean(0), plug[burn:].mean(0)

    est, plug = jax.jit(jax.vmap(chain))(jax.random.split(jax.random.key(0), chains))
    gap_kl = np.linalg.norm(np.asarray(est).mean(0) - target)
    gap_plugin = np.linalg.norm(np.asarray(plug).mean(0) - target)
    assert gap_kl < 0.5 * gap_plugin


# ------------------------------------------------------------------------------ robustness
@functools.cache
def _shifted():
    ds = load_shifted_minority(num_clients=10, examples_per_client=100)
    model = logistic_regression((10,), 2)

    @jax.jit
    def client_losses(params, data):
        s = client_stats(model, params, data.x, data.y, data.counts, VMAP)
        return s["loss"] / s["count"]

    return ds.train, model, client_losses


def test_dro_lowers_worst_client_loss_on_shifted_minority():
    """Spec 8.11: same rounds, I = 32: FGDRO-CVaR (K = 2) and FGDRO-KL (lambda = 0.5) reach a
    lower worst-client training loss than FedAvg, and FGDRO-KL a lower KL objective."""
    data, model, client_losses = _shifted()
    local = LocalSpec(steps=32, batch_size=32)
    common = dict(
        num_clients=10, client_optimizer=0.1, local=local, client_map=VMAP, client_metrics=False
    )
    algs = {
        "fedavg": fedavg(
            model.loss,
            client_optimizer=0.1,
            local=local,
            cohort=CohortSpec(weighting="uniform"),
            client_map=VMAP,
        ),
        "cvar": fgdro_cvar(model.loss, k=2, **common),
        "kl": fgdro_kl(model.loss, temperature=0.5, **common),
    }
    worst, kl = {}, {}
    for name, alg in algs.items():
        w_, k_ = [], []
        for seed in range(2):
            key = jax.random.key(seed)
            state, _ = run(alg.step, alg.init(model.init(key), key), data, key, 25)
            losses = client_losses(state.params, data)
            w_.append(float(jnp.max(losses)))
            k_.append(float(kl_objective(losses, 0.5)))
        worst[name], kl[name] = np.mean(w_), np.mean(k_)
    assert worst["cvar"] < worst["fedavg"] - 0.1
    assert worst["kl"] < worst["fedavg"] - 0.03
    assert kl["kl"] <= kl["fedavg"] + 1e-3


# ------------------------------------------------------------------------------ validation
def test_bad_hyper_parameters_raise():
    loss = linear_regression(2).loss
    with pytest.raises(ValueError, match="K must be an integer in"):
        fgdro_cvar(loss, num_clients=5, k=0)
    with pytest.raises(ValueError, match="K must be an integer in"):
        fgdro_cvar(loss, num_clients=5, k=6)
    for temperature in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            fgdro_kl(loss, num_clients=5, temperature=temperature)
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            fgdro_kl_adam(loss, num_clients=5, temperature=temperature)
    for name in ("beta1", "beta2", "beta3"):
        for bad in (0.0, 1.5, -0.1):
            with pytest.raises(ValueError, match=f"{name} must be in \\(0, 1\\]"):
                fgdro_kl(loss, num_clients=5, **{name: bad})
    with pytest.raises(ValueError, match="beta1 must be in"):
        fgdro_cvar(loss, num_clients=5, beta1=0.0)
    with pytest.raises(ValueError, match="beta4 must be in"):
        fgdro_kl_adam(loss, num_clients=5, beta4=2.0)
    with pytest.raises(ValueError, match="beta4 must be in"):
        local_adam(loss, num_clients=5, beta4=0.0)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        local_adam(loss, num_clients=5, eps=0.0)
    with pytest.raises(ValueError, match="client_optimizer \\(learning rate\\) must be"):
        fgdro_kl(loss, num_clients=5, client_optimizer=-1.0)
    with pytest.raises(ValueError, match="uniformly"):
        fgdro_kl(loss, num_clients=5, cohort=CohortSpec(weighting="counts"))
    with pytest.raises(ValueError, match="not epochs"):
        fgdro_cvar(loss, num_clients=5, local=LocalSpec(epochs=1.0))
    problem = least_squares(num_clients=4, examples_per_client=5, dim=2)
    alg = fgdro_cvar(loss, num_clients=5)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="num_clients=5 but the data has 4"):
        alg.step(alg.init({"w": jnp.zeros(2)}, key), problem.data, key)
