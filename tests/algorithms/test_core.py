"""Shared machinery: local_train masking and sampling, cohort order, client_map modes,
stragglers and cohort sampling statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jex_core

from fedjax_sim.algorithms import cohorts
from fedjax_sim.algorithms.core import (
    CohortSpec,
    LocalSpec,
    Stragglers,
    client_key,
    local_train,
    map_cohort,
    weighted_mean,
)
from fedjax_sim.data import ClientData, least_squares
from fedjax_sim.models import linear_regression
from fedjax_sim.runtime.parallel import ClientMap


def _client(n, n_max, dim=1):
    """Client whose features are the example index (so batches reveal which rows were used)."""
    x = jnp.arange(n_max, dtype=jnp.float32)[:, None] * jnp.ones(dim)
    return ClientData(x, jnp.zeros(n_max), jnp.int32(n))


def _record_batches(client, key, steps, sampling, batch_size):
    """Runs local_train with a hook that records each batch's example ids and mask."""

    def grad_fn(value_and_grad, params, batch, aux):
        ids, masks, k = aux
        ids = ids.at[k].set(batch.x[:, 0].astype(jnp.int32))
        masks = masks.at[k].set(batch.mask)
        loss, g = value_and_grad(params, batch)
        return loss, g, (ids, masks, k + 1)

    aux = (jnp.zeros((steps, batch_size), jnp.int32), jnp.zeros((steps, batch_size)), 0)
    model = linear_regression(1)
    res = local_train(
        model.init(None),
        client,
        key,
        loss_fn=model.loss,
        optimizer=optax.sgd(0.0),
        max_steps=steps,
        batch_size=batch_size,
        sampling=sampling,
        grad_fn=grad_fn,
        aux=aux,
    )
    return np.asarray(res.aux[0]), np.asarray(res.aux[1])


def test_epoch_sampling_visits_each_example_once_per_epoch():
    n, bs = 10, 4  # 3 steps per epoch, last batch has 2 valid rows
    ids, mask = _record_batches(_client(n, 16), jax.random.key(0), 6, "epoch", bs)
    for epoch in range(2):
        rows = slice(3 * epoch, 3 * epoch + 3)
        seen = ids[rows][mask[rows] > 0]
        assert sorted(seen.tolist()) == list(range(n))
    assert mask[2].sum() == 2 and mask[5].sum() == 2
    assert not np.array_equal(ids[:3], ids[3:6])  # a fresh permutation each epoch


def test_replacement_sampling_stays_within_count():
    ids, mask = _record_batches(_client(5, 12), jax.random.key(1), 50, "replacement", 8)
    assert ids.max() < 5 and mask.min() == 1
    assert len(np.unique(ids)) == 5


def test_replacement_indices_drawn_before_the_scan_are_the_per_step_stream(monkeypatch):
    """Short local runs draw every step's indices before the scan (`PREDRAW_LIMIT`); the
    values are step k's `randint(fold_in(fold_in(key, 0), k))` either way, so the trained
    model is bitwise the one of per-step draws."""
    from fedjax_sim.algorithms import core

    client, key, steps, bs = _client(7, 12), jax.random.key(3), 5, 4
    expected = np.stack(
        [
            jax.random.randint(jax.random.fold_in(jax.random.fold_in(key, 0), k), (bs,), 0, 7)
            for k in range(steps)
        ]
    )
    assert steps * bs <= core.PREDRAW_LIMIT
    ids, _ = _record_batches(client, key, steps, "replacement", bs)
    np.testing.assert_array_equal(ids, expected)
    problem = least_squares(num_clients=1, examples_per_client=[9], dim=3)
    model = linear_regression(3)

    def train():
        return local_train(
            {"w": jnp.array([0.5, -0.5, 1.0])},
            problem.data.client(0),
            key,
            loss_fn=model.loss,
            optimizer=optax.sgd(0.05, momentum=0.9),
            max_steps=steps,
            batch_size=bs,
        ).params["w"]

    predrawn = jax.jit(train)()
    monkeypatch.setattr(core, "PREDRAW_LIMIT", 0)
    ids, _ = _record_batches(client, key, steps, "replacement", bs)
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_array_equal(jax.jit(train)(), predrawn)


def test_fixed_sampling_reuses_one_batch_of_distinct_examples():
    ids, mask = _record_batches(_client(9, 12), jax.random.key(2), 4, "fixed", 6)
    assert (ids == ids[0]).all()
    assert len(np.unique(ids[0])) == 6 and ids.max() < 9


