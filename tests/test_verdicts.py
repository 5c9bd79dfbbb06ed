"""The README's verdict table is the generator's output, and the rule is applied as written."""

import json
import os
import sys

import numpy as np
import pytest

EXPERIMENTS = os.path.join(os.path.dirname(__file__), "..", "experiments")
sys.path.insert(0, EXPERIMENTS)
verdicts = pytest.importorskip("verdicts")  # needs scipy / matplotlib like the report scripts


def test_readme_table_is_generated():
    with open(verdicts.README) as f:
        text = f.read()
    want = verdicts.replace_table(text, verdicts.render(verdicts.ROWS))
    assert text == want, "README verdict table is stale: run experiments/verdicts.py --write"


@pytest.mark.parametrize(
    ("values", "paper", "sign", "null", "verdict"),
    [
        ([1.0, 1.1, 0.9, 1.0], 1.0, 1, 0.0, "inconclusive (n < 5)"),
        ([1.0, 1.1, 0.9, 1.0, 1.05], 1.0, 1, 0.0, "reproduced"),
        ([1.0, 1.1, 0.9, 1.0, 1.05], 4.0, 1, 0.0, "reproduced in sign, not in size"),
        ([1.0, 1.1, 0.9, 1.0, 1.05], None, 1, 0.0, "reproduced"),
        ([-1.0, -1.1, -0.9, -1.0, -1.05], 4.0, 1, 0.0, "not reproduced"),
        ([-1.0, 1.1, -0.9, 1.0, 0.0], 4.0, 1, 0.0, "not reproduced"),
        ([-1.0, 1.1, -0.9, 1.0, 0.0], 0.5, 1, 0.0, "inconclusive"),
        ([-1.0, 1.1, -0.9, 1.0, 0.0], None, -1, 0.0, "inconclusive"),
        ([1.05, 1.1, 1.08, 1.12, 1.06], 1.6, 1, 1.0, "reproduced in sign, not in size"),
    ],
)
def test_rule(values, paper, sign, null, verdict):
    assert verdicts.decide(np.array(values), paper, sign, null) == verdict


def test_missing_files_are_not_run():
    row = verdicts.Row("p", "c", "e", "n", ("none.json",), lambda: verdicts._json("none.json"),
                       not_run="reason and cost")  # fmt: skip
    line = verdicts.render([row]).splitlines()[-1]
    assert "reason and cost" in line and "**not run**" in line


def _sweep_blob(cells: dict, rounds: int = 100, last: int = 100) -> dict:
    """A `stepsizes_fmnist.py --seeds 5` result with the given cells (key -> number of runs),
    configured for `rounds` rounds, its runs evaluated up to round `last`."""
    cfg = {"algorithms": ["FedAvg", "EF-FedAvg"], "partitions": ["IID"], "seeds": 5,
           "rounds": rounds}  # fmt: skip
    run = {"round": [0, last], "test_accuracy": [0.1, 0.8], "train_loss": [2.3, 0.5]}
    return {"config": cfg, "cells": {k: {"runs": [dict(run, seed=s) for s in range(n)]}
                                     for k, n in cells.items()}}  # fmt: skip


def _step_row(name: str):
    return verdicts.Row("p", "c", "e", "n", (f"stepsizes/sweep_{name}.json",),
                        verdicts.step_diff((name, "EF-FedAvg"), (name, "FedAvg"), "IID"),
                        not_run="reason and cost")  # fmt: skip


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ('{"config": {"rounds": 100}, "cells": {"FedAvg|IID": {"ru', "not valid JSON"),
        (_sweep_blob({"FedAvg|IID": 5}), "lacks cell(s) EF-FedAvg|IID"),
        (_sweep_blob({"FedAvg|IID": 5, "EF-FedAvg|IID": 3}), "has 3 of 5 runs"),
        (_sweep_blob({"FedAvg|IID": 5, "EF-FedAvg|IID": 5}, rounds=200), "stops before round 200"),
    ],
)
def test_incomplete_result_is_not_run(tmp_path, monkeypatch, content, reason):
    """A result file that is there but unfinished (a run in progress, a crash) gives a "not run"
    row that says why, not a crash and not a verdict from part of the runs."""
    monkeypatch.setattr(verdicts, "RESULTS", str(tmp_path))
    verdicts._step_sweep.cache_clear()
    (tmp_path / "stepsizes").mkdir()
    text = content if isinstance(content, str) else json.dumps(content)
    (tmp_path / "stepsizes" / "sweep_x.json").write_text(text)
    line = verdicts.render([_step_row("x")]).splitlines()[-1]
    verdicts._step_sweep.cache_clear()
    assert "**not run**" in line and "incomplete result" in line and reason in line
    assert "reason and cost" in line


