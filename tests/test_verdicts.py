"""The README's verdict table is the generator's output, and the rule is applied as written."""

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