def test_full_sampling_masks_padding():
    ids, mask = _record_batches(_client(3, 5), jax.random.key(3), 2, "full", 5)
    np.testing.assert_array_equal(mask[0], [1, 1, 1, 0, 0])


def test_unequal_steps_masked_equals_own_run():
    """The masked vectorised run with per-client steps equals each client run alone."""
    problem = least_squares(num_clients=4, examples_per_client=[5, 9, 3, 7], dim=3)
    model = linear_regression(3)
    params = {"w": jnp.array([0.5, -0.5, 1.0])}
    steps = jnp.array([1, 6, 3, 0])
    key = jax.random.key(0)
    opt = optax.sgd(0.05, momentum=0.9)  # optimizer state must be masked too

    def one(cid, s):
        return local_train(
            params,
            problem.data.client(cid),
            client_key(key, cid),
            loss_fn=model.loss,
            optimizer=opt,
            max_steps=8,
            num_steps=s,
            batch_size=2,
        ).params["w"]

    batched = jax.vmap(one)(jnp.arange(4), steps)
    for cid in range(4):
        alone = local_train(
            params,
            problem.data.client(cid),
            client_key(key, cid),
            loss_fn=model.loss,
            optimizer=opt,
            max_steps=int(steps[cid]) or 1,
            num_steps=None if steps[cid] else jnp.int32(0),
            batch_size=2,
        )
        np.testing.assert_allclose(batched[cid], alone.params["w"], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(batched[3], params["w"])  # zero steps: untouched


def test_local_spec_epochs_steps():
    spec = LocalSpec(epochs=2, batch_size=4)
    np.testing.assert_array_equal(spec.num_steps(jnp.array([0, 1, 4, 5, 9])), [0, 2, 2, 4, 6])
    assert spec.max_steps(9) == 6
    assert LocalSpec(epochs=1.5, batch_size=10).max_steps(20) == 3


@pytest.mark.parametrize(
    "bad", [dict(steps=0), dict(epochs=0.0), dict(batch_size=0), dict(sampling="bogus")]
)
def test_local_spec_validation(bad):
    with pytest.raises(ValueError):
        LocalSpec(**bad)


def test_map_cohort_independent_of_order_and_mode():
    problem = least_squares(num_clients=8, examples_per_client=np.arange(3, 11), dim=2)
    model = linear_regression(2)
    params = {"w": jnp.ones(2)}
    key = jax.random.key(4)

    def client_fn(cid):
        res = local_train(
            params,
            problem.data.client(cid),
            client_key(key, cid),
            loss_fn=model.loss,
            optimizer=optax.sgd(0.1),
            max_steps=3,
            batch_size=2,
        )
        return res.params, res.params["w"]

    ids = jnp.array([6, 1, 3, 0, 7])
    w = problem.data.counts[ids].astype(jnp.float32)
    ref = map_cohort(client_fn, ids, w, client_map=ClientMap("vmap"))
    perm = jnp.array([3, 0, 4, 2, 1])
    for cmap in [ClientMap("vmap"), ClientMap("map", 2), ClientMap("map", 1)]:
        out = map_cohort(client_fn, ids[perm], w[perm], client_map=cmap)
        np.testing.assert_allclose(out.mean["w"], ref.mean["w"], rtol=1e-6)
        # per-client results are bitwise identical wherever the client sits in the cohort
        np.testing.assert_array_equal(out.outputs[np.argsort(perm)], ref.outputs)
    expected = weighted_mean(ref.outputs, w)
    np.testing.assert_allclose(ref.mean["w"], expected, rtol=1e-6)


def test_client_map_map_sum_remainder():
    xs = jnp.arange(7.0)
    for cmap in [ClientMap("map", 3), ClientMap("map", 7), ClientMap("map", 10), ClientMap("vmap")]:
        total, outs = cmap.map_sum(lambda x: (x * 2, x + 1), xs)
        assert float(total) == 42.0
        np.testing.assert_array_equal(outs, np.arange(7.0) + 1)
        np.testing.assert_array_equal(cmap.map(lambda x: x * x, xs), np.arange(7.0) ** 2)


def test_client_map_one_client_per_chunk_is_not_vmapped():
    # a size-1 vmap axis makes every dot a batched dot (slow weight-gradient layouts on
    # XLA:CPU); chunks of one client call the function on the client itself
    def batch_dims(cmap):
        def fn(x, w):  # per-client weights, as after a local step
            return x @ w, jax.grad(lambda w_: jnp.sum(x @ w_))(w)

        jaxpr = jax.make_jaxpr(lambda *a: (cmap.map_sum(fn, *a), cmap.map(fn, *a)))(
            jnp.ones((4, 5, 3)), jnp.ones((4, 3, 2))
        )
        dots = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
        assert dots
        return {tuple(e.params["dimension_numbers"][1][0]) for e in dots}

    assert batch_dims(ClientMap("map", 1)) == {()}
    assert (0,) in batch_dims(ClientMap("map", 2))


def _equations(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in jex_core.jaxprs_in_params(e.params):
            yield from _equations(sub)


def test_weighted_mean_all_zero_weights_is_zero():
    out = weighted_mean({"a": jnp.ones((3, 2))}, jnp.zeros(3))
    np.testing.assert_array_equal(out["a"], np.zeros(2))


def test_stragglers_exact_count_and_partial_work():
    local = LocalSpec(epochs=5, batch_size=10)
    counts = jnp.full((20,), 30)
    idx = jnp.arange(20)
    steps = local.num_steps(counts)
    weights = jnp.ones(20)
    key = jax.random.key(0)
    s, w, is_s = Stragglers(0.5, "partial").apply(key, idx, counts, steps, weights, local)
    assert int(is_s.sum()) == 10
    epochs = np.asarray(s)[np.asarray(is_s)] / 3  # 3 steps per epoch
    assert np.all(epochs == np.round(epochs)) and epochs.min() >= 1 and epochs.max() <= 5
    np.testing.assert_array_equal(np.asarray(s)[~np.asarray(is_s)], 15)
    # order independence: same clients straggle when the cohort is permuted
    perm = jnp.array(np.random.default_rng(0).permutation(20))
    _, _, is_p = Stragglers(0.5, "partial").apply(key, idx[perm], counts, steps, weights, local)
    np.testing.assert_array_equal(np.asarray(is_p), np.asarray(is_s)[np.asarray(perm)])
    _, w_drop, is_d = Stragglers(0.5, "drop").apply(key, idx, counts, steps, weights, local)
    np.testing.assert_array_equal(np.asarray(w_drop), np.where(np.asarray(is_d), 0.0, 1.0))


def test_uniform_cohort_is_without_replacement_and_uniform():
    keys = jax.random.split(jax.random.key(0), 4000)
    draws = np.asarray(jax.vmap(lambda k: cohorts.uniform(k, 20, 5))(keys))
    assert all(len(set(row)) == 5 for row in draws[:200])
    freq = np.bincount(draws.ravel(), minlength=20) / draws.size
    # appearances ~ Binomial(4000, 1/4): sd of freq = sqrt(4000 * 3/16) / 20000 = 0.00137
    np.testing.assert_allclose(freq, 1 / 20, atol=5 * 0.00137)


def test_proportional_cohort_frequency_follows_counts():
    counts = jnp.array([1, 2, 3, 4, 0, 10])
    keys = jax.random.split(jax.random.key(1), 3000)
    draws = np.asarray(jax.vmap(lambda k: cohorts.proportional(k, counts, 4))(keys))
    freq = np.bincount(draws.ravel(), minlength=6) / draws.size
    np.testing.assert_allclose(freq, np.asarray(counts) / 20, atol=0.02)  # ~4 sd
    assert freq[4] == 0.0
    _, weights = CohortSpec(4, "proportional").sample(keys[0], counts)
    np.testing.assert_array_equal(weights, np.ones(4))  # auto: uniform weights, unbiased


def test_cohort_validation():
    with pytest.raises(ValueError, match="exceeds"):
        CohortSpec(size=11).sample(jax.random.key(0), jnp.ones(10, jnp.int32))
    with pytest.raises(ValueError):
        CohortSpec(size=0)
    with pytest.raises(ValueError):
        Stragglers(fraction=1.5)


def test_local_train_float32_params_under_x64(x64):
    """Mixed precision must not break the scan carry (float32 loss, float64 accumulator)."""
    problem = least_squares(num_clients=1, examples_per_client=4, dim=2)
    model = linear_regression(2)
    params = {"w": jnp.zeros(2, jnp.float32)}
    res = local_train(
        params,
        problem.data.client(0),
        jax.random.key(0),
        loss_fn=model.loss,
        optimizer=optax.sgd(0.1),
        max_steps=2,
        batch_size=2,
    )
    assert np.isfinite(float(res.loss))
