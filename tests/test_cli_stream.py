"""`fedjax-sim run --population / --client-store`: streamed populations from the command line
(issue 35) write the run's files, equal the in-memory run bit for bit, and resume."""

import json

import numpy as np
import pytest

from fedjax_sim import data
from fedjax_sim.app.cli import main
from fedjax_sim.data.store import write_client_store

C = 12
TINY = ["--rounds", "4", "--eval-every", "2", "--cohort-size", "3", "--hidden", "4"]
TINY += ["--local-steps", "2", "--no-progress"]


def _history(folder):
    return json.loads((folder / "history.json").read_text())


def test_population_run_writes_the_history(tmp_path, monkeypatch, capsys):
    """A procedural population of 10^5 clients: 4 rounds, evaluated on held-out clients."""
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--population", "fedprox_synthetic", "--num-clients", "100000", *TINY]) == 0
    out = capsys.readouterr().out
    assert "100000 clients" in out and "streamed (device state rows)" in out
    [folder] = (tmp_path / "results").iterdir()
    assert folder.name.startswith("fedavg_fedprox_synthetic_")
    for name in ("history.json", "history.csv", "history.png"):
        assert (folder / name).stat().st_size > 0
    hist = _history(folder)
    assert hist["rounds"] == [1, 2, 3, 4]
    assert [e["round"] for e in hist["eval"]] == [0, 2, 4]
    assert "test_accuracy" in hist["eval"][-1]
    assert hist["meta"]["config"]["population"] == "fedprox_synthetic"
    assert hist["meta"]["data"]["num_clients"] == 100000


@pytest.fixture(scope="module")
def digits_store(tmp_path_factory):
    """The CLI's digits partition over C clients (`--num-clients C`, seed 0), in a store."""
    train = data.load("digits", num_clients=C, seed=0, partitioner="dirichlet", alpha=0.5).train
    x, y, counts = (np.asarray(a) for a in (train.x, train.y, train.counts))
    path = str(tmp_path_factory.mktemp("store") / "digits")
    write_client_store(
        path,
        C,
        train.max_count,
        train.feature_shape,
        lambda ids: (x[ids], y[ids], counts[ids]),
        x_dtype=x.dtype,
        num_classes=train.num_classes,
        progress=False,
    )
    return path


def test_client_store_equals_in_memory_run(digits_store, tmp_path, monkeypatch, capsys):
    """The store run's rounds are the in-memory `--dataset digits` run's, bit for bit; its
    --num-clients defaults to the store's."""
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--client-store", digits_store, *TINY, "--out", "store"]) == 0
    assert "no central test set" in capsys.readouterr().out
    assert main(["run", "--num-clients", str(C), *TINY, "--out", "memory"]) == 0
    store, memory = _history(tmp_path / "store"), _history(tmp_path / "memory")
    assert store["meta"]["config"]["num_clients"] == C
    assert store["rounds"] == memory["rounds"]
    assert store["metrics"] == memory["metrics"]
    assert [e["round"] for e in store["eval"]] == [0, 2, 4]


def test_streamed_resume_equals_straight_run(digits_store, tmp_path, monkeypatch):
    """SCAFFOLD with host state rows on disk: 2 rounds, then --rounds 4 --resume, writes the
    files of 4 rounds straight."""
    monkeypatch.chdir(tmp_path)
    args = ["run", "--client-store", digits_store, "--algorithm", "scaffold", *TINY]
    args += ["--state-rows", "host", "--checkpoint-every", "2"]
    assert main([*args, "--out", "straight", "--rows-dir", "rows_a"]) == 0
    parts = [*args, "--out", "parts", "--rows-dir", "rows_b"]
    assert main([*parts, "--rounds", "2"]) == 0
    assert main([*parts, "--rounds", "4", "--resume"]) == 0
    for name in ("history.csv", "history.jsonl"):
        assert (tmp_path / "parts" / name).read_bytes() == (
            tmp_path / "straight" / name
        ).read_bytes()
