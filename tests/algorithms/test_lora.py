"""Federated LoRA (`algorithms.lora`): the adapters-only partition on the transformer (base
bit-identical after rounds, bytes = the adapters' bytes, FedAvg / FedProx / SCAFFOLD / DP, robust
aggregators, top-k with error feedback, secure aggregation and FedAdam on the adapters), the
pitfall (averaging A and B is not averaging B A), and heterogeneous ranks
with HetLoRA and FLoRA against independent NumPy references (float64 full-batch GD on a
one-module LoRA least-squares model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from fedjax_sim.algorithms import fedadam, fedavg, fedbuff, fedprox, scaffold
from fedjax_sim.algorithms.aggregators import error_feedback
from fedjax_sim.algorithms.compression import INDEX_BYTES, TopK
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec
from fedjax_sim.algorithms.lora import (
    flora,
    flora_fedavg,
    hetlora,
    hetlora_fedavg,
    lora_partition,
    max_rank,
    stacked_product,
    truncate,
    with_rule,
)
from fedjax_sim.algorithms.privacy import dp_mean
from fedjax_sim.algorithms.robust import median, trimmed_mean
from fedjax_sim.algorithms.secure_aggregation import payload_bytes, secure_aggregation
from fedjax_sim.data import least_squares, markov_tokens
from fedjax_sim.data.federated import tree_size_bytes
from fedjax_sim.models import Model, transformer

V, T, C, M = 11, 8, 4, 2


@pytest.fixture(scope="module")
def setup():
    data, _ = markov_tokens(num_clients=C, examples_per_client=8, vocab_size=V, seq_len=T)
    model = transformer((T,), V, d_model=16, num_layers=1, num_heads=2, lora_rank=2)
    params = model.init(jax.random.key(0))
    return data, model, params


def run(alg, params, data, rounds=2):
    state = alg.init(params, jax.random.key(0))
    step = jax.jit(alg.step)
    for r in range(rounds):
        state, metrics = step(state, data, jax.random.key(r + 1))
    return state, metrics


def split_adapters(params):
    """`(adapter leaves, other leaves)` as `{path: array}`."""
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(params)}
    ad = {k: v for k, v in flat.items() if "lora_" in k}
    return ad, {k: v for k, v in flat.items() if "lora_" not in k}


def test_partition_labels_only_adapters_shared(setup):
    _, _, params = setup
    labels = lora_partition().of(params)
    for path, label in jax.tree_util.tree_leaves_with_path(labels):
        assert label == ("shared" if "lora_" in jax.tree_util.keystr(path) else "frozen")
    assert max_rank(params) == 2


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "scaffold", "dp"])
def test_algorithms_train_only_the_adapters(setup, name):
    data, model, params = setup
    common = dict(
        client_optimizer=0.5,
        local=LocalSpec(steps=2, batch_size=4),
        cohort=CohortSpec(size=M),
        partition=lora_partition(),
    )
    if name == "fedavg":
        alg = fedavg(model.loss, **common)
    elif name == "fedprox":
        alg = fedprox(model.loss, mu=0.1, **common)
    elif name == "scaffold":
        alg = scaffold(model.loss, num_clients=C, **common)
    else:
        alg = fedavg(model.loss, aggregator=dp_mean(0.5, 1.0, expected_cohort=M), **common)
    state, metrics = run(alg, params, data)
    new_ad, new_base = split_adapters(state.params)
    old_ad, old_base = split_adapters(params)
    for k, v in old_base.items():  # the frozen base is bit-identical
        np.testing.assert_array_equal(new_base[k], v, err_msg=k)
    assert any(float(jnp.max(jnp.abs(new_ad[k] - v))) > 0 for k, v in old_ad.items())
    assert np.isfinite(float(metrics["train_loss"]))
    adapter_bytes = sum(v.size * v.dtype.itemsize for v in old_ad.values())
    if name in ("fedavg", "fedprox"):  # DP's payload adds its clipped bit
        assert float(metrics["bytes_up"]) == M * adapter_bytes
    if name == "fedavg":
        assert float(metrics["bytes_down"]) == M * adapter_bytes
    if name == "scaffold":  # its control variates (sent too) are of the adapters only
        assert float(metrics["bytes_up"]) == 2 * M * adapter_bytes
        assert tree_size_bytes(state.rows["control_variates"].value) == C * adapter_bytes


TOP_K = 5


@pytest.mark.parametrize("name", ["median", "trimmed_mean", "top_k_ef", "secagg", "fedadam"])
def test_every_part_on_the_adapters(setup, name):
    """Robust aggregators, compression with error feedback, secure aggregation and a server
    Adam see only the adapters: the base stays bit-identical, the adapters move, bytes_up is
    the aggregator's payload of the adapters (and per-client / server state is
    adapter-shaped)."""
    data, model, params = setup
    old_ad, old_base = split_adapters(params)
    d = sum(v.size for v in old_ad.values())
    adapter_bytes = sum(v.size * v.dtype.itemsize for v in old_ad.values())
    common = dict(
        client_optimizer=0.5,
        local=LocalSpec(steps=2, batch_size=4),
        cohort=CohortSpec(size=M, weighting="uniform"),
        partition=lora_partition(),
    )
    aggregator = {
        "median": median(),
        "trimmed_mean": trimmed_mean(0.25),
        "top_k_ef": error_feedback(TopK(k=TOP_K)),
        "secagg": secure_aggregation(neighbours=M - 1, bits=32, clip=1.0),
    }.get(name)
    if name == "fedadam":
        alg = fedadam(model.loss, server_optimizer=0.01, **common)
    else:
        alg = fedavg(model.loss, aggregator=aggregator, num_clients=C, **common)
    state, metrics = run(alg, params, data)
    new_ad, new_base = split_adapters(state.params)
    for k, v in old_base.items():
        np.testing.assert_array_equal(new_base[k], v, err_msg=k)
    assert any(float(jnp.max(jnp.abs(new_ad[k] - v))) > 0 for k, v in old_ad.items())
    assert np.isfinite(float(metrics["train_loss"]))
    per_client = {
        "median": adapter_bytes,
        "trimmed_mean": adapter_bytes,
        "top_k_ef": TOP_K * (4 + INDEX_BYTES),  # k float32 values + k int32 indices
        "secagg": payload_bytes(d, 32, M - 1),  # keys, shares, d 32-bit masked words
        "fedadam": adapter_bytes,
    }[name]
    assert float(metrics["bytes_up"]) == M * per_client
    if name == "top_k_ef":  # the error-feedback memory is one adapter-shaped row per client
        assert tree_size_bytes(state.aggregator.rows["error_feedback"].value) == C * adapter_bytes
    if name == "secagg":
        assert float(metrics["secagg_failed"]) == 0.0
    if name == "fedadam":  # Adam's moments are adapter-shaped: mu and nu, d scalars each
        moments = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
        assert sum(np.size(x) for x in moments) == 2 * d


# ------------------------------------------------------------------------------ the pitfall
def test_averaging_a_and_b_is_not_averaging_the_products(setup):
    """FedAvg on the adapters gives mean(A) mean(B), not mean(A B): non-zero gap with two
    clients, zero with one (and zero in NumPy when the clients share A)."""
    data, model, params = setup
    s = 1.0  # lora_alpha=None

    def gap(cohort):
        alg = fedavg(
            model.loss,
            client_optimizer=0.5,
            local=LocalSpec(steps=3, batch_size=4),
            cohort=CohortSpec(size=cohort, weighting="uniform"),
            partition=lora_partition(),
            report_sent=True,
        )
        state, metrics = run(alg, params, data, rounds=1)
        shared = lora_partition().select(params, params, "shared")
        _, unravel = ravel_pytree(shared)
        clients = [
            jax.tree.map(jnp.add, shared, unravel(row)) for row in np.asarray(metrics["sent"])
        ]
        mod = lambda p: p["block_0"]["query"]
        mean_of_products = np.mean(
            [s * mod(c)["lora_a"] @ mod(c)["lora_b"] for c in clients], axis=0
        )
        new = mod(state.params)
        return np.abs(s * new["lora_a"] @ new["lora_b"] - mean_of_products).max()

    assert gap(M) > 1e-6
    assert gap(1) < 1e-6
    rng = np.random.default_rng(0)
    a, bs = rng.normal(size=(5, 2)), rng.normal(size=(3, 2, 4))
    np.testing.assert_allclose(a @ bs.mean(0), np.mean([a @ b for b in bs], 0))  # shared A


# ------------------------------------------------------------------------------ heterogeneous
D, OUT, R, S, LR, K = 6, 2, 4, 0.5, 0.05, 3
READOUT = np.array([1.0, -0.5])
RANKS = np.array([1, 2, 3, 4])


def lora_lsq():
    """One LoRA module: `out = x (W + S A B) v` with squared loss."""
    rng = np.random.default_rng(3)
    init = {
        "layer": {
            "kernel": rng.normal(size=(D, OUT)).astype(np.float32),
            "lora_a": rng.normal(size=(D, R)).astype(np.float32),
            "lora_b": (0.3 * rng.normal(size=(R, OUT))).astype(np.float32),
        }
    }

    def apply(p, x):
        m = p["layer"]
        return x @ (m["kernel"] + S * m["lora_a"] @ m["lora_b"]) @ jnp.asarray(READOUT, x.dtype)

    model = Model(init=lambda key: jax.tree.map(jnp.asarray, init), apply=apply,
                  loss_kind="squared")  # fmt: skip
    problem = least_squares(num_clients=C, examples_per_client=np.arange(5, 5 + C), dim=D)
    return model, init, problem.data


def numpy_local(x, y, w, a, b, lam=0.0, start=0, mu=0.0):
    """K full-batch GD steps on (a, b) of `0.5 mean((x (w + S a b) v - y)^2)` (+ HetLoRA's
    `lam ||a_tail b||_F`, the tail the columns `start:` of a; + FedProx's `mu/2 ||(a, b) -
    (a_0, b_0)||^2`)."""
    a0, b0 = a, b
    a, b = a.copy(), b.copy()
    keep = (np.arange(a.shape[1]) >= start).astype(np.float64)
    for _ in range(K):
        res = x @ (w + S * a @ b) @ READOUT - y
        g = x.T @ res[:, None] @ READOUT[None] / len(y)  # dL/dM
        ga, gb = S * g @ b.T, S * a.T @ g
        if lam:
            tail = (a * keep) @ b
            gt = lam * tail / np.linalg.norm(tail)
            ga, gb = ga + (gt @ b.T) * keep, gb + (a * keep).T @ gt
        ga, gb = ga + mu * (a - a0), gb + mu * (b - b0)
        a, b = a - LR * ga, b - LR * gb
    return a, b


def tail_norm_np(a, b, start):
    return np.linalg.norm(a[:, start:] @ b[start:])


def client_arrays(data, i):
    n = int(data.counts[i])
    return np.asarray(data.x[i, :n], np.float64), np.asarray(data.y[i, :n], np.float64)


def hetlora_numpy(data, layer, rounds, mu=0.0, adam=None):
    """HetLoRA's rounds; `mu`: FedProx's local steps; `adam=(lr, b1, b2, eps)`: the server
    steps with (bias-corrected) Adam on the pseudo-gradient `-(aggregate - x_t)`."""
    w, a, b = (np.asarray(layer[k], np.float64) for k in ("kernel", "lora_a", "lora_b"))
    moments = [np.zeros_like(a), np.zeros_like(b)], [np.zeros_like(a), np.zeros_like(b)]
    for t in range(1, rounds + 1):
        pa, pb, norms = [], [], []
        for i, r in enumerate(RANKS):
            ai, bi = numpy_local(*client_arrays(data, i), w, a[:, :r], b[:r], mu=mu)
            pa.append(np.pad(ai, ((0, 0), (0, R - r))))
            pb.append(np.pad(bi, ((0, R - r), (0, 0))))
            norms.append(np.linalg.norm(ai @ bi))
        p = np.array(norms) / np.sum(norms)
        new = [np.tensordot(p, pa, 1), np.tensordot(p, pb, 1)]
        if adam is None:
            a, b = new
            continue
        lr, b1, b2, eps = adam
        (m, v), out = moments, []
        for j, x in enumerate((a, b)):
            g = x - new[j]  # the pseudo-gradient
            m[j] = b1 * m[j] + (1 - b1) * g
            v[j] = b2 * v[j] + (1 - b2) * g**2
            step = (m[j] / (1 - b1**t)) / (np.sqrt(v[j] / (1 - b2**t)) + eps)
            out.append(x - lr * step)
        a, b = out
    return a, b


def flora_numpy(data, layer, rounds):
    w, a0, b = (np.asarray(layer[k], np.float64) for k in ("kernel", "lora_a", "lora_b"))
    for _ in range(rounds):
        mods = [
            numpy_local(*client_arrays(data, i), w, a0[:, :r], b[:r]) for i, r in enumerate(RANKS)
        ]
        w = w + S * stacked_product([m[0] for m in mods], [m[1] for m in mods], np.ones(C))
        b = np.zeros_like(b)
    return w, a0, b


def het_alg(model, hook):
    from fedjax_sim.algorithms.compose import ClientWork, compose
    from fedjax_sim.algorithms.local_hook import chain

    work = ClientWork(
        model.loss,
        client_optimizer=LR,
        local=LocalSpec(steps=K, sampling="full"),
        hook=chain(hook),
        partition=lora_partition(),
    )
    return compose(work, num_clients=C, cohort=CohortSpec(size=C, weighting="uniform"))


HET = dict(  # het_alg's settings, as preset options
    client_optimizer=LR,
    local=LocalSpec(steps=K, sampling="full"),
    partition=lora_partition(),
    num_clients=C,
    cohort=CohortSpec(size=C, weighting="uniform"),
)


def test_hetlora_matches_numpy():
    model, init, data = lora_lsq()
    state, metrics = run(het_alg(model, hetlora(RANKS)), model.init(None), data, rounds=2)
    a, b = hetlora_numpy(data, init["layer"], rounds=2)
    layer = state.params["layer"]
    np.testing.assert_allclose(layer["lora_a"], a, rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose(layer["lora_b"], b, rtol=2e-4, atol=1e-5)
    np.testing.assert_array_equal(layer["kernel"], init["layer"]["kernel"])
    assert float(metrics["hetlora_rank"]) == RANKS.mean()


def test_flora_matches_numpy_stacking():
    model, init, data = lora_lsq()
    state, metrics = run(het_alg(model, flora(RANKS, S)), model.init(None), data, rounds=2)
    w, a, b = flora_numpy(data, init["layer"], rounds=2)
    layer = state.params["layer"]
    np.testing.assert_allclose(layer["kernel"], w, rtol=2e-4, atol=1e-5)
    np.testing.assert_array_equal(layer["lora_a"], init["layer"]["lora_a"])
    np.testing.assert_array_equal(layer["lora_b"], np.zeros_like(b))
    assert float(metrics["flora_merged_norm"]) > 0


def test_stacking_is_exact_and_separate_averages_are_not():
    rng = np.random.default_rng(1)
    ranks, w = [1, 3, 2], np.array([1.0, 2.0, 3.0])
    a = [rng.normal(size=(5, r)) for r in ranks]
    b = [rng.normal(size=(r, 4)) for r in ranks]
    p = w / w.sum()
    exact = sum(pi * ai @ bi for pi, ai, bi in zip(p, a, b, strict=True))
    np.testing.assert_allclose(stacked_product(a, b, w), exact, rtol=1e-12)
    pad_a = [np.pad(x, ((0, 0), (0, 3 - x.shape[1]))) for x in a]
    pad_b = [np.pad(x, ((0, 3 - x.shape[0]), (0, 0))) for x in b]
    separate = np.tensordot(p, pad_a, 1) @ np.tensordot(p, pad_b, 1)
    assert np.abs(separate - exact).max() > 1e-3
    np.testing.assert_allclose(stacked_product(a[:1], b[:1], w[:1]), a[0] @ b[0])


def test_hetlora_rank_self_pruning_matches_numpy():
    """A client whose tail norm ||A_tail B_tail|| ends its local training below where it
    started keeps max(1, floor(decay r_i)) ranks from then on (its row)."""
    model, init, data = lora_lsq()
    lam, decay = 2.0, 0.5
    alg = het_alg(model, hetlora(RANKS, prune_lam=lam, decay=decay))
    ranks = RANKS.copy()
    w, a, b = (np.asarray(init["layer"][k], np.float64) for k in ("kernel", "lora_a", "lora_b"))
    state = alg.init(model.init(None), jax.random.key(0))
    for t in range(2):
        state, metrics = alg.step(state, data, jax.random.key(t + 1))
        assert float(metrics["hetlora_rank"]) == ranks.mean()
        pa, pb, norms, new_ranks = [], [], [], ranks.copy()
        for i, r in enumerate(ranks):
            start = int(np.floor(decay * r))
            ai, bi = numpy_local(*client_arrays(data, i), w, a[:, :r], b[:r], lam, start)
            if tail_norm_np(ai, bi, start) < tail_norm_np(a[:, :r], b[:r], start):
                new_ranks[i] = max(1, start)
            pa.append(np.pad(ai, ((0, 0), (0, R - r))))
            pb.append(np.pad(bi, ((0, R - r), (0, 0))))
            norms.append(np.linalg.norm(ai @ bi))
        p = np.array(norms) / np.sum(norms)
        a, b, ranks = np.tensordot(p, pa, 1), np.tensordot(p, pb, 1), new_ranks
        np.testing.assert_array_equal(state.rows["hetlora"].value, ranks)
        np.testing.assert_allclose(state.params["layer"]["lora_a"], a, rtol=2e-4, atol=1e-5)
    assert ranks.sum() < RANKS.sum()  # some client pruned


def test_truncate_masks_the_rank_axis():
    tree = {"m": {"lora_a": jnp.ones((3, 4)), "lora_b": jnp.ones((4, 2)), "kernel": jnp.ones(2)}}
    t = truncate(tree, jnp.int32(2))
    np.testing.assert_array_equal(t["m"]["lora_a"].sum(0), [3, 3, 0, 0])
    np.testing.assert_array_equal(t["m"]["lora_b"].sum(1), [2, 2, 0, 0])
    np.testing.assert_array_equal(t["m"]["kernel"], tree["m"]["kernel"])
    with pytest.raises(ValueError, match="ranks"):
        hetlora([0, 2])


@pytest.mark.parametrize("rule", ["hetlora", "flora"])
def test_heterogeneous_ranks_on_the_transformer(setup, rule):
    """Both rules on every adapted module of the transformer: FLoRA moves exactly the
    adapted kernels (B reset), HetLoRA only the adapters."""
    data, model, params = setup
    ranks = np.array([1, 2, 1, 2])
    hook = hetlora(ranks, prune_lam=0.1) if rule == "hetlora" else flora(ranks, 1.0)
    state, metrics = run(het_alg(model, hook), params, data, rounds=1)
    new_ad, new_base = split_adapters(state.params)
    old_ad, old_base = split_adapters(params)
    moved = {k for k, v in old_base.items() if np.any(np.asarray(new_base[k]) != v)}
    if rule == "flora":
        adapted = {k.replace("lora_a", "kernel") for k in old_ad if "lora_a" in k}
        assert moved == adapted and len(adapted) == 6
        assert all(not np.any(new_ad[k]) for k in new_ad if "lora_b" in k)
    else:
        assert not moved
        assert float(metrics["hetlora_rank"]) == 1.5


# ------------------------------------------------------------------------------ rules x presets
def test_fedprox_with_hetlora_matches_numpy():
    """`with_rule(fedprox, "hetlora")`: the proximal term acts on the rank-masked local
    steps (NumPy: each client's prox to its truncated x_t); mu = 0 is FedAvg + HetLoRA bit
    for bit."""
    model, init, data = lora_lsq()
    mu = 2.0
    prox = with_rule(fedprox, "hetlora")
    state, _ = run(prox(model.loss, mu=mu, ranks=RANKS, **HET), model.init(None), data)
    a, b = hetlora_numpy(data, init["layer"], rounds=2, mu=mu)
    a0, b0 = hetlora_numpy(data, init["layer"], rounds=2)
    assert np.abs(a - a0).max() > 1e-3  # the proximal term matters at this mu
    layer = state.params["layer"]
    np.testing.assert_allclose(layer["lora_a"], a, rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose(layer["lora_b"], b, rtol=2e-4, atol=1e-5)
    zero, _ = run(prox(model.loss, mu=0.0, ranks=RANKS, **HET), model.init(None), data)
    plain, _ = run(hetlora_fedavg(model.loss, ranks=RANKS, **HET), model.init(None), data)
    jax.tree.map(np.testing.assert_array_equal, zero.params, plain.params)


def test_fedadam_with_hetlora_matches_numpy():
    """`with_rule(fedadam, "hetlora")`: the server's Adam (optax, bias-corrected) steps on
    HetLoRA's sparsity-weighted mean of the zero-padded modules."""
    model, init, data = lora_lsq()
    adam = (0.05, 0.9, 0.99, 1e-3)  # lr, b1, b2, eps (fedadam's defaults but the lr)
    alg = with_rule(fedadam, "hetlora")(model.loss, server_optimizer=adam[0], ranks=RANKS, **HET)
    state, metrics = run(alg, model.init(None), data, rounds=3)
    a, b = hetlora_numpy(data, init["layer"], rounds=3, adam=adam)
    layer = state.params["layer"]
    np.testing.assert_allclose(layer["lora_a"], a, rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose(layer["lora_b"], b, rtol=2e-4, atol=1e-5)
    np.testing.assert_array_equal(layer["kernel"], init["layer"]["kernel"])
    assert float(metrics["hetlora_rank"]) == RANKS.mean()


def test_fedadam_with_flora_reduces_to_fedavg_with_flora(setup):
    """FLoRA merges the stacked products at server learning rate 1 and resets the adapters,
    so a server Adam's step on them is discarded: FedAdam + FLoRA's models equal FedAvg +
    FLoRA's bit for bit, while Adam's moments (its state) do move."""
    data, model, params = setup
    ranks = np.array([1, 2, 1, 2])
    opts = dict(
        client_optimizer=0.5,
        local=LocalSpec(steps=2, batch_size=4),
        cohort=CohortSpec(size=M),
        partition=lora_partition(),
        ranks=ranks,
        scale=1.0,
    )
    fedadam_flora = with_rule(fedadam, "flora")
    adam, _ = run(fedadam_flora(model.loss, server_optimizer=0.01, **opts), params, data)
    plain, _ = run(flora_fedavg(model.loss, **opts), params, data)
    jax.tree.map(np.testing.assert_array_equal, adam.params, plain.params)
    _, base = split_adapters(params)
    _, moved = split_adapters(adam.params)
    assert any(np.any(moved[k] != v) for k, v in base.items())  # FLoRA moved the base
    moments = [x for x in jax.tree.leaves(adam.opt_state) if np.ndim(x) > 0]
    assert any(np.any(np.asarray(x) != 0) for x in moments)


def test_rules_need_a_preset_with_hooks():
    with pytest.raises(ValueError, match="fedbuff takes no hooks"):
        with_rule(fedbuff, "hetlora")
    with pytest.raises(ValueError, match="unknown LoRA rule 'bogus'"):
        with_rule(fedavg, "bogus")


MESH_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
from fedjax_sim.algorithms import CohortSpec, LocalSpec, fedavg
from fedjax_sim.algorithms.lora import lora_partition
from fedjax_sim.data import markov_tokens
from fedjax_sim.models import transformer
from fedjax_sim.runtime.distributed import place_run
from fedjax_sim.runtime.parallel import ClientMap, client_mesh

data, _ = markov_tokens(num_clients=8, examples_per_client=8, vocab_size=11, seq_len=8)
model = transformer((8,), 11, d_model=16, num_layers=1, num_heads=2, lora_rank=2)
params = model.init(jax.random.key(0))
mesh = client_mesh(2)
out = {}
for name, cmap, m in (("plain", ClientMap("map", 1), None),
                      ("map", ClientMap("map", 1, mesh=mesh), mesh),
                      ("vmap", ClientMap("vmap", mesh=mesh), mesh)):
    alg = fedavg(model.loss, client_optimizer=0.1, local=LocalSpec(steps=3, batch_size=4),
                 cohort=CohortSpec(size=4), client_map=cmap, partition=lora_partition())
    state, placed = alg.init(params, jax.random.key(0)), data
    if m is not None:  # as simulate(mesh=...) places a run
        state, placed = place_run(state, data, m)
    step = jax.jit(alg.step)
    for r in range(2):
        state, _ = step(state, placed, jax.random.key(r + 1))
    flat = jax.tree_util.tree_leaves_with_path(state.params)
    out.update({name + jax.tree_util.keystr(p): np.asarray(v) for p, v in flat})
np.savez(sys.argv[1], **out)
"""


def test_lora_on_a_mesh_of_2_devices_equals_1_device(script_npz):
    """LoRA FedAvg with the cohort sharded over 2 host devices (`lax.map` and vmap per
    device) against one device: the adapters agree to float32 rounding, the base (frozen,
    replicated) is untouched."""
    r = script_npz(MESH_SCRIPT)
    keys = [k[len("plain") :] for k in r.files if k.startswith("plain")]
    assert any("lora_b" in k for k in keys)
    for mode in ("map", "vmap"):
        for k in keys:
            np.testing.assert_allclose(r[mode + k], r["plain" + k], rtol=1e-5, atol=1e-6,
                                       err_msg=mode + k)  # fmt: skip
    moved = [k for k in keys if "lora_b" in k]
    assert all(np.abs(r["plain" + k]).max() > 0 for k in moved)  # B trained away from 0
