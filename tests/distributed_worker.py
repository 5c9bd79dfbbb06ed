"""Worker for tests/test_distributed.py (run in subprocesses with several CPU devices).

python tests/distributed_worker.py sharded OUT.npz
    4 virtual devices: sharded vs unsharded runs of the same algorithms.
python tests/distributed_worker.py personalized OUT.npz
    4 virtual devices: the personalized presets' params and personal models, both ways.
python tests/distributed_worker.py clock OUT.npz
    4 virtual devices: the virtual clock's features, sharded vs unsharded.
python tests/distributed_worker.py placement OUT.npz
    2 virtual devices: the shardings `place_run` gives a SCAFFOLD state and its data.
python tests/distributed_worker.py process PID NPROC PORT OUT.npz
    one process of a multi-process run (2 virtual devices per process, gloo collectives).
"""

import os
import sys
import tempfile

mode = sys.argv[1]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=" + (
    "4" if mode in ("sharded", "personalized", "clock") else "2"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from fedjax_sim.algorithms import CohortSpec, LocalSpec, fedavg, fedprox  # noqa: E402
from fedjax_sim.algorithms.area import area  # noqa: E402
from fedjax_sim.algorithms.core import local_train, minibatch  # noqa: E402
from fedjax_sim.algorithms.device_model import (  # noqa: E402
    DeviceModel,
    event_model,
    named_profiles,
)
from fedjax_sim.algorithms.events import Aggregation  # noqa: E402
from fedjax_sim.algorithms.fedbuff import fedbuff  # noqa: E402
from fedjax_sim.algorithms.partitioned import fedbabu, fedper, fedrep, lg_fedavg  # noqa: E402
from fedjax_sim.algorithms.personal_models import (  # noqa: E402
    apfl,
    ditto,
    fedavg_ft,
    per_fedavg,
    pfedme,
)
from fedjax_sim.algorithms.scaffold import scaffold  # noqa: E402
from fedjax_sim.data import least_squares  # noqa: E402
from fedjax_sim.models import linear_regression  # noqa: E402
from fedjax_sim.run.simulate import EvalSpec, simulate  # noqa: E402
from fedjax_sim.run.sweep import runs_mesh, sweep  # noqa: E402
from fedjax_sim.runtime import distributed  # noqa: E402
from fedjax_sim.runtime.parallel import ClientMap, client_mesh  # noqa: E402

ROUNDS = 4
# (algorithm, cohort, map mode): FedAvg, and FedProx (momentum client optimizer, proximal
# hook) with a cohort of 10 padded to 12 on 4 devices, in both map modes
CASES = [
    ("fedavg", "cohort8", "vmap"),
    ("fedprox", "cohort10", "vmap"),
    ("fedprox", "cohort10", "map2"),
    ("fedprox", "full", "map2"),
]


def problem():
    return least_squares(num_clients=16, examples_per_client=np.arange(3, 19), dim=3, seed=2)


def start_params(alg):
    """`w`; a personalized preset's model has a second factor `z` (`x @ (w * z)`): FedPer's
    personal head, LG-FedAvg's global head (the body `w` personal), FedBABU's frozen head."""
    params = {"w": jnp.ones(3)}
    if getattr(alg, "personalize", None) is not None:
        params["z"] = jnp.linspace(0.5, 1.5, 3)
    return params


def run(alg, data, rounds=ROUNDS, mesh=None, personal=False):
    """Final global model `w`; with a mesh, the data and every per-client state row `[C, ...]`
    are placed sharded over the clients axis (as `simulate(mesh=...)` does). With `personal`:
    (all global params raveled `[P]`, the 16 clients' personal models raveled `[16, P]`)."""
    key = jax.random.key(0)
    state = alg.init(start_params(alg), key)
    if mesh is not None:
        state, data = distributed.place_run(state, data, mesh)
    step = jax.jit(alg.step)
    for r in range(rounds):
        state, _ = step(state, data, jax.random.fold_in(key, r))
    if not personal:
        return np.asarray(state.params["w"])
    models = jax.jit(alg.personalize)(state, data, jnp.arange(16), jax.random.key(7))
    leaves = jax.tree.leaves(models)
    return (
        np.concatenate([np.ravel(a) for a in jax.tree.leaves(state.params)]),
        np.concatenate([np.asarray(a).reshape(16, -1) for a in leaves], axis=1),
    )


