"""DRFA and federated DR-DSGD (spec fgdro.md section 2.5) against NumPy references, the
simplex projection, the sampled DRFA variant, payload, and DR-DSGD's small-batch bias."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from fedjax_sim.algorithms import dr_dsgd, drfa
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.algorithms.dro_baselines import project_simplex, snapshot_step
from fedjax_sim.algorithms.hooks import tilted
from fedjax_sim.data import Batch, least_squares
from fedjax_sim.models import linear_regression
from fedjax_sim.runtime.parallel import ClientMap

VMAP = ClientMap("vmap")
FULL = LocalSpec(steps=4, sampling="full")


@functools.partial(jax.jit, static_argnums=(0, 4))
def run(step, state, data, key, rounds):
    return lax.scan(lambda s, _: step(s, data, key), state, None, length=rounds)


class Quadratic:
    """Full-batch least-squares losses and gradients, float64 NumPy."""

    def __init__(self, data):
        counts = np.asarray(data.counts)
        x, y = np.asarray(data.x, np.float64), np.asarray(data.y, np.float64)
        self.a = [x[i, : counts[i]] for i in range(len(counts))]
        self.b = [y[i, : counts[i]] for i in range(len(counts))]

    def __call__(self, i, w):
        r = self.a[i] @ w - self.b[i]
        return 0.5 * np.mean(r**2), self.a[i].T @ r / len(r)


def np_project_simplex(v):
    """Bisection on theta: sum(max(v - theta, 0)) = 1 (independent of the sort algorithm)."""
    lo, hi = v.min() - 1.0, v.max()
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if np.maximum(v - mid, 0).sum() > 1 else (lo, mid)
    return np.maximum(v - 0.5 * (lo + hi), 0)


def _problem():
    return least_squares(num_clients=5, examples_per_client=[6, 9, 4, 12, 7], dim=3, seed=2)


def test_project_simplex_matches_bisection(x64):
    rng = np.random.default_rng(0)
    for n in (1, 7, 30):
        for scale in (0.01, 1.0, 10.0):
            v = rng.normal(size=n) * scale
            p = np.asarray(project_simplex(jnp.asarray(v)))
            np.testing.assert_allclose(p, np_project_simplex(v), atol=1e-12)
            assert p.min() >= 0 and p.sum() == pytest.approx(1.0)


def test_drfa_full_participation_matches_numpy_and_payload(x64):
    """Full-participation DRFA: lam-weighted averages of w(I) and of the snapshot w(t'), one
    loss per client at the snapshot, projected ascent lam += gamma I v (gamma decaying)."""
    problem = _problem()
    f = Quadratic(problem.data)
    model = linear_regression(3)
    lr, gamma, decay, steps, rounds = 0.05, 0.02, 0.9, 4, 5
    alg = drfa(
        model.loss,
        num_clients=5,
        client_optimizer=lr,
        dual_lr=gamma,
        dual_lr_decay=decay,
        local=FULL,
        client_map=VMAP,
    )
    key = jax.random.key(4)
    w0 = np.array([0.3, -0.5, 0.2])
    state, metrics = run(alg.step, alg.init({"w": jnp.asarray(w0)}, key), problem.data, key, rounds)

    w_bar, lam = w0.copy(), np.full(5, 0.2)
    snaps = [int(snapshot_step(key, jnp.int32(r), steps)) for r in range(rounds)]
    assert len(set(snaps)) > 1 and min(snaps) >= 1 and max(snaps) <= steps
    for r in range(rounds):
        finals, snapped = [], []
        for i in range(5):
            w = w_bar.copy()
            for t in range(1, steps + 1):
                w = w - lr * f(i, w)[1]
                if t == snaps[r]:
                    snap = w.copy()
            finals.append(w)
            snapped.append(snap)
        w_bar, w_snap = lam @ np.array(finals), lam @ np.array(snapped)
        v = np.array([f(i, w_snap)[0] for i in range(5)])
        lam = np_project_simplex(lam + gamma * decay**r * steps * v)
    np.testing.assert_allclose(state.params["w"], w_bar, rtol=1e-10)
    np.testing.assert_allclose(state.cohort, lam, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(metrics["client_weights"][-1], state.cohort)
    assert np.abs(lam - 0.2).max() > 0.01  # the weights really moved
    d = 3  # payload: w(I), w(t') and one loss up; w and w_snap down (float64)
    np.testing.assert_array_equal(metrics["bytes_up"], 5 * (2 * d + 1) * 8)
    np.testing.assert_array_equal(metrics["bytes_down"], 5 * 2 * d * 8)


def test_drfa_sampled_variant_trains_clients_drawn_from_lambda(x64):
    """m = 3 training clients ~ lam with replacement: with all mass on client 2, the new model
    is client 2's local SGD; lam stays in the simplex, above the floor; payload counts m."""
    problem = _problem()
    f = Quadratic(problem.data)
    model = linear_regression(3)
    alg = drfa(
        model.loss,
        num_clients=5,
        client_optimizer=0.05,
        dual_lr=0.01,
        weight_floor=0.01,
        initial_weights=jnp.array([0.0, 0.0, 1.0, 0.0, 0.0]),
        local=FULL,
        cohort=CohortSpec(size=3),
        client_map=VMAP,
    )
    key = jax.random.key(0)
    w0 = np.array([0.3, -0.5, 0.2])
    state, metrics = run(alg.step, alg.init({"w": jnp.asarray(w0)}, key), problem.data, key, 1)
    w = w0.copy()
    for _ in range(4):
        w = w - 0.05 * f(2, w)[1]
    np.testing.assert_allclose(state.params["w"], w, rtol=1e-10)
    lam = np.asarray(state.cohort)
    # floored at 0.01 then renormalised (authors' code): the floor shrinks by the renormaliser
    assert lam.sum() == pytest.approx(1.0) and lam.min() >= 0.01 / (1 + 5 * 0.01)
    d = 3
    np.testing.assert_array_equal(metrics["bytes_up"], [3 * 2 * d * 8 + 3 * 8])
    np.testing.assert_array_equal(metrics["bytes_down"], [3 * d * 8 + 3 * d * 8])


def test_dr_dsgd_matches_numpy_and_payload(x64):
    problem = _problem()
    f = Quadratic(problem.data)
    model = linear_regression(3)
    mu, lr = 3.0, 0.1
    alg = dr_dsgd(model.loss, temperature=mu, client_optimizer=lr, local=FULL, client_map=VMAP)
    key = jax.random.key(0)
    w0 = np.array([0.3, -0.5, 0.2])
    state, metrics = run(alg.step, alg.init({"w": jnp.asarray(w0)}, key), problem.data, key, 4)
    w_bar = w0.copy()
    for _ in range(4):
        finals = []
        for i in range(5):
            w = w_bar.copy()
            for _ in range(4):
                loss, g = f(i, w)
                w = w - lr * np.exp(loss / mu) / mu * g
            finals.append(w)
        w_bar = np.mean(finals, 0)  # uniform, not count-weighted
    np.testing.assert_allclose(state.params["w"], w_bar, rtol=1e-10)
    np.testing.assert_array_equal(metrics["bytes_up"], 5 * 3 * 8)


def test_dr_dsgd_bias_shrinks_with_batch_size(x64):
    """E[(1/mu) exp(l_B/mu) grad l_B] over minibatches of size B (with replacement) differs
    from (1/mu) exp(l/mu) grad l and the gap shrinks like O(1/B)."""
    problem = least_squares(num_clients=1, examples_per_client=30, dim=2, seed=5)
    model = linear_regression(2)
    x, y = problem.data.x[0, :30], problem.data.y[0, :30]
    w = {"w": jnp.array([0.8, -0.6])}
    mu = 1.0
    f = Quadratic(problem.data)
    loss, grad = f(0, np.asarray(w["w"]))
    target = np.exp(loss / mu) / mu * grad
    vg = jax.value_and_grad(model.loss)
    hook = tilted(mu).direction

    def mean_direction(key, batch_size, samples=100_000):
        idx = jax.random.randint(key, (samples, batch_size), 0, 30)

        def one(i):
            return hook(vg, w, Batch(x[i], y[i], jnp.ones(batch_size)), None, None)[1]["w"]

        return jnp.mean(lax.map(one, idx, batch_size=4096), axis=0)

    gaps = {}
    for b in (1, 4, 16):
        est = jax.jit(mean_direction, static_argnums=1)(jax.random.key(b), b)
        gaps[b] = np.linalg.norm(np.asarray(est) - target)
    assert gaps[1] > gaps[4] > gaps[16]
    assert gaps[1] > 0.05 * np.linalg.norm(target)  # the small-batch bias is real
    assert gaps[1] / gaps[16] > 5  # ~16 for an O(1/B) bias


def test_bad_hyper_parameters_raise():
    loss = linear_regression(2).loss
    for mu in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            dr_dsgd(loss, temperature=mu)
    with pytest.raises(ValueError, match="uniformly"):
        dr_dsgd(loss, cohort=CohortSpec(weighting="counts"))
    with pytest.raises(ValueError, match="dual_lr must be >= 0"):
        drfa(loss, num_clients=4, dual_lr=-0.1)
    with pytest.raises(ValueError, match="dual_lr_decay"):
        drfa(loss, num_clients=4, dual_lr_decay=1.5)
    with pytest.raises(ValueError, match="weight_floor"):
        drfa(loss, num_clients=4, weight_floor=0.25)
    with pytest.raises(ValueError, match="initial_weights"):
        drfa(loss, num_clients=4, initial_weights=jnp.array([1.0, -1.0, 0.5, 0.5]))
    with pytest.raises(ValueError, match="initial_weights"):
        drfa(loss, num_clients=4, initial_weights=jnp.ones(3))
    with pytest.raises(ValueError, match="exceeds the number of clients"):
        drfa(loss, num_clients=4, cohort=CohortSpec(size=5))
