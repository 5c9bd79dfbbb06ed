"""benchmarks/gpu_log_rows.py: the printed rows of the GPU lease's logs become rows (cheap:
files only)."""

import importlib.util
import json
import os

import pytest

from fedjax_sim.app.bench.report import one_line
from fedjax_sim.app.bench.results import REPO, read_rows, validate_row

spec = importlib.util.spec_from_file_location(
    "gpu_log_rows", os.path.join(REPO, "benchmarks", "gpu_log_rows.py")
)
gpu_log_rows = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_log_rows)

MACHINE = {"device_kind": "GPU X", "backend": "gpu", "jax": "0", "cpu_count": 4}


def printed(suite: str, label: str, median: float, steps: float, gib: float) -> str:
    """A line as `fedjax-sim bench` prints it (`report.one_line` of a round row)."""
    row = {"kind": "round", "suite": suite, "label": label, "round_s_median": median}
    row.update(round_s_min=median / 2, compile_s=None, client_steps_per_s=steps)
    row.update(peak_memory_bytes=int(gib * 2**30))
    return one_line(row)


def header(load: float) -> str:
    return "fedjax-sim bench: suites baselines; memory budget 60.0 GiB; machine " + json.dumps(
        {**MACHINE, "load_avg_1m": load}
    )


def test_committed_rows_are_those_of_the_committed_logs():
    assert gpu_log_rows.main(["--check"]) == 0, "run benchmarks/gpu_log_rows.py"


def test_printed_lines_become_rows_and_the_later_call_wins(tmp_path, monkeypatch):
    lease = {"kind": "measurement", "suite": "s", "label": "a", "commit": "abc1234-dirty"}
    lease.update(time="2026-01-02T03:04:05+00:00", machine="m", load="l", command="c")
    (tmp_path / "lease.jsonl").write_text(json.dumps(lease) + "\n")
    first = [
        "=== baselines (cap 170s) 10:00:00",
        header(1.5),
        printed("baselines", "fedjax_sim vmap W1 M=10", 0.002, 50_000, 1.59),
        printed("baselines", "PyTorch per-client loop (1 thread) W1 M=10", 0.25, 400, 1.59),
        "[baselines] pfl-research (1 thread) W1 M=10: skipped (no venv)",
        "=== baselines: rc 124 in 170 s",
        "[baselines] fedjax_sim vmap W1 M=99: 1 s/round (min 1, compile – s), 1 client-steps/s, "
        "peak mem 1 GiB",  # after the run's end: not a row of it
    ]
    second = [
        "#   timeout 215 python3 -m fedjax_sim bench --suite baselines --out $OUT",
        header(4.0),
        printed("baselines", "fedjax_sim vmap W1 M=10", 0.001, 100_000, 1.6),
    ]
    (tmp_path / "one.txt").write_text("\n".join(first) + "\n")
    (tmp_path / "two.txt").write_text("\n".join(second) + "\n")
    monkeypatch.setattr(gpu_log_rows, "GPU", str(tmp_path))
    monkeypatch.setattr(gpu_log_rows, "LOGS", ("one.txt", "two.txt"))
    monkeypatch.setattr(gpu_log_rows, "LEASE_ROWS", ("lease.jsonl",))
    rows = gpu_log_rows.rows_by_suite()["baselines"]
    assert [r["label"] for r in rows] == [
        "fedjax_sim vmap W1 M=10",
        "PyTorch per-client loop (1 thread) W1 M=10",
    ]
    engine, torch = rows
    # the engine's row is call 2's, in call 1's place
    assert engine["round_s_median"] == 0.001 and engine["round_s_min"] == 0.0005
    assert engine["client_steps_per_s"] == 100_000 and engine["peak_memory_gib"] == 1.6
    assert engine["load"]["start_1m"] == 4.0 and engine["log_line"] == 3
    assert engine["command"].startswith("timeout 215 python3 -m fedjax_sim bench")
    assert engine["machine"]["device_kind"] == "GPU X" and engine["commit"] == "abc1234-dirty"
    assert engine["workload"]["name"] == "W1" and engine["workload"]["clients"] == 10
    assert engine["engine"] == "fedjax_sim" and engine["system"] == "fedjax_sim vmap"
    assert torch["engine"] == "torch-loop" and torch["torch_threads"] == 1
    assert torch["round_s_median"] == 0.25 and torch["compile_s"] is None
    assert torch["command"] == "timeout 170 " + gpu_log_rows.CALL1_PARTS["baselines"]
    assert torch["time"].startswith("2026-01-02T10:00:00+00:00")
    assert torch["cohort_run"] == "W1 M=10" and torch["load"]["start_1m"] == 1.5
    for row in rows:
        validate_row(row)


def test_a_label_it_cannot_read_is_refused():
    with pytest.raises(ValueError, match="unexpected baselines label"):
        gpu_log_rows.configuration("baselines", "no cohort here")
    with pytest.raises(ValueError, match="measured vmap rounds, not map"):
        gpu_log_rows.configuration("cohort", "W1 M=10 map(batch_size=1)")


def test_committed_gpu_rows_match_their_printed_lines():
    for name in gpu_log_rows.OUT.values():
        for row in read_rows(os.path.join(gpu_log_rows.GPU, name)):
            with open(os.path.join(REPO, row["log"])) as f:
                assert f.read().splitlines()[row["log_line"] - 1] == row["printed"]