def test_complete_result_is_decided(tmp_path, monkeypatch):
    monkeypatch.setattr(verdicts, "RESULTS", str(tmp_path))
    verdicts._step_sweep.cache_clear()
    (tmp_path / "stepsizes").mkdir()
    blob = _sweep_blob({"FedAvg|IID": 5, "EF-FedAvg|IID": 5})
    (tmp_path / "stepsizes" / "sweep_x.json").write_text(json.dumps(blob))
    line = verdicts.render([_step_row("x")]).splitlines()[-1]
    verdicts._step_sweep.cache_clear()
    assert "n = 5 seeds" in line and "**not run**" not in line


def test_partial_progress_file_is_ignored(tmp_path, monkeypatch):
    """`stepsizes_fmnist.py` keeps a run in progress in `<name>.json.partial` and writes
    `<name>.json` atomically at the end: while it runs, the row stays "not run"."""
    fmnist = pytest.importorskip("stepsizes_fmnist")
    monkeypatch.setattr(verdicts, "RESULTS", str(tmp_path))
    verdicts._step_sweep.cache_clear()
    partial = tmp_path / "stepsizes" / "sweep_x.json.partial"
    fmnist.write_atomic(str(partial), _sweep_blob({"FedAvg|IID": 5}))
    assert sorted(p.name for p in partial.parent.iterdir()) == ["sweep_x.json.partial"]
    line = verdicts.render([_step_row("x")]).splitlines()[-1]
    verdicts._step_sweep.cache_clear()
    assert "**not run**" in line and "reason and cost" in line and "incomplete" not in line


def test_resume_keeps_cells_of_the_same_run_only():
    """`--checkpoint-every`: a rerun keeps the finished cells of a `.partial` written by the
    same settings (the output folder and the checkpoint interval aside), not another run's."""
    fmnist = pytest.importorskip("stepsizes_fmnist")
    cfg = {"rounds": 200, "seeds": 5, "first_seed": 5, "out": "a", "checkpoint_every": 10}
    assert fmnist.same_run(cfg, dict(cfg, out="/abs/a", checkpoint_every=20))
    assert not fmnist.same_run(cfg, dict(cfg, rounds=100))
    assert not fmnist.same_run(cfg, dict(cfg, first_seed=0))


def _clock_blob(fedbuff_acc: list[float], seeds: int = 5, fedavg_seeds: int = 5) -> dict:
    """A `cross_device_clock.py` result: FedAvg reaches 0.8 at 1 h (its target 0.72 at 0.5 h),
    FedBuff's accuracies at 0, 0.1, 0.2 h as given."""
    cfg = {"methods": ["FedAvg", "FedBuff"], "seeds_list": list(range(100, 100 + seeds)),
           "rounds": 2}  # fmt: skip
    avg = {"method": "FedAvg", "hours": [0.0, 0.5, 1.0], "test_accuracy": [0.1, 0.75, 0.8],
           "round_time": [1800.0, 1800.0], "late": 0, "dropouts": 0}  # fmt: skip
    buff = {"method": "FedBuff", "hours": [0.0, 0.1, 0.2], "test_accuracy": fedbuff_acc}
    runs = [dict(avg, seed=100 + s) for s in range(fedavg_seeds)]
    runs += [dict(buff, seed=100 + s) for s in range(seeds)]
    return {"config": cfg, "runs": runs}