def stateful_algorithms(client_map):
    """Per-client state `[C, ...]` (SCAFFOLD's control variates) and asynchronous event
    algorithms (AREA's per-client memory, FedBuff), all with 16 clients."""
    model = linear_regression(3)
    local = LocalSpec(epochs=2, batch_size=4)
    events_kw = dict(
        num_clients=16,
        firing_probability=0.4,
        buffer_size=3,
        capacity=7,
        client_optimizer=0.05,
        local=LocalSpec(steps=2, batch_size=4),
        client_map=client_map,
    )
    return {
        "scaffold": scaffold(
            model.loss,
            num_clients=16,
            client_optimizer=0.05,
            local=local,
            cohort=CohortSpec(size=10),
            client_map=client_map,
        ),
        "area": area(model.loss, **events_kw),
        "fedbuff": fedbuff(model.loss, **events_kw),
    }


def clock_algorithms(client_map):
    """The virtual clock's features, 16 clients: over-selection (draw 10, keep the first 8
    to finish) with a 4 s deadline and partial work; cohorts of 6 drawn among the online
    phones (12 candidates); FedBuff firing from the phones' profiles with at most 4 clients
    training at once."""
    model = linear_regression(3)
    local = LocalSpec(epochs=2, batch_size=4)
    phones = named_profiles("phones", seed=1)
    return {
        "fedavg_clock": fedavg(
            model.loss,
            num_clients=16,
            client_optimizer=0.05,
            local=local,
            cohort=CohortSpec(size=8),
            device_model=DeviceModel(
                named_profiles("always_on"), deadline=4.0, late="partial", over_selection=1.25
            ),
            client_map=client_map,
        ),
        "fedavg_available": fedavg(
            model.loss,
            num_clients=16,
            client_optimizer=0.05,
            local=local,
            cohort=CohortSpec(size=6),
            device_model=DeviceModel(phones, cohort="available", candidates=2.0),
            client_map=client_map,
        ),
        "fedbuff_capped": fedbuff(
            model.loss,
            events=event_model(
                phones,
                16,
                steps=2,
                bytes_down=1e3,
                bytes_up=1e3,
                concurrency=4,
                aggregation=Aggregation.every(1),
                max_probability=0.5,
            ),
            client_optimizer=0.05,
            local=LocalSpec(steps=2, batch_size=4),
            client_map=client_map,
        ),
    }


def clock(out):
    """Final `w` of the clock's features (`clock_algorithms`), sharded and not."""
    data = problem().data
    mesh = client_mesh(4)
    results = {}
    for map_name, cmap in {"vmap": ClientMap("vmap"), "map2": ClientMap("map", 2)}.items():
        plain = clock_algorithms(cmap)
        shard = clock_algorithms(ClientMap(cmap.mode, cmap.batch_size, mesh=mesh))
        for name in plain:
            rounds = 20 if name == "fedbuff_capped" else 6  # ~9 deliveries in 20 iterations
            results[f"{name}/{map_name}/plain"] = run(plain[name], data, rounds=rounds)
            results[f"{name}/{map_name}/sharded"] = run(shard[name], data, rounds, mesh=mesh)
    np.savez(out, **results)


