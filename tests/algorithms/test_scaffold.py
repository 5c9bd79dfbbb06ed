"""SCAFFOLD (option II) against an independent NumPy implementation and its exactness on
heterogeneous quadratics; per-client state handling (cohort rows only, Bernoulli padding)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import fedavg, round_decay, scaffold
from fedjax_sim.algorithms.core import COHORT, CohortSpec, LocalSpec, round_key
from fedjax_sim.data import least_squares
from fedjax_sim.models import linear_regression

MODEL = linear_regression(3)


def cohorts_of(cohort, key, counts, rounds):
    return [
        np.asarray(cohort.sample(round_key(key, jnp.int32(t), COHORT), counts)[0])
        for t in range(rounds)
    ]


def numpy_scaffold(problem, w0, cohorts, lr, steps, server_lr):
    """Karimireddy et al. option II with full-batch local gradients, uniform 1/S mean."""
    h, lin = problem.hessians, problem.linear
    num, dim = lin.shape
    x, c, ci = np.array(w0, np.float64), np.zeros(dim), np.zeros((num, dim))
    for t, ids in enumerate(cohorts):
        eta = lr(t)
        deltas, new_ci = [], {}
        for i in ids:
            y = x.copy()
            for _ in range(steps):
                y = y - eta * (h[i] @ y - lin[i] - ci[i] + c)
            deltas.append(y - x)
            new_ci[i] = ci[i] - c + (x - y) / (steps * eta)
        x = x + server_lr * np.mean(deltas, axis=0)
        c = c + sum(new_ci[i] - ci[i] for i in ids) / num
        for i in ids:
            ci[i] = new_ci[i]
    return x, c, ci


def test_scaffold_matches_numpy_partial_participation_with_lr_decay(x64):
    problem = least_squares(num_clients=14, examples_per_client=np.arange(4, 18), dim=3, seed=4)
    sched = round_decay(0.08, 0.95)
    cohort = CohortSpec(size=3, weighting="uniform")
    key, rounds, steps = jax.random.key(6), 6, 4
    alg = scaffold(
        MODEL.loss,
        num_clients=14,
        client_optimizer=sched,
        server_optimizer=0.8,
        local=LocalSpec(steps=steps, sampling="full"),
        cohort=cohort,
    )
    state = alg.init({"w": jnp.array([0.2, -0.5, 1.0])}, key)
    step = jax.jit(alg.step)
    for _ in range(rounds):
        state, metrics = step(state, problem.data, key)
    cohorts = cohorts_of(cohort, key, problem.data.counts, rounds)
    x, c, ci = numpy_scaffold(
        problem, [0.2, -0.5, 1.0], cohorts, lambda t: 0.08 * 0.95**t, steps, 0.8
    )
    np.testing.assert_allclose(state.params["w"], x, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(state.hooks["control_variates"]["w"], c, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(state.rows["control_variates"]["w"], ci, rtol=1e-10, atol=1e-12)
    never = set(range(14)) - set(np.concatenate(cohorts))
    assert never and all(np.all(ci[i] == 0) for i in never)  # untouched rows really exist
    assert int(metrics["participants"]) == 3


def test_scaffold_full_gradients_reach_optimum_fedavg_does_not(x64):
    """Full participation, K = 5 full-batch steps: SCAFFOLD's limit is the optimum x* of
    (1/C) sum_i f_i; FedAvg's is its biased closed-form fixed point."""
    problem = least_squares(num_clients=6, examples_per_client=20, dim=3, heterogeneity=2.0)
    lr, steps = 0.1, 5
    local = LocalSpec(steps=steps, sampling="full")
    key = jax.random.key(0)

    def final(alg, rounds):
        run = jax.jit(
            lambda s: jax.lax.scan(lambda s, _: alg.step(s, problem.data, key), s, length=rounds)
        )
        return np.asarray(run(alg.init({"w": jnp.zeros(3)}, key))[0].params["w"])

    x_scaffold = final(scaffold(MODEL.loss, num_clients=6, client_optimizer=lr, local=local), 400)
    x_fedavg = final(fedavg(MODEL.loss, client_optimizer=lr, local=local), 400)
    opt = problem.optimum()
    np.testing.assert_allclose(x_scaffold, opt, atol=1e-9)
    np.testing.assert_allclose(x_fedavg, problem.fedavg_fixed_point(lr, steps), atol=1e-9)
    assert np.linalg.norm(x_fedavg - opt) > 1e-2


def test_bernoulli_cohort_updates_only_selected_rows():
    """Bernoulli participation with a fixed-capacity buffer: padding slots (unselected
    clients) and empty rounds leave their control variates, c and x unchanged."""
    problem = least_squares(num_clients=12, examples_per_client=6, dim=3, seed=2)
    cohort = CohortSpec(size=6, sampling="bernoulli", probability=0.15)
    key = jax.random.key(3)
    alg = scaffold(
        MODEL.loss,
        num_clients=12,
        client_optimizer=0.05,
        local=LocalSpec(3, batch_size=2),
        cohort=cohort,
    )
    state = alg.init({"w": jnp.ones(3)}, key)
    step = jax.jit(alg.step)
    seen_empty = False
    for t in range(12):
        ids, weights = cohort.sample(round_key(key, jnp.int32(t), COHORT), problem.data.counts)
        selected = np.asarray(ids)[np.asarray(weights) > 0]
        new, metrics = step(state, problem.data, key)
        changed = np.any(
            new.rows["control_variates"]["w"] != state.rows["control_variates"]["w"], axis=1
        )
        np.testing.assert_array_equal(np.flatnonzero(changed), np.sort(selected))
        assert int(metrics["participants"]) == selected.size
        if selected.size == 0:
            seen_empty = True
            np.testing.assert_array_equal(new.params["w"], state.params["w"])
            np.testing.assert_array_equal(
                new.hooks["control_variates"]["w"], state.hooks["control_variates"]["w"]
            )
        state = new
    assert seen_empty


def test_state_size_and_cohort_checks():
    problem = least_squares(num_clients=5, examples_per_client=4, dim=3)
    alg = scaffold(MODEL.loss, num_clients=4)
    state = alg.init({"w": jnp.zeros(3)}, None)
    with pytest.raises(ValueError, match="num_clients=4"):
        alg.step(state, problem.data, jax.random.key(0))
    with pytest.raises(ValueError, match="distinct cohort ids"):
        scaffold(MODEL.loss, num_clients=4, cohort=CohortSpec(2, sampling="proportional"))
