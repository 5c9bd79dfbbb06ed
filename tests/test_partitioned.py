"""FedPer, LG-FedAvg and FedRep (`algorithms.partitioned`): FedRep against an independent
NumPy loop (float64, cohorts, full-batch local steps); the head found on an MLP; bad heads
refused before any work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_param_partition import BLOCKS, W0, C, loss, split

from fedjax_sim.algorithms.core import COHORT, CohortSpec, LocalSpec, round_key
from fedjax_sim.algorithms.partitioned import fedbabu, fedper, fedrep, head_and_body, lg_fedavg
from fedjax_sim.data import least_squares
from fedjax_sim.models import mlp


def numpy_fedrep(problem, cohorts, lr, steps, head_steps, server_lr):
    """Collins et al. Algorithm 1 with full-batch GD: the personal head ("head" and "base"
    blocks) for `head_steps` steps, then the shared body for the rest; uniform mean."""
    h, lin = problem.hessians, problem.linear
    body, rest = BLOCKS["body"], np.r_[2:6]
    x = W0.copy()
    heads = np.tile(W0[rest], (C, 1))
    for ids in cohorts:
        deltas = []
        for i in ids:
            y = x.copy()
            y[rest] = heads[i]
            for k in range(steps):
                g = h[i] @ y - lin[i]
                if k < head_steps:
                    g[body] = 0.0
                else:
                    g[rest] = 0.0
                y = y - lr * g
            deltas.append(y[body] - x[body])
            heads[i] = y[rest]
        x[body] += server_lr * np.mean(deltas, axis=0)
    return x, heads


def test_fedrep_matches_numpy(x64):
    problem = least_squares(num_clients=C, examples_per_client=np.arange(3, 3 + C), dim=6, seed=7)
    cohort = CohortSpec(size=4, weighting="uniform")
    steps, head_steps, rounds = 5, 3, 4
    alg = fedrep(
        loss,
        head="head|base",
        head_steps=head_steps,
        num_clients=C,
        client_optimizer=0.07,
        server_optimizer=0.9,
        local=LocalSpec(steps=steps, sampling="full"),
        cohort=cohort,
    )
    key = jax.random.key(2)
    state = alg.init(split(W0), key)
    step = jax.jit(alg.step)
    for _ in range(rounds):
        state, metrics = step(state, problem.data, key)
    cohorts = [
        np.asarray(cohort.sample(round_key(key, jnp.int32(t), COHORT), problem.data.counts)[0])
        for t in range(rounds)
    ]
    x, heads = numpy_fedrep(problem, cohorts, 0.07, steps, head_steps, 0.9)
    np.testing.assert_allclose(state.params["body"], x[BLOCKS["body"]], rtol=1e-10)
    got = np.concatenate([state.rows["personal"]["head"], state.rows["personal"]["base"]], 1)
    np.testing.assert_allclose(got, heads, rtol=1e-10, atol=1e-12)
    assert float(metrics["bytes_up"]) == 4 * 2 * 8  # the body only
    # FedRep with head_steps = 0 moves only the body: the heads keep their start
    body_only = fedrep(
        loss,
        head="head|base",
        head_steps=0,
        num_clients=C,
        local=LocalSpec(steps=steps, sampling="full"),
        cohort=cohort,
    )
    s = jax.jit(body_only.step)(body_only.init(split(W0), key), problem.data, key)[0]
    np.testing.assert_array_equal(s.rows["personal"]["head"], np.tile(W0[2:4], (C, 1)))
    with pytest.raises(ValueError, match="leaves the body no step"):
        fedrep(loss, head_steps=steps, local=LocalSpec(steps=steps))


def test_fedbabu_matches_numpy(x64):
    """The head ("head" and "base" blocks) stays at its initialisation, the body follows
    full-batch FedAvg; personal models: 3 full-batch GD steps on the whole model."""
    problem = least_squares(num_clients=C, examples_per_client=np.arange(3, 3 + C), dim=6, seed=5)
    h, lin = problem.hessians, problem.linear
    cohort = CohortSpec(size=C, weighting="uniform")
    lr, steps = 0.06, 3
    alg = fedbabu(
        loss,
        head="head|base",
        finetune_steps=steps,
        num_clients=C,
        client_optimizer=lr,
        local=LocalSpec(steps=steps, sampling="full"),
        cohort=cohort,
    )
    key = jax.random.key(4)
    state = alg.init(split(W0), key)
    for _ in range(3):
        state, metrics = jax.jit(alg.step)(state, problem.data, key)
    x = W0.copy()
    for _ in range(3):
        deltas = []
        for i in range(C):
            y = x.copy()
            for _ in range(steps):
                g = h[i] @ y - lin[i]
                y[BLOCKS["body"]] -= lr * g[BLOCKS["body"]]
            deltas.append(y - x)
        x = x + np.mean(deltas, axis=0)
    np.testing.assert_allclose(state.params["body"], x[BLOCKS["body"]], rtol=1e-10)
    np.testing.assert_array_equal(state.params["head"], W0[BLOCKS["head"]])
    assert float(metrics["bytes_up"]) == C * 2 * 8
    ids = jnp.array([1, 7])
    own = alg.personalize(state, problem.data, ids, key)
    for j, i in enumerate([1, 7]):
        y = x.copy()
        for _ in range(steps):
            y = y - lr * (h[i] @ y - lin[i])
        got = np.concatenate([own[k][j] for k in ("body", "head", "base")])
        np.testing.assert_allclose(got, y, rtol=1e-10)


def test_head_of_an_mlp_and_lg_fedavg():
    model = mlp((8,), 3, hidden=(5, 4))
    params = model.init(jax.random.key(0))
    labels = head_and_body(None, head_label="personal", body_label="shared").of(params)
    assert labels["Dense_2"] == {"bias": "personal", "kernel": "personal"}
    assert labels["Dense_0"]["kernel"] == labels["Dense_1"]["bias"] == "shared"
    wrapped = head_and_body(None, head_label="personal", body_label="shared").of(
        {"params": {f"Dense_{i}": {"w": jnp.zeros(2)} for i in range(12)}}
    )
    assert wrapped["params"]["Dense_11"]["w"] == "personal"  # natural order: 11 > 2
    assert wrapped["params"]["Dense_2"]["w"] == "shared"
    problem = least_squares(num_clients=C, dim=8, seed=0)
    data = problem.data
    alg = lg_fedavg(
        model.loss, num_clients=C, cohort=CohortSpec(size=3), local=LocalSpec(steps=2, batch_size=4)
    )
    key = jax.random.key(0)
    state, metrics = jax.jit(alg.step)(alg.init(params, key), data, key)
    assert set(state.rows["personal"].value) == {"Dense_0", "Dense_1", "Dense_2"}
    head_bytes = 4 * (4 * 3 + 3)  # float32 Dense_2 travels, the body stays
    assert float(metrics["bytes_up"]) == 3 * head_bytes
    np.testing.assert_array_equal(state.params["Dense_0"]["kernel"], params["Dense_0"]["kernel"])


def test_bad_heads_are_refused():
    params = split(W0)
    with pytest.raises(ValueError, match="matches no parameter"):
        fedper(loss, head="Dense_9", num_clients=C).init(params, jax.random.key(0))
    with pytest.raises(ValueError, match="last layer"):
        fedper(loss, num_clients=C).init({"w": jnp.zeros(3)}, jax.random.key(0))
    with pytest.raises(ValueError, match="sets the partition itself"):
        fedper(loss, partition=head_and_body(None, head_label="frozen", body_label="shared"))
    with pytest.raises(ValueError, match="head_steps"):
        fedrep(loss, head_steps=-1)
    with pytest.raises(ValueError, match="give head_steps"):
        fedrep(loss, local=LocalSpec(epochs=1))
    fedrep(loss, local=LocalSpec(steps=1))  # default: the body's ceil(1 / 11) = 1 step


@pytest.mark.parametrize("name", ["fedrep", "lg_fedavg", "fedbabu"])
def test_streamed_equals_simulate(name):
    """FedRep's personal head and LG-FedAvg's personal body stream from the host
    (`state_rows="host"`), FedBABU (no rows: its head is frozen) with device rows: the same
    final state and personal models as `simulate`, bit for bit."""
    from test_param_partition import BLOCK_MODEL, M

    from fedjax_sim.data.store import ClientStore
    from fedjax_sim.run.simulate import EvalSpec, simulate
    from fedjax_sim.run.streaming import AlgorithmCohorts, simulate_streamed

    data = least_squares(num_clients=C, examples_per_client=np.arange(3, 3 + C), dim=6, seed=2).data
    kw = dict(num_clients=C, local=LocalSpec(steps=2, batch_size=4), cohort=CohortSpec(size=M))
    alg = {
        "fedrep": lambda: fedrep(loss, head="head", head_steps=1, **kw),
        "lg_fedavg": lambda: lg_fedavg(loss, head="head", **kw),
        "fedbabu": lambda: fedbabu(loss, head="head", finetune_steps=2, **kw),
    }[name]()
    key = jax.random.key(4)
    common = dict(model=BLOCK_MODEL, num_rounds=3, progress=False, return_state=True)
    evaluation = EvalSpec(every=3, central=False, clients=False)
    _, on_device = simulate(alg, data, key, evaluation=evaluation, **common)
    store = ClientStore.from_federated(data)
    plan = AlgorithmCohorts(kw["cohort"], store.counts)
    rows = "device" if name == "fedbabu" else "host"
    _, streamed = simulate_streamed(
        alg, store, key, plan=plan, state_rows=rows, evaluation=evaluation, **common
    )
    for a, b in zip(jax.tree.leaves(on_device), jax.tree.leaves(streamed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ids = jnp.arange(C)
    mine = jax.jit(alg.personalize)(on_device, data, ids, key)
    theirs = jax.jit(alg.personalize)(streamed, data, ids, key)
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
