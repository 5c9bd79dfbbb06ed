"""FedAvg / FedProx local operators, EF-FedAvg / EF-FedProx (Beikmohammadi et al. 2024).

Spec docs/specs/stepsizes_no_similarity.md section 8: exact reductions (8.1, 8.6), the
virtual iterate (8.2), closed-form prox and its inner solver (8.7), the per-round inequality
(1) with the constants of Propositions 1-4 every round at several heterogeneity levels with
one step size (8.8), Theorems 1-3 (8.9), the EF-memory inequality (8.10), the rate shape
(8.11), a scaled-down reproduction smoke (8.14), determinism and vmap-vs-loop (8.15).
Deterministic theory checks use full-batch gradients (sigma = 0) in float64.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import ALGORITHMS, fedavg, fedprox, schedules
from fedjax_sim.algorithms.aggregators import error_feedback
from fedjax_sim.algorithms.compression import Identity, TopK
from fedjax_sim.algorithms.core import (
    LOCAL,
    CohortSpec,
    LocalSpec,
    client_key,
    minibatch,
    round_key,
)
from fedjax_sim.algorithms.fixed_point import (
    ef_fedavg,
    ef_fedprox,
    exact_prox,
    fixed_point,
    fp_fedavg,
    fp_fedprox,
    inexact_prox,
    local_sgd,
)
from fedjax_sim.data import least_squares, pack
from fedjax_sim.models import linear_regression
from fedjax_sim.models.base import masked_mean
from fedjax_sim.runtime.parallel import ClientMap

UNIFORM = CohortSpec(weighting="uniform")


def trajectory(alg, params, data, rounds, key=None, step=None):
    """States after rounds 0..K (the initial state first)."""
    key = jax.random.key(0) if key is None else key
    state = alg.init(params, key)
    step = step or jax.jit(alg.step)
    states = [state]
    for _ in range(rounds):
        state, _ = step(state, data, key)
        states.append(state)
    return states


# ------------------------------------------------------------------------------ problems
@dataclasses.dataclass
class Problem:
    """A federated objective with uniform weights `f = (1/n) sum_i f_i`, its smoothness `L`,
    a lower bound `f_lb <= f_inf` and an upper bound `delta_inf >= Delta_inf`."""

    data: object
    loss: object
    f_i: object  # x [d] -> [n]
    grad_i: object  # x [d] -> [n, d]
    L: float
    f_lb: float
    delta_inf: float

    def f(self, x):
        return float(np.mean(self.f_i(x)))

    def grad(self, x):
        return np.mean(self.grad_i(x), axis=0)


def quadratic(heterogeneity, seed=0, n=6, m=12, d=5):
    """Heterogeneous least squares `f_i = ||A_i x - b_i||^2 / (2m)`; exact f_inf, f_i_inf."""
    q = least_squares(
        num_clients=n, examples_per_client=m, dim=d, heterogeneity=heterogeneity, seed=seed
    )
    b = np.asarray(q.data.y, np.float64)  # [n, m], no padding (equal sizes)
    const = 0.5 * np.mean(b**2, axis=1)
    f_i = lambda x: 0.5 * np.einsum("j,ijk,k->i", x, q.hessians, x) - q.linear @ x + const
    grad_i = lambda x: q.hessians @ x - q.linear
    fi_inf = np.array([f_i(w)[i] for i, w in enumerate(q.client_optima())])
    x_star = np.linalg.solve(q.hessians.mean(0), q.linear.mean(0))
    f_inf = float(np.mean(f_i(x_star)))
    L = float(np.max(np.linalg.eigvalsh(q.hessians)))
    return Problem(q.data, linear_regression(d).loss, f_i, grad_i, L, f_inf, f_inf - fi_inf.mean())


def phi(t):
    return t**2 / (1 + t**2)


def nonconvex(spread, seed=0, n=5, d=4):
    """`f_i(x) = sum_j phi(x_j - a_ij)`, phi(t) = t^2/(1+t^2): L = 2, f_i_inf = 0; f_inf is
    bounded below by 0 and Delta_inf above by f at a good point (both only loosen (1))."""
    a = spread * np.random.default_rng(seed).normal(size=(n, d))
    data = pack(a.astype(np.float32), np.zeros(n, np.float32), np.arange(n), n)

    def loss(params, batch):
        return masked_mean(jnp.sum(phi(params["w"] - batch.x), axis=-1), batch.mask)

    f_i = lambda x: np.sum(phi(x[None] - a), axis=1)
    grad_i = lambda x: 2 * (x[None] - a) / (1 + (x[None] - a) ** 2) ** 2
    x = np.median(a, axis=0)
    for _ in range(3000):  # GD on f from the median: an upper bound on f_inf
        x = x - 0.2 * np.mean(grad_i(x), axis=0)
    return Problem(data, loss, f_i, grad_i, 2.0, 0.0, float(np.mean(f_i(x))))


# ------------------------------------------------------------------------------ checks of (1)
def lyapunov(problem, state, step, weight):
    """V_k = f(z^k) - f_lb + weight * s_k / n * sum_i ||e_i||^2 (z = x without memory)."""
    x = np.asarray(state.params["w"], np.float64)
    if not state.aggregator.rows:
        return problem.f(x) - problem.f_lb
    e = np.asarray(state.aggregator.rows["error_feedback"]["w"], np.float64)
    z = x + e.mean(0)
    return problem.f(z) - problem.f_lb + weight * step * np.mean(np.sum(e**2, axis=1))


def violations(problem, states, steps, rc):
    """Rounds where V_{k+1} <= (1 + b1 s^2) V_k - b2 s W_k + b3 s^2 fails."""
    bad = []
    for k in range(len(states) - 1):
        s = float(steps[k])
        v0 = lyapunov(problem, states[k], s, rc.error_weight)
        v1 = lyapunov(problem, states[k + 1], float(steps[k + 1]), rc.error_weight)
        w = float(np.sum(problem.grad(np.asarray(states[k].params["w"], np.float64)) ** 2))
        rhs = (1 + rc.b1 * s * s) * v0 - rc.b2 * s * w + rc.b3 * s * s
        if v1 > rhs + 1e-12 * (1 + abs(rhs)):
            bad.append(k)
    return bad


def algorithm_and_constants(name, problem, step, T=5, k_top=1):
    """The algorithm and the constants of its Proposition (sigma = 0, full batches)."""
    L, dinf = problem.L, problem.delta_inf
    n = problem.data.num_clients
    d = int(problem.data.x.shape[-1])
    delta = k_top / d
    full = LocalSpec(steps=T, sampling="full")
    if name == "fedavg":
        alg = fp_fedavg(problem.loss, client_optimizer=step, local=full, cohort=UNIFORM)
        return alg, schedules.fedavg_constants(L, T, 0.0, dinf)
    if name == "fedprox":
        alg = fp_fedprox(
            problem.loss, client_optimizer=step, exact=True, batch_size=None, cohort=UNIFORM
        )
        return alg, schedules.fedprox_constants(L, 0.0, dinf)
    if name == "fedprox_inner":  # non-quadratic: 80 inner GD steps of lr s (contraction sL)
        alg = fp_fedprox(
            problem.loss,
            client_optimizer=step,
            inner_steps=80,
            inner_lr=1.0,
            batch_size=1,
            cohort=UNIFORM,
        )
        return alg, schedules.fedprox_constants(L, 0.0, dinf)
    top = TopK(k=k_top)
    if name == "ef_fedprox_inner":  # non-quadratic: inner GD of lr s, contraction s L <= 0.07
        alg = ef_fedprox(
            problem.loss,
            num_clients=n,
            compressor=top,
            client_optimizer=step,
            inner_steps=80,
            inner_lr=1.0,
            batch_size=1,
            cohort=UNIFORM,
        )
        return alg, schedules.ef_fedprox_constants(L, delta, 0.0, dinf)
    if name == "ef_fedavg":
        alg = ef_fedavg(
            problem.loss,
            num_clients=n,
            compressor=top,
            client_optimizer=step,
            local=full,
            cohort=UNIFORM,
        )
        return alg, schedules.ef_fedavg_constants(L, delta, 0.0, dinf)
    alg = ef_fedprox(
        problem.loss,
        num_clients=n,
        compressor=top,
        client_optimizer=step,
        exact=True,
        batch_size=None,
        cohort=UNIFORM,
    )
    return alg, schedules.ef_fedprox_constants(L, delta, 0.0, dinf)


def cap(name, L, delta):
    return {
        "fedavg": schedules.fedavg_cap(L),
        "fedprox": schedules.fedprox_cap(L),
        "fedprox_inner": schedules.fedprox_cap(L),
        "ef_fedavg": schedules.ef_fedavg_cap(L, delta),
        "ef_fedprox": schedules.ef_fedprox_cap(L, delta),
        "ef_fedprox_inner": schedules.ef_fedprox_cap(L, delta),
    }[name]


ALGS = ["fedavg", "fedprox", "ef_fedavg", "ef_fedprox"]


@pytest.mark.parametrize("name", ALGS)
def test_inequality_1_every_round_least_squares_one_step_size(x64, name):
    """The paper's claim: one step size (from L and the compressor only) gives (1) every round
    whatever the heterogeneity."""
    problems = [quadratic(h) for h in (0.0, 1.0, 3.0)]
    L = max(p.L for p in problems)
    assert L >= 1 / 3  # spec 7.8 for Prop 3
    s = cap(name, L, 1 / 5)
    assert problems[0].delta_inf < problems[1].delta_inf < problems[2].delta_inf
    step = None
    for p in problems:
        p.L = L  # a larger L is still a valid smoothness constant
        alg, rc = algorithm_and_constants(name, p, s)
        step = step or jax.jit(alg.step)  # same shapes: one compilation for all levels
        states = trajectory(alg, {"w": jnp.zeros(5)}, p.data, 25, step=step)
        assert violations(p, states, np.full(26, s), rc) == []
        assert p.f(np.asarray(states[-1].params["w"])) < p.f(np.zeros(5))  # it does move


@pytest.mark.parametrize("name", ["fedavg", "fedprox_inner", "ef_fedavg", "ef_fedprox_inner"])
def test_inequality_1_every_round_nonconvex(x64, name):
    """phi problem; the prox of (EF-)FedProx (no closed form) is solved to float64 precision by
    80 inner GD steps of lr s (contraction factor s L <= 0.41)."""
    problems = [nonconvex(spread) for spread in (0.3, 1.0, 3.0)]
    s = cap(name, 2.0, 1 / 4)
    step = None
    for p in problems:
        alg, rc = algorithm_and_constants(name, p, s, k_top=1)
        step = step or jax.jit(alg.step)
        states = trajectory(alg, {"w": jnp.zeros(4)}, p.data, 20, step=step)
        assert violations(p, states, np.full(21, s), rc) == []


@pytest.mark.parametrize("heterogeneity", [0.0, 3.0])
def test_inequality_check_is_not_vacuous(x64, heterogeneity):
    """Negative control: the same check with the same constants fails once the round moves
    beyond the stability limit of f (server lr turning the round step into 3 / lambda_max)."""
    p = quadratic(heterogeneity)
    lam = np.linalg.eigvalsh(np.mean([p.grad_i(e) - p.grad_i(0 * e) for e in np.eye(5)], 1))
    s = schedules.fedavg_cap(p.L)
    alg = fixed_point(
        p.loss,
        operator=local_sgd(1, 1, sampling="full"),
        step_size=s,
        cohort=UNIFORM,
        server_optimizer=3.0 / (lam.max() * s),
    )
    states = trajectory(alg, {"w": jnp.zeros(5)}, p.data, 8)
    assert violations(p, states, np.full(9, s), schedules.fedavg_constants(p.L, 1, 0, p.delta_inf))


# ------------------------------------------------------------------------------ theorems
def min_grad_sq(problem, states):
    return min(float(np.sum(problem.grad(np.asarray(s.params["w"])) ** 2)) for s in states[:-1])


@pytest.mark.parametrize("name", ALGS)
def test_theorem1_and_theorem2_bounds(x64, name):
    p, K = quadratic(2.0), 40
    c = cap(name, p.L, 1 / 5)
    v0 = p.f(np.zeros(5)) - p.f_lb
    # Theorem 1: s = c / sqrt(K)
    alg, rc = algorithm_and_constants(name, p, c / math.sqrt(K))
    w = min_grad_sq(p, trajectory(alg, {"w": jnp.zeros(5)}, p.data, K))
    assert w <= schedules.fixed_bound(rc, v0, c / math.sqrt(K), K)
    assert w <= schedules.theorem1_bound(rc, v0, c, K)
    # Theorem 2: s_k = c / (k + 1)^0.75
    sched = schedules.diminishing(c, 0.75)
    alg, rc = algorithm_and_constants(name, p, sched)
    states = trajectory(alg, {"w": jnp.zeros(5)}, p.data, K)
    steps = schedules.values(sched, K + 1)
    assert violations(p, states, steps, rc) == []
    w = min_grad_sq(p, states)
    assert w <= schedules.diminishing_bound(rc, v0, steps[:K])
    assert w <= schedules.theorem2_bound(rc, v0, c, 0.75, K)


def test_theorem3_step_decay_bounds(x64):
    """rho = 2, K = rho^{2M} = 256, M = 4 phases of P = 64 (spec 7.4)."""
    p = quadratic(2.0)
    K, P, M, rho = 256, 64, 4, 2.0
    assert P == round(schedules.theory_phase_length(K, rho))
    s0 = schedules.fedavg_cap(p.L)
    sched = schedules.step_decay(s0, rho, P)
    alg, rc = algorithm_and_constants("fedavg", p, sched)
    states = trajectory(alg, {"w": jnp.zeros(5)}, p.data, K)
    steps = schedules.values(sched, K + 1)
    assert violations(p, states, steps, rc) == []
    r_max = max(lyapunov(p, s, 0.0, 0.0) for s in states)
    w = min_grad_sq(p, states)
    assert w <= schedules.single_phase_bound(rc, r_max, s0, rho, P, M)
    assert w <= schedules.theorem3_bound(rc, r_max, s0, rho, K)


def isotropic_least_squares(n=3, m=8, d=2, spread=1.0, noise=1.0, seed=0):
    """`f_i = ||A_i x - b_i||^2 / (2m)` with `A_i^T A_i / m = I` (example j of client i is
    `sqrt(d) e_{j mod d}`), so L = mu = 1 and `grad f(x) = x - mean_i c_i`; heterogeneous
    client optima (spread) and noisy targets, so minibatch gradients have sigma > 0."""
    rng = np.random.default_rng(seed)
    optima = spread * rng.normal(size=(n, d))
    coord, owner = np.tile(np.arange(m) % d, n), np.repeat(np.arange(n), m)
    x = math.sqrt(d) * np.eye(d)[coord]
    y = math.sqrt(d) * optima[owner, coord] + noise * rng.normal(size=n * m)
    data = pack(x.astype(np.float32), y.astype(np.float32), owner, n)
    a, b = np.asarray(data.x, np.float64), np.asarray(data.y, np.float64)
    np.testing.assert_allclose(
        np.einsum("cnd,cne->cde", a, a) / m, np.broadcast_to(np.eye(d), (n, d, d)), rtol=1e-6
    )
    return data, np.einsum("cnd,cn->cd", a, b).mean(0) / m  # data, minimiser of f


def test_rate_shape_fixed_and_diminishing():
    """Spec 8.11: min_k of the seed-averaged W_k = ||grad f(x^k)||^2 over K in {100, 400, 1600}
    on least squares with minibatch noise decays with log-log slope <= -0.35 for the fixed
    schedule s = c / sqrt(K) (Thm 1: -1/2) and <= -0.15 for c / (k+1)^0.75 (Thm 2: -1/4), with
    c the FedAvg cap 1/(sqrt6 L). Negative control: a step size that does not shrink with K
    (s = c / 10 for every K) must NOT pass the fixed-schedule threshold, so the check measures
    the schedule, not the longer min over more rounds. One compilation: the step size
    `a / (k+1)^nu` is traced (nu = 0: fixed), runs of K < 1600 rounds are prefixes of the
    1600-round run (no schedule here depends on K except through a)."""
    data, x_star = isotropic_least_squares()
    model = linear_regression(2)
    c, rounds, ks = schedules.fedavg_cap(1.0), 1600, np.array([100, 400, 1600])

    def run(a, nu, key):
        alg = fp_fedavg(
            model.loss,
            client_optimizer=lambda k: a / (k + 1.0) ** nu,
            local=LocalSpec(steps=2, batch_size=1),
            cohort=UNIFORM,
        )

        def body(state, _):
            g = state.params["w"] - x_star  # grad f, Hessian = I
            return alg.step(state, data, key)[0], jnp.sum(g * g)

        return jax.lax.scan(body, alg.init({"w": jnp.zeros(2)}, key), None, length=rounds)[1]

    configs = [(c / math.sqrt(k), 0.0) for k in ks] + [(c, 0.75), (c / 10, 0.0)]
    a, nu = (jnp.asarray(v, jnp.float32) for v in zip(*configs, strict=True))
    keys = jax.random.split(jax.random.key(0), 64)
    w = np.asarray(jax.jit(jax.vmap(jax.vmap(run, (None, None, 0)), (0, 0, None)))(a, nu, keys))
    w = w.mean(axis=1)  # seed average [config, round]

    def slope(row_of_k):
        mins = [w[row_of_k(i), :k].min() for i, k in enumerate(ks)]
        return np.polyfit(np.log(ks), np.log(mins), 1)[0]

    assert slope(lambda i: i) <= -0.35  # fixed c / sqrt(K)
    assert slope(lambda i: 3) <= -0.15  # diminishing nu = 0.75
    assert slope(lambda i: 4) > -0.35  # control: same step for every K


def test_ef_memory_inequality(x64):
    """mean ||e^{k+1}||^2 <= (1 - delta/4) mean ||e^k||^2 + D1 mean ||grad f_i(z^k)||^2 over
    clients (sigma = 0, s <= a_hat)."""
    p = quadratic(3.0)
    delta = 1 / 5
    s = schedules.ef_fedavg_cap(p.L, delta)
    alg, _ = algorithm_and_constants("ef_fedavg", p, s)
    states = trajectory(alg, {"w": jnp.zeros(5)}, p.data, 25)
    d1 = 16 * (1 - delta) * (1 + 2 / delta) * s**2 / 3
    grew = False
    for a, b in zip(states[:-1], states[1:], strict=True):
        e0, e1 = (
            np.asarray(a.aggregator.rows["error_feedback"]["w"]),
            np.asarray(b.aggregator.rows["error_feedback"]["w"]),
        )
        z = np.asarray(a.params["w"]) + e0.mean(0)
        lhs = np.mean(np.sum(e1**2, 1))
        rhs = (1 - delta / 4) * np.mean(np.sum(e0**2, 1)) + d1 * np.mean(
            np.sum(p.grad_i(z) ** 2, 1)
        )
        assert lhs <= rhs * (1 + 1e-12)
        grew |= lhs > 0
    assert grew


def one_client_step(alg, x, data, step=None):
    key = jax.random.key(0)
    state, _ = (step or jax.jit(alg.step))(alg.init({"w": jnp.asarray(x)}, key), data, key)
    return np.asarray(state.params["w"], np.float64)


def test_lemma3_fedavg_client_drift(x64):
    """Lemma 3 (sigma = 0): local GD with lr g = 1/(sqrt6 T L) from x stays within
    sum_{t<T} ||x - x^t||^2 <= 6 g^2 T^3 ||grad f_i(x)||^2, with x^t = the library's t-step
    operator on one client, checked against an independent NumPy recursion."""
    q = least_squares(num_clients=1, examples_per_client=12, dim=4, heterogeneity=2.0, seed=5)
    h, c = q.hessians[0], q.linear[0]
    L, T = float(np.linalg.eigvalsh(h).max()), 4
    g = 1 / (math.sqrt(6) * T * L)
    points = np.random.default_rng(0).normal(size=(3, 4)) * 3
    drift, ref = np.zeros(len(points)), np.zeros(len(points))
    for t in range(1, T):
        op = local_sgd(t, 1, divide_by_T=False, sampling="full")
        alg = fixed_point(linear_regression(4).loss, operator=op, step_size=g)
        step = jax.jit(alg.step)
        for j, x in enumerate(points):
            drift[j] += np.sum((one_client_step(alg, x, q.data, step) - x) ** 2)
            y = x.copy()
            for _ in range(t):
                y = y - g * (h @ y - c)
            ref[j] += np.sum((y - x) ** 2)
    np.testing.assert_allclose(drift, ref, rtol=1e-10)
    bound = np.array([6 * g**2 * T**3 * np.sum((h @ x - c) ** 2) for x in points])
    assert np.all(drift <= bound)


def test_lemma4_prox_drift(x64):
    """Lemma 4 (sigma = 0): ||x - prox_{s f_i}(x)||^2 <= 6 s^2 ||grad f_i(x)||^2 for
    s <= 1/(sqrt6 L), every client of a heterogeneous problem (exact prox operator)."""
    q = least_squares(num_clients=4, examples_per_client=10, dim=5, heterogeneity=3.0, seed=6)
    L = float(np.linalg.eigvalsh(q.hessians).max())
    s = schedules.fedprox_cap(L)
    alg = fp_fedprox(linear_regression(5).loss, client_optimizer=s, exact=True, batch_size=None)
    step = jax.jit(alg.step)
    for i in range(4):
        one = q.data.replace(
            x=q.data.x[i : i + 1], y=q.data.y[i : i + 1], counts=q.data.counts[i : i + 1]
        )
        for x in np.random.default_rng(i).normal(size=(3, 5)) * 3:
            p = one_client_step(alg, x, one, step)
            g = q.hessians[i] @ x - q.linear[i]
            assert np.sum((x - p) ** 2) <= 6 * s**2 * np.sum(g**2)
            np.testing.assert_allclose(p, x - s * (q.hessians[i] @ p - q.linear[i]), atol=1e-10)


# ------------------------------------------------------------------------------ reductions
def stochastic_problem():
    return least_squares(num_clients=5, examples_per_client=[9, 14, 6, 11, 20], dim=6, seed=4)


@pytest.mark.parametrize(
    "operator",
    [
        local_sgd(4, 3, divide_by_T=True),
        inexact_prox(6, 0.1, 4),
    ],
    ids=["fedavg", "fedprox"],
)
def test_error_feedback_with_identity_is_algorithm_1_bitwise(operator):
    q = stochastic_problem()
    model = linear_regression(6)
    sched = schedules.diminishing(0.3, 0.6)
    fp = fixed_point(model.loss, operator=operator, step_size=sched)
    ef = fixed_point(
        model.loss, operator=operator, step_size=sched, compressor=Identity(), num_clients=5
    )
    a = trajectory(fp, {"w": jnp.ones(6)}, q.data, 6)
    b = trajectory(ef, {"w": jnp.ones(6)}, q.data, 6)
    for sa, sb in zip(a, b, strict=True):
        np.testing.assert_array_equal(sa.params["w"], sb.params["w"])
        assert not np.any(np.asarray(sb.aggregator.rows["error_feedback"]["w"]))
    assert not np.array_equal(a[0].params["w"], a[-1].params["w"])


def test_virtual_iterate_identity():
    """z^{k+1} - z^k == sum_i w_i (x_i^k - x^k): the local models x_i^k come from an Alg. 1
    round run from the same x^k with the same key (same minibatches)."""
    q = stochastic_problem()
    model = linear_regression(6)
    op = local_sgd(3, 4, divide_by_T=False)
    fp = fixed_point(model.loss, operator=op, step_size=0.05)
    ef = fixed_point(model.loss, operator=op, step_size=0.05, compressor=TopK(k=2), num_clients=5)
    key = jax.random.key(3)
    states = trajectory(ef, {"w": jnp.zeros(6)}, q.data, 5, key=key)
    fp_step = jax.jit(fp.step)
    z = lambda s: s.params["w"] + jnp.mean(s.aggregator.rows["error_feedback"]["w"], 0)
    for a, b in zip(states[:-1], states[1:], strict=True):
        start = fp.init(a.params, key).replace(round=a.round)
        moved = fp_step(start, q.data, key)[0].params["w"] - a.params["w"]
        np.testing.assert_allclose(z(b) - z(a), moved, rtol=1e-6, atol=1e-6)
    assert np.any(
        np.asarray(states[-1].aggregator.rows["error_feedback"]["w"])
    )  # the memory is really used


def test_fedavg_one_step_is_distributed_minibatch_sgd(x64):
    q = stochastic_problem()
    model = linear_regression(6)
    key, s, batch = jax.random.key(7), 0.2, 4
    x0 = np.linspace(-1, 1, 6)
    alg = fp_fedavg(model.loss, client_optimizer=s, local=LocalSpec(steps=1, batch_size=batch))
    state, _ = jax.jit(alg.step)(alg.init({"w": jnp.asarray(x0)}, key), q.data, key)
    local_key = round_key(key, jnp.int32(0), LOCAL)
    grads = []
    for i in range(5):
        b = minibatch(q.data.client(i), client_key(local_key, i), 0, batch, "replacement")
        a, y = np.asarray(b.x, np.float64), np.asarray(b.y, np.float64)
        grads.append(a.T @ (a @ x0 - y) / batch)
    np.testing.assert_allclose(state.params["w"], x0 - s * np.mean(grads, 0), rtol=1e-12)


def test_fedavg_identity_18_full_batch_schedule(x64):
    """x^{k+1} = x^k - (s_k / (nT)) sum_i sum_t grad f_i(x_i^{k,t}), s_k from a schedule."""
    q = stochastic_problem()
    model = linear_regression(6)
    T, sched = 4, schedules.step_decay(0.4, 2.0, 2)
    alg = fp_fedavg(
        model.loss,
        client_optimizer=sched,
        local=LocalSpec(steps=T, sampling="full"),
        cohort=UNIFORM,
    )
    states = trajectory(alg, {"w": jnp.zeros(6)}, q.data, 5)
    x = np.zeros(6)
    for k in range(5):
        s = 0.4 / 2 ** (k // 2)
        total = np.zeros(6)
        for i in range(5):
            y = x.copy()
            for _ in range(T):
                g = q.hessians[i] @ y - q.linear[i]
                total += g
                y = y - s / T * g
        x = x - s / (5 * T) * total
        np.testing.assert_allclose(states[k + 1].params["w"], x, rtol=1e-11, atol=1e-13)


# ------------------------------------------------------------------------------ prox
def test_exact_prox_closed_form(x64):
    q = stochastic_problem()
    model = linear_regression(6)
    s, x0 = 0.3, np.linspace(0.5, -0.5, 6)
    alg = fp_fedprox(model.loss, client_optimizer=s, exact=True, batch_size=None, cohort=UNIFORM)
    key = jax.random.key(0)
    state, metrics = jax.jit(alg.step)(alg.init({"w": jnp.asarray(x0)}, key), q.data, key)
    eye = np.eye(6)
    prox = [
        np.linalg.solve(eye + s * h, x0 + s * c) for h, c in zip(q.hessians, q.linear, strict=True)
    ]
    for p, h, c in zip(prox, q.hessians, q.linear, strict=True):  # p = x - s grad f_i(p)
        np.testing.assert_allclose(p, x0 - s * (h @ p - c), rtol=1e-12)
    np.testing.assert_allclose(state.params["w"], np.mean(prox, 0), rtol=1e-12)
    assert int(metrics["local_steps"]) == 1


def test_inner_solver_converges_to_the_prox_when_capped(x64):
    s = 0.3
    q = least_squares(num_clients=1, examples_per_client=12, dim=4, seed=2)
    model = linear_regression(4)
    L = float(np.linalg.eigvalsh(q.hessians[0]).max())
    assert s * L < 1  # with lr = s the inner iteration contracts by s L
    x0 = np.ones(4)
    p = np.linalg.solve(np.eye(4) + s * q.hessians[0], x0 + s * q.linear[0])
    errors = []
    for J in (3, 60):
        alg = fp_fedprox(model.loss, client_optimizer=s, inner_steps=J, inner_lr=0.5, batch_size=12)
        key = jax.random.key(0)
        state, _ = jax.jit(alg.step)(alg.init({"w": jnp.asarray(x0)}, key), q.data, key)
        errors.append(np.linalg.norm(np.asarray(state.params["w"]) - p))
    assert 1e-4 < errors[0] < np.linalg.norm(x0 - p)
    assert errors[1] < 1e-10


def test_uncapped_inner_solver_diverges_for_small_step(x64):
    """Regression check of spec 7.2: inner lr 0.1 with s < 0.05 is unstable (0.1/s > 2)."""
    q = least_squares(num_clients=1, examples_per_client=12, dim=4, seed=2)
    model = linear_regression(4)
    x0, s = np.ones(4), 0.025
    p = np.linalg.solve(np.eye(4) + s * q.hessians[0], x0 + s * q.linear[0])
    errors = {}
    for cap_lr in (True, False):
        alg = fp_fedprox(
            model.loss,
            client_optimizer=s,
            inner_steps=30,
            inner_lr=0.1,
            batch_size=12,
            cap_inner_lr=cap_lr,
        )
        key = jax.random.key(0)
        state, _ = jax.jit(alg.step)(alg.init({"w": jnp.asarray(x0)}, key), q.data, key)
        errors[cap_lr] = np.linalg.norm(np.asarray(state.params["w"]) - p)
    assert errors[True] < 1e-10
    assert errors[False] > 1e3 * np.linalg.norm(x0 - p)


def test_capped_inner_solver_fails_when_s_times_curvature_exceeds_one(x64):
    """With lr = s (the cap, e.g. the paper's fixed s = inner lr = 0.1) every inner step is
    `y <- x - s grad F(y)`: it converges to the prox only while s L < 1 (L = the minibatch
    loss's curvature, which exceeds 1/s = 10 for the CNN after a few rounds, see
    experiments/README.md); a smaller inner lr (GD on the prox objective, stable while
    lr (L + 1/s) < 2) still converges."""
    q = least_squares(num_clients=1, examples_per_client=12, dim=4, seed=2)
    model = linear_regression(4)
    L = float(np.linalg.eigvalsh(q.hessians[0]).max())
    s = 1.5 / L  # s L = 1.5: the prox subproblem is strongly convex, the iteration is not stable
    x0 = np.ones(4)
    p = np.linalg.solve(np.eye(4) + s * q.hessians[0], x0 + s * q.linear[0])
    errors = {}
    for lr in (s, 1 / (L + 1 / s)):
        alg = fp_fedprox(model.loss, client_optimizer=s, inner_steps=60, inner_lr=lr, batch_size=12)
        errors[lr] = np.linalg.norm(one_client_step(alg, x0, q.data) - p)
    assert errors[s] > np.linalg.norm(x0 - p)
    assert errors[1 / (L + 1 / s)] < 1e-10


# ------------------------------------------------------------------------------ reproduction smoke
def test_reproduction_smoke_digits():
    """Spec 8.14 scaled to a unit test (MNIST and the 431k-parameter CNN for K = 400 do not fit
    a CPU test): scikit-learn digits (1437 train / 360 test), a 64-32-10 MLP (2,410 parameters,
    top-1% = 24 entries), the reproduction config of spec 4 (fixed s = 0.1, local lr s not
    divided by T, data-size weights, 10 clients, full participation) with T = 10 local steps of
    batch 32 and K = 100 rounds; central test accuracy after every round. The paper's claims:
    (a) FedAvg IID learns the task: within 3 points of a centrally trained multinomial logistic
    regression (scikit-learn, independent of this library; the paper: >= 98% on MNIST by
    K = 100); (b) IID: EF-FedAvg (top-1%) within 1 point of FedAvg at K (the paper: at K = 400);
    (c) EF loses most under low similarity: the accuracy gap FedAvg - EF-FedAvg averaged over
    rounds K/2..K is >= 2 points larger under Non-IID1 (client i holds class i) than under IID
    (the paper: ~29 points at K = 200 for its CNN on Fashion-MNIST; averaged because EF's
    Non-IID1 curve oscillates from round to round; the 2-point margin is scaled down for a
    model that sends 24 entries per round)."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    from fedjax_sim.data.partition import iid_shards, one_class
    from fedjax_sim.models import count_params, mlp

    bunch = load_digits()
    x, y = (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int32)
    test = np.random.default_rng(0).permutation(y.size)[:360]
    train = np.setdiff1d(np.arange(y.size), test)
    (x, y), (xt, yt) = (x[train], y[train]), (x[test], y[test])
    reference = LogisticRegression(max_iter=2000).fit(x, y).score(xt, yt)
    splits = [iid_shards(y, 10, seed=0), one_class(y, 10)]  # IID, Non-IID1
    n_max = max(np.bincount(ids).max() for ids in splits)
    stacked = jax.tree.map(
        lambda *a: jnp.stack(a),
        *[pack(x, y, ids, 10, num_classes=10, max_count=int(n_max)) for ids in splits],
    )
    model = mlp((64,), 10, hidden=(32,))
    params = model.init(jax.random.key(1))
    assert count_params(params) == 2410 and TopK(fraction=0.01).num_kept(2410) == 24
    common = dict(
        client_optimizer=0.1,
        local=LocalSpec(steps=10, batch_size=32),
        divide_by_T=False,
        cohort=CohortSpec(weighting="counts"),
        client_map=ClientMap("vmap"),  # compiles 2-3x faster than "auto" (lax.map) here
    )
    fp = fp_fedavg(model.loss, **common)
    ef = ef_fedavg(model.loss, num_clients=10, compressor=TopK(fraction=0.01), **common)
    rounds, key = 100, jax.random.key(0)

    def accuracy(alg):
        def run(data):
            def body(state, _):
                state = alg.step(state, data, key)[0]
                return state, jnp.mean(jnp.argmax(model.apply(state.params, xt), -1) == yt)

            return jax.lax.scan(body, alg.init(params, key), None, length=rounds)[1]

        return 100 * np.asarray(jax.jit(jax.vmap(run))(stacked))  # [split, round k+1]

    (fp_iid, fp_n1), (ef_iid, ef_n1) = accuracy(fp), accuracy(ef)
    assert fp_iid[-1] >= 100 * reference - 3  # (a)
    assert abs(ef_iid[-1] - fp_iid[-1]) <= 1  # (b)
    late = slice(rounds // 2 - 1, None)  # rounds K/2..K
    assert np.mean(fp_n1[late] - ef_n1[late]) >= np.mean(fp_iid[late] - ef_iid[late]) + 2  # (c)


# ------------------------------------------------------------------------------ wrappers, bytes
def test_error_feedback_wraps_fedavg_and_fedprox():
    """`aggregator=error_feedback(...)` around the foundation's fedavg / fedprox: EF-FedAvg built
    that way is ef_fedavg; with the identity compressor fedprox is unchanged."""
    q = stochastic_problem()
    model = linear_regression(6)
    local = LocalSpec(steps=3, batch_size=4)
    wrapped = fedavg(
        model.loss,
        client_optimizer=schedules.client_sgd(0.1, scale=1 / 3),
        local=local,
        cohort=UNIFORM,
        aggregator=error_feedback(TopK(k=2)),
        num_clients=5,
    )
    named = ef_fedavg(
        model.loss, num_clients=5, compressor=TopK(k=2), client_optimizer=0.1, local=local
    )
    runs = [trajectory(g, {"w": jnp.zeros(6)}, q.data, 4) for g in (wrapped, named)]
    for a, b in zip(*runs, strict=True):
        np.testing.assert_array_equal(a.params["w"], b.params["w"])
        np.testing.assert_array_equal(
            a.aggregator.rows["error_feedback"]["w"], b.aggregator.rows["error_feedback"]["w"]
        )
    kw = dict(mu=0.5, client_optimizer=0.05, local=local)
    plain = trajectory(fedprox(model.loss, **kw), {"w": jnp.zeros(6)}, q.data, 3)
    ident = fedprox(model.loss, **kw, aggregator=error_feedback(Identity()), num_clients=5)
    for a, b in zip(plain, trajectory(ident, {"w": jnp.zeros(6)}, q.data, 3), strict=True):
        np.testing.assert_array_equal(a.params["w"], b.params["w"])


def test_partial_participation_keeps_memory_and_counts_bytes():
    q = least_squares(num_clients=8, examples_per_client=10, dim=6, seed=1)
    model = linear_regression(6)
    alg = ef_fedavg(
        model.loss,
        num_clients=8,
        compressor=TopK(k=2),
        client_optimizer=0.1,
        local=LocalSpec(steps=2, batch_size=4),
        cohort=CohortSpec(size=3, weighting="uniform"),
    )
    key = jax.random.key(2)
    state = alg.init({"w": jnp.zeros(6)}, key)
    for _ in range(3):
        new, metrics = jax.jit(alg.step)(state, q.data, key)
        changed = np.any(
            np.asarray(
                new.aggregator.rows["error_feedback"]["w"]
                != state.aggregator.rows["error_feedback"]["w"]
            ),
            axis=1,
        )
        assert changed.sum() <= 3
        cohort = np.asarray(
            CohortSpec(size=3).sample(round_key(key, state.round, 0), q.data.counts)[0]
        )
        assert set(np.flatnonzero(changed)) <= set(cohort.tolist())
        state = new
    assert float(metrics["bytes_up"]) == 3 * 2 * (4 + 4)  # k values + k int32 indices each
    assert float(metrics["bytes_down"]) == 3 * 6 * 4  # full-precision broadcast
    full = fp_fedavg(model.loss, local=LocalSpec(steps=2, batch_size=4))
    _, m = jax.jit(full.step)(full.init({"w": jnp.zeros(6)}, key), q.data, key)
    assert float(m["bytes_up"]) == 8 * 6 * 4


def test_determinism_and_vmap_equals_loop():
    q = stochastic_problem()
    model = linear_regression(6)

    def build(mode):
        return ef_fedprox(
            model.loss,
            num_clients=5,
            compressor=TopK(k=2),
            client_optimizer=schedules.diminishing(0.3, 0.6),
            inner_steps=5,
            batch_size=4,
            client_map=ClientMap(mode, 1),
        )

    def run(alg, step):
        return trajectory(alg, {"w": jnp.zeros(6)}, q.data, 4, jax.random.key(9), step)[-1]

    vmapped, looped = build("vmap"), build("map")  # map with chunks of 1: a loop over clients
    step = jax.jit(vmapped.step)
    a, b, c = run(vmapped, step), run(vmapped, step), run(looped, None)
    np.testing.assert_array_equal(a.params["w"], b.params["w"])
    np.testing.assert_array_equal(
        a.aggregator.rows["error_feedback"]["w"], b.aggregator.rows["error_feedback"]["w"]
    )
    np.testing.assert_allclose(a.params["w"], c.params["w"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        a.aggregator.rows["error_feedback"]["w"],
        c.aggregator.rows["error_feedback"]["w"],
        rtol=1e-6,
        atol=1e-6,
    )


def test_registered_and_validated():
    for name in ("fp_fedavg", "fp_fedprox", "ef_fedavg", "ef_fedprox"):
        assert name in ALGORITHMS
    model = linear_regression(3)
    with pytest.raises(ValueError, match="num_clients"):
        fixed_point(model.loss, operator=exact_prox(), step_size=0.1, compressor=TopK(k=1))
    with pytest.raises(ValueError, match="inner_lr"):
        inexact_prox(inner_lr=0.0)
    with pytest.raises(ValueError, match="step size"):
        fp_fedavg(model.loss, client_optimizer=-1.0)
    alg = ef_fedavg(model.loss, num_clients=3)
    q = least_squares(num_clients=4, dim=3)
    with pytest.raises(ValueError, match="per-client memory was built for num_clients=3"):
        alg.step(alg.init({"w": jnp.zeros(3)}, None), q.data, jax.random.key(0))
