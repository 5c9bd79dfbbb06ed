"""Parameter partitions (`algorithms.partition`): shared leaves train and travel, personal
leaves train and stay on their client as rows, frozen leaves neither. Against an independent
NumPy loop (float64, cohorts, full-batch local steps); personal values never reach the server
(payload 0, server state without them); host-streamed rows equal rows on device; the
default (no partition) path is pinned by tests/test_run_loop.py and the golden tests."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_sim import EvalSpec
from fedjax_sim.algorithms import fedavg, fedprox, scaffold
from fedjax_sim.algorithms.core import COHORT, CohortSpec, LocalSpec, round_key
from fedjax_sim.algorithms.partition import Partition, by_path
from fedjax_sim.core.rows import Rows
from fedjax_sim.data import least_squares
from fedjax_sim.data.store import ClientStore
from fedjax_sim.models import Model
from fedjax_sim.run.streaming import AlgorithmCohorts, simulate_streamed

C, M, K, ROUNDS = 10, 3, 4, 5
BLOCKS = {"body": slice(0, 2), "head": slice(2, 4), "base": slice(4, 6)}
LABELS = {"body": "shared", "head": "personal", "base": "frozen"}


W0 = np.array([0.3, -0.2, 0.5, 0.1, -0.4, 0.7])


def split(w):
    return {k: jnp.asarray(w[s]) for k, s in BLOCKS.items()}


BLOCK_MODEL = Model(  # least squares on the concatenation [body, head, base] (6 features)
    init=lambda key: split(W0),
    apply=lambda p, x: x @ jnp.concatenate([p["body"], p["head"], p["base"]]),
    loss_kind="squared",
    name="blocks",
)
loss = BLOCK_MODEL.loss


@pytest.fixture(scope="module")
def problem():
    return least_squares(num_clients=C, examples_per_client=np.arange(3, 3 + C), dim=6, seed=2)


def numpy_partitioned(problem, cohorts, lr, server_lr):
    """FedAvg where the head is personal (client rows) and the base frozen: full-batch GD on
    every trainable block from (x's body, the client's head, x's base); the server averages
    the body updates (uniform weights)."""
    h, lin = problem.hessians, problem.linear
    x = W0.copy()
    heads = np.tile(W0[BLOCKS["head"]], (C, 1))
    for ids in cohorts:
        deltas = []
        for i in ids:
            y = x.copy()
            y[BLOCKS["head"]] = heads[i]
            for _ in range(K):
                g = h[i] @ y - lin[i]
                g[BLOCKS["base"]] = 0.0
                y = y - lr * g
            deltas.append(y[BLOCKS["body"]] - x[BLOCKS["body"]])
            heads[i] = y[BLOCKS["head"]]
        x[BLOCKS["body"]] += server_lr * np.mean(deltas, axis=0)
    return x, heads


def run(alg, problem, key, rounds=ROUNDS):
    state = alg.init(split(W0), key)
    step = jax.jit(alg.step)
    for _ in range(rounds):
        state, metrics = step(state, problem.data, key)
    return state, metrics


def test_personal_head_frozen_base_match_numpy(x64, problem):
    cohort = CohortSpec(size=M, weighting="uniform")
    alg = fedavg(
        loss,
        num_clients=C,
        client_optimizer=0.05,
        server_optimizer=0.8,
        local=LocalSpec(steps=K, sampling="full"),
        cohort=cohort,
        partition=Partition(LABELS),
    )
    key = jax.random.key(5)
    state, metrics = run(alg, problem, key)
    cohorts = [
        np.asarray(cohort.sample(round_key(key, jnp.int32(t), COHORT), problem.data.counts)[0])
        for t in range(ROUNDS)
    ]
    x, heads = numpy_partitioned(problem, cohorts, 0.05, 0.8)
    for k, s in BLOCKS.items():
        np.testing.assert_allclose(state.params[k], x[s] if k != "head" else W0[s], rtol=1e-12)
    np.testing.assert_allclose(state.rows["personal"]["head"], heads, rtol=1e-10, atol=1e-12)
    never = set(range(C)) - set(np.concatenate(cohorts))
    assert never and all(np.all(heads[i] == W0[BLOCKS["head"]]) for i in never)
    # personal leaves never leave the client, frozen ones are not sent each round: the payload
    # is the 2 float64 coordinates of the body, both ways
    assert float(metrics["bytes_up"]) == M * 2 * 8
    assert float(metrics["bytes_down"]) == M * 2 * 8
    # personal models: the global body and base with each client's own head
    ids = jnp.array([4, 0, 9])
    own = alg.personalize(state, problem.data, ids, key)
    for j, i in enumerate(np.asarray(ids)):
        np.testing.assert_array_equal(own["head"][j], state.rows["personal"]["head"][i])
        np.testing.assert_array_equal(own["body"][j], state.params["body"])
        np.testing.assert_array_equal(own["base"][j], W0[BLOCKS["base"]])


def test_server_state_holds_no_personal_leaf(problem):
    """With a stateful server optimizer (Adam) and a stateful hook (SCAFFOLD): the server's
    optimizer state has leaves for the shared body only, the hooks' rows and server state
    cover the trainable leaves (no frozen base), and the server's head is the initial one
    (every client's personal head differs from it)."""
    alg = scaffold(
        loss,
        num_clients=C,
        server_optimizer=optax.adam(0.05),
        local=LocalSpec(steps=K, batch_size=4),
        cohort=CohortSpec(size=C),
        partition=Partition(LABELS),
    )
    state, _ = run(alg, problem, jax.random.key(1), rounds=3)
    shapes = {
        jax.tree_util.keystr(p): np.shape(v)
        for p, v in jax.tree_util.tree_leaves_with_path(state.opt_state)
    }
    assert shapes and all("body" in p for p in shapes if shapes[p] == (2,)), shapes
    assert not any("head" in p or "base" in p for p in shapes), shapes
    variates = state.rows["control_variates"].value
    assert isinstance(variates["base"], optax.MaskedNode)
    assert variates["body"].shape == (C, 2) and variates["head"].shape == (C, 2)
    np.testing.assert_array_equal(state.params["head"], np.float32(W0[BLOCKS["head"]]))
    np.testing.assert_array_equal(state.params["base"], np.float32(W0[BLOCKS["base"]]))
    heads = np.asarray(state.rows["personal"]["head"])
    assert np.all(np.abs(heads - W0[BLOCKS["head"]]).max(axis=1) > 1e-4)
    assert np.any(np.asarray(state.params["body"]) != np.float32(W0[BLOCKS["body"]]))


def test_fedprox_anchor_is_the_clients_own_start(x64, problem):
    """FedProx's proximal term pulls each trainable leaf toward the client's start: the
    personal head toward its own row, with mu so large that one step cannot move it."""
    alg = fedprox(
        loss,
        mu=1e6,
        num_clients=C,
        client_optimizer=1e-9,
        local=LocalSpec(steps=2, sampling="full"),
        cohort=CohortSpec(size=C),
        partition=by_path(personal="head"),
    )
    state, _ = run(alg, problem, jax.random.key(0), rounds=2)
    np.testing.assert_allclose(
        state.rows["personal"]["head"], np.tile(W0[BLOCKS["head"]], (C, 1)), atol=1e-6
    )


@functools.cache
def _streamed_alg():
    return fedavg(
        loss,
        num_clients=C,
        local=LocalSpec(steps=2, batch_size=4),
        cohort=CohortSpec(size=M),
        partition=Partition(LABELS),
    )


def test_personal_rows_stream_from_the_host(problem):
    """`simulate_streamed(state_rows="host")` keeps the personal rows on the host: the same
    history and final state as the all-on-device run."""
    alg = _streamed_alg()
    store = ClientStore.from_federated(problem.data)
    key = jax.random.key(3)
    kw = dict(
        num_rounds=4,
        evaluation=EvalSpec(every=2, clients=False),
        progress=False,
        return_state=True,
        model=BLOCK_MODEL,
        params=split(W0),
    )
    plan = AlgorithmCohorts(CohortSpec(size=M), store.counts)
    h_dev, s_dev = simulate_streamed(alg, store, key, plan=plan, state_rows="device", **kw)
    h_host, s_host = simulate_streamed(alg, store, key, plan=plan, state_rows="host", **kw)
    for k in h_dev.metrics:
        np.testing.assert_array_equal(np.asarray(h_dev.metrics[k]), np.asarray(h_host.metrics[k]))
    for a, b in zip(jax.tree.leaves(s_dev), jax.tree.leaves(s_host), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert isinstance(s_host.rows["personal"], Rows)


def test_bad_partitions_are_refused_before_any_work():
    params = split(W0)
    with pytest.raises(ValueError, match="one of"):
        Partition({"body": "shared", "head": "mine", "base": "frozen"}).of(params)
    with pytest.raises(ValueError, match="structure"):
        Partition({"body": "shared"}).of(params)
    with pytest.raises(ValueError, match="trainable"):
        Partition(dict.fromkeys(params, "frozen")).of(params)
    with pytest.raises(ValueError, match="matches no parameter"):
        by_path(personal="Dense_9").of(params)
    with pytest.raises(ValueError, match="both personal and frozen"):
        by_path(personal="head", frozen="h").of(params)
    with pytest.raises(TypeError, match="Partition"):
        fedavg(loss, partition=LABELS)
    with pytest.raises(ValueError, match="distinct cohort ids"):
        fedavg(
            loss,
            num_clients=C,
            cohort=CohortSpec(size=M, sampling="proportional"),
            partition=Partition(LABELS),
        ).init(params, jax.random.key(0))


def test_a_hook_finalize_may_move_frozen_leaves(problem):
    """`RoundSummary.model` holds the frozen leaves; a `finalize` returning them moves them
    (FLoRA's merge into the base); the clients still never train them."""
    from fedjax_sim.algorithms.compose import ClientWork, compose
    from fedjax_sim.algorithms.local_hook import LocalHook, chain

    def finalize(server, summary, server_step):
        new = server_step(summary.update)
        return server, {**new, "base": summary.model["base"] + 1.0}, {}

    work = ClientWork(
        loss,
        local=LocalSpec(steps=1, sampling="full"),
        hook=chain(LocalHook("mover", finalize=finalize)),
        partition=Partition({"body": "shared", "head": "shared", "base": "frozen"}),
    )
    alg = compose(work, cohort=CohortSpec(size=M))
    state = alg.init(split(W0), jax.random.key(0))
    state, _ = alg.step(state, problem.data, jax.random.key(1))
    np.testing.assert_allclose(state.params["base"], W0[BLOCKS["base"]] + 1.0, rtol=1e-6)
