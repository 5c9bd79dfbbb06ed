"""experiments/hypergradient_report.py: README's block is its output, and issue 36's claim
(within 1 point of the grid best's mean test accuracy with < 1/3 of its client-steps) is
applied as stated, on made-up result files whose numbers are worked out here by hand."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))
report = pytest.importorskip("hypergradient_report")

GRID = [0.01, 0.03, 0.1, 0.3, 1.0, 3.0]


def test_readme_block_is_generated():
    with open(report.README) as f:
        text = f.read()
    assert text == report.replace_block(text, report.render(report.load())), (
        "README's hypergradient block is stale: run experiments/hypergradient_report.py --write"
    )


@pytest.mark.parametrize(
    ("gap", "ratio", "expected"),
    [
        (-1.0, 1 / 6, True),  # exactly 1 point below: within 1 point
        (-1.01, 1 / 6, False),
        (+3.0, 1 / 6, True),
        (0.0, 1 / 3, False),  # a third is not less than a third
        (0.0, 0.333, True),
        (0.0, 0.5, False),  # the backward-inclusive count would fail the cost part
    ],
)
def test_rule(gap, ratio, expected):
    assert report.holds(gap, ratio) is expected


def _blob(tuner_small, tuner_large, dataset="digits", alpha=0.1, algorithm="fedavg", first=5):
    """5 seeds; the grid's best by validation is lr 0.3 (index 3) with test accuracies
    0.90 +- 0.01 by seed, while lr 0.1 has the higher *test* mean (0.95): selection must use
    validation. `tuner_small` / `tuner_large`: the tuners' per-seed test accuracies."""
    noise = np.array([0.0, 0.01, -0.01, 0.005, -0.005])
    val = np.full((6, 5), 0.5)
    val[3] = 0.9
    test = np.full((6, 5), 0.5) + noise
    test[3] = 0.90 + noise
    test[2] = 0.95
    steps = 100 * 10 * 10
    return {
        "file": "made_up.json", "dataset": dataset, "alpha": alpha, "algorithm": algorithm,
        "grid": GRID, "seeds": list(range(first, first + 5)), "best_lr": 0.3,
        "grid_val_accuracy": val.tolist(), "grid_test_accuracy": test.tolist(),
        "tuner_starts": [0.03, 3.0], "tuner_spec": {"window": 10, "step_size": 0.3,
                                                    "tolerance": 0.01},
        "tuner_test_accuracy": [list(tuner_small), list(tuner_large)],
        "tuner_final_effective_lr": [[0.3] * 5, [0.3] * 5],
        "tuner_rejected_windows": [[0] * 5, [1] * 5],
        "client_steps_grid": 30 * steps, "client_steps_tuner_per_start": 5 * steps,
    }  # fmt: skip


def test_cell_selects_by_validation_and_pairs_by_seed():
    noise = np.array([0.0, 0.01, -0.01, 0.005, -0.005])
    # from lr / 10: 0.895 + 2 x noise: mean gap -0.5 points, per-seed gaps -0.5 + 100 x noise
    # from lr x 10: 0.889 flat: mean gap -1.1 points
    c = report.cell(_blob(0.895 + 2 * noise, np.full(5, 0.889)))
    assert c["best_lr"] == 0.3
    np.testing.assert_allclose(c["grid_test"], 100 * (0.90 + noise))
    small, large = c["starts"]
    assert small["gap"] == pytest.approx(-0.5) and small["holds"]
    assert large["gap"] == pytest.approx(-1.1) and not large["holds"]
    # paired CI half-width: t(0.975, 4) x std(100 x noise, ddof 1) / sqrt(5)
    half = 2.7764451051977987 * np.std(100 * noise, ddof=1) / np.sqrt(5)
    assert small["gap_ci"] == pytest.approx(half)
    assert large["gap_ci"] == pytest.approx(half)  # flat tuner minus noisy grid
    assert c["steps_ratio"] == pytest.approx(1 / 6)
    np.testing.assert_allclose(small["fixed"], 100 * (0.5 + noise))  # lr 0.03 held fixed
    np.testing.assert_allclose(large["fixed"], 100 * (0.5 + noise))  # lr 3 held fixed


def test_cell_refuses_a_best_lr_it_cannot_recompute():
    blob = _blob(np.zeros(5), np.zeros(5)) | {"best_lr": 0.1}
    with pytest.raises(ValueError, match="best lr 0.1 != recomputed 0.3"):
        report.cell(blob)


def test_verdicts():
    good, bad = np.full(5, 0.9), np.full(5, 0.1)
    cells = [(d, a, m) for d, a, m in report.CELLS]

    def run(small, large, n=8):
        return [report.cell(_blob(small, large, *cells[i])) for i in range(n)]

    assert report.verdict(run(good, good)).startswith("**holds**")
    assert report.verdict(run(bad, bad)).startswith("**fails**")
    text = report.verdict(run(good, bad))
    assert text.startswith("**holds in 8 of 16 (cell, start) pairs**")
    assert "from lr / 10: 8 of 8 cells; from lr x 10: 0 of 8 cells" in text
    partial = report.verdict(run(good, good, n=6))
    missing = "2 of 8 cells not run: Fashion-MNIST Dir 1 FedAvg, Fashion-MNIST Dir 1 FedProx"
    assert missing in partial


def test_render_says_the_confirming_run_is_missing():
    selection = [_blob(np.full(5, 0.9), np.full(5, 0.1), first=0)]
    assert "Confirming run on fresh seeds: **not run**" in report.render(selection)
    confirming = [_blob(np.full(5, 0.9), np.full(5, 0.1), first=5)]
    block = report.render(confirming)
    assert "not run**:" not in block
    assert block.startswith("**seeds 5-9 (fresh seeds, confirming run)")
    # the same seeds with another tuner are a diagnostic, not the confirming run
    other = _blob(np.full(5, 0.9), np.full(5, 0.1), first=5)
    other["tuner_spec"] = other["tuner_spec"] | {"tolerance": 9.0}
    block = report.render([other, *confirming])
    assert block.startswith("**seeds 5-9 (fresh seeds, confirming run)")
    assert "seeds 5-9 (fresh seeds, diagnostic); tuner window 10, step 0.3, earlier" in block
    assert "Confirming run on fresh seeds: **not run**" in report.render([other])