def personalized_algorithms(client_map):
    """Every personalized preset on the model `x @ (w * z)`, 16 clients, cohort 10."""
    loss = linear_regression(3).loss

    def wz(p, b):
        return loss({"w": p["w"] * p["z"]}, b)

    kw = dict(
        num_clients=16,
        client_optimizer=0.05,
        local=LocalSpec(epochs=2, batch_size=4),
        cohort=CohortSpec(size=10),
        client_map=client_map,
    )
    return {
        # personal rows: Ditto's v_i, APFL's (v_i, adaptive a_i), pFedMe's theta_i
        "ditto": ditto(wz, lam=0.5, **kw),
        "apfl": apfl(wz, mixing=0.25, adaptive=True, **kw),
        "pfedme": pfedme(wz, lam=5.0, personal_lr=0.02, inner_steps=2, **kw),
        # personal models fine-tuned from the global one; Per-FedAvg (HF): batches in thirds
        "per_fedavg_hf": per_fedavg(
            wz,
            inner_lr=0.02,
            variant="hf",
            adapt_steps=2,
            **dict(kw, local=LocalSpec(epochs=2, batch_size=6)),
        ),
        "fedavg_ft": fedavg_ft(wz, finetune_steps=2, **kw),
        # partitioned: personal head (FedPer, FedRep), personal body (LG-FedAvg), frozen head
        "fedper": fedper(wz, head="z", **kw),
        "lg_fedavg": lg_fedavg(wz, head="z", **kw),
        "fedrep": fedrep(wz, head="z", head_steps=2, **kw),
        "fedbabu": fedbabu(wz, head="z", finetune_steps=2, **kw),
    }


# (preset, map mode): every preset vmapped; Ditto's personal rows and FedPer's partition
# also through `lax.map` in groups of 2 (the map path is the same compose code for all)
PERSONALIZED = ["ditto", "apfl", "pfedme", "per_fedavg_hf", "fedavg_ft", "fedper", "lg_fedavg"]
PERSONALIZED += ["fedrep", "fedbabu"]
PERSONALIZED_CASES = [
    *((name, "vmap") for name in PERSONALIZED),
    ("ditto", "map2"),
    ("fedper", "map2"),
]


def personalized(out, rounds=6):
    """Global params and personal models of every personalized preset, sharded and not."""
    data = problem().data
    mesh = client_mesh(4)
    maps = {"vmap": ClientMap("vmap"), "map2": ClientMap("map", 2)}
    results = {"personal/init": np.concatenate([np.ones(3), np.linspace(0.5, 1.5, 3)])}
    for name, map_name in PERSONALIZED_CASES:
        cmap = maps[map_name]
        plain = personalized_algorithms(cmap)[name]
        shard = personalized_algorithms(ClientMap(cmap.mode, cmap.batch_size, mesh=mesh))[name]
        for label, alg, m in (("plain", plain, None), ("sharded", shard, mesh)):
            params, models = run(alg, data, rounds=rounds, mesh=m, personal=True)
            results[f"{name}/personal/{map_name}/{label}/params"] = params
            results[f"{name}/personal/{map_name}/{label}/models"] = models
    np.savez(out, **results)


def algorithms(client_map, cohort):
    model = linear_regression(3)
    local = LocalSpec(epochs=2, batch_size=4)
    return {
        "fedavg": fedavg(
            model.loss, client_optimizer=0.05, local=local, cohort=cohort, client_map=client_map
        ),
        "fedprox": fedprox(
            model.loss,
            mu=0.1,
            client_optimizer=optax.sgd(0.05, momentum=0.5),
            local=local,
            cohort=cohort,
            client_map=client_map,
        ),
    }


