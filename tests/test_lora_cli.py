"""Federated LoRA from the command line (issue 39): `--pretrained` (a user's checkpoint as the
run's initial model, bit for bit, and its refusals), `--lora-rule hetlora|flora` with
`--lora-ranks` on FedAvg, FedProx and FedAdam (the CLI run equals the run built from the
hooks; bad values refused up front), and `bytes_up` of heterogeneous ranks: each client's
true rank, derived here from the shapes."""

import json

import jax
import numpy as np
import optax
import pytest

from fedjax_sim import data
from fedjax_sim.algorithms.client_work import ClientWork
from fedjax_sim.algorithms.compose import compose
from fedjax_sim.algorithms.core import CohortSpec, LocalSpec, Stragglers
from fedjax_sim.algorithms.device_model import (
    PROFILES,
    DeviceModel,
    ProceduralProfiles,
    constant,
)
from fedjax_sim.algorithms.hooks import proximal
from fedjax_sim.algorithms.local_hook import chain
from fedjax_sim.algorithms.lora import device_class_ranks, flora, hetlora, lora_partition
from fedjax_sim.app import validate
from fedjax_sim.app.cli import main
from fedjax_sim.app.config import RunConfig, algorithm_kwargs, build_run, device_profiles
from fedjax_sim.core.checks import UsageError
from fedjax_sim.models import transformer
from fedjax_sim.models.transformer import lora_scale, save_params
from fedjax_sim.run.differentiate import initial_params
from fedjax_sim.run.evaluation import evaluate_central
from fedjax_sim.run.simulate import EvalSpec, simulate
from fedjax_sim.runtime.parallel import ClientMap

C, M, ROUNDS, STEPS, BATCH = 4, 2, 2, 1, 4
RUN = ["run", "--dataset", "markov_tokens", "--model", "transformer", "--num-clients", str(C)]
RUN += ["--cohort-size", str(M), "--rounds", str(ROUNDS), "--eval-every", str(ROUNDS)]
RUN += ["--local-steps", str(STEPS), "--batch-size", str(BATCH), "--client-map", "vmap"]
RUN += ["--no-progress"]


def _task():
    train, test = data.load("markov_tokens", num_clients=C, seed=0)[:2]
    return train, test


def _flat(params):
    return {
        jax.tree_util.keystr(p): np.asarray(v)
        for p, v in jax.tree_util.tree_leaves_with_path(params)
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A base transformer of the CLI's sizes, trained away from its initialisation (so a
    fresh init could not pass for it), saved as a flax msgpack file."""
    train, _ = _task()
    base = transformer(train.x.shape[2:], int(np.max(train.y)) + 1)
    params = base.init(jax.random.key(123))
    params = jax.tree.map(lambda w: w + 0.01 * np.arange(w.size).reshape(w.shape) % 0.3, params)
    path = tmp_path_factory.mktemp("ckpt") / "base.msgpack"
    save_params(path, params)
    return str(path), params


# ------------------------------------------------------------------------------ --pretrained
@pytest.mark.parametrize("lora_rank", [None, 2])
def test_pretrained_is_the_initial_model_bit_for_bit(checkpoint, lora_rank):
    path, saved = checkpoint
    cfg = RunConfig(dataset="markov_tokens", model="transformer", num_clients=C, cohort_size=M,
                    pretrained=path, lora_rank=lora_rank)  # fmt: skip
    _, model, _, _ = build_run(cfg)
    start = _flat(initial_params(model, jax.random.key(cfg.seed)))  # what `simulate` starts from
    for k, v in _flat(saved).items():
        assert start[k].dtype == v.dtype
        np.testing.assert_array_equal(start[k], v, err_msg=k)
    adapters = {k: v for k, v in start.items() if "lora_" in k}
    assert bool(adapters) == (lora_rank is not None)
    assert all(not v.any() for k, v in adapters.items() if "lora_b" in k)  # starts as the base


def test_pretrained_run_end_to_end(checkpoint, tmp_path, monkeypatch, capsys):
    """The CLI run with LoRA on the checkpoint: its round-0 evaluation is the saved base
    model's (B = 0: the LoRA model computes the base exactly)."""
    path, saved = checkpoint
    monkeypatch.chdir(tmp_path)
    assert main([*RUN, "--lora-rank", "2", "--pretrained", path, "--out", "out"]) == 0
    assert f"initial model from {path}" in capsys.readouterr().out
    hist = json.loads((tmp_path / "out" / "history.json").read_text())
    assert hist["meta"]["config"]["pretrained"] == path
    train, test = _task()
    base = transformer(train.x.shape[2:], int(np.max(train.y)) + 1)
    first = hist["eval"][0]
    assert first["round"] == 0
    expected = evaluate_central(base, saved, test)
    for name in ("test_loss", "test_accuracy"):
        assert first[name] == pytest.approx(float(expected[name]), rel=1e-6), name


