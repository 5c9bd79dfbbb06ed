"""benchmarks/README.md's tables are generated from benchmarks/results/ (cheap: files only)."""

import importlib.util
import os

from fedjax_sim.bench.results import REPO, RESULTS

spec = importlib.util.spec_from_file_location(
    "bench_report", os.path.join(REPO, "benchmarks", "report.py")
)
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def test_readme_tables_are_generated_from_the_rows():
    with open(report.README) as f:
        text = f.read()
    assert report.render(text) == text, "stale: PYTHONPATH=$PWD python benchmarks/report.py"


def test_every_suite_with_rows_has_a_renderer():
    suites = {n.removesuffix(".jsonl") for n in os.listdir(RESULTS) if n.endswith(".jsonl")}
    assert suites <= set(report.TABLES)
