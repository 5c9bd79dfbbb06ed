"""benchmarks/sweep_throughput.py's statistics (cheap: no measurement runs)."""

import importlib.util
import os

from fedjax_sim.app.bench.results import REPO

spec = importlib.util.spec_from_file_location(
    "sweep_throughput", os.path.join(REPO, "benchmarks", "sweep_throughput.py")
)
sweep_throughput = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep_throughput)


def test_median_trial_is_the_middle_figure_and_keeps_every_trial_in_order():
    rows = [{"runs_per_s": v, "trial": i} for i, v in enumerate([41.5, 46.7, 43.0])]
    got = sweep_throughput._median_trial(rows)
    assert got["trial"] == 2 and got["runs_per_s"] == 43.0
    assert got["trial_figures"] == [41.5, 46.7, 43.0]  # measurement order, for the notes


def test_median_trial_of_an_even_count_is_the_lower_middle_and_bounds_use_their_figure():
    # the bound's row has no runs/s of its own: its figure is the training alone over the cores
    rows = [{"train_autodiff_cores_runs_per_s": v, "peak_gflops": 300.0} for v in (55, 52, 57, 50)]
    got = sweep_throughput._median_trial(rows)
    assert got["train_autodiff_cores_runs_per_s"] == 52
    assert got["trial_figures"] == [55, 52, 57, 50]
