"""Issue 34: noise calibration in a bracket (PLD from RDP's z, never where a PLD table is
unaffordable), impossible targets refused in one line before compilation, and the accounting
recorded in a run's history."""

import dataclasses
import json
import math
import time

import pytest
from scipy.stats import norm

from fedjax_sim.algorithms import accounting
from fedjax_sim.algorithms.accounting import PrivacyAccounting
from fedjax_sim.app.cli import main


def _gaussian_delta(epsilon: float, sigma: float) -> float:
    """Exact delta(epsilon) of the Gaussian mechanism with sensitivity 1 and std sigma
    (Balle & Wang 2018, Thm. 8)."""
    a = 1.0 / (2.0 * sigma)
    return norm.cdf(a - epsilon * sigma) - math.exp(epsilon) * norm.cdf(-a - epsilon * sigma)


def test_pld_calibration_is_bracketed_by_rdp_and_fast():
    """Issue 34's case (it needed 301 GiB): T full-participation rounds are one Gaussian
    mechanism with std z / sqrt(T), so the calibrated z is checked against the exact delta."""
    acc = PrivacyAccounting(1.0, 20, "full", accountant="pld")
    t0 = time.perf_counter()
    pld = acc.calibrated(3.0, 4)
    assert time.perf_counter() - t0 < 60
    z = pld.noise_multiplier
    rdp = dataclasses.replace(acc, accountant="rdp").calibrated(3.0, 4)
    assert z <= rdp.noise_multiplier
    assert 0.99 * 3.0 <= pld.epsilon(4) <= 3.0
    # the exact mechanism meets the target at z, and misses it 1 % below (PLD is tight)
    assert _gaussian_delta(3.0, z / 2.0) <= 1e-5
    assert _gaussian_delta(3.0, 0.99 * z / 2.0) > 1e-5
    # the smallest z to the calibration's tolerance (1e-3 relative)
    assert dataclasses.replace(pld, noise_multiplier=z * (1 - 2e-3)).epsilon(4) > 3.0


def test_pld_calibration_with_poisson_sampling():
    acc = PrivacyAccounting(1.0, 20, "poisson", probability=0.25, accountant="pld")
    pld = acc.calibrated(3.0, 6)
    rdp = dataclasses.replace(acc, accountant="rdp").calibrated(3.0, 6)
    assert pld.noise_multiplier <= rdp.noise_multiplier
    assert 0.99 * 3.0 <= pld.epsilon(6) <= 3.0
    assert 0.99 * 3.0 <= rdp.epsilon(6) <= 3.0


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize(
    "target, rounds, message",
    [
        (0.0, 4, "finite number > 0"),
        (-1.0, 4, "finite number > 0"),
        (math.inf, 4, "finite number > 0"),
        (math.nan, 4, "finite number > 0"),
        (1e9, 4, "met already at noise multiplier 0.001"),
        (1e-9, 4, "needs a noise multiplier above 1000"),
    ],
)
def test_calibration_refuses_impossible_targets(accountant, target, rounds, message):
    acc = PrivacyAccounting(1.0, 20, "full", accountant=accountant)
    with pytest.raises(ValueError, match=message) as e:
        acc.calibrated(target, rounds)
    assert "\n" not in str(e.value)


def test_pld_refuses_below_its_affordable_floor():
    """A target whose PLD z would be below `pld_floor` is refused without building the table
    (the RDP z for 1000 over 20 rounds is below it); so is such an explicit z."""
    acc = PrivacyAccounting(1.0, 20, "full", accountant="pld")
    floor = accounting.pld_floor(acc, 20)
    assert accounting.pld_entries(acc, 20, floor) == pytest.approx(accounting.PLD_MAX_ENTRIES)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="use the rdp accountant"):
        acc.calibrated(1000.0, 20)
    assert time.perf_counter() - t0 < 10
    with pytest.raises(ValueError, match="use the rdp accountant"):
        dataclasses.replace(acc, noise_multiplier=0.5 * floor).check(20)
    dataclasses.replace(acc, noise_multiplier=floor).check(20)  # affordable: no error
    dataclasses.replace(acc, accountant="rdp", noise_multiplier=0.01).check(20)


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5])
def test_accounting_refuses_delta_outside_0_1(delta):
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        PrivacyAccounting(1.0, 20, "full", delta=delta)


TINY = ["--dataset", "fedprox_synthetic", "--model", "logistic", "--num-clients", "20",
        "--rounds", "4", "--eval-every", "2", "--local-steps", "1", "--cohort-sampling",
        "bernoulli", "--cohort-probability", "0.25", "--cohort-size", "None", "--dp-clip", "1.0",
        "--no-progress"]  # fmt: skip


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--target-epsilon", "0"], "--target-epsilon must be > 0"),
        (["--target-epsilon", "1e9"], "--target-epsilon 1e+09: target epsilon 1e+09 is met"),
        (["--target-epsilon", "1e-9"], "needs a noise multiplier above 1000"),
        (
            ["--target-epsilon", "1e5", "--dp-accountant", "pld", "--rounds", "200"],
            "use the rdp accountant",
        ),
        (["--dp-noise", "0.01", "--dp-accountant", "pld"], "--dp-accountant pld: noise"),
        (["--dp-delta", "1.5"], "--dp-delta must be in (0, 1)"),
    ],
)
@pytest.mark.parametrize("command", ["run", "sweep"])
def test_cli_refuses_impossible_privacy_up_front(tmp_path, capsys, command, flags, message):
    out = tmp_path / "out"
    assert main([command, *TINY, *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists() or not any(out.iterdir())  # refused before anything was written


def test_history_records_the_accounting(tmp_path):
    """A calibrated run's history.json holds the noise multiplier `calibrated` returns (full
    precision), the sampling, the accountant, delta and the clip norm."""
    out = tmp_path / "run"
    argv = [*TINY, "--target-epsilon", "3", "--dp-accountant", "pld", "--dp-delta", "1e-6"]
    assert main(["run", *argv, "--out", str(out)]) == 0
    meta = json.loads((out / "history.json").read_text())["meta"]["privacy"]
    expected = PrivacyAccounting(
        1.0, 20, "poisson", delta=1e-6, probability=0.25, accountant="pld"
    ).calibrated(3.0, 4)
    assert meta["noise_multiplier"] == expected.noise_multiplier  # exact, not rounded
    assert meta["sampling"] == "poisson"
    assert meta["probability"] == meta["sampling_rate"] == 0.25
    assert meta["expected_cohort"] == 5.0
    assert meta["num_clients"] == 20
    assert meta["accountant"] == "pld"
    assert meta["delta"] == 1e-6
    assert meta["clip_norm"] == 1.0
    assert meta["target_epsilon"] == 3.0
