"""Bernoulli participation (`CohortSpec(sampling="bernoulli")`, `cohorts.bernoulli`):
distinct ids, selected clients first, capacity, empty rounds and the participation rate."""

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms import cohorts
from fedjax_sim.algorithms.core import CohortSpec


def test_buffer_layout_and_participation_rate():
    num, p, cap = 50, 0.1, 12
    draw = jax.jit(jax.vmap(lambda k: cohorts.bernoulli(k, num, p, cap)))
    ids, selected = map(np.asarray, draw(jax.random.split(jax.random.key(0), 4000)))
    assert ids.shape == (4000, cap)
    assert all(len(set(row)) == cap for row in ids)  # distinct: safe for .at[idx].set
    n_sel = selected.sum(axis=1)
    # selected first, then padding
    assert np.all(selected == (np.arange(cap)[None] < n_sel[:, None]))
    # count ~ Binomial(50, 0.1) (capacity 12 is 5 sd above the mean: no overflow here)
    np.testing.assert_allclose(n_sel.mean(), num * p, rtol=0.05)
    np.testing.assert_allclose(n_sel.var(), num * p * (1 - p), rtol=0.15)
    np.testing.assert_allclose((n_sel == 0).mean(), (1 - p) ** num, atol=0.004)
    counts = np.bincount(ids[selected], minlength=num)  # every client equally likely
    np.testing.assert_allclose(counts / 4000, p, atol=0.02)


def test_cohort_spec_weights_zero_for_padding_and_empty_clients():
    counts = jnp.array([5, 0, 7, 3, 9, 2], jnp.int32)
    spec = CohortSpec(sampling="bernoulli", probability=0.5)
    for seed in range(5):
        ids, weights = spec.sample(jax.random.key(seed), counts)
        _, selected = cohorts.bernoulli(jax.random.key(seed), 6, 0.5)
        np.testing.assert_array_equal(ids, np.arange(6))  # capacity None: all clients
        np.testing.assert_array_equal(weights, np.where(selected, counts, 0))
