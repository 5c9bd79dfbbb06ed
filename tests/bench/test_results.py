"""The row stamp (commit, machine, load, command) and the one-file-per-suite writer."""

import json
import os
import subprocess

import pytest

from fedjax_sim.app.bench import results
from fedjax_sim.app.bench.results import UNKNOWN, Recorder, read_rows, replace_rows, validate_row


def test_stamp_names_commit_machine_load_and_command():
    s = results.stamp(["benchmarks/x.py", "--flag", "a b"])
    head = subprocess.run(
        ["git", "-C", results.REPO, "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert s["commit"] in (head, head + "-dirty")
    assert s["command"] == "python benchmarks/x.py --flag 'a b'"
    for key in (*results.MACHINE, "cpu_model", "memory_gib"):
        assert key in s["machine"]
    assert s["load"]["start_1m"] >= 0 and s["load"]["end_1m"] is None


def test_recorder_writes_stamped_rows_and_replaces_by_label(tmp_path):
    path = str(tmp_path / "suite.jsonl")
    rec = Recorder("suite", path, argv=["b.py"])
    rec.add("a", x=1)
    rec.add("b", x=2)
    rec.write()
    again = Recorder("suite", path, argv=["b.py", "--only-b"])
    again.add("b", x=3)
    again.add("c", x=4)
    again.write()
    rows = read_rows(path)
    assert [(r["label"], r["x"]) for r in rows] == [("a", 1), ("b", 3), ("c", 4)]
    for r in rows:
        validate_row(r)
        assert r["load"]["end_1m"] is not None
    assert rows[0]["command"] == "python b.py" and rows[1]["command"] == "python b.py --only-b"
    assert [p for p in os.listdir(tmp_path)] == ["suite.jsonl"]  # no temporary file left


def test_row_keeps_its_own_machine(tmp_path):
    path = str(tmp_path / "s.jsonl")
    rec = Recorder("s", path, argv=["b.py"])
    child = {k: "child" for k in results.MACHINE}
    rec.add("a", machine=child)
    rec.write()
    assert read_rows(path)[0]["machine"] == child


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.pop("commit"), "lacks field 'commit'"),
        (lambda r: r.update(command=""), "must not be empty"),
        (lambda r: r.update(load={"start_1m": 1.0}), "lacks 'end_1m'"),
        (lambda r: r.update(machine="somewhere"), "machine must be a dict"),
    ],
)
def test_schema_requires_the_stamp(change, message):
    row = {
        "kind": "measurement", "suite": "s", "label": "a", "time": "t", "commit": "abc",
        "machine": UNKNOWN, "load": UNKNOWN, "command": "python x.py",
    }  # fmt: skip
    validate_row(row)
    change(row)
    with pytest.raises(ValueError, match=message):
        validate_row(row)


def test_replace_rows_is_plain_json_lines(tmp_path):
    path = str(tmp_path / "x.jsonl")
    replace_rows(path, [{"label": "a", "v": [1, 2]}])
    assert [json.loads(line) for line in open(path)] == [{"label": "a", "v": [1, 2]}]


# folders of this machine's rows under another condition: folder -> the field every row has
CONDITIONS = {"under_load": "competing_job"}


def test_committed_results_follow_the_schema():
    """Every file in benchmarks/results/ is one suite's rows, each stamped; a folder holds
    another machine's: `<machine>_<suite>.jsonl` rows and the raw `*_log.txt` logs they come
    from (e.g. `gpu/`), or this machine's under a condition: `<suite>.jsonl` rows that
    name it (`under_load/`: `fedjax-sim bench --competing-threads`)."""
    names = sorted(os.listdir(results.RESULTS))
    assert names, "benchmarks/results/ is empty"
    for name in names:
        path = os.path.join(results.RESULTS, name)
        if name.startswith("."):
            continue
        if os.path.isdir(path):
            condition = CONDITIONS.get(name)
            for inner in sorted(os.listdir(path)):
                if inner.endswith("_log.txt"):
                    continue
                stem = inner.removesuffix(".jsonl")
                assert inner.endswith(".jsonl") and (condition or "_" in stem), f"{name}/{inner}"
                for row in read_rows(os.path.join(path, inner)):
                    validate_row(row)
                    assert row["suite"] == (stem if condition else stem.split("_", 1)[1])
                    assert condition is None or condition in row, f"{name}/{inner}: {row['label']}"
            continue
        assert name.endswith(".jsonl"), f"benchmarks/results/{name} is not a suite's rows"
        for row in read_rows(path):
            validate_row(row)
            assert row["suite"] == name.removesuffix(".jsonl")
