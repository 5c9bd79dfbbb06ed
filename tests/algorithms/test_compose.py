"""The composable layer (issue 18): an algorithm built from public parts with no new module
against a NumPy reference, FedNova against its NumPy reference, forced cohorts, traced
hyper-parameters, and the presets' argument checking."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_sim.algorithms import fedavg, fednova, fedprox, scaffold
from fedjax_sim.algorithms.aggregators import error_feedback
from fedjax_sim.algorithms.client_work import ClientWork
from fedjax_sim.algorithms.compose import compose
from fedjax_sim.algorithms.compression import TopK
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec, Stragglers
from fedjax_sim.algorithms.distributors import forced_cohorts
from fedjax_sim.algorithms.hooks import control_variates
from fedjax_sim.algorithms.local_hook import LocalHook, chain
from fedjax_sim.data import least_squares
from fedjax_sim.models import linear_regression

DIM = 5


def run(alg, w0, data, rounds, key):
    state = alg.init({"w": jnp.asarray(w0, jnp.float64)}, key)
    step = jax.jit(alg.step)
    out = []
    for _ in range(rounds):
        state, metrics = step(state, data, key)
        out.append(jax.tree.map(np.asarray, metrics))
    return state, out


def top_k(u, k):
    """Top-k by magnitude, ties to the lower index (as `lax.top_k`)."""
    keep = np.argsort(-np.abs(u), kind="stable")[:k]
    q = np.zeros_like(u)
    q[keep] = u[keep]
    return q


def test_scaffold_error_feedback_fedadam_bernoulli_from_public_parts(x64):
    """SCAFFOLD's hook + error-feedback top-k aggregator + FedAdam server + Bernoulli cohort,
    composed from public parts, equals a NumPy replay of the four rules (float64)."""
    problem = least_squares(num_clients=7, examples_per_client=np.arange(4, 11), dim=DIM, seed=3)
    h, lin, counts = problem.hessians, problem.linear, np.asarray(problem.data.counts)
    eta, steps, lr, b1, b2, eps = 0.05, 3, 0.1, 0.9, 0.99, 1e-3
    work = ClientWork(
        linear_regression(DIM).loss,
        client_optimizer=eta,
        local=LocalSpec(steps=steps, sampling="full"),
        hook=chain(control_variates()),
    )
    alg = compose(
        work,
        num_clients=7,
        aggregator=error_feedback(TopK(k=2)),
        server_optimizer=optax.adam(lr, b1=b1, b2=b2, eps=eps),
        cohort=CohortSpec(size=5, sampling="bernoulli", probability=0.45),
        report_cohort=True,
    )
    w0 = np.linspace(-1.0, 1.0, DIM)
    state, metrics = run(alg, w0, problem.data, 6, jax.random.key(4))

    x, c, ci, e = w0.copy(), np.zeros(DIM), np.zeros((7, DIM)), np.zeros((7, DIM))
    m, v, t = np.zeros(DIM), np.zeros(DIM), 0
    sizes = []
    for mt in metrics:
        ids, w = mt["cohort_ids"], mt["cohort_weights"]
        sel = w > 0
        sizes.append(int(sel.sum()))
        np.testing.assert_array_equal(w[sel], counts[ids[sel]])  # count weighting
        total, change = np.zeros(DIM), np.zeros(DIM)
        for i, wi in zip(ids[sel], w[sel], strict=True):
            y = x.copy()
            for _ in range(steps):
                y = y - eta * (h[i] @ y - lin[i] - ci[i] + c)
            new_ci = ci[i] - c + (x - y) / (steps * eta)
            change += new_ci - ci[i]
            ci[i] = new_ci
            u = (y - x) + e[i]
            q = top_k(u, 2)
            e[i] = u - q
            total += wi * q
        c = c + change / 7
        if sel.any():
            g = -total / w[sel].sum()
            t += 1
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            x = x - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    assert min(sizes) < max(sizes) and max(sizes) > 0  # cohorts of different sizes
    np.testing.assert_allclose(state.params["w"], x, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(state.hooks["control_variates"]["w"], c, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(state.rows["control_variates"]["w"], ci, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(
        state.aggregator.rows["error_feedback"]["w"], e, rtol=1e-9, atol=1e-12
    )
    assert np.abs(e).max() > 1e-3  # the error memory is really in use


def test_fednova_matches_numpy_normalized_averaging(x64):
    """FedNova with unequal local work (half the cohort straggles: a random number of steps
    in [1, K]): x += tau_eff sum_i w_i Delta_i / tau_i / sum_i w_i, tau_eff the weighted mean
    of tau_i. FedAvg on the same cohorts differs (the objective inconsistency is real)."""
    problem = least_squares(num_clients=6, examples_per_client=np.arange(5, 11), dim=DIM, seed=1)
    h, lin = problem.hessians, problem.linear
    eta, steps = 0.1, 6
    kw = dict(
        client_optimizer=eta,
        local=LocalSpec(steps=steps, sampling="full"),
        cohort=CohortSpec(size=4),
        stragglers=Stragglers(0.5, "partial"),
        report_cohort=True,
    )
    key = jax.random.key(2)
    w0 = np.ones(DIM)
    state, metrics = run(fednova(linear_regression(DIM).loss, **kw), w0, problem.data, 5, key)
    x = w0.copy()
    for mt in metrics:
        ids, w, tau = mt["cohort_ids"], mt["cohort_weights"], mt["cohort_steps"]
        assert len(set(tau.tolist())) > 1  # unequal local work
        normalized = np.zeros(DIM)
        for i, wi, ti in zip(ids, w, tau, strict=True):
            y = x.copy()
            for _ in range(ti):
                y = y - eta * (h[i] @ y - lin[i])
            normalized += wi * (y - x) / ti
        x = x + (w @ tau / w.sum()) * normalized / w.sum()
    np.testing.assert_allclose(state.params["w"], x, rtol=1e-11, atol=1e-13)
    avg, avg_metrics = run(fedavg(linear_regression(DIM).loss, **kw), w0, problem.data, 5, key)
    assert np.abs(np.asarray(avg.params["w"]) - x).max() > 1e-3
    # payload derived from what is sent: FedNova's clients also send tau_i (one float64)
    for mt, ma in zip(metrics, avg_metrics, strict=True):
        n = float(np.sum(mt["cohort_weights"] > 0))
        assert float(mt["bytes_up"]) == n * (DIM * 8 + 8)
        assert float(ma["bytes_up"]) == float(np.sum(ma["cohort_weights"] > 0)) * DIM * 8
        assert float(mt["bytes_down"]) == float(ma["bytes_down"]) == 4 * DIM * 8


def test_forced_cohorts_and_reported_ids():
    problem = least_squares(num_clients=6, examples_per_client=8, dim=3, seed=0)
    ids = np.array([[0, 1], [2, 5], [4, 3]])
    alg = fedavg(
        linear_regression(3).loss,
        local=LocalSpec(steps=2, batch_size=4),
        cohort=forced_cohorts(ids),
        report_cohort=True,
    )
    state = alg.init({"w": jnp.zeros(3)}, jax.random.key(0))
    for t in range(4):
        state, m = alg.step(state, problem.data, jax.random.key(0))
        np.testing.assert_array_equal(m["cohort_ids"], ids[t % 3])
        np.testing.assert_array_equal(m["cohort_weights"], [8.0, 8.0])
    with pytest.raises(ValueError, match="shape"):
        forced_cohorts(np.arange(3))


def _scaling(name, sent, corrected):
    """A hook that sends `sent * update` and corrects the server's update by `corrected`."""

    def finish(ctx, outcome):
        return ctx.row, None, None, jax.tree.map(lambda u: sent * u, outcome.update)

    def finalize(server, s, server_step):
        new = server_step(jax.tree.map(lambda u: corrected * u, s.update))
        return server, new, {name: s.update["w"]}

    return LocalHook(name, finish=finish, finalize=finalize)