def _clock_line(tmp_path, monkeypatch, blob: dict) -> str:
    """The row FedAvg / FedBuff from the blob split as the script writes it: FedAvg in
    `clock_sync.json`, FedBuff in `clock_async.json`."""
    monkeypatch.setattr(verdicts, "RESULTS", str(tmp_path))
    (tmp_path / "cross_device").mkdir()
    for name, m in (("sync", "FedAvg"), ("async", "FedBuff")):
        part = {"config": dict(blob["config"], methods=[m]),
                "runs": [r for r in blob["runs"] if r["method"] == m]}  # fmt: skip
        (tmp_path / "cross_device" / f"clock_{name}.json").write_text(json.dumps(part))
    row = verdicts._clock("p", "c", "e", "n", "speedup", "FedAvg", "FedBuff", 3.3)
    return verdicts.render([row]).splitlines()[-1]


def test_clock_speedup_is_decided(tmp_path, monkeypatch):
    """FedBuff first reaches 0.9 x FedAvg's final 0.8 at 0.1 h, FedAvg at 0.5 h: 5x."""
    line = _clock_line(tmp_path, monkeypatch, _clock_blob([0.1, 0.73, 0.7]))
    assert "5.00 +- 0.00" in line and "n = 5 seeds" in line


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (_clock_blob([0.1, 0.6, 0.7]), "5 FedBuff run(s) miss the target"),
        (_clock_blob([0.1, 0.73, 0.7], fedavg_seeds=3), "FedAvg has seeds [100, 101, 102]"),
    ],
)
def test_clock_censored_or_incomplete_is_not_run(tmp_path, monkeypatch, blob, reason):
    """A time to target censored at the horizon is only a bound: the row is not run."""
    line = _clock_line(tmp_path, monkeypatch, blob)
    assert "**not run**" in line and reason in line


@pytest.mark.parametrize("cap", [None, 32, 16])
def test_clock_equal_concurrency(tmp_path, monkeypatch, cap):
    """FedBuff at equal concurrency is read from `clock_async_conc32.json` (its methods renamed
    `FedBuff@32`), not from the uncapped `clock_async.json`; without that file the row is not
    run and gives the command; a file with another cap is incomplete."""
    monkeypatch.setattr(verdicts, "RESULTS", str(tmp_path))
    (tmp_path / "cross_device").mkdir()
    blob = _clock_blob([0.1, 0.73, 0.7])
    slow = _clock_blob([0.1, 0.6, 0.73])  # the capped FedBuff reaches the target at 0.2 h
    parts = {"sync": (blob, "FedAvg"), "async": (blob, "FedBuff")}
    if cap is not None:
        parts["async_conc32"] = (slow, "FedBuff")
    for name, (b, m) in parts.items():
        cfg = dict(b["config"], methods=[m]) | ({"concurrency": cap} if "conc" in name else {})
        part = {"config": cfg, "runs": [r for r in b["runs"] if r["method"] == m]}
        (tmp_path / "cross_device" / f"clock_{name}.json").write_text(json.dumps(part))
    row = next(r for r in verdicts.ROWS if "equal concurrency" in r.claim and "FedBuff" in r.claim)
    assert row.files == ("cross_device/clock_sync.json", "cross_device/clock_async_conc32.json")
    line = verdicts.render([row]).splitlines()[-1]
    if cap == 32:
        assert "2.50 +- 0.00" in line and "n = 5 seeds" in line
        area = next(
            r for r in verdicts.ROWS if "equal concurrency" in r.claim and "AREA" in r.claim
        )
        line = verdicts.render([area]).splitlines()[-1]  # the file has FedBuff only
        assert "**not run**" in line and "no AREA@32 runs" in line
    else:
        assert (
            "**not run**" in line and "--concurrency 32" in line and "--tag _async_conc32" in line
        )
        assert ("concurrency 16, not 32" in line) == (cap == 16)
