"""Issue 34: the bare install (no extras) runs `run`, `sweep`, `list` and `bench`; a feature
that needs an extra fails up front with one line naming it (exit 2).

The optional packages are hidden in a subprocess by a `sys.meta_path` finder that makes every
import of them fail as if they were not installed and records each attempt: the main paths
must not even try to import them. All commands run in that one process (one JAX start-up).
"""

import json
import subprocess
import sys

import pytest

HIDDEN = ("jax_privacy", "dp_accounting", "tensorflow_datasets", "torch")

WRAPPER = r"""
import contextlib, io, json, sys

HIDDEN = set(json.loads(sys.argv[1]))
attempts = []


class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Hide())
from fedjax_sim.app.cli import main

results = []
for argv in json.loads(sys.argv[2]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    results.append({"code": code, "err": err.getvalue(), "attempts": attempts[:]})
    attempts.clear()
from fedjax_sim.algorithms.privacy import dp_mean

try:
    dp_mean(1.0, 1.0, 1.0)
    api = "no error"
except ImportError as e:
    api = str(e)
with open(sys.argv[3], "w") as f:
    json.dump({"commands": results, "dp_mean": api}, f)
"""

TINY = ["--dataset", "fedprox_synthetic", "--model", "logistic", "--num-clients", "10",
        "--cohort-size", "5", "--rounds", "2", "--eval-every", "1", "--local-steps", "1",
        "--no-progress"]  # fmt: skip


def _commands(tmp_path):
    """(argv, extra the command needs or None)."""
    out = lambda name: ["--out", str(tmp_path / name)]  # noqa: E731
    return [
        (["list"], None),
        (["run", *TINY, *out("run")], None),
        (["sweep", *TINY, "--seeds", "2", *out("sweep")], None),
        (["bench", "--workload", "tiny-lr", "--no-isolate", "--no-flops", *out("bench")], None),
        (["run", *TINY, "--dp-clip", "1.0", *out("dp")], "privacy"),
        (["run", *TINY, "--dp-clip", "1.0", "--target-epsilon", "3", *out("dp_eps")], "privacy"),
        (["sweep", *TINY, "--dp-clip", "1.0", *out("dp_sweep")], "privacy"),
        (["run", *TINY, "--dataset", "mnist", *out("mnist")], "tfds"),
        (["run", *TINY, "--dataset", "tfds:emnist/letters", *out("tfds")], "tfds"),
        (["bench", "--workload", "tiny-lr", "--suite", "baselines", *out("peers")], "peers"),
    ]


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bare")
    commands = _commands(tmp_path)
    report = tmp_path / "report.json"
    argvs = json.dumps([argv for argv, _ in commands])
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, json.dumps(HIDDEN), argvs, str(report)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(report.read_text())
    return tmp_path, commands, results


def test_bare_install_runs_every_feature_without_an_extra(bare):
    tmp_path, commands, results = bare
    for (argv, extra), res in zip(commands, results["commands"], strict=True):
        if extra is None:
            assert res["code"] == 0, (argv, res["err"])
            assert res["attempts"] == [], argv  # no optional package is even tried
    assert (tmp_path / "run" / "history.json").exists()
    assert (tmp_path / "sweep" / "histories.json").exists()
    assert (tmp_path / "bench" / "round.jsonl").exists()


def test_a_feature_that_needs_an_extra_fails_up_front_naming_it(bare):
    tmp_path, commands, results = bare
    for (argv, extra), res in zip(commands, results["commands"], strict=True):
        if extra is None:
            continue
        lines = res["err"].strip().splitlines()
        assert res["code"] == 2, (argv, res["err"])
        assert len(lines) == 1, (argv, lines)
        assert lines[0].startswith("fedjax-sim: error: ")
        assert f"needs the '{extra}' extra: pip install -e \".[{extra}]\"" in lines[0]
        out = tmp_path / argv[argv.index("--out") + 1]
        assert not out.exists() or not any(out.iterdir()), argv  # nothing was trained
    assert "needs the 'privacy' extra" in results["dp_mean"]  # the Python API names it too
