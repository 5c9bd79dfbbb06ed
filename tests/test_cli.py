"""CLI: the README's main command end to end (few rounds), and clear exit-2 errors."""

import json
import subprocess
import sys

import pytest

from fedjax_sim.cli import main


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