def test_chained_hooks_pass_the_update_on_and_wrap_the_server_step(x64):
    """Each hook's `finish` sees the previous hook's update; each `finalize` sees the update
    as the hooks before it corrected it and wraps the next ones and the server step."""
    problem = least_squares(num_clients=4, examples_per_client=6, dim=3, seed=1)
    key = jax.random.key(0)
    w0 = {"w": jnp.ones(3, jnp.float64)}

    def composed(*hooks):
        work = ClientWork(linear_regression(3).loss, local=LocalSpec(steps=2), hook=chain(*hooks))
        return compose(work, cohort=CohortSpec(size=4))

    plain = composed()
    fedavg_state, m = plain.step(plain.init(w0, key), problem.data, key)
    mean = np.asarray(fedavg_state.params["w"]) - 1.0  # the mean Delta_i
    alg = composed(_scaling("a", 2.0, 3.0), _scaling("b", 2.0, 5.0))
    state, m2 = alg.step(alg.init(w0, key), problem.data, key)
    np.testing.assert_allclose(m2["a"], 4 * mean, rtol=1e-12)  # sent 2 * 2 * Delta_i
    np.testing.assert_allclose(m2["b"], 12 * mean, rtol=1e-12)  # corrected by a
    np.testing.assert_allclose(np.asarray(state.params["w"]) - 1.0, 60 * mean, rtol=1e-12)
    np.testing.assert_allclose(m2["update_norm"], 4 * m["update_norm"], rtol=1e-12)

    def skipping(server, s, server_step):
        return server, s.params, {}

    alg = composed(LocalHook("skip", finalize=skipping))
    with pytest.raises(ValueError, match="must call server_step"):
        alg.step(alg.init(w0, key), problem.data, key)


