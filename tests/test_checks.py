"""Value checks shared by the algorithms and the command line (`fedjax_sim.core.checks`)."""

import jax
import jax.numpy as jnp
import pytest

from fedjax_sim.app import validate
from fedjax_sim.core.checks import (
    INT32_MAX,
    POSITIVE_INT,
    Range,
    check_number,
    non_negative,
    positive,
)


def test_range_names_the_violated_side():
    assert Range(0, 1, hi_open=True).violation(0.5) is None
    assert Range(0, 1, hi_open=True).violation(1.0) == "in [0, 1)"
    assert POSITIVE_INT.violation(0) == ">= 1"
    assert POSITIVE_INT.violation(INT32_MAX + 1) == f"<= {INT32_MAX}"


def test_check_number_with_a_range_or_a_predicate():
    check_number("m", 0.9, Range(0, 1, hi_open=True))
    with pytest.raises(ValueError, match=r"m must be in \[0, 1\), got 1.0"):
        check_number("m", 1.0, Range(0, 1, hi_open=True))
    with pytest.raises(ValueError, match=r"m must be in \[0, 1\), got nan"):
        check_number("m", float("nan"), Range(0, 1, hi_open=True))
    with pytest.raises(ValueError, match=r"lr must be a finite number > 0, got 0"):
        positive("lr", 0)
    with pytest.raises(ValueError, match=r"mu must be a number \(a finite number >= 0\)"):
        non_negative("mu", "x")


def test_traced_values_pass():
    def checked(x):
        positive("lr", x)
        check_number("m", x, Range(0, 1))
        return x

    assert jax.vmap(checked)(jnp.array([-1.0, 2.0])).shape == (2,)


def test_command_line_rules_are_ranges():
    assert all(isinstance(r, Range) for r in validate.RULES.values())
