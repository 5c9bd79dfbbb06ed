"""Fuzz of `fedjax-sim` with bad inputs (issue 19): every one is refused before any
compilation with exit code 2, one error line that names the flag, no traceback, and nothing
created in the working directory; valid edge values pass the same checks."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import pytest

import fedjax_sim.run.streaming
import fedjax_sim.run.sweep
from fedjax_sim.app import cli, validate
from fedjax_sim.run.checkpoint import Checkpointer

NONFINITE = ["nan", "inf", "-inf", "1e39", "-1e39"]
FLOAT_FLAGS = ["--client-lr", "--server-lr", "--alpha", "--l2", "--mu", "--client-lr-decay"]

# (args, the flag the message must name)
BAD: list[tuple[list[str], str]] = [
    # non-finite or float32-overflowing values of every float flag
    *[(["run", f, v], f) for f in FLOAT_FLAGS for v in NONFINITE],
    (["run", "--sigma", "nan", "--partition", "quantity_skew"], "--sigma"),
    (["run", "--sigma", "inf"], "--sigma"),
    (["run", "--straggler-fraction", "nan"], "--straggler-fraction"),
    (["run", "--local-epochs", "inf"], "--local-epochs"),
    (["run", "--local-epochs", "0"], "--local-epochs"),
    # ranges
    (["run", "--rounds", "0"], "--rounds"),
    (["run", "--rounds", "-5"], "--rounds"),
    (["run", "--rounds", "99999999999"], "--rounds"),
    (["run", "--num-clients", "0"], "--num-clients"),
    (["run", "--local-steps", "0"], "--local-steps"),
    (["run", "--batch-size", "0"], "--batch-size"),
    (["run", "--batch-size", "-1"], "--batch-size"),
    (["run", "--eval-every", "0"], "--eval-every"),
    (["run", "--cohort-size", "0"], "--cohort-size"),
    (["run", "--cohort-size", "101"], "--cohort-size"),
    (["run", "--shards-per-client", "0"], "--shards-per-client"),
    (["run", "--map-batch-size", "0"], "--map-batch-size"),
    (["run", "--checkpoint-every", "0"], "--checkpoint-every"),
    (["run", "--checkpoint-every", "-3"], "--checkpoint-every"),
    (["run", "--hidden", "0"], "--hidden"),
    (["run", "--hidden", "64", "-8"], "--hidden"),
    (["run", "--seed", "-1"], "--seed"),
    (["run", "--seed", "4294967296"], "--seed"),
    (["run", "--seed", "99999999999999999999"], "--seed"),
    (["run", "--client-lr", "0"], "--client-lr"),
    (["run", "--client-lr", "-0.1"], "--client-lr"),
    (["run", "--server-lr", "0"], "--server-lr"),
    (["run", "--alpha", "0"], "--alpha"),
    (["run", "--alpha", "-1"], "--alpha"),
    (["run", "--l2", "-0.1"], "--l2"),
    (["run", "--mu", "-1"], "--mu"),
    (["run", "--straggler-fraction", "1.5"], "--straggler-fraction"),
    (["run", "--client-lr-decay", "0"], "--client-lr-decay"),
    (["run", "--devices", "0"], "--devices"),
    (["run", "--devices", "1000000", "--num-clients", "2000000"], "--devices"),
    (["run", "--devices", "200"], "--devices"),
    (["run", "--num-processes", "2", "--process-id", "2"], "--process-id"),
    (["run", "--process-id", "-1"], "--process-id"),
    (["run", "--resume", "--resume-or-start"], "--resume"),
    # types and parsing (tyro's errors, condensed to one line)
    (["run", "--rounds", "abc"], "--rounds"),
    (["run", "--rounds", "1.5"], "--rounds"),
    (["run", "--client-lr", "fast"], "--client-lr"),
    (["run", "--hidden", "a"], "--hidden"),
    (["run", "--partition", "bogus"], "--partition"),
    (["run", "--partition", "hsu"], "--partition"),
    (["run", "--client-map", "pmap"], "--client-map"),
    (["run", "--sampling", "nope"], "--sampling"),
    (["run", "--rounds"], "--rounds"),
    (["run", "--roundz", "3"], "--rounds"),
    (["run", "--config"], "--config"),
    # registries
    (["run", "--algorithm", "nope"], "algorithm"),
    (["run", "--dataset", "nope"], "dataset"),
    (["run", "--model", "nope"], "model"),
    # output paths
    (["run", "--out", ""], "--out"),
    (["run", "--out", "   "], "--out"),
    (["run", "--out", "{}"], "--out"),
    (["run", "--out", "res/{algo}"], "--out"),
    (["run", "--out", "res/{algorithm"], "--out"),
    (["run", "--out", "{0}"], "--out"),
    (["run", "--out", "a_file/sub"], "--out"),
    (["run", "--out", "a_file"], "--out"),
    (["run", "--out", "readonly/sub"], "--out"),
    # resume
    (["run", "--resume"], "--resume"),
    # model / data / resources (after loading the data, before compiling)
    (["run", "--model", "lstm"], "--model"),
    (["run", "--model", "gru"], "--model"),
    (["run", "--batch-size", "100000000"], "--batch-size"),
    (["run", "--hidden", "100000", "100000", "--client-map", "vmap"], "--batch-size"),
    # bench
    (["bench", "--repeats", "1"], "--repeats"),
    (["bench", "--clients", "0"], "--clients"),
    (["bench", "--memory-budget-gb", "nan"], "--memory-budget-gb"),
    (["bench", "--memory-budget-gb", "-1"], "--memory-budget-gb"),
    (["bench", "--max-round-s", "inf"], "--max-round-s"),
    (["bench", "--cohorts", "10", "0"], "--cohorts"),
    (["bench", "--widths", "-5"], "--widths"),
    (["bench", "--out", "a_file"], "--out"),
    (["bench", "--out", ""], "--out"),
    (["bench", "--workload", "nope"], "workload"),
    (["bench", "--suite", "nope"], "--suite"),
    (["bench", "--peak-n", "0"], "--peak-n"),
]

# issue 34: sweep, privacy, robust aggregation, attacks and bench
KRUM = ["--aggregator", "krum", "--aggregator-args"]
MKRUM = ["--aggregator", "multi_krum", "--aggregator-args"]
BAD_34: list[tuple[list[str], str]] = [
    # aggregator arguments: ranges, names, types, the cohort (10 of 100)
    *[(["run", *KRUM, a], "--aggregator-args") for a in ["f=5", "f=4", "f=-1", "f=1.5", "f=x"]],
    *[(["run", *MKRUM, a], "--aggregator-args") for a in ["m=20", "m=11", "m=0", "f=4"]],
    (["run", *MKRUM, "m=8", "--cohort-size", "5"], "--aggregator-args"),
    *[
        (["run", "--aggregator", agg, "--aggregator-args", a], "--aggregator-args")
        for agg, a in [
            ("trimmed_mean", "beta=0.5"),
            ("trimmed_mean", "beta=-0.1"),
            ("trimmed_mean", "beta=abc"),
            ("trimmed_mean", "beta=nan"),
            ("trimmed_mean", "gamma=0.1"),
            ("trimmed_mean", "chunk=0"),
            ("median", "chunk=-2"),
            ("median", "beta=0.1"),
            ("geometric_median", "iters=0"),
            ("geometric_median", "iters=2.5"),
            ("geometric_median", "nu=0"),
            ("geometric_median", "nu=-1"),
            ("geometric_median", "nu=inf"),
            ("centered_clip", "tau=0"),
            ("centered_clip", "tau=-1"),
            ("centered_clip", "tau=1e39"),
            ("centered_clip", "iters=0"),
            ("centered_clip", "tau"),
        ]
    ],
    (["run", "--aggregator-args", "beta=0.1"], "--aggregator-args"),
    (["run", "--aggregator", "nope"], "--aggregator"),
    # attacks: scale finite and of the kind's sign, names, types, fraction
    *[
        (["run", "--attack", kind, "--attack-args", a], "--attack-args")
        for kind, a in [
            ("gaussian", "scale=-1"),
            ("gaussian", "scale=abc"),
            ("gaussian", "scale=inf"),
            ("gaussian", "scale=nan"),
            ("sign_flip", "scale=0"),
            ("sign_flip", "scale=-2"),
            ("scale", "scale=-10"),
            ("scale", "scale=0"),
            ("alie", "scale=-1"),
            ("label_flip", "scale=2"),
            ("sign_flip", "fraction=0.5"),
            ("sign_flip", "kind=scale"),
            ("sign_flip", "seed=3"),
            ("sign_flip", "sampling=sometimes"),
            ("sign_flip", "sampling=1"),
            ("sign_flip", "bogus"),
        ]
    ],
    (["run", "--attack", "nope"], "--attack"),
    (["run", "--attack", "sign_flip", "--byzantine-fraction", "1.5"], "--byzantine-fraction"),
    (["run", "--attack", "sign_flip", "--byzantine-fraction", "-0.1"], "--byzantine-fraction"),
    (["run", "--attack", "sign_flip", "--byzantine-fraction", "nan"], "--byzantine-fraction"),
    (["run", "--byzantine-fraction", "0.2"], "--byzantine-fraction"),
    (["run", "--attack-args", "scale=2"], "--attack-args"),
    # privacy
    (["run", "--dp-clip", "0"], "--dp-clip"),
    (["run", "--dp-clip", "-1"], "--dp-clip"),
    (["run", "--dp-clip", "nan"], "--dp-clip"),
    (["run", "--dp-clip", "1", "--dp-noise", "-1"], "--dp-noise"),
    (["run", "--dp-clip", "1", "--dp-noise", "inf"], "--dp-noise"),
    (["run", "--dp-clip", "1", "--dp-delta", "0"], "--dp-delta"),
    (["run", "--dp-clip", "1", "--dp-delta", "1"], "--dp-delta"),
    (["run", "--dp-clip", "1", "--dp-quantile", "1"], "--dp-quantile"),
    (["run", "--dp-clip", "1", "--dp-quantile", "0"], "--dp-quantile"),
    (["run", "--dp-clip", "1", "--target-epsilon", "0"], "--target-epsilon"),
    (["run", "--dp-clip", "1", "--target-epsilon", "-1"], "--target-epsilon"),
    (["run", "--dp-clip", "1", "--dp-accountant", "moments"], "--dp-accountant"),
    (["run", "--dp-noise", "1"], "--dp-noise"),
    (["run", "--dp-delta", "1e-6"], "--dp-delta"),
    (["run", "--dp-clip", "1", "--aggregator", "median"], "--dp-clip"),
    (["run", "--dp-clip", "1", "--target-epsilon", "1", "--dp-noise", "1"], "--target-epsilon"),
    (["run", "--dp-clip", "1", "--cohort-sampling", "proportional"], "--dp-clip"),
    # sweep: its own flags and every grid value
    (["sweep", "--seeds", "0"], "--seeds"),
    (["sweep", "--seeds", "-3"], "--seeds"),
    (["sweep", "--seeds", "abc"], "--seeds"),
    (["sweep", "--seeds", "99999999999"], "--seeds"),
    (["sweep", "--seed", "4294967295", "--seeds", "2"], "--seeds"),
    (["sweep", "--runs-per-group", "0"], "--runs-per-group"),
    (["sweep", "--at-round", "-1"], "--at-round"),
    (["sweep", "--at-round", "x"], "--at-round"),
    (["sweep", "--memory-budget-gb", "nan"], "--memory-budget-gb"),
    (["sweep", "--memory-budget-gb", "0"], "--memory-budget-gb"),
    (["sweep", "--grid", "client_lr"], "--grid"),
    (["sweep", "--grid", "client_lr="], "--grid"),
    (["sweep", "--grid", "client_lr=a,b"], "--grid"),
    (["sweep", "--grid", "client_lr=0.1,nan"], "--grid"),
    (["sweep", "--grid", "client_lr=0.1,0"], "--grid"),
    (["sweep", "--grid", "server_lr=-1"], "--grid"),
    (["sweep", "--grid", "mu=-1"], "--grid"),
    (["sweep", "--grid", "nosuch=1"], "--grid"),
    (["sweep", "--grid", "momentum=0.9"], "--grid"),
    (["sweep", "--grid", "mu=0", "--grid", "mu=1"], "--grid"),
    (["sweep", "--resume"], "--resume"),
    (["sweep", "--num-processes", "2"], "--num-processes"),
    (["sweep", "--out", ""], "--out"),
    (["sweep", "--rounds", "0"], "--rounds"),
    (["sweep", "--aggregator", "krum", "--aggregator-args", "f=5"], "--aggregator-args"),
    (["sweep", "--attack", "gaussian", "--attack-args", "scale=-1"], "--attack-args"),
    (["sweep", "--dp-clip", "1", "--dp-delta", "2"], "--dp-delta"),
    # bench
    (["bench", "--hparams", "foo=1"], "--hparams"),
    (["bench", "--devices", "1000"], "--devices"),
    (["bench", "--devices", "0"], "--devices"),
    (["bench", "--devices", "8", "--clients", "4"], "--devices"),
    (["bench", "--algorithms", "nope"], "--algorithms"),
    (["bench", "--baseline-cohorts", "10", "0"], "--baseline-cohorts"),
    (["bench", "--devices", "2", "--baseline-cohorts", "10", "1"], "--devices"),
    (["bench", "--pfl-python", "/no/such/python"], "--pfl-python"),
    (["bench", "--fedjax-python", "/no/such/python"], "--fedjax-python"),
    (["bench", "--algorithm", "nope"], "algorithm"),
    (["bench", "--map-batch", "0"], "--map-batch"),
    (["bench", "--per-client", "0"], "--per-client"),
    (["bench", "--local-steps", "0"], "--local-steps"),
    (["bench", "--batch-size", "-1"], "--batch-size"),
    (["bench", "--steps-list", "1", "0"], "--steps-list"),
    (["bench", "--map-batches", "0"], "--map-batches"),
    (["bench", "--memory-rounds", "0"], "--memory-rounds"),
    (["bench", "--torch-threads", "0"], "--torch-threads"),
    (["bench", "--peer-max-cohort", "0"], "--peer-max-cohort"),
    (["bench", "--repeats", "abc"], "--repeats"),
    (["bench", "--mode", "pmap"], "--mode"),
    (["bench", "--hidden", "0"], "--hidden"),
    # output folder that access() calls writable
    (["run", "--out", "/proc/x"], "--out"),
]

# after loading the data and tracing one run's shapes (no compilation)
BAD_34_TRACED: list[tuple[list[str], str]] = [
    (["sweep", "--seeds", "1000000000"], "--seeds"),
    (["sweep", "--metric", "nosuch"], "--metric"),
    (["sweep", "--at-round", "7"], "--at-round"),
    (["sweep", "--at-round", "201"], "--at-round"),
    (["sweep", "--metric", "train_loss", "--at-round", "0"], "--at-round"),
    (["sweep", "--algorithm", "fedadam", "--grid", "b2=0.9,1.5"], "--grid b2=1.5"),
    (["sweep", "--algorithm", "fedadam", "--grid", "b1=-0.1"], "--grid b1"),
    (["sweep", "--algorithm", "fedadam", "--grid", "eps=0"], "--grid eps"),
    (["sweep", "--algorithm", "fedavgm", "--grid", "momentum=0.5,1"], "--grid momentum"),
    (["sweep", "--algorithm", "fedprox", "--grid", "mu=0,-0.1"], "--grid mu"),
    (["sweep", "--algorithm", "fedsam", "--grid", "rho=-1"], "--grid rho"),
    (["sweep", "--algorithm", "fedcm", "--grid", "momentum=1.5"], "--grid momentum"),
    (["sweep", "--algorithm", "feddyn", "--grid", "regularization=0"], "--grid regularization"),
]

# a preset's own range checks, after loading the data, before `simulate` starts
BAD_34_HPARAMS: list[tuple[list[str], str]] = [
    (["run", "--algorithm", "fedadam", "--hparams", "b2=1.5"], "--hparams b2=1.5"),
    (["run", "--algorithm", "fedadam", "--hparams", "eps=0"], "--hparams eps=0"),
    (["run", "--algorithm", "fedavgm", "--hparams", "momentum=1"], "--hparams momentum=1"),
    (["run", "--algorithm", "fedsam", "--hparams", "rho=-1"], "--hparams rho=-1"),
]

# issue 35: streamed populations (--client-store / --population), refused before compiling
POP = ["--population", "uniform"]
BAD_35: list[tuple[list[str], str]] = [
    (["run", "--client-store", "nowhere"], "--client-store"),
    (["run", "--client-store", "a_file"], "--client-store"),
    (["run", "--client-store", "readonly"], "--client-store"),  # a folder, not a store
    (["run", "--client-store", "corrupt"], "--client-store"),  # unreadable store.json
    (["run", "--client-store", "nowhere", *POP], "--population"),
    (["run", *POP, "--dataset", "mnist"], "--dataset"),
    (["run", *POP, "--partition", "iid"], "--partition"),
    (["run", *POP, "--data-dir", "x"], "--data-dir"),
    (["run", *POP, "--alpha", "0.3"], "--alpha"),
    (["run", *POP, "--devices", "2"], "--devices"),
    (["run", *POP, "--num-processes", "2"], "--num-processes"),
    (["run", *POP, "--num-clients", "200000000"], "--num-clients"),
    (["run", *POP, "--algorithm", "fedbuff"], "--algorithm fedbuff"),
    (["run", *POP, "--algorithm", "drfa"], "--algorithm drfa"),
    (["run", *POP, "--algorithm", "fedlps"], "--algorithm fedlps"),
    (["run", *POP, "--rows-dir", "rows"], "--rows-dir"),
    (["run", *POP, "--state-rows", "disk"], "--state-rows"),
    (["run", *POP, "--state-rows", "host", "--rows-dir", "a_file"], "--rows-dir"),
    (["run", *POP, "--model", "lstm"], "--model"),
    (["run", "--population", "nope"], "--population"),
    (["run", "--state-rows", "host"], "--state-rows"),
    (["run", "--rows-dir", "rows"], "--rows-dir"),
    (["sweep", *POP], "--population"),
    (["sweep", "--client-store", "nowhere"], "--client-store"),
]

# --config files: (JSON text, the key the message must name)
BAD_CONFIGS: list[tuple[str, str]] = [
    ("[1, 2]", "JSON object"),
    ('"rounds"', "JSON object"),
    ("{bad json", "--config"),
    ('{"rounds": "ten"}', "'rounds'"),
    ('{"rounds": 1.5}', "'rounds'"),
    ('{"client_lr": "0.1"}', "'client_lr'"),
    ('{"hidden": 64}', "'hidden'"),
    ('{"hidden": ["a"]}', "'hidden'"),
    ('{"progress": 1}', "'progress'"),
    ('{"partition": "hsu"}', "'partition'"),
    ('{"cohort_size": true}', "'cohort_size'"),
    ('{"alpha": NaN}', "'alpha'"),
    ('{"bogus": 1}', "unknown keys"),
    ('{"cohort_size": 1000}', "--cohort-size"),
]


# issue 39: the LoRA flags (model flags: refused before the data is loaded or the run starts)
TRANSFORMER = ["--dataset", "markov_tokens", "--model", "transformer"]
BAD_39: list[tuple[list[str], str]] = [
    (["run", *TRANSFORMER, "--lora-rank", "0"], "--lora-rank"),
    (["run", *TRANSFORMER, "--lora-rank", "-2"], "--lora-rank"),
    (["run", *TRANSFORMER, "--lora-rank", "1.5"], "--lora-rank"),
    *[
        (["run", *TRANSFORMER, "--lora-rank", "4", "--lora-alpha", v], "--lora-alpha")
        for v in [*NONFINITE, "0", "-1"]
    ],  # fmt: skip
    (["run", *TRANSFORMER, "--lora-rank", "4", "--lora-targets", "kernel"], "--lora-targets"),
    (["run", *TRANSFORMER, "--lora-alpha", "8"], "--lora-alpha"),
    (["run", *TRANSFORMER, "--lora-targets", "query"], "--lora-targets"),
    (["run", "--lora-rank", "4"], "--lora-rank"),  # --model mlp
    (["run", "--model", "lstm", "--dataset", "shakespeare", "--lora-rank", "4"], "--lora-rank"),
    (["run", *TRANSFORMER, "--lora-rank", "4", "--algorithm", "fedbuff"], "--lora-rank"),
    (["run", "--model", "transformer"], "--model"),  # digits: float features
]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory with a plain file and a read-only folder in it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "readonly").mkdir()
    os.chmod(tmp_path / "readonly", 0o500)
    yield tmp_path
    os.chmod(tmp_path / "readonly", 0o700)


def _contents(path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


def _refused(capsys, workdir, args: list[str], names: str) -> None:
    before = _contents(workdir)
    assert cli.main(args) == 2, args
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedjax-sim: error: "), err
    assert "\n" not in err and "Traceback" not in err, err
    assert names in err, (names, err)
    assert _contents(workdir) == before, "something was created"


def test_at_least_80_bad_invocations():
    assert len(BAD) + len(BAD_CONFIGS) >= 80


@pytest.mark.parametrize("args, names", BAD, ids=[" ".join(a)[:60] for a, _ in BAD])
def test_bad_invocation_refused(capsys, workdir, args, names):
    if os.geteuid() == 0 and "readonly/sub" in args:
        pytest.skip("root can write into a read-only folder")
    _refused(capsys, workdir, [*args, "--no-progress"] if args[0] == "run" else args, names)


@pytest.mark.parametrize("text, names", BAD_CONFIGS, ids=[t[:30] for t, _ in BAD_CONFIGS])
def test_bad_config_file_refused(capsys, workdir, tmp_path_factory, text, names):
    path = tmp_path_factory.mktemp("cfg") / "c.json"
    path.write_text(text)
    _refused(capsys, workdir, ["run", "--config", str(path)], names)


def _fake_checkpoint(workdir, round_: int, **overrides) -> str:
    """A checkpoint in the default results folder, written by `overrides` of the defaults."""
    config = dataclasses.asdict(dataclasses.replace(cli.RunConfig(), **overrides))
    ckpt = Checkpointer(str(workdir / "results" / "fedavg_digits" / "checkpoints"))
    ckpt.save(round_, {"w": jnp.zeros(3)}, jax.random.key(0), {"meta": {"config": config}})
    ckpt.close()
    return ckpt.directory


def test_resume_with_other_settings_names_them(capsys, workdir):
    _fake_checkpoint(workdir, 40, num_clients=50, cohort_size=5)
    _refused(capsys, workdir, ["run", "--resume"], "--num-clients 50 -> 100")
    # other settings have their own default folder: name the one holding the checkpoint
    again = ["run", "--resume-or-start", "--hidden", "8", "--out", "results/fedavg_digits"]
    _refused(capsys, workdir, again, "--hidden")


def test_fresh_run_over_an_interrupted_one_is_refused(capsys, workdir):
    _fake_checkpoint(workdir, 40)
    _refused(capsys, workdir, ["run"], "--resume")


def test_corrupt_checkpoint_one_line(capsys, workdir):
    directory = _fake_checkpoint(workdir, 40)
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "w") as f:
                f.write("garbage")
    _refused(capsys, workdir, ["run", "--resume"], "checkpoint")


def test_checkpoint_of_another_state_one_line(capsys, workdir):
    """Same settings, arrays of another algorithm: refused at restore, before compiling."""
    _fake_checkpoint(workdir, 40)  # state {"w": [3]} is not FedAvg's
    _refused(capsys, workdir, ["run", "--resume"], "does not match this run's state")


def test_empty_central_test_set_refused(capsys, workdir):
    _refused(capsys, workdir, ["run", "--num-clients", "5000"], "--num-clients")


def test_valid_edge_values_pass_validation(workdir):
    """Edge values that are legal are not refused by the checks (no run is started)."""
    edges = [
        ["--alpha", "1e-3"],
        ["--alpha", "1e30"],
        ["--seed", "4294967295"],
        ["--seed", "0"],
        ["--straggler-fraction", "0"],
        ["--straggler-fraction", "1"],
        ["--client-lr", "3e38"],
        ["--cohort-size", "100"],
        ["--cohort-size", "500", "--cohort-sampling", "proportional"],
        ["--l2", "0", "--mu", "0"],
        ["--hidden"],
        ["--out", "res/{algorithm}-{dataset}/x"],
        ["--out", "a b/ü"],
        ["--checkpoint-every", "1", "--eval-every", "1", "--rounds", "1"],
        ["--resume-or-start"],
        ["--devices", "1"],
        ["--model", "transformer", "--lora-rank", "1", "--lora-alpha", "1e-3"],
        ["--model", "transformer", "--lora-rank", "64", "--lora-targets", "mlp_out"],
    ]
    for args in edges:
        cfg = cli._parse(cli.RunConfig, args, None, "fedjax-sim run")
        validate.check_run(cfg)
    assert _contents(workdir) == {"a_file", "readonly"}


def test_config_file_values_reach_the_config(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"hidden": [8, 4], "client_lr": 1, "cohort_size": None}))
    values = validate.load_config_file(cli.RunConfig, str(path))
    assert values == {"hidden": (8, 4), "client_lr": 1, "cohort_size": None}


def test_help_mentions_config(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert "--config FILE" in capsys.readouterr().out


def test_list_partitioners_are_the_accepted_ones(capsys):
    assert cli.main(["list", "--what", "partitioners"]) == 0
    out = capsys.readouterr().out
    names = [ln.split()[0] for ln in out.splitlines()[1:] if not ln.strip().startswith("(")]
    assert names == ["dirichlet", "iid", "shards", "quantity_skew"]
    assert "McMahan et al. 2017" in out or "McMahan et al." not in out.split("shards")[1][:20]


def test_divergence_warning():
    assert validate.divergence_message([1.0] * 10 + [50.0] * 10) is not None
    assert validate.divergence_message([2.0, 1.0, 0.5, 0.4]) is None


# ------------------------------------------------------------------------------ issue 34
def test_issue_34_has_120_bad_invocations():
    assert len(BAD_34) + len(BAD_34_TRACED) + len(BAD_34_HPARAMS) >= 120


@pytest.mark.parametrize("args, names", BAD_34, ids=[" ".join(a)[:60] for a, _ in BAD_34])
def test_issue_34_refused(capsys, workdir, args, names):
    _refused(capsys, workdir, [*args, "--no-progress"] if args[0] != "bench" else args, names)


@pytest.mark.parametrize("args, names", BAD_35, ids=[" ".join(a)[:60] for a, _ in BAD_35])
def test_issue_35_streamed_refused(capsys, workdir, monkeypatch, args, names):
    """Streamed-run flags refused in one line naming the flag, before the run starts."""
    (workdir / "corrupt").mkdir()
    (workdir / "corrupt" / "store.json").write_text("{not json")
    (workdir / "corrupt" / "counts.npy").write_text("x")

    def started(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(sys.modules["fedjax_sim.run.simulate"], "simulate", started)
    monkeypatch.setattr(fedjax_sim.run.streaming, "simulate_streamed", started)
    _refused(capsys, workdir, [*args, "--no-progress"], names)


@pytest.mark.parametrize(
    "args, names", BAD_34_TRACED, ids=[" ".join(a)[:60] for a, _ in BAD_34_TRACED]
)
def test_issue_34_refused_before_compiling(capsys, workdir, monkeypatch, args, names):
    """Refused after the data is loaded and one run is traced, before the sweep (its
    compilation) starts."""

    def started(*args, **kwargs):
        raise AssertionError("the sweep started")

    monkeypatch.setattr(fedjax_sim.run.sweep, "sweep", started)
    _refused(capsys, workdir, [*args, "--no-progress"], names)


@pytest.mark.parametrize(
    "args, names", BAD_34_HPARAMS, ids=[" ".join(a)[:60] for a, _ in BAD_34_HPARAMS]
)
def test_issue_34_hparam_ranges_refused_before_running(capsys, workdir, monkeypatch, args, names):
    """A preset's own range check names the `--hparams` entry and stops before `simulate`."""

    def started(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(sys.modules["fedjax_sim.run.simulate"], "simulate", started)
    _refused(capsys, workdir, [*args, "--no-progress"], names)


def test_sweep_interrupt_names_the_saved_checkpoint(capsys, workdir, monkeypatch):
    """Ctrl-C after round 2 of a checkpointed sweep: exit 130 and the checkpoint's folder,
    which holds round 2."""
    from fedjax_sim.run.history import History

    append = History.append_eval

    def interrupt_at_round_2(self, round_, values):
        append(self, round_, values)
        if round_ == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(History, "append_eval", interrupt_at_round_2)
    args = ["sweep", "--rounds", "4", "--eval-every", "1", "--checkpoint-every", "1"]
    args += ["--seeds", "1", "--num-clients", "20", "--hidden", "8", "--no-progress"]
    out = workdir / "results" / "interrupted_sweep"
    assert cli.main([*args, "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip()
    directory = out / "checkpoints"
    assert err == (
        f"fedjax-sim: interrupted at round 2; checkpoint saved to {directory}; "
        "rerun the same command with --resume"
    ), err
    assert Checkpointer(str(directory)).latest_round() == 2


@pytest.mark.parametrize("args, names", BAD_39, ids=[" ".join(a)[:60] for a, _ in BAD_39])
def test_issue_39_lora_flags_refused(capsys, workdir, monkeypatch, args, names):
    def started(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(sys.modules["fedjax_sim.run.simulate"], "simulate", started)
    _refused(capsys, workdir, [*args, "--no-progress"], names)
