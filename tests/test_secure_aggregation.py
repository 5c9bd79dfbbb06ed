"""Issue 38 item 3: secure aggregation (SecAgg / SecAgg+) as an aggregator wrapper."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import fedavg
from fedjax_sim.algorithms import secure_aggregation as S
from fedjax_sim.algorithms.aggregators import Aggregator, clipped, compressed, mean
from fedjax_sim.algorithms.compression import TopK
from fedjax_sim.algorithms.core import Cohort, CohortSpec, LocalSpec
from fedjax_sim.algorithms.privacy import dp_mean
from fedjax_sim.algorithms.robust import krum, median, trimmed_mean
from fedjax_sim.algorithms.secure_aggregation import secure_aggregation
from fedjax_sim.data import least_squares
from fedjax_sim.models import linear_regression

KEY = jax.random.PRNGKey(0)
mask = jax.jit(S.mask, static_argnums=(3, 4))  # eager dispatch of the scans is slow
unmask = jax.jit(S.unmask, static_argnums=(4, 5))


def ints(m, d, bits, seed=1):
    n = S.levels(bits, m)
    return jax.random.randint(jax.random.PRNGKey(seed), (m, d), -n, n + 1)


def plain_sum(q, alive):
    return np.asarray(q, np.int64)[np.asarray(alive)].sum(0)


# ------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("m, k, bits", [(7, 6, 32), (8, 3, 12), (5, 0, 8)])
def test_unmasked_sum_equals_the_plain_quantised_sum_exactly(m, k, bits):
    # SecAgg (k = M - 1), SecAgg+ (odd and even k), self masks only (k = 0)
    ids = jnp.arange(m) * 5 + 2
    q = ints(m, 300, bits)
    offsets = S.neighbour_offsets(m, k)
    masked = mask(q, ids, KEY, offsets, bits)
    dropped = np.ones(m, bool)
    dropped[[1, m - 2]] = False  # two clients drop after masking
    for alive in (np.ones(m, bool), dropped):
        z = unmask(masked, jnp.asarray(alive), ids, KEY, offsets, bits)
        np.testing.assert_array_equal(np.asarray(S.from_field(z, bits)), plain_sum(q, alive))
        assert int(jnp.max(z)) < 2**bits
    if k:  # without recovering the dropped clients' masks the sum is garbage
        wrong = unmask(
            masked * jnp.asarray(dropped, jnp.uint32)[:, None],
            jnp.ones(m, bool),
            ids,
            KEY,
            offsets,
            bits,
        )
        assert np.mean(np.asarray(S.from_field(wrong, bits)) != plain_sum(q, dropped)) > 0.9


def test_graph_is_symmetric_and_has_k_neighbours():
    for m, k in [(10, 9), (10, 2), (10, 3), (11, 4), (6, 0)]:
        offsets = S.neighbour_offsets(m, k)
        assert len(offsets) == k
        assert sorted((m - o) % m for o in offsets) == sorted(offsets)  # b in N(a) <=> a in N(b)
    with pytest.raises(ValueError, match="odd"):
        S.neighbour_offsets(9, 3)
    with pytest.raises(ValueError, match="at most 5"):
        S.neighbour_offsets(6, 6)


def test_duplicate_ids_still_cancel():  # proportional sampling draws a client twice
    ids = jnp.array([3, 3, 7, 3, 1, 7, 3])
    q = ints(7, 300, 32)  # the shapes of the first exactness case: no new compilation
    offsets = S.neighbour_offsets(7, 6)
    alive = jnp.array([True, True, False, True, True, True, False])
    z = unmask(mask(q, ids, KEY, offsets, 32), alive, ids, KEY, offsets, 32)
    np.testing.assert_array_equal(np.asarray(S.from_field(z, 32)), plain_sum(q, alive))


# ------------------------------------------------------------------------------ hiding
def test_masks_hide_a_single_clients_vector():
    m, d, bits = 6, 20_000, 16
    ids = jnp.arange(m)
    offsets = S.neighbour_offsets(m, 2)
    q = ints(m, d, bits)
    y = np.asarray(mask(q, ids, KEY, offsets, bits), np.int64)
    own = np.asarray(S.to_field(q, bits), np.int64)
    assert np.mean(y[0] != own[0]) > 0.999  # the masked vector is not the update
    # uniform on Z_{2^16}: 16 equal bins (chi-square, 15 dof: 99.99 % quantile ~ 44)
    counts = np.bincount(y[0] >> 12, minlength=16)
    assert np.sum((counts - d / 16) ** 2 / (d / 16)) < 44
    # uncorrelated with the update (|r| < 5 / sqrt(d))
    assert abs(np.corrcoef(y[0], np.asarray(q[0]))[0, 1]) < 5 / math.sqrt(d)
    # changing the update by delta changes the masked vector by exactly delta mod 2^B, and
    # nobody else's: the mask does not depend on the data
    delta = jax.random.randint(jax.random.PRNGKey(9), (d,), 1, 100)
    y2 = np.asarray(mask(q.at[0].add(delta), ids, KEY, offsets, bits), np.int64)
    np.testing.assert_array_equal((y2[0] - y[0]) % 2**bits, np.asarray(delta))
    np.testing.assert_array_equal(y2[1:], y[1:])
    # a new round key gives new masks
    y3 = np.asarray(mask(q, ids, jax.random.PRNGKey(1), offsets, bits), np.int64)
    assert np.mean(y3[0] != y[0]) > 0.999


# ------------------------------------------------------------------------------ the wrapper
def identity_inner() -> Aggregator:
    """Reduces to the decoded sum itself (and reports the weight)."""
    base = mean()
    return base._replace(
        reduce=lambda server, total, weight, stacked, cohort, key: (total, server, {"w": weight})
    )


def cohort(weights):
    w = jnp.asarray(weights, jnp.float32)
    return Cohort(jnp.arange(w.shape[0]) * 3, w, jnp.int32(0), 100)


_JITTED = {}


def reduce(agg, rows, weights, key=KEY):
    """`agg.reduce` of the stacked `rows [M, d]` (compiled once per aggregator and shape)."""
    server, _ = agg.init({"w": rows[0]}, 1)
    run = _JITTED.setdefault(
        (id(agg), rows.shape),
        jax.jit(lambda r, w, k: agg.reduce(server, None, None, {"w": r}, cohort(w), k)),
    )
    return run(rows, jnp.asarray(weights, jnp.float32), key)


def test_wrapper_sum_is_the_quantised_sum_of_the_survivors():
    m, d, bits, bound = 6, 500, 16, 2.0
    rows = jax.random.uniform(jax.random.PRNGKey(2), (m, d), minval=-bound, maxval=bound)
    weights = [1, 1, 0, 1, 1, 1]  # slot 2 drops (weight 0)
    agg = secure_aggregation(identity_inner(), neighbours=2, bits=bits, bound=bound)
    total, _, metrics = reduce(agg, rows, weights)
    key = jax.random.fold_in(KEY, S.SECAGG)
    n = S.levels(bits, m)
    q = S.quantise(rows, cohort(weights).ids, jax.random.fold_in(key, 0), bound, n)
    expected = jnp.asarray(plain_sum(q, np.asarray(weights) > 0), jnp.float32)
    np.testing.assert_array_equal(total["w"], expected * jnp.float32(bound / n))
    assert float(metrics["w"]) == 5 and int(metrics["secagg_survivors"]) == 5
    assert float(metrics["secagg_failed"]) == 0 and float(metrics["secagg_rounds"]) == 4


@pytest.mark.parametrize("rounding, factor", [("stochastic", 1.0), ("deterministic", 0.5)])
def test_dequantised_mean_within_the_quantisation_bound(rounding, factor):
    # |q_i / s - x_i| < 1 / s (stochastic) or <= 1 / (2 s) (nearest), s = L / R; the mean
    # of n errors is bounded by the same, plus float32 rounding of values <= R
    m, d, bits, bound = 8, 4000, 14, 1.5
    rows = jax.random.uniform(jax.random.PRNGKey(3), (m, d), minval=-bound, maxval=bound)
    agg = secure_aggregation(neighbours=7, bits=bits, bound=bound, rounding=rounding)
    update, _, _ = reduce(agg, rows, jnp.ones(m))
    err = np.abs(np.asarray(update["w"]) - np.asarray(rows.mean(0)))
    step = bound / S.levels(bits, m)
    assert err.max() <= factor * step + 4 * bound * 2**-23
    assert err.max() > 0.1 * factor * step  # the bound is tight, not vacuous
    if rounding == "stochastic":  # unbiased: mean error ~ 0 (sd <= step / sqrt(12 m d))
        assert abs(
            np.mean(np.asarray(update["w"]) - np.asarray(rows.mean(0)))
        ) < 5 * step / math.sqrt(12 * m * d)


def test_below_threshold_the_round_yields_no_update():
    m, d = 6, 50
    rows = jnp.ones((m, d)) * 0.5
    agg = secure_aggregation(neighbours=5, bits=16, bound=1.0, threshold=0.5)
    update, _, metrics = reduce(agg, rows, [1, 1, 1, 0, 0, 0])  # 3 = ceil(0.5 * 6): ok
    assert float(metrics["secagg_failed"]) == 0
    np.testing.assert_allclose(update["w"], 0.5, atol=1e-3)
    update, _, metrics = reduce(agg, rows, [1, 1, 0, 0, 0, 0])  # 2 < 3: aborted
    assert float(metrics["secagg_failed"]) == 1
    np.testing.assert_array_equal(update["w"], 0.0)
    # SecAgg+: 4 of 6 survive, but slot 0's both ring neighbours (5, 1) dropped
    ring = secure_aggregation(neighbours=2, bits=16, bound=1.0, threshold=0.5)
    _, _, metrics = reduce(ring, rows, [1, 0, 1, 1, 1, 0])
    assert float(metrics["secagg_failed"]) == 1
    _, _, metrics = reduce(ring, rows, [1, 1, 0, 1, 1, 0])
    assert float(metrics["secagg_failed"]) == 0


def test_keyed_dropout_after_masking():
    m = 12
    rows = jnp.ones((m, 10)) * 0.25
    agg = secure_aggregation(
        identity_inner(), neighbours=4, bits=20, bound=1.0, dropout=0.4, threshold=0.0
    )
    _, _, metrics = reduce(agg, rows, jnp.ones(m))
    n = int(metrics["secagg_survivors"])
    assert 0 < n < m
    total, _, again = reduce(agg, rows, jnp.ones(m))
    assert int(again["secagg_survivors"]) == n  # keyed: reproducible
    np.testing.assert_allclose(total["w"], 0.25 * n, rtol=1e-4)


# ------------------------------------------------------------------------------ runs
def problem():
    p = least_squares(num_clients=8, examples_per_client=10, dim=3, seed=0)
    return p.data, linear_regression(3).loss


def test_fedavg_with_secure_aggregation_matches_fedavg_and_counts_its_bytes():
    data, loss = problem()
    m, bits, clip = 6, 16, 10.0
    kw = dict(
        cohort=CohortSpec(size=m, weighting="uniform"), local=LocalSpec(steps=2, batch_size=4)
    )
    plain = fedavg(loss, **kw)
    agg = secure_aggregation(neighbours=m - 1, bits=bits, clip=clip)
    sec = fedavg(loss, aggregator=agg, **kw)
    p0 = {"w": jnp.ones(3)}
    s1, s2 = plain.init(p0, KEY), sec.init(p0, KEY)
    step1, step2 = jax.jit(plain.step), jax.jit(sec.step)
    step = clip / S.levels(bits, m)  # round 1: |error| < R / L per coordinate
    for r in range(3):
        key = jax.random.fold_in(KEY, r)
        s1, m1 = step1(s1, data, key)
        s2, m2 = step2(s2, data, key)
        err = float(jnp.max(jnp.abs(s1.params["w"] - s2.params["w"])))
        assert err < step * (r + 1) * 2, (r, err)  # errors add up over rounds (factor 2:
        # local training from a model off by < r R / L is 1-Lipschitz-ish here)
        assert float(m2["secagg_failed"]) == 0
    assert err > 0  # it did quantise
    d = sum(x.size for x in jax.tree.leaves(p0))
    per_client = 2 * 32 + (m - 1) * (2 * 4 + 2 * 32 + 28) + math.ceil(d * bits / 8) + (m - 1) * 36
    assert S.payload_bytes(d, bits, m - 1) == per_client
    assert float(m2["bytes_up"]) == float(m2["participants"]) * per_client == m * per_client


# ------------------------------------------------------------------------------ composition
def test_central_dp_inside_secure_aggregation():
    m, d = 5, 2000
    rows = jax.random.normal(jax.random.PRNGKey(4), (m, d)) * 0.01
    dp = dp_mean(0.0, 1.0, float(m))
    agg = secure_aggregation(dp, neighbours=4, bits=32, bound=1.0)
    server, _ = agg.init({"w": rows[0]}, 1)
    encode = lambda r, i: agg.encode({"w": r}, {}, jax.random.fold_in(KEY, i), server)[0]
    sent = jax.jit(jax.vmap(encode))(rows, jnp.arange(m))
    update, _, metrics = jax.jit(
        lambda sent: agg.reduce(server, None, None, sent, cohort(jnp.ones(m)), KEY)
    )(sent)
    np.testing.assert_allclose(update["w"], rows.mean(0), atol=1e-6)
    assert float(metrics["dp_clip_norm"]) == 1.0 and float(metrics["dp_unit_weights"]) == 1.0


def test_distributed_dp_noise_adds_up_to_the_central_std():
    m, d, z, c = 8, 20_000, 1.2, 0.5
    agg = S.distributed_dp(z, c, float(m), neighbours=4, threshold=1.0, bits=32)
    sigma = S.distributed_noise_std(z, c, float(m), 1.0)
    assert sigma == pytest.approx(z * c / math.sqrt(m))
    server, _ = agg.init({"w": jnp.zeros(d)}, 1)
    zero = {"w": jnp.zeros(d)}
    encode = lambda i: agg.encode(zero, {}, jax.random.fold_in(KEY, i), server)[0]
    sent = jax.jit(jax.vmap(encode))(jnp.arange(m))
    assert abs(float(jnp.std(sent[0]["w"][0])) / sigma - 1) < 5 / math.sqrt(2 * d)
    update, _, metrics = jax.jit(
        lambda sent: agg.reduce(server, None, None, sent, cohort(jnp.ones(m)), KEY)
    )(sent)
    # the sum of m clients' noise has std sqrt(m) sigma = z C; the update divides by m
    noise = np.asarray(update["w"])
    assert abs(noise.std() / (z * c / m) - 1) < 5 / math.sqrt(2 * d)
    assert float(metrics["secagg_clamped"]) < 1e-3  # R = C + 4 sigma


def test_composes_with_compression_and_clipping():
    m, d = 4, 64
    rows = jax.random.normal(jax.random.PRNGKey(5), (m, d))
    agg = secure_aggregation(compressed(TopK(k=8)), neighbours=2, bits=24, clip=100.0)
    server, _ = agg.init({"w": rows[0]}, 1)
    sent = jax.jit(jax.vmap(lambda r: agg.encode({"w": r}, {}, KEY, server)[0]))(rows)
    update, _, _ = jax.jit(
        lambda sent: agg.reduce(server, None, None, sent, cohort(jnp.ones(m)), KEY)
    )(sent)
    expected = jax.vmap(lambda r: TopK(k=8)(r))(rows).mean(0)
    np.testing.assert_allclose(update["w"], expected, atol=100.0 / S.levels(24, m))
    # the masked vector is dense: top-k saves no bytes under secure aggregation
    assert agg.payload({"w": rows[0]}) == S.payload_bytes(d, 24, 2)
    assert clipped(1.0, agg).stacked  # an outer clip keeps the wrapper's stacked rows


@pytest.mark.parametrize(
    "inner", [median(), trimmed_mean(0.2), krum(1), "nested"], ids=["median", "trim", "krum", "sa"]
)
def test_refuses_aggregators_that_need_individual_updates(inner):
    if inner == "nested":
        inner = secure_aggregation(neighbours=2, bound=1.0)
    with pytest.raises(ValueError, match="reveals only the sum") as e:
        secure_aggregation(inner, neighbours=2, bound=1.0)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(neighbours=2), "give clip or bound"),
        (dict(neighbours=-1, bound=1.0), "neighbours"),
        (dict(neighbours=2, bound=1.0, bits=33), "bits"),
        (dict(neighbours=2, bound=1.0, threshold=1.5), "threshold"),
        (dict(neighbours=2, bound=1.0, dropout=1.0), "dropout"),
        (dict(neighbours=2, bound=1.0, rounding="up"), "rounding"),
        (dict(neighbours=2, bound=-1.0), "bound"),
    ],
)
def test_bad_arguments_refused_when_building(kwargs, match):
    with pytest.raises(ValueError, match=match):
        secure_aggregation(**kwargs)


def test_too_few_bits_for_the_cohort():
    with pytest.raises(ValueError, match="cannot hold"):
        S.levels(4, 9)


# ------------------------------------------------------------------------------ CLI
@pytest.mark.parametrize(
    "args, message",
    [
        (["--secure-aggregation", "bits=16"], "needs clip="),
        (["--secure-aggregation", "clip=1", "bits=40"], "bits must be an int in [2, 32]"),
        (["--secure-aggregation", "clip=1", "neighbours=12"], "at most 9"),
        (["--secure-aggregation", "clip=1", "bits=4"], "cannot hold the sum of 10"),
        (["--secure-aggregation", "clip=1", "--aggregator", "median"], "reveals only the sum"),
        (["--secure-aggregation", "clip=1", "--weighting", "counts"], "--weighting uniform"),
        (["--secure-aggregation", "clip=1", "nope=3"], "takes bits, bound, clip"),
    ],
)
def test_cli_refuses_bad_secure_aggregation_up_front(capsys, args, message):
    from fedjax_sim.app.cli import main

    assert main(["run", "--rounds", "1", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_builds_secure_aggregation_around_dp():
    from fedjax_sim.app.config import RunConfig, algorithm_kwargs

    cfg = RunConfig(dp_clip=1.0, secure_aggregation=("bits=24", "neighbours=4"))
    kwargs = algorithm_kwargs(cfg, {"dp_clip", "secure_aggregation"})
    assert kwargs["aggregator"].stacked and kwargs["cohort"].weighting == "uniform"
    # dp_mean sends (clipped update, b_i): 10 + 1 coordinates, from the shapes it sends
    assert kwargs["aggregator"].payload({"w": jnp.zeros(10)}) == S.payload_bytes(11, 24, 4)