def test_traced_hyper_parameters_equal_static_ones():
    """An algorithm built inside `jax.vmap` over (client lr, mu, server lr) gives, per grid
    point, exactly the run built with the same static values."""
    problem = least_squares(num_clients=5, examples_per_client=6, dim=3, seed=2)
    loss = linear_regression(3).loss
    local, key = LocalSpec(steps=2, batch_size=3), jax.random.key(1)
    params = {"w": jnp.ones(3)}
    grid = jnp.array([[0.05, 0.0, 1.0], [0.1, 0.3, 0.5]])

    def final(lr, mu, slr):
        alg = fedprox(loss, mu=mu, client_optimizer=lr, server_optimizer=slr, local=local)
        state = alg.init(params, key)
        for _ in range(2):
            state, _ = alg.step(state, problem.data, key)
        return state.params["w"]

    traced = jax.jit(jax.vmap(lambda g: final(g[0], g[1], g[2])))(grid)
    for row, values in zip(traced, grid.tolist(), strict=True):
        np.testing.assert_array_equal(row, jax.jit(lambda: final(*values))())


def test_presets_refuse_unknown_and_fixed_arguments():
    loss = linear_regression(3).loss
    with pytest.raises(TypeError, match="bogus"):
        fedavg(loss, bogus=1)
    from fedjax_sim.algorithms import fedsgd

    with pytest.raises(TypeError, match="client_optimizer"):
        fedsgd(loss, client_optimizer=0.1)  # FedSGD's client step is fixed (-grad)
    with pytest.raises(ValueError, match="client_optimizer"):
        fedavg(loss, client_optimizer=float("nan"))
    with pytest.raises(ValueError, match="num_clients"):
        scaffold(loss, num_clients=0)


def test_every_preset_is_exported_from_the_top_level_package():
    import fedjax_sim
    from fedjax_sim.algorithms import ALGORITHMS

    for name, factory in ALGORITHMS.items():
        assert getattr(fedjax_sim, name) is factory, name
        assert name in fedjax_sim.__all__


def test_async_rules_take_an_optax_server_optimizer(x64):
    """FedBuff / MIFA with `server_optimizer=optax.sgd(eta)` equal the float eta_g (to
    round-off: the coefficient is applied in another order; AS-FedAvg shares FedBuff's rule);
    with Adam the server state advances exactly once per aggregation."""
    from fedjax_sim.algorithms import fedbuff, mifa
    from fedjax_sim.algorithms.events import Aggregation, Arrivals, Events

    problem = least_squares(num_clients=6, examples_per_client=8, dim=3, seed=4)
    events = Events(Arrivals.categorical(np.linspace(1.0, 2.0, 6)), Aggregation.every(2))
    kw = dict(events=events, client_optimizer=0.05, local=LocalSpec(steps=2, batch_size=4))
    loss, key = linear_regression(3).loss, jax.random.key(3)
    for factory in (fedbuff, mifa):
        plain, _ = run(factory(loss, server_optimizer=0.7, **kw), np.ones(3), problem.data, 9, key)
        sgd = factory(loss, server_optimizer=optax.sgd(0.7), **kw)
        opt, _ = run(sgd, np.ones(3), problem.data, 9, key)
        np.testing.assert_allclose(opt.params["w"], plain.params["w"], rtol=1e-12, atol=1e-14)
        if factory is mifa:
            continue
        adam, metrics = run(
            factory(loss, server_optimizer=optax.adam(0.1), **kw), np.ones(3), problem.data, 9, key
        )
        aggregations = sum(int(m["aggregated"]) for m in metrics)
        assert 0 < aggregations < 9
        count = jax.tree.leaves(adam.rule.opt_state)[0]  # optax's step count
        assert int(count) == aggregations, factory.__name__


@pytest.mark.parametrize("compress", [False, True])
def test_report_sent_is_what_the_server_averages(x64, compress):
    """`report_sent=True`: the rows `sent [M, d]` are the cohort's encoded updates (top-2
    compressed: at most 2 non-zeros each) and their weighted mean is the server's step (FedAvg,
    server learning rate 1)."""
    problem = least_squares(num_clients=6, examples_per_client=np.arange(3, 9), dim=DIM, seed=1)
    kw = dict(aggregator=error_feedback(TopK(k=2)), num_clients=6) if compress else {}
    alg = fedavg(
        linear_regression(DIM).loss,
        client_optimizer=0.05,
        local=LocalSpec(steps=2, sampling="full"),
        cohort=CohortSpec(size=4),
        report_cohort=True,
        report_sent=True,
        **kw,
    )
    w = np.linspace(-1.0, 1.0, DIM)
    state = alg.init({"w": jnp.asarray(w)}, jax.random.key(0))
    step = jax.jit(alg.step)
    for _ in range(3):
        state, m = step(state, problem.data, jax.random.key(0))
        sent, weights = np.asarray(m["sent"]), np.asarray(m["cohort_weights"])
        assert sent.shape == (4, DIM)
        nonzeros = (sent != 0).sum(axis=1)
        assert (nonzeros <= 2).all() if compress else (nonzeros == DIM).all()
        new = np.asarray(state.params["w"])
        np.testing.assert_allclose(new - w, weights @ sent / weights.sum(), rtol=1e-12, atol=0)
        w = new
