"""experiments/federated_lora_report.py: README's block is its output, and the rule stated in
experiments/README.md (non-inferiority at a 5 % margin, the claim's verdict) is applied as
written, on made-up results whose CIs are computed here by hand."""

import os
import sys

import numpy as np
import pytest
from scipy import stats

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))
report = pytest.importorskip("federated_lora_report")


def test_readme_block_is_generated():
    with open(report.README) as f:
        text = f.read()
    assert text == report.replace_block(text, report.render(report.load())), (
        "README's federated LoRA block is stale: run experiments/federated_lora_report.py --write"
    )


def _upper(diff):
    d = np.asarray(diff)
    return d.mean() + stats.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / np.sqrt(d.size)


@pytest.mark.parametrize(
    ("diff", "verdict"),
    [
        ([0.1, 0.2, 0.0, 0.1], "inconclusive (n < 5)"),
        ([0.1, 0.2, 0.0, 0.1, 0.15], "matches"),  # upper bound 0.22 <= 0.5
        ([-1.0, -0.8, -1.2, -0.9, -1.1], "matches"),  # better than full
        ([1.0, 0.9, 1.1, 1.0, 0.95], "worse"),  # lower bound 0.90 > 0.5
        ([0.0, 1.0, 0.2, 0.9, 0.4], "inconclusive"),  # CI [-0.05, 1.05] straddles 0.5
    ],
)
def test_rule(diff, verdict):
    margin = 0.5
    assert report.decide(np.array(diff), margin) == verdict
    if len(diff) >= 5 and verdict == "matches":
        assert _upper(diff) <= margin


def _blob(shift: dict[tuple[str, str], float], full_bytes=100.0, lora_bytes=10.0) -> dict:
    """Results of 5 seeds: full fine-tuning at perplexity 10 (+ seed noise), each LoRA
    variant shifted by `shift[(algorithm, variant)]` (default +5: worse)."""
    noise = [0.0, 0.02, -0.02, 0.01, -0.01]

    def runs(ppl, b):
        return [{"seed": s, "global_ppl": ppl + noise[s], "personal_ppl": ppl + noise[s],
                 "base_ppl": 12.0, "bytes_up": b, "bytes_down": b} for s in range(5)]  # fmt: skip

    cells = {}
    for a in report.ALGORITHMS:
        cells[f"{a} full"] = {"runs": runs(10.0, full_bytes)}
        for v in report.VARIANTS:
            cells[f"{a} {v}"] = {"runs": runs(10.0 + shift.get((a, v), 5.0), lora_bytes)}
    return {"pretrain": {"val_ppl": 11.0}, "cells": cells}


def test_claim_verdicts():
    every = {(a, "r8"): 0.1 for a in report.ALGORITHMS}
    assert report.verdict(report.rows(_blob(every))) == "holds"
    assert report.verdict(report.rows(_blob({}))) == "fails"
    assert report.verdict(report.rows(_blob({("FedProx", "r4"): 0.0}))) == "holds for FedProx only"
    # a match with too many bytes (ratio 0.3 > 0.25) does not count for the claim
    heavy = report.rows(_blob(every, lora_bytes=30.0))
    assert all(abs(r["ratio"] - 0.3) < 1e-12 for r in heavy)
    assert report.verdict(heavy) == "fails"
    # heterogeneous ranks alone do not decide the claim
    het = {(a, "hetlora"): 0.0 for a in report.ALGORITHMS}
    assert report.verdict(report.rows(_blob(het))) == "fails"