def sharded(out):
    data = problem().data
    mesh = client_mesh(4)
    results = {}
    cohorts = {"cohort8": CohortSpec(size=8), "cohort10": CohortSpec(size=10), "full": CohortSpec()}
    maps = {"vmap": ClientMap("vmap"), "map2": ClientMap("map", 2)}
    for name, cohort_name, map_name in CASES:
        cmap = maps[map_name]
        plain = algorithms(cmap, cohorts[cohort_name])[name]
        shard = algorithms(ClientMap(cmap.mode, cmap.batch_size, mesh=mesh), cohorts[cohort_name])[
            name
        ]
        results[f"{name}/{cohort_name}/{map_name}/plain"] = run(plain, data)
        results[f"{name}/{cohort_name}/{map_name}/sharded"] = run(shard, data)

    # per-client state and async event algorithms: state rows sharded over the devices,
    # the firing slots (7, padded to 8) and the cohort (10, padded to 12) mapped over them
    for map_name, cmap in maps.items():
        plain = stateful_algorithms(cmap)
        shard = stateful_algorithms(ClientMap(cmap.mode, cmap.batch_size, mesh=mesh))
        for name in plain:
            results[f"{name}/stateful/{map_name}/plain"] = run(plain[name], data, rounds=6)
            results[f"{name}/stateful/{map_name}/sharded"] = run(
                shard[name], data, rounds=6, mesh=mesh
            )
    # the pitfall: a gradient step inside shard_map WITHOUT pcast silently sums the gradient
    # of the replicated params over devices; local_train under ClientMap(mesh) does not
    model = linear_regression(3)
    params = {"w": jnp.ones(3)}
    ids = jnp.arange(8)

    def gd_step(cid):
        batch = minibatch(data.client(cid), jax.random.key(0), 0, 1, "full")
        grads = jax.grad(model.loss)(params, batch)
        return params["w"] - 0.05 * grads["w"]

    def train(cid):
        return local_train(
            params,
            data.client(cid),
            jax.random.key(0),
            loss_fn=model.loss,
            optimizer=optax.sgd(0.05),
            max_steps=1,
            sampling="full",
        ).params["w"]

    naive = jax.jit(
        jax.shard_map(
            jax.vmap(gd_step), mesh=mesh, in_specs=jax.P("clients"), out_specs=jax.P("clients")
        )
    )(ids)
    results["pitfall/naive"] = np.asarray(naive)
    results["pitfall/clientmap"] = np.asarray(
        jax.jit(lambda i: ClientMap("vmap", mesh=mesh).map(train, i))(ids)
    )
    results["pitfall/reference"] = np.asarray(jax.vmap(gd_step)(ids))

    # simulate with a mesh: data/state placed by client, outputs identical to a plain run
    alg_plain = algorithms(ClientMap("vmap"), CohortSpec(size=8))["fedavg"]
    alg_shard = algorithms(ClientMap("vmap", mesh=mesh), CohortSpec(size=8))["fedavg"]
    kw = dict(
        model=model,
        num_rounds=6,
        params={"w": jnp.ones(3)},
        evaluation=EvalSpec(every=3, train=True),
        progress=False,
    )
    h_plain = simulate(alg_plain, data, jax.random.key(3), **kw)
    h_shard = simulate(alg_shard, data, jax.random.key(3), mesh=mesh, **kw)
    results["simulate/plain"] = np.asarray(h_plain.metric("train_loss"))
    results["simulate/sharded"] = np.asarray(h_shard.metric("train_loss"))
    results["simulate/plain_eval"] = np.array([e["train_objective"] for e in h_plain.evals])
    results["simulate/sharded_eval"] = np.array([e["train_objective"] for e in h_shard.evals])

    # a sweep with its runs sharded over 4 devices: 5 SCAFFOLD runs (padded to 8) x a grid
    # of client learning rates, vs the same sweep on one device
    def make(hp):
        return scaffold(
            model.loss,
            num_clients=16,
            client_optimizer=hp["lr"],
            local=LocalSpec(steps=2, batch_size=4),
            cohort=CohortSpec(size=6),
            client_map=ClientMap("vmap"),
        )

    sweep_kw = dict(seeds=[0, 1, 2, 3, 4], grid={"lr": [0.05]}, **kw)
    for label, m in (("plain", None), ("sharded", runs_mesh(4))):
        res = sweep(make, data, mesh=m, **sweep_kw)
        results[f"sweep/{label}/train_loss"] = np.stack(
            [h.metric("train_loss") for h in res.histories]
        )
        results[f"sweep/{label}/w"] = np.asarray(res.states.params["w"])
        results[f"sweep/{label}/devices"] = np.asarray(res.meta["devices"])
    # interrupted after 3 of 6 rounds and resumed: checkpoints hold the 5 real runs, the
    # padding copies are rebuilt on resume
    ckpt = tempfile.mkdtemp()
    resumed_kw = dict(sweep_kw, mesh=runs_mesh(4), checkpoint_dir=ckpt, checkpoint_every=3)
    sweep(make, data, **dict(resumed_kw, num_rounds=3))
    res = sweep(make, data, resume=True, **resumed_kw)
    results["sweep/resumed/train_loss"] = np.stack([h.metric("train_loss") for h in res.histories])
    results["sweep/resumed/w"] = np.asarray(res.states.params["w"])
    np.savez(out, **results)


