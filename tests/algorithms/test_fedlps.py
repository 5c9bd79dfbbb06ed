"""FedLPS (spec docs/specs/fedlps_local_perturbation.md, section 8): reduction to FedAvg,
round-0 anchors, the Lemma 1 identity at every local step, exact per-eigendirection
contraction on the shared-Hessian quadratic (FedAvg, FedLPS, FedProx), convergence to the
graph-weighted optimum, the paper's bounds, the divergence regime, monotonicity in beta,
masking rules against a NumPy reference, and bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from fedjax_sim.algorithms import ALGORITHMS, fedavg, fedlps, fedprox
from fedjax_sim.algorithms.core import (
    COHORT,
    LOCAL,
    CohortSpec,
    LocalSpec,
    client_key,
    local_train,
    round_key,
)
from fedjax_sim.algorithms.fedlps import perturbation, perturbation_anchors
from fedjax_sim.algorithms.local_hook import HookContext
from fedjax_sim.algorithms.similarity import similarity_graph
from fedjax_sim.data import least_squares, pack
from fedjax_sim.models import linear_regression, logistic_regression
from fedjax_sim.runtime.parallel import ClientMap

H_EIGS = np.array([0.1, 0.3, 0.7, 1.2, 2.0])  # mu = 0.1, L = 2
MU, L, E = 0.1, 2.0, 10
VMAP = ClientMap("vmap")


# ------------------------------------------------------------------------------ closed forms
def r_fedavg(h, gamma, e=E):
    return (1 - gamma * h) ** e


def r_fedlps(h, gamma, beta, e=E):
    return 1 - (1 - (1 - gamma * beta * h) ** e) / beta


def r_fedprox(h, gamma, alpha, e=E):
    return (alpha + h * (1 - gamma * (alpha + h)) ** e) / (alpha + h)


# ------------------------------------------------------------------------------ fixtures
def random_graph(num_clients, seed=0, valid=None):
    msgs = np.random.default_rng(seed + 100).normal(size=(num_clients, 8))
    return similarity_graph(msgs, valid=valid)


def shared_hessian_problem(num_clients=6, seed=0):
    """f_i(w) = 1/2 w'Hw - c_i'w (+ const) as least squares with identical rows A (so every
    client has Hessian H = Q diag(H_EIGS) Q') and client-specific targets."""
    rng = np.random.default_rng(seed)
    d = H_EIGS.size
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    a = np.sqrt(d) * np.diag(np.sqrt(H_EIGS)) @ q.T  # A'A / d = Q diag(h) Q'
    y = 3 * rng.normal(size=(num_clients, d))
    data = pack(
        np.tile(a, (num_clients, 1)),
        y.reshape(-1),
        np.repeat(np.arange(num_clients), d),
        num_clients,
    )
    lin = np.einsum("nd,cn->cd", a, y) / d  # c_i = A'y_i / d
    return data, q, lin


def optimum(q, lin, weights):
    hess = q @ np.diag(H_EIGS) @ q.T
    return np.linalg.solve(hess, np.tensordot(weights, lin, axes=1))


def trajectory(alg, w0, data, rounds, key=None):
    """`[rounds + 1, d]` global models w_bar_0..w_bar_T, one compiled lax.scan."""
    key = jax.random.key(0) if key is None else key
    state = alg.init({"w": w0}, key)

    def body(s, _):
        s, _ = alg.step(s, data, key)
        return s, s.params["w"]

    _, ws = jax.jit(lambda s: lax.scan(body, s, None, length=rounds))(state)
    return np.concatenate([np.asarray(w0)[None], np.asarray(ws)])


def make(kind, graph, gamma, param=None, e=E):
    loss = linear_regression(H_EIGS.size).loss
    kw = dict(
        client_optimizer=gamma,
        local=LocalSpec(steps=e, sampling="full"),
        client_map=VMAP,
    )
    weights = CohortSpec(client_weights=graph.degrees)
    if kind == "fedavg":
        return fedavg(loss, cohort=weights, **kw)
    if kind == "fedprox":
        return fedprox(loss, mu=param, cohort=weights, **kw)
    return fedlps(loss, beta=param, graph=graph, **kw)


def expected_factor(kind, gamma, param, e=E):
    if kind == "fedavg":
        return r_fedavg(H_EIGS, gamma, e)
    if kind == "fedprox":
        return r_fedprox(H_EIGS, gamma, param, e)
    return r_fedlps(H_EIGS, gamma, param, e)


def eigen_errors(ws, q, w_star):
    return (ws - w_star) @ q  # [T+1, d] error in the eigenbasis of H


# ------------------------------------------------------------------------------ 1. beta = 1
@pytest.mark.parametrize("dtype64", [False, True], ids=["float32", "float64"])
def test_beta_one_is_fedavg_with_graph_weights(dtype64):
    """Stochastic minibatches, E epochs (masked unequal steps), partial participation, L2."""
    with jax.enable_x64(dtype64):
        problem = least_squares(num_clients=12, examples_per_client=np.arange(3, 15), dim=3)
        graph = random_graph(12)
        model = linear_regression(3, l2=0.01)
        local = LocalSpec(epochs=2, batch_size=4, sampling="epoch")
        kw = dict(client_optimizer=0.05, local=local, client_map=VMAP)
        cohort = CohortSpec(size=5)
        weighted = dataclasses.replace(cohort, client_weights=graph.degrees)
        w0 = jnp.ones(3, jnp.float64 if dtype64 else jnp.float32)
        lps = trajectory(
            fedlps(model.loss, beta=1.0, graph=graph, cohort=cohort, **kw), w0, problem.data, 6
        )
        avg = trajectory(fedavg(model.loss, cohort=weighted, **kw), w0, problem.data, 6)
        tol = 1e-12 if dtype64 else 1e-6
        np.testing.assert_allclose(lps, avg, rtol=tol, atol=tol)
        if dtype64:  # and beta < 1 really differs (the comparison can fail)
            half = fedlps(model.loss, beta=0.5, graph=graph, cohort=cohort, **kw)
            assert np.abs(trajectory(half, w0, problem.data, 6)[-1] - avg[-1]).max() > 1e-3


# ------------------------------------------------------------------------------ 3. round 0
def test_round_zero_anchors_are_initial_model():
    graph = random_graph(5, valid=np.array([True, True, False, True, True]))
    model = logistic_regression((4,), 3)
    params = model.init(jax.random.key(1))
    alg = fedlps(model.loss, beta=0.5, graph=graph)
    state = alg.init(params, jax.random.key(0))
    rows = jnp.asarray(graph.row_normalised, jnp.float32)
    anchors = perturbation_anchors(state.hooks["perturbation"], state.params, rows)
    for leaf, init in zip(jax.tree.leaves(anchors), jax.tree.leaves(params), strict=True):
        assert leaf.shape == (5, *init.shape)
        np.testing.assert_allclose(leaf, np.broadcast_to(init, leaf.shape), rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(leaf[2], init)  # no neighbours: exactly the global model


# ------------------------------------------------------------------------------ 4. Lemma 1
def test_lemma1_identity_every_local_step(x64):
    """Full participation, softmax loss, stochastic minibatches, epochs mode (masked steps):
    sum_i p_i w_tilde^i_k = beta w_bar_k + (1 - beta) w_bar_0 at every k, and the recorded
    local runs aggregate to the algorithm's next global model."""
    rng = np.random.default_rng(0)
    num, dim, beta, lr = 6, 4, 0.4, 0.3
    sizes = np.array([9, 4, 13, 7, 11, 6])
    owner = np.repeat(np.arange(num), sizes)
    x = rng.normal(size=(owner.size, dim)) + rng.normal(size=(num, dim))[owner]
    y = rng.integers(0, 3, owner.size)
    data = pack(x, y, owner, num, num_classes=3)
    model = logistic_regression((dim,), 3, l2=0.01)
    graph = random_graph(num, seed=3)
    p = graph.degrees
    local = LocalSpec(epochs=2, batch_size=3, sampling="epoch")
    alg = fedlps(
        model.loss, beta=beta, graph=graph, client_optimizer=lr, local=local, client_map=VMAP
    )
    key = jax.random.key(4)
    state = alg.init(jax.tree.map(lambda a: a.astype(jnp.float64), model.init(key)), key)
    step = jax.jit(alg.step)
    for _ in range(2):  # so that last_w differs between clients
        state, _ = step(state, data, key)
    flat = lambda tree: jnp.concatenate([a.reshape(-1) for a in jax.tree.leaves(tree)])
    w_bar0 = np.asarray(flat(state.params))
    rows = jnp.asarray(graph.row_normalised)
    anchors = perturbation_anchors(state.hooks["perturbation"], state.params, rows)
    u = np.asarray(jax.vmap(flat)(anchors))  # [C, P]
    np.testing.assert_allclose(p @ u, w_bar0, rtol=1e-10, atol=1e-12)
    assert np.abs(u - w_bar0).max() > 1e-2  # the anchors are not trivially the global model

    max_steps = local.max_steps(data.max_count)
    num_steps = local.num_steps(data.counts)
    local_key = round_key(key, state.round, LOCAL)

    def recorded(cid, anchor, steps):
        ctx = HookContext(
            state.params, None, None, anchor, state.round, lr, cid, client_key(local_key, cid)
        )
        inner = perturbation(beta, graph).direction

        def grad_fn(value_and_grad, params, batch, aux):
            k, points, iterates = aux
            box = {}

            def spy(w, b):
                box["w"] = w
                return value_and_grad(w, b)

            loss, g, _ = inner(spy, params, batch, None, ctx)
            points = jax.tree.map(lambda buf, v: buf.at[k].set(v), points, box["w"])
            iterates = jax.tree.map(lambda buf, v: buf.at[k].set(v), iterates, params)
            return loss, g, (k + 1, points, iterates)

        buf = jax.tree.map(lambda a: jnp.zeros((max_steps, *a.shape), a.dtype), state.params)
        res = local_train(
            state.params,
            data.client(cid),
            client_key(local_key, cid),
            loss_fn=model.loss,
            optimizer=optax.sgd(lr),
            max_steps=max_steps,
            num_steps=steps,
            batch_size=local.batch_size,
            sampling=local.sampling,
            grad_fn=grad_fn,
            aux=(0, buf, buf),
        )
        return res.params, res.aux[1], res.aux[2]

    final, points, iterates = jax.vmap(recorded)(jnp.arange(num), anchors, num_steps)
    final = np.asarray(jax.vmap(flat)(final))  # [C, P]
    points = np.asarray(jax.vmap(jax.vmap(flat))(points))  # [C, S, P]
    iterates = np.asarray(jax.vmap(jax.vmap(flat))(iterates))
    steps = np.asarray(num_steps)
    assert steps.min() < steps.max() == max_steps  # unequal local work, masked steps exist
    k = np.arange(max_steps)[None, :, None]
    active = k < steps[:, None, None]
    w_k = np.where(active, iterates, final[:, None])  # frozen after a client's last step
    w_tilde = np.where(active, points, beta * final[:, None] + (1 - beta) * u[:, None])
    np.testing.assert_allclose(  # the recorded points are the perturbed iterates
        points[active[..., 0]],
        (beta * iterates + (1 - beta) * u[:, None])[active[..., 0]],
        rtol=1e-12,
        atol=1e-12,
    )
    lhs = np.einsum("i,isp->sp", p, w_tilde)
    rhs = beta * np.einsum("i,isp->sp", p, w_k) + (1 - beta) * w_bar0
    np.testing.assert_allclose(lhs, rhs, rtol=1e-10, atol=1e-12)
    new_state, _ = step(state, data, key)
    np.testing.assert_allclose(flat(new_state.params), p @ final, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(
        jax.vmap(flat)(new_state.hooks["perturbation"]), final, rtol=1e-12, atol=1e-12
    )


# ------------------------------------------------------------------------------ 5. contraction
CASES = [("fedavg", None), ("fedprox", 0.0), ("fedprox", 0.5)] + [
    ("fedlps", b) for b in (0.9, 0.5, 0.1)
]


@pytest.mark.parametrize("gamma_l", [1 / (2 * E), 0.3], ids=["theory_step", "large_step"])
@pytest.mark.parametrize("kind,param", CASES, ids=[f"{k}-{p}" for k, p in CASES])
def test_exact_contraction_per_eigendirection(x64, kind, param, gamma_l):
    data, q, lin = shared_hessian_problem()
    graph = random_graph(6)
    gamma = gamma_l / L
    w_star = optimum(q, lin, graph.degrees)
    ws = trajectory(make(kind, graph, gamma, param), jnp.zeros(5), data, 200)
    z = eigen_errors(ws, q, w_star)
    r = expected_factor(kind, gamma, param)
    t = np.arange(201)[:, None]
    scale = np.maximum(np.linalg.norm(z[0]), np.linalg.norm(z, axis=1))[:, None]
    assert np.all(np.abs(z - r[None] ** t * z[0]) < 1e-10 * scale)
    if kind == "fedlps" and param == 0.1 and gamma_l == 0.3:
        assert np.linalg.norm(z[-1]) > 1e10 * np.linalg.norm(z[0])  # the divergence regime
    if gamma_l == 1 / (2 * E) and param != 0.5:  # theory step: the paper's bounds, measured
        r_mu = z[1, 0] / z[0, 0]  # first round, along the h = mu eigendirection
        beta = 1.0 if kind != "fedlps" else param  # FedAvg = FedProx(0) = FedLPS(1)
        assert r_mu <= 1 - MU / (beta * MU + 2 * L) <= 1 - MU / ((beta + 2) * L)
        assert r_mu <= 1 - MU / (2 * L + MU)  # FedProx's bound with alpha = 0


def test_convergence_to_graph_weighted_optimum(x64):
    data, q, lin = shared_hessian_problem(seed=1)
    graph = random_graph(6, seed=1)
    ws = trajectory(make("fedlps", graph, 0.3 / L, 0.5), jnp.zeros(5), data, 400)
    w_star = optimum(q, lin, graph.degrees)
    assert np.linalg.norm(ws[-1] - w_star) < 1e-8
    counts_opt = optimum(q, lin, np.full(6, 1 / 6))  # N_i-weighted optimum (equal sizes here)
    assert np.linalg.norm(w_star - counts_opt) > 1e-2  # the graph weights matter


# ------------------------------------------------------------------------------ 7. bounds
# The closed forms r_X are pinned to the implementation by the exact-contraction test above
# (which also checks the measured factors against these bounds at the theory step size).
def test_contraction_bounds_and_ordering_closed_forms():
    betas = np.linspace(0.02, 0.98, 25)
    for e in (1, 2, 3, 5, 10, 20):
        for mu in np.linspace(0.01, 1.0, 12) * L:
            gamma = 1 / (2 * L * e)
            r = r_fedlps(mu, gamma, betas, e)
            kappa = 1 - 1 / betas + (1 / betas) * (1 - betas * mu * gamma) ** e  # the paper's
            b1 = 1 - mu / (betas * mu + 2 * L)
            b2 = 1 - mu / ((betas + 2) * L)
            assert np.all(r <= b1 + 1e-15) and np.all(b1 <= b2 + 1e-15)
            assert np.all(b2 < 1 - mu / (3 * L))
            assert np.all(r * r <= kappa + 1e-15)  # kappa bounds the squared distance
            for alpha in (0.01, 0.5, 5.0, 50.0):
                g = 1 / (2 * e * (L + alpha))
                bound = 1 - mu / (3 * alpha + 2 * L + mu)
                assert r_fedprox(mu, g, alpha, e) <= bound + 1e-15
                assert bound <= 1 - mu / (3 * (L + alpha)) + 1e-15
    # E >= 2, common gamma with gamma (alpha + mu) <= 1: r_FedLPS < r_FedAvg < r_FedProx
    for e in (2, 5, 10):
        for gamma, alpha in [(0.01, 0.5), (0.15, 0.5), (0.5, 1.5)]:
            assert (
                r_fedlps(MU, gamma, 0.5, e)
                < r_fedavg(MU, gamma, e)
                < r_fedprox(MU, gamma, alpha, e)
            )
    # E = 1: all three coincide
    np.testing.assert_allclose(
        [r_fedlps(MU, 0.15, 0.5, 1), r_fedavg(MU, 0.15, 1), r_fedprox(MU, 0.15, 0.5, 1)],
        1 - 0.15 * MU,
        rtol=1e-14,
    )
    # The FedProx ordering needs gamma (alpha + mu) <= 1 (spec 8.7). Refinement found here: with
    # E even, q^E >= 0 gives r_FedProx >= alpha/(alpha+mu) >= 1 - gamma mu >= r_FedAvg whenever
    # gamma (alpha + mu) >= 1, so the order only breaks for E odd and gamma (alpha + mu) > 2.
    g, alpha = 0.077, 39.6  # gamma (alpha + mu) = 3.06
    assert r_fedprox(MU, g, alpha, 3) < r_fedavg(MU, g, 3)
    assert r_fedprox(MU, g, alpha, 10) > r_fedavg(MU, g, 10)
    for a in np.linspace(1 / g - MU, 2 / g - MU, 50):  # gamma (alpha + mu) in [1, 2]
        assert all(r_fedprox(MU, g, a, e) >= r_fedavg(MU, g, e) - 1e-14 for e in range(1, 12))


# ------------------------------------------------------------------------------ 8-9
def test_divergence_regime(x64):
    data, q, lin = shared_hessian_problem(seed=2)
    graph = random_graph(6, seed=2)
    gamma = 0.3 / L
    assert abs(r_fedlps(L, gamma, 0.1)) == pytest.approx(1.63, abs=0.01)
    norms = {}
    for kind, param in [("fedlps", 0.1), ("fedlps", 0.5), ("fedavg", None)]:
        ws = trajectory(make(kind, graph, gamma, param), jnp.zeros(5), data, 60)
        norms[(kind, param)] = np.linalg.norm(ws - optimum(q, lin, graph.degrees), axis=1)
    e0 = norms[("fedavg", None)][0]
    assert norms[("fedlps", 0.1)][-1] > 1e6 * e0
    assert norms[("fedlps", 0.5)][-1] < 1e-2 * e0
    assert norms[("fedavg", None)][-1] < 1e-2 * e0


def test_rounds_to_tolerance_monotone_in_beta(x64):
    data, q, lin = shared_hessian_problem(seed=3)
    graph = random_graph(6, seed=3)
    w_star = optimum(q, lin, graph.degrees)
    rounds = []
    for beta in (1.0, 0.9, 0.7, 0.5, 0.3):
        ws = trajectory(make("fedlps", graph, 1 / (2 * L * E), beta), jnp.zeros(5), data, 700)
        below = np.flatnonzero(np.linalg.norm(ws - w_star, axis=1) < 1e-6)
        assert below.size, f"beta={beta} did not reach 1e-6 in 700 rounds"
        rounds.append(int(below[0]))
    assert all(a >= b for a, b in zip(rounds, rounds[1:], strict=False)), rounds
    assert rounds[-1] < rounds[0], rounds


# ------------------------------------------------------------------------------ 12. masking
def numpy_fedlps(problem, graph, w0, rounds, *, beta, lr, steps, cohorts, stale):
    """Independent reference: full-batch GD at the perturbed point, stale last_w, aggregation
    normalised over the cohort's graph degrees; clients without data are skipped."""
    h, c = problem.hessians, problem.linear
    counts = np.asarray(problem.data.counts)
    p, pn = graph.degrees, graph.row_normalised
    num = len(p)
    w = np.array(w0, np.float64)
    last = np.tile(w, (num, 1))
    sums = []
    for t in range(rounds):
        u = np.where((p > 0)[:, None], pn @ last, w)
        sums.append(p @ u - w)
        finals = {}
        for i in cohorts[t]:
            if counts[i] == 0:
                continue
            x = w.copy()
            for _ in range(steps):
                point = beta * x + (1 - beta) * u[i]
                x = x - lr * (h[i] @ point - c[i])
            finals[i] = x
        ids = np.array(sorted(finals))
        weights = p[ids] / p[ids].sum()
        w = np.tensordot(weights, np.array([finals[i] for i in ids]), axes=1)
        for i in range(num):
            if i in finals:
                last[i] = finals[i]
            elif stale == "global":
                last[i] = w
    return w, last, np.array(sums)


@pytest.mark.parametrize("stale", ["keep", "global"])
def test_partial_participation_matches_numpy(x64, stale):
    counts = np.array([6, 9, 0, 12, 7, 5, 10])
    problem = least_squares(num_clients=7, examples_per_client=counts, dim=3, seed=4)
    graph = random_graph(7, seed=4, valid=counts > 0)
    model = linear_regression(3)
    cohort = CohortSpec(size=3)
    key = jax.random.key(7)
    kw = dict(beta=0.4, client_optimizer=0.1, local=LocalSpec(steps=4, sampling="full"))
    # "keep" runs in lax.map mode (chunks of 2), "global" vmapped: both match the reference
    cmap = ClientMap("map", 2) if stale == "keep" else VMAP
    alg = fedlps(model.loss, graph=graph, cohort=cohort, stale=stale, client_map=cmap, **kw)
    w0 = jnp.array([0.5, -0.3, 0.2])
    state = alg.init({"w": w0}, key)
    step = jax.jit(alg.step)
    cohorts, sums = [], []
    rows = jnp.asarray(graph.row_normalised)
    for t in range(6):
        cohorts.append(
            np.asarray(cohort.sample(round_key(key, jnp.int32(t), COHORT), problem.data.counts)[0])
        )
        u = perturbation_anchors(state.hooks["perturbation"], state.params, rows)["w"]
        sums.append(np.asarray(graph.degrees @ np.asarray(u) - state.params["w"]))
        before = np.asarray(state.hooks["perturbation"]["w"])
        state, metrics = step(state, problem.data, key)
        outside = ~np.isin(np.arange(7), cohorts[-1]) | (counts == 0)
        after = np.asarray(state.hooks["perturbation"]["w"])
        if stale == "keep":  # a client that did not report keeps its last model
            np.testing.assert_array_equal(after[outside], before[outside])
        else:  # non-reporters are filled with the new global model
            np.testing.assert_array_equal(
                after[outside], np.broadcast_to(state.params["w"], after[outside].shape)
            )
        assert int(metrics["participants"]) == int(np.sum(counts[cohorts[-1]] > 0))
        assert float(metrics["bytes_down"]) == 2 * float(metrics["bytes_up"]) * 3 / int(
            metrics["participants"]
        )
    ref_w, ref_last, ref_sums = numpy_fedlps(
        problem, graph, w0, 6, beta=0.4, lr=0.1, steps=4, cohorts=cohorts, stale=stale
    )
    np.testing.assert_allclose(state.params["w"], ref_w, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(state.hooks["perturbation"]["w"], ref_last, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.array(sums), ref_sums, atol=1e-10)
    # Lemma 1's premise sum_i p_i u_i = w_bar holds every round only with stale="global"
    if stale == "global":
        np.testing.assert_allclose(np.array(sums), 0.0, atol=1e-10)
    else:
        assert np.abs(np.array(sums)).max() > 1e-4


def test_fedprox_baseline_with_fixed_graph_weights_matches_numpy(x64):
    """The baselines aggregate with CohortSpec(client_weights=p): sum p_i x_i / sum p_i over
    clients with data (an empty client contributes nothing)."""
    counts = np.array([6, 0, 9, 12, 7])
    problem = least_squares(num_clients=5, examples_per_client=counts, dim=3, seed=6)
    graph = random_graph(5, seed=6)  # p_1 > 0 although client 1 has no data
    model = linear_regression(3)
    cohort = CohortSpec(client_weights=graph.degrees)
    local = LocalSpec(steps=3, sampling="full")
    alg = fedprox(model.loss, mu=0.3, client_optimizer=0.1, local=local, cohort=cohort)
    ws = trajectory(alg, jnp.zeros(3), problem.data, 5)
    h, c = problem.hessians, problem.linear
    w = np.zeros(3)
    p = np.where(counts > 0, graph.degrees, 0.0)
    for _ in range(5):
        finals = []
        for i in range(5):
            x = w.copy()
            for _ in range(3):
                x = x - 0.1 * (h[i] @ x - c[i] + 0.3 * (x - w))
            finals.append(x)
        w = np.tensordot(p / p.sum(), np.array(finals), axes=1)
    np.testing.assert_allclose(ws[-1], w, rtol=1e-10)
    counts_weighted = trajectory(
        fedprox(model.loss, mu=0.3, client_optimizer=0.1, local=local),
        jnp.zeros(3),
        problem.data,
        5,
    )
    assert np.abs(counts_weighted[-1] - w).max() > 1e-3  # the weights matter


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("beta", [0.0, -0.1, 1.5, float("nan")])
def test_bad_beta_raises(beta):
    with pytest.raises(ValueError, match="beta must be in"):
        fedlps(linear_regression(2).loss, beta=beta, graph=random_graph(3))


def test_other_bad_input_raises():
    loss = linear_regression(2).loss
    with pytest.raises(ValueError, match="graph"):
        fedlps(loss, beta=0.5)
    with pytest.raises(ValueError, match="stale"):
        fedlps(loss, beta=0.5, graph=random_graph(3), stale="drop")
    with pytest.raises(ValueError, match="uniformly"):
        fedlps(loss, graph=random_graph(3), cohort=CohortSpec(size=2, sampling="proportional"))
    with pytest.raises(ValueError, match="exceeds"):
        fedlps(loss, graph=random_graph(3), cohort=CohortSpec(size=4))
    problem = least_squares(num_clients=4, examples_per_client=5, dim=2)
    alg = fedlps(loss, graph=random_graph(3))
    state = alg.init({"w": jnp.zeros(2)}, jax.random.key(0))
    with pytest.raises(ValueError, match="data has 4 clients, the graph 3"):
        alg.step(state, problem.data, jax.random.key(0))
    with pytest.raises(ValueError, match="client_weights"):
        CohortSpec(client_weights=[0.5, -0.1])
    with pytest.raises(ValueError, match="3 entries for 4 clients"):
        fedavg(loss, cohort=CohortSpec(client_weights=[1.0, 1.0, 1.0])).step(
            state, problem.data, jax.random.key(0)
        )


def test_registered_and_builds_graph_from_data():
    assert "fedlps" in ALGORITHMS
    problem = least_squares(num_clients=4, examples_per_client=[5, 0, 6, 7], dim=3)
    alg = ALGORITHMS["fedlps"](linear_regression(3).loss, beta=0.5, data=problem.data)
    state = alg.init({"w": jnp.zeros(3)}, jax.random.key(0))
    state, metrics = jax.jit(alg.step)(state, problem.data, jax.random.key(0))
    assert int(metrics["participants"]) == 3 and np.isfinite(state.params["w"]).all()
