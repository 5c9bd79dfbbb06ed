"""benchmarks/README.md's tables are generated from benchmarks/results/ (cheap: files only)."""

import importlib.util
import os
import re

from fedjax_sim.app.bench.results import REPO, RESULTS

spec = importlib.util.spec_from_file_location(
    "bench_report", os.path.join(REPO, "benchmarks", "report.py")
)
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def readme() -> str:
    with open(report.README) as f:
        return f.read()


def test_readme_tables_are_generated_from_the_rows():
    text = readme()
    assert report.render(text) == text, "stale: PYTHONPATH=$PWD python benchmarks/report.py"


def test_every_suite_with_rows_is_a_table_in_the_readme():
    suites = {n.removesuffix(".jsonl") for n in os.listdir(RESULTS) if n.endswith(".jsonl")}
    gpu = os.path.join(RESULTS, "gpu")  # another machine's rows (benchmarks/gpu_log_rows.py)
    suites |= {f"gpu/{n.removesuffix('.jsonl')}" for n in os.listdir(gpu) if n.endswith(".jsonl")}
    tables = set(re.findall(r"<!-- table:(\w+):begin -->", readme()))
    assert tables <= set(report.TABLES)
    rendered = {s for t in tables for s in report.sources(t)}
    assert suites <= rendered, f"suites with rows but no README table: {suites - rendered}"
    for t in report.TABLES:
        for s in report.sources(t):
            assert os.path.exists(os.path.join(RESULTS, f"{s}.jsonl")), (t, s)


def test_summary_rows_are_formatted_not_dumped():
    text = readme()
    assert "{'" not in text and "['" not in text, "a summary row is rendered as a raw dict/list"


def test_readme_cites_no_removed_result_file():
    text = readme()
    for path in re.findall(r"`(?:benchmarks/)?results/([^`\s]+)`", text):
        if "<" not in path:
            assert os.path.exists(os.path.join(RESULTS, path)), path
    for gone in ("uptime.log", "algorithms_first.md", "cohort.png", "baselines_rerun.jsonl"):
        assert f"`{gone}`" not in text and f"/{gone}`" not in text, gone


def test_peers_table_sorts_every_system_fedjax_included():
    """The peers table's rows of a workload and cohort: the engine first, then the JAX loop,
    fedjax, PyTorch, pfl (a system missing from `SYSTEM_ORDER` raises), each over the best
    engine row's median."""

    def row(engine, s):
        return {"engine": engine, "clients": 10, "workload": {"name": "W1"}, "round_s_median": s}

    rows = [row("pfl", 4.0), row("fedjax", 3.0), row("torch-loop", 5.0), row("python-loop", 2.5)]
    rows += [row("fedjax_sim", 2.0), row("fedjax_sim", 1.0)]
    out = report.peers_rows(rows)
    engines = ["fedjax_sim", "fedjax_sim", "python-loop", "fedjax", "torch-loop", "pfl"]
    assert [r["engine"] for r in out] == engines
    assert [r["vs_best_engine"] for r in out] == [2.0, 1.0, 2.5, 3.0, 5.0, 4.0]


def test_sweep_trials_notes_pair_each_trials_sweep_with_its_bound():
    """A median cell hides the spread: one line per (workload, R) pairs trial i of the sweep
    over the cores with trial i of its bound (the same interleaved pass) and their ratio."""
    rows = [
        {"workload": "digits", "R": 16, "mode": "sweep-cores", "trial_figures": [40.0, 45.0]},
        {"workload": "digits", "R": 16, "mode": "matmul", "trial_figures": [50.0, 60.0]},
        {"workload": "digits", "R": 4, "mode": "sweep-cores", "trial_figures": [40.0]},
        {"workload": "digits", "R": 4, "mode": "matmul", "trial_figures": [50.0]},
    ]
    (line,) = report.sweep_trials_notes(rows)  # a single trial has no spread to show
    assert line.startswith("digits R = 16, 2 trials")
    assert line.endswith("40 / 50 = 80.0%, 45 / 60 = 75.0%")