def placement(out):
    """A linear model on 16 features for 16 clients: its parameter `w` `[16]` has C rows by
    shape only and must be replicated, while SCAFFOLD's control variates `[C, 16]` and the data
    are sharded. Also the final model of 3 rounds on the placed state vs on one device."""
    mesh = client_mesh(2)
    data = least_squares(num_clients=16, examples_per_client=np.arange(3, 19), dim=16, seed=2).data
    key = jax.random.key(0)

    def make(client_map):
        return scaffold(
            linear_regression(16).loss,
            num_clients=16,
            client_optimizer=0.05,
            local=LocalSpec(steps=2, batch_size=4),
            cohort=CohortSpec(size=6),
            client_map=client_map,
        )

    runs = {}
    for label, cmap in (("plain", ClientMap("vmap")), ("sharded", ClientMap("vmap", mesh=mesh))):
        alg = make(cmap)
        state, run_data = alg.init({"w": jnp.ones(16)}, key), data
        if label == "sharded":
            state, run_data = distributed.place_run(state, data, mesh)
            leaves = {
                "params": state.params["w"],
                "control_variates": state.rows["control_variates"]["w"],
                "server_control": state.hooks["control_variates"]["w"],
                "data_x": run_data.x,
                "data_counts": run_data.counts,
            }
            specs = {f"spec/{k}": np.asarray(str(v.sharding.spec)) for k, v in leaves.items()}
        step = jax.jit(alg.step)
        for r in range(3):
            state, _ = step(state, run_data, jax.random.fold_in(key, r))
        runs[f"w/{label}"] = np.asarray(state.params["w"])
    np.savez(out, **specs, **runs)


def process(pid, nproc, port, out):
    distributed.initialize(f"localhost:{port}", nproc, pid)
    mesh = client_mesh()  # every device of every process
    full = problem().data
    data = distributed.globalize(
        distributed.local_rows(full, mesh, 16, all_rows=True), mesh, 16, all_rows=True
    )
    model = linear_regression(3)
    alg = algorithms(ClientMap("vmap", mesh=mesh), CohortSpec(size=10))["fedprox"]
    hist = simulate(
        alg,
        data,
        jax.random.key(0),
        model=model,
        num_rounds=ROUNDS,
        params={"w": jnp.ones(3)},
        evaluation=EvalSpec(every=2),
        progress=False,
        mesh=mesh,
    )
    state = alg.init({"w": jnp.ones(3)}, jax.random.key(0))
    state = distributed.place(state, mesh, 16)
    step = jax.jit(alg.step)
    for _ in range(ROUNDS):
        state, _ = step(state, data, jax.random.key(0))
    w = distributed.fetch(state.params["w"])
    if pid == 0:
        np.savez(
            out,
            w=w,
            devices=jax.device_count(),
            processes=jax.process_count(),
            train_loss=np.asarray(hist.metric("train_loss")),
        )


if __name__ == "__main__":
    if mode == "sharded":
        sharded(sys.argv[2])
    elif mode == "personalized":
        personalized(sys.argv[2])
    elif mode == "clock":
        clock(sys.argv[2])
    elif mode == "placement":
        placement(sys.argv[2])
    else:
        process(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