def _refused(capsys, args, *words):
    assert main([*args, "--out", "never"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err


def test_pretrained_refusals(checkpoint, tmp_path, monkeypatch, capsys):
    path, saved = checkpoint
    monkeypatch.chdir(tmp_path)
    _refused(capsys, [*RUN, "--pretrained", "nowhere.msgpack"], "--pretrained", "no such file")
    _refused(capsys, [*RUN, "--pretrained", path, "--model", "mlp"], "--model transformer")
    small = transformer((8,), 16, d_model=32).init(jax.random.key(0))
    save_params(tmp_path / "small.msgpack", small)
    shape = "block_0/key/bias: checkpoint shape (32,) != model (64,)"  # leaf and both shapes
    _refused(capsys, [*RUN, "--pretrained", "small.msgpack"], "--pretrained small.msgpack", shape)
    (tmp_path / "junk.msgpack").write_bytes(b"not a checkpoint")
    _refused(capsys, [*RUN, "--pretrained", "junk.msgpack"], "not a readable checkpoint")
    assert not (tmp_path / "never").exists()


# ------------------------------------------------------------------------------ --lora-rule
RANKS = (1, 2)  # clients 0, 2: rank 1; clients 1, 3: rank 2


MU, SERVER_LR = 0.3, 0.05  # --mu of fedprox, --server-lr of fedadam


def _api_run(rule, rank, alpha, train, test, algorithm="fedavg"):
    """The run built directly from the hooks (the rule's first, then FedProx's proximal term)
    and the server optimizer (FedAdam's optax Adam), the CLI's defaults spelled out."""
    model = transformer(train.x.shape[2:], int(np.max(train.y)) + 1, lora_rank=rank,
                        lora_alpha=alpha, lora_targets=("query", "value"))  # fmt: skip
    ranks = np.asarray(RANKS)[np.arange(C) % len(RANKS)]
    hooks = [hetlora(ranks) if rule == "hetlora" else flora(ranks, lora_scale(rank, alpha))]
    if algorithm == "fedprox":
        hooks.append(proximal(MU))
    server = optax.adam(SERVER_LR, b1=0.9, b2=0.99, eps=1e-3) if algorithm == "fedadam" else 1.0
    work = ClientWork(
        model.loss,
        client_optimizer=0.1,
        local=LocalSpec(steps=STEPS, batch_size=BATCH),
        hook=chain(*hooks),
        stragglers=Stragglers(policy="partial" if algorithm == "fedprox" else "drop"),
        partition=lora_partition(),
    )
    alg = compose(work, num_clients=C, cohort=CohortSpec(size=M), client_map=ClientMap("vmap"),
                  server_optimizer=server)  # fmt: skip
    return simulate(alg, train, jax.random.key(0), model=model, num_rounds=ROUNDS, test=test,
                    evaluation=EvalSpec(every=ROUNDS), progress=False,
                    client_map=ClientMap("vmap"))  # fmt: skip


@pytest.mark.parametrize(
    "rule, algorithm", [("hetlora", "fedavg"), ("flora", "fedavg"), ("hetlora", "fedprox"),
                        ("hetlora", "fedadam")]
)  # fmt: skip
def test_cli_rule_equals_the_hooks(rule, algorithm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [*RUN, "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "query", "value"]
    args += ["--lora-rule", rule, "--lora-ranks", *map(str, RANKS), "--out", "out"]
    args += ["--algorithm", algorithm]
    args += {"fedprox": ["--mu", str(MU)], "fedadam": ["--server-lr", str(SERVER_LR)]}.get(
        algorithm, []
    )
    assert main(args) == 0
    cli = json.loads((tmp_path / "out" / "history.json").read_text())["metrics"]
    api = _api_run(rule, 4, 8.0, *_task(), algorithm=algorithm)
    for name, values in api.metrics.items():
        np.testing.assert_array_equal(cli[name], np.asarray(values), err_msg=name)
    assert {"bytes_up", f"{rule}_rank" if rule == "hetlora" else "flora_merged_norm"} <= set(cli)


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--lora-rule", "hetlora", "--lora-ranks", "0", "2"], ["--lora-ranks must be"]),
        (["--lora-rule", "flora", "--lora-ranks", "2", "8"], ["--lora-ranks 8 exceeds"]),
        (["--lora-rule", "flora"], ["needs --lora-ranks"]),
        (["--lora-ranks", "1", "2"], ["--lora-ranks needs --lora-rule"]),
        (
            ["--lora-rule", "hetlora", "--lora-ranks", "1", "--algorithm", "fedbuff"],
            ["--lora-rule hetlora: fedbuff takes no hooks", "synchronous preset"],
        ),
        (["--lora-rule", "hetlora", "--lora-ranks", "1", "--dp-clip", "1"], ["--dp-clip"]),
        (["--lora-rule", "bogus", "--lora-ranks", "1"], ["--lora-rule"]),
    ],
)
def test_bad_rule_values_refused_up_front(extra, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _refused(capsys, [*RUN, "--lora-rank", "4", *extra], *words)


def test_rule_needs_lora_rank():
    cfg = RunConfig(model="transformer", dataset="markov_tokens", lora_rule="hetlora",
                    lora_ranks=(1,))  # fmt: skip
    with pytest.raises(UsageError, match="needs --lora-rank"):
        validate.check_config(cfg)


# ------------------------------------------------------------------------------ bytes
def _ranked_work(rule, ranks, rank, steps):
    """`(train, model, ClientWork)`: a rank-`rank` LoRA transformer (query and value of 2
    blocks, 64 -> 64) whose clients train ranks `ranks` under HetLoRA or FLoRA."""
    train, _ = _task()
    model = transformer(train.x.shape[2:], int(np.max(train.y)) + 1, lora_rank=rank,
                        lora_targets=("query", "value"))  # fmt: skip
    hook = hetlora(ranks) if rule == "hetlora" else flora(ranks, 1.0)
    work = ClientWork(model.loss, client_optimizer=0.1, local=LocalSpec(steps=steps, batch_size=4),
                      hook=chain(hook), partition=lora_partition())  # fmt: skip
    return train, model, work


@pytest.mark.parametrize("rule", ["hetlora", "flora"])
def test_bytes_up_counts_each_clients_true_rank(rule):
    """bytes_up = sum over the cohort's reporting clients of `(d_in + d_out) r_i` float32
    values per adapted module (here query and value of 2 blocks, 64 -> 64), not the
    max-rank padded adapters."""
    r, d_model, layers = 4, 64, 2
    ranks = np.array([1, 3, 2, 4])
    train, model, work = _ranked_work(rule, ranks, r, steps=1)
    alg = compose(work, num_clients=C, cohort=CohortSpec(size=3), report_cohort=True)
    state = alg.init(model.init(jax.random.key(0)), jax.random.key(0))
    per_rank = layers * 2 * (d_model + d_model) * 4  # blocks x modules x (A col + B row) x f32
    padded = layers * 2 * (d_model * r + r * d_model) * 4
    for t in range(2):
        state, metrics = jax.jit(alg.step)(state, train, jax.random.key(t + 1))
        ids = np.asarray(metrics["cohort_ids"])
        sent = ranks[ids][np.asarray(metrics["cohort_weights"]) > 0]
        assert float(metrics["bytes_up"]) == per_rank * sent.sum()
        assert float(metrics["bytes_up"]) < len(sent) * padded


@pytest.mark.parametrize("rule", ["hetlora", "flora"])
def test_the_clock_times_each_clients_upload_at_its_rank(rule):
    """On the virtual clock a rank-r_i client uploads `(d_in + d_out) r_i` values per
    module, not the padded rank-r adapters: the round time is the slowest reporter's
    `bytes_down / downlink + steps / speed + bytes_i / uplink`, computed here from the
    device profile and the true ranks (with padded uploads every client would take the
    rank-4 time, which the last assertion tells apart)."""
    r, d_model, layers = 4, 64, 2
    ranks = np.array([1, 3, 2, 1])
    train, model, work = _ranked_work(rule, ranks, r, steps=2)
    speed, up, down = 4.0, 1000.0, 1.0e6
    profiles = ProceduralProfiles(0, speed=constant(speed), uplink=constant(up),
                                  downlink=constant(down), **PROFILES["always_on"])  # fmt: skip
    alg = compose(work, num_clients=C, cohort=CohortSpec(size=3), report_cohort=True,
                  device_model=DeviceModel(profiles, availability=False))  # fmt: skip
    params = model.init(jax.random.key(0))
    state = alg.init(params, jax.random.key(0))
    per_rank = layers * 2 * (d_model + d_model) * 4  # blocks x modules x (A col + B row) x f32
    adapters = sum(v.size * 4 for p, v in _flat(params).items() if "lora_" in p)
    for t in range(2):
        state, metrics = jax.jit(alg.step)(state, train, jax.random.key(t + 1))
        ids = np.asarray(metrics["cohort_ids"])
        sent = ranks[ids][np.asarray(metrics["cohort_weights"]) > 0]
        times = adapters / down + 2 / speed + per_rank * sent / up
        np.testing.assert_allclose(float(metrics["round_time"]), times.max(), rtol=1e-6)
        assert float(metrics["bytes_up"]) == per_rank * sent.sum()
        padded = adapters / down + 2 / speed + r * per_rank / up
        assert float(metrics["round_time"]) < padded


# ------------------------------------------------------------------------------ device class
def test_ranks_by_device_class():
    """Sorted by speed, the clients fall into equal classes, slowest class -> smallest rank
    (class of the k-th slowest: k * n_ranks // C)."""
    speeds = np.array([5.0, 1.0, 3.0, 2.0, 4.0, 6.0])  # slowest three: ids 1, 3, 2
    np.testing.assert_array_equal(device_class_ranks((8, 2), speeds), [8, 2, 2, 2, 8, 8])
    # 7 clients, 3 classes of sizes 3, 2, 2; client 6 is the slowest
    np.testing.assert_array_equal(
        device_class_ranks((4, 1, 2), np.arange(7.0)[::-1]), [4, 4, 2, 2, 1, 1, 1]
    )


def test_cli_ranks_by_speed_follow_the_device_model():
    """`--lora-ranks-by speed`: the preset's ranks are the device classes of the
    `--device-model` profiles' speeds (faster device, rank at least as large), 1/3 each."""
    cfg = RunConfig(model="transformer", dataset="markov_tokens", num_clients=30,
                    lora_rank=4, lora_rule="hetlora", lora_ranks=(4, 1, 2),
                    lora_ranks_by="speed", device_model="phones")  # fmt: skip
    validate.check_config(cfg)
    ranks = np.asarray(algorithm_kwargs(cfg)["ranks"])
    speeds = np.asarray(device_profiles(cfg)(jax.numpy.arange(30)).speed)
    assert np.bincount(ranks)[[1, 2, 4]].tolist() == [10, 10, 10]
    order = np.argsort(speeds, kind="stable")
    assert np.all(np.diff(ranks[order]) >= 0)
    assert len(set(speeds.tolist())) > 3  # the phones' speeds differ: a real ordering


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--lora-rule", "hetlora", "--lora-ranks", "1", "2", "--lora-ranks-by", "speed"],
         ["--lora-ranks-by speed needs --device-model"]),
        (["--lora-ranks-by", "speed"], ["--lora-ranks-by speed needs --lora-rule"]),
    ],
)  # fmt: skip
def test_ranks_by_speed_refused_without_its_inputs(extra, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _refused(capsys, [*RUN, "--lora-rank", "4", *extra], *words)
