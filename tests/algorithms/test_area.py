"""AREA against the spec's eager iterate form, closed forms and the paper's theory
(spec area_async.md, Section 8)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _async_reference import area_reference, local_update, replay, run

from fedjax_sim.algorithms import area, diminishing, fedavg, sample_size_scale
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.algorithms.events import Aggregation, Arrivals, Availability, Events
from fedjax_sim.data import fedprox_synthetic, least_squares, toy_quadratic
from fedjax_sim.models import linear_regression, logistic_regression
from fedjax_sim.run.simulate import EvalSpec, simulate

PROBLEM = least_squares(num_clients=6, examples_per_client=[5, 9, 12, 7, 20, 3], dim=3, seed=2)
MODEL = linear_regression(3)
FULL = LocalSpec(steps=1, sampling="full")
X0 = np.array([0.4, -0.3, 0.2])


def w(state):
    return np.asarray(state.params["w"])


def gd_path(problem, x0, lr, steps):
    """Gradient descent on (1/n) sum_i f_i: x_j for j = 0..steps."""
    h, c = problem.hessians.mean(0), problem.linear.mean(0)
    xs = [np.array(x0, np.float64)]
    for _ in range(steps):
        xs.append(xs[-1] - lr * (h @ xs[-1] - c))
    return np.array(xs)


def strong_convexity(problem):
    eig = np.linalg.eigvalsh(problem.hessians)
    return eig[:, 0], eig[:, -1]  # mu_i, L_i


CASES = {
    "categorical-count": (
        Events(Arrivals.categorical(np.linspace(1.0, 3.0, 6)), Aggregation.every(3)),
        "compute",
        False,
        None,
    ),
    "bernoulli-random-paper-after": (
        Events(Arrivals.bernoulli(np.linspace(0.1, 0.6, 6)), Aggregation.random(0.3)),
        "paper",
        True,
        None,
    ),
    "bernoulli-time-capacity-weights": (
        Events(Arrivals.bernoulli(0.2, num_clients=6), Aggregation.timer(2.5), capacity=2),
        "compute",
        False,
        np.array([1.0, 2.0, 0.5, 3.0, 1.0, 1.0]),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager_iterate_form_and_keeps_invariant(x64, case):
    """Against the spec's eager form (2)-(4); and x_s + u_s = sum_i w_i y_i after every step,
    x_s = sum_i w_i y_i after every aggregation (spec 8.1), in each mode and rule."""
    events, init_mode, after, weights = CASES[case]
    key = jax.random.key(3)
    alg = area(
        MODEL.loss,
        events=events,
        client_optimizer=0.05,
        local=LocalSpec(steps=2, sampling="full"),
        init_mode=init_mode,
        read_after_aggregate=after,
        weights=weights,
    )
    collect = lambda s: (s.params["w"], s.rule.residual["w"], s.rule.memory["w"])
    state, metrics, (xs, us, y) = run(alg, PROBLEM.data, {"w": jnp.asarray(X0)}, 80, key, collect)
    wts = np.full(6, 1 / 6) if weights is None else weights / weights.sum()
    seq = replay(events, key, 80)
    ref, y_ref = area_reference(
        PROBLEM, X0, seq, lr=0.05, steps=2, init_mode=init_mode, after=after, w=wts
    )
    agg = metrics["aggregated"].astype(bool)
    assert agg.sum() >= 5 and agg.tolist() == [a for *_, a in seq]
    np.testing.assert_allclose(xs, ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(state.rule.memory["w"], y_ref, rtol=1e-12, atol=1e-13)
    avg = np.einsum("i,tij->tj", wts, y)
    scale = np.abs(avg).max()
    assert np.abs(xs + us - avg).max() <= 1e-12 * scale
    assert np.abs(xs[agg] - avg[agg]).max() <= 1e-12 * scale
    assert np.abs(avg[-1] - X0).max() > 1e-2  # the memory did move


@pytest.mark.parametrize(
    "init_mode, after, iteration_to_gd",
    [
        ("compute", False, lambda t: (t + 1) // 2),  # iterations 2j-1 and 2j: GD^j
        ("paper", False, lambda t: t // 2),  # iterations 2j and 2j+1: GD^j
        ("compute", True, lambda t: t),  # read_after_aggregate: iteration j is GD^j
    ],
)
def test_synchronous_limit_is_gradient_descent(x64, init_mode, after, iteration_to_gd):
    n = PROBLEM.num_clients
    events = Events(Arrivals.bernoulli(1.0, num_clients=n), Aggregation.every(n))
    alg = area(
        MODEL.loss,
        events=events,
        client_optimizer=0.1,
        local=FULL,
        init_mode=init_mode,
        read_after_aggregate=after,
    )
    _, _, path = run(
        alg, PROBLEM.data, {"w": jnp.asarray(X0)}, 12, jax.random.key(0), lambda s: s.params["w"]
    )
    gd = gd_path(PROBLEM, X0, 0.1, 12)
    expected = np.array([gd[iteration_to_gd(t)] for t in range(1, 13)])
    np.testing.assert_allclose(path, expected, rtol=1e-13, atol=1e-14)


def test_synchronous_limit_with_local_steps_is_fedavg(x64):
    """p_i = 1, Delta = n, read_after_aggregate, K = 3 stochastic steps: FedAvg with full
    participation (uniform weights), same minibatches (keys of the read iteration = round)."""
    train, _ = fedprox_synthetic(0.5, 0.5, num_clients=5, dim=6, num_classes=3, seed=1)
    model = logistic_regression((6,), 3, l2=1e-3)
    params = jax.tree.map(lambda a: a.astype(jnp.float64), model.init(jax.random.key(0)))
    local = LocalSpec(steps=3, batch_size=4)
    events = Events(Arrivals.bernoulli(1.0, num_clients=5), Aggregation.every(5))
    alg = area(
        model.loss, events=events, client_optimizer=0.3, local=local, read_after_aggregate=True
    )
    ref = fedavg(
        model.loss, client_optimizer=0.3, local=local, cohort=CohortSpec(weighting="uniform")
    )
    key = jax.random.key(7)
    state, _, _ = run(alg, train, params, 6, key)
    ref_state, _, _ = run(ref, train, params, 6, key)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-13)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.abs(a - b).max(), state.params, params))
    assert max(moved) > 1e-2


@pytest.mark.parametrize("mode", ["categorical", "bernoulli"])
def test_exact_convergence_float64(x64, mode):
    problem = least_squares(num_clients=8, examples_per_client=10, dim=3, seed=5)
    mu, big_l = strong_convexity(problem)
    lr = 0.9 * np.min(2 / (mu + big_l))
    x_star = problem.optimum(np.full(8, 1 / 8))
    if mode == "categorical":  # sum_i p_i + p_s = 1
        p = np.linspace(0.01, 0.2, 8)
        events = Events(Arrivals.categorical(p), Aggregation.random(1 - p.sum()))
        iterations = 12000
    else:
        p = np.linspace(0.01, 0.3, 8)
        events = Events(Arrivals.bernoulli(p), Aggregation.random(0.2))
        iterations = 6000
    alg = area(linear_regression(3).loss, events=events, client_optimizer=lr, local=FULL)
    state, _, _ = run(alg, problem.data, {"w": jnp.zeros(3)}, iterations, jax.random.key(1))
    assert np.sum((w(state) - x_star) ** 2) < 1e-20
    # clients' memories reach x_i* = x* - alpha grad f_i(x*)
    x_i_star = x_star - lr * (problem.hessians @ x_star - problem.linear)
    np.testing.assert_allclose(state.rule.memory["w"], x_i_star, atol=1e-9)
    np.testing.assert_allclose(x_i_star.mean(0), x_star, atol=1e-12)


def test_theorem8_monte_carlo_bound(x64):
    """Categorical mode, sigma = 0: E||x_s,k - x*||^2 <= [A^k U_0]_{2n+1} (Theorem 8)."""
    n = 5
    problem = least_squares(num_clients=n, examples_per_client=6, dim=2, seed=11)
    mu, big_l = strong_convexity(problem)
    lr = 0.8 * np.min(2 / (mu + big_l))
    gamma = 2 * mu * big_l / (mu + big_l)
    p = np.array([0.1, 0.15, 0.2, 0.25, 0.1])
    p_s = 1 - p.sum()
    events = Events(Arrivals.categorical(p), Aggregation.random(p_s))
    alg = area(linear_regression(2).loss, events=events, client_optimizer=lr, local=FULL)
    x0 = np.array([1.5, -2.0])
    x_star = problem.optimum(np.full(n, 1 / n))
    grads = problem.hessians @ x_star - problem.linear
    x_i_star = x_star - lr * grads
    iterations = 150

    def one(key):
        state = alg.init({"w": jnp.asarray(x0)}, key)

        def body(s, _):
            s, _ = alg.step(s, problem.data, key)
            return s, jnp.sum((s.params["w"] - x_star) ** 2)

        return jax.lax.scan(body, state, None, length=iterations)[1]

    keys = jax.random.split(jax.random.key(0), 400)
    errors = np.asarray(jax.jit(jax.vmap(one))(keys)).mean(0)  # [T]
    big_p = np.diag(p)
    a = np.zeros((2 * n + 1, 2 * n + 1))
    a[:n, :n] = np.eye(n) - big_p
    a[:n, -1] = p * (1 - lr * gamma)
    a[n : 2 * n, :n] = big_p
    a[n : 2 * n, n : 2 * n] = np.eye(n) - big_p
    a[-1, n : 2 * n] = p_s / n
    a[-1, -1] = 1 - p_s
    x_init = np.array([local_update(problem, i, x0, lr, 1) for i in range(n)])  # "compute"
    u = np.concatenate(
        [
            np.sum((x_init - x_i_star) ** 2, 1),
            np.sum((x0 - x_i_star) ** 2, 1),
            [np.sum((x0 - x_star) ** 2)],
        ]
    )
    bound = []
    for _ in range(iterations):
        u = a @ u
        bound.append(u[-1])
    assert max(abs(np.linalg.eigvals(a))) < 1
    assert (errors <= np.array(bound)).all()
    assert errors[-1] < 0.05 * errors[0]  # and the error did decay


def test_permanent_dropout_converges_to_predicted_biased_point(x64):
    n, j = 5, 2
    problem = least_squares(num_clients=n, examples_per_client=8, dim=2, seed=4)
    trace = np.ones((n, 12), bool)
    trace[j, 11:] = False  # client j never fires after iteration 10 (dt = 1, t = k)
    events = Events(
        Arrivals.bernoulli(0.5, num_clients=n),
        Aggregation.every(2),
        availability=Availability.from_trace(trace),
    )
    lr = 0.1
    alg = area(linear_regression(2).loss, events=events, client_optimizer=lr, local=FULL)
    state, metrics, _ = run(alg, problem.data, {"w": jnp.zeros(2)}, 3000, jax.random.key(2))
    assert metrics["lost"].sum() > 100
    others = np.arange(n) != j
    y_j = np.asarray(state.rule.memory["w"])[j]
    h, c = problem.hessians[others].sum(0), problem.linear[others].sum(0)
    predicted = np.linalg.solve(np.eye(2) + lr * h, y_j + lr * c)
    np.testing.assert_allclose(w(state), predicted, atol=1e-10)
    assert np.linalg.norm(predicted - problem.optimum(np.full(n, 1 / n))) > 1e-2


SPARSE = least_squares(num_clients=16, examples_per_client=6, dim=3, seed=8)
SPARSE_ARRIVALS = Arrivals.bernoulli(np.linspace(0.02, 0.08, 16))


def sparse_area(capacity="auto"):
    """AREA with stochastic K = 2 local steps on 16 sparsely firing clients."""
    events = Events(SPARSE_ARRIVALS, Aggregation.every(3), capacity=capacity)
    return area(
        linear_regression(3).loss,
        events=events,
        client_optimizer=0.05,
        local=LocalSpec(steps=2, batch_size=3),
        init_mode="paper",
    )


@functools.cache
def shared_sparse_area():
    """One instance, so that the two tests below share its compiled scan (`run` caches by
    algorithm, length and `collect`)."""
    return sparse_area()


def _whole_state(state):
    return state


def run_sparse(alg, key):
    """80 jitted iterations; collects the whole state `[T, ...]` (16 clients x 3: small)."""
    return run(alg, SPARSE.data, {"w": jnp.zeros(3)}, 80, key, _whole_state)


def test_capacity_compacted_step_equals_full_masked_step(x64):
    assert Events(SPARSE_ARRIVALS, Aggregation.every(3)).slots < 16
    assert Events(SPARSE_ARRIVALS, Aggregation.every(3), capacity=None).slots == 16
    outs = [run_sparse(alg, jax.random.key(4)) for alg in (shared_sparse_area(), sparse_area(None))]
    (s1, m1, _), (s2, m2, _) = outs
    assert m1["overflow"].sum() == 0 and m1["fired"].sum() > 40
    np.testing.assert_array_equal(m1["fired"], m2["fired"])
    for a, b in zip(jax.tree.leaves(s1.events), jax.tree.leaves(s2.events), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)


def test_same_key_bit_identical_and_jit_equals_eager(x64):
    alg, key = shared_sparse_area(), jax.random.key(4)
    a, _, path = run_sparse(alg, key)
    b, _, _ = run(sparse_area(), SPARSE.data, {"w": jnp.zeros(3)}, 80, key)  # fresh trace
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    c, _, _ = run_sparse(alg, jax.random.key(10))
    assert not np.array_equal(w(a), w(c))  # another key, another trajectory
    # no jit (eager is slow: one step) from the jitted state at iteration j, where the next
    # iteration delivers computed local work (memory moves) and aggregates (x_s moves)
    mem, x_s = path.rule.memory["w"], path.params["w"]
    moves = [
        t
        for t in range(len(x_s) - 1)
        if not np.array_equal(mem[t], mem[t + 1]) and not np.array_equal(x_s[t], x_s[t + 1])
    ]
    assert moves
    j = moves[0]
    state, _ = alg.step(jax.tree.map(lambda v: jnp.asarray(v[j]), path), SPARSE.data, key)
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(path), strict=True):
        np.testing.assert_allclose(x, y[j + 1], rtol=1e-14, atol=1e-15)


def test_sample_size_weighting_reaches_example_weighted_optimum(x64):
    """Spec 7.2: f_i = (s_i/S) fhat_i (client_scale), or server weights s_i/S: both reach
    argmin sum_i s_i fhat_i."""
    counts = np.array([3, 20, 7, 12, 5, 30])
    problem = least_squares(num_clients=6, examples_per_client=counts, dim=3, seed=6)
    target = problem.optimum()  # count-weighted
    assert np.linalg.norm(target - problem.optimum(np.full(6, 1 / 6))) > 1e-2
    events = Events(Arrivals.bernoulli(0.5, num_clients=6), Aggregation.every(3))
    for kwargs in (
        dict(client_scale=sample_size_scale(counts), client_optimizer=1.0),
        dict(weights=counts, client_optimizer=0.1),
    ):
        alg = area(MODEL.loss, events=events, local=FULL, **kwargs)
        state, _, _ = run(alg, problem.data, {"w": jnp.zeros(3)}, 1500, jax.random.key(0))
        np.testing.assert_allclose(w(state), target, atol=1e-9)


def test_box_projection_with_diminishing_steps_reaches_constrained_optimum(x64):
    """1-D quadratics with x* = 2 outside X = [-0.5, 1]: with alpha_k -> 0 the projected
    iterates approach argmin over X = 1 (Theorem 10); a constant step keeps a bias."""
    data = toy_quadratic(4).data.replace(
        x=jnp.ones((4, 1, 1), jnp.float32), y=jnp.array([[-1.0], [2.0], [3.0], [4.0]], jnp.float32)
    )  # f_i(x) = (x - c_i)^2 / 2
    events = Events(Arrivals.categorical(np.ones(4)), Aggregation.every(2))
    finals = {}
    for name, opt in (("constant", 0.5), ("diminishing", diminishing(0.5, 0.6))):
        alg = area(
            linear_regression(1).loss,
            events=events,
            client_optimizer=opt,
            local=FULL,
            box=(-0.5, 1.0),
        )
        state, _, path = run(
            alg, data, {"w": jnp.array([-0.5])}, 6000, jax.random.key(3), lambda s: s.params["w"]
        )
        assert (path >= -0.5).all() and (path <= 1.0).all()
        finals[name] = float(w(state)[0])
    assert abs(finals["diminishing"] - 1.0) < 0.02 < 0.1 < abs(finals["constant"] - 1.0)


def test_toy_quadratic_closed_form_and_simulate_integration():
    problem = toy_quadratic(50)
    np.testing.assert_allclose(problem.optimum(), 1275 / 42925)
    model = linear_regression(1)
    events = Events(Arrivals.poisson(np.full(50, 10.0)), Aggregation.every(4))
    alg = area(model.loss, events=events, client_optimizer=1e-3, local=FULL)
    history = simulate(
        alg,
        problem.data,
        jax.random.key(0),
        model=model,
        num_rounds=40,
        evaluation=EvalSpec(every=20, clients=False),
        progress=False,
    )
    t = np.asarray(history.metrics["t"])
    np.testing.assert_allclose(np.diff(t), events.arrivals.dt, rtol=1e-5)
    assert len(history.metrics["tau_hist"][0]) == events.histogram_bins
    assert sum(history.metrics["fired"]) > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(init_mode="lazy", num_clients=4), "init_mode"),
        (dict(num_clients=None), "num_clients"),
        (dict(num_clients=4, buffer_size=0), "Delta"),
        (dict(num_clients=4, capacity=0), "capacity"),
        (dict(num_clients=4, firing_probability=1.5), "in \\(0, 1\\]"),
        (dict(num_clients=4, firing_probability=0.0), "in \\(0, 1\\]"),
        (dict(num_clients=4, weights=[1.0, -1.0, 1.0, 1.0]), "weights"),
        (dict(num_clients=4, box=(1.0, 0.0)), "box"),
        (dict(num_clients=4, client_scale=np.array([1.0, -1.0, 1.0, 1.0])), "client_scale"),
        (dict(num_clients=4, client_optimizer=-0.1), "learning rate"),
    ],
)
def test_bad_hyper_parameters_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        area(MODEL.loss, **kwargs)


def test_wrong_number_of_clients_raises():
    alg = area(MODEL.loss, num_clients=4)
    state = jax.eval_shape(alg.init, {"w": jnp.zeros(3)}, jax.random.key(0))
    with pytest.raises(ValueError, match="6 clients but the events model has 4"):
        jax.eval_shape(alg.step, state, PROBLEM.data, jax.random.key(0))  # raised when traced
