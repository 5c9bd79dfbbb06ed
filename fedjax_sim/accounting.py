"""Privacy accounting of DP-FedAvg (`algorithms.privacy.dp_mean`) with Google's
`dp_accounting` library (RDP: Mironov 2017, Mironov et al. 2019, Wang et al. 2019; PLD:
Koskela et al. 2020, Doroshenko et al. 2022), on the host, once per evaluation.

One round is one Gaussian mechanism with noise multiplier z on the clipped sum (sensitivity C
under adding / removing one client, since the denominator is fixed), amplified by the cohort
sampling, composed over T rounds (`SelfComposedDpEvent`):

- Bernoulli (Poisson) cohorts with probability q: `PoissonSampledDpEvent(q, Gaussian(z))`
  (add / remove one client; RDP or PLD accountant).
- M clients uniformly without replacement out of C:
  `SampledWithoutReplacementDpEvent(C, M, Gaussian(z / 2))` under the replace-one
  relation (RDP accountant only): replacing a client moves the clipped sum by up to 2C,
  so the noise multiplier relative to that sensitivity is z / 2 (jax-privacy's
  `DpsgdTrainingAccountant` makes the same doubling for fixed-size batches).
- Full participation: `Gaussian(z)` without amplification.

`calibrate_noise` finds the smallest z (to a relative tolerance) whose epsilon after T rounds
is at most a target, with `dp_accounting.calibrate_dp_mechanism`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from typing import Literal

import dp_accounting
from dp_accounting import pld, rdp

Sampling = Literal["poisson", "uniform", "full"]


@contextlib.contextmanager
def _quiet():
    """dp_accounting's RDP logs a warning per fractional order it excludes: silence absl."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@dataclasses.dataclass(frozen=True)
class PrivacyAccounting:
    """The privacy of a DP-FedAvg run.

    Attributes:
      noise_multiplier: z (0: no privacy, epsilon = inf).
      num_clients: C.
      sampling: "poisson" (Bernoulli cohorts, `probability` q), "uniform" (`cohort_size` M
        without replacement) or "full".
      delta: the target delta.
      probability: q of Poisson sampling.
      cohort_size: M of uniform sampling.
      accountant: "rdp" or "pld" ("uniform" sampling needs "rdp").
    """

    noise_multiplier: float
    num_clients: int
    sampling: Sampling
    delta: float = 1e-5
    probability: float | None = None
    cohort_size: int | None = None
    accountant: Literal["rdp", "pld"] = "rdp"

    def __post_init__(self):
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"noise multiplier must be >= 0, got {self.noise_multiplier}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if self.sampling == "poisson" and not (
            self.probability is not None and 0 < self.probability <= 1
        ):
            raise ValueError(
                f"poisson sampling needs a probability in (0, 1], got {self.probability}"
            )
        if self.sampling == "uniform":
            if not (self.cohort_size and 1 <= self.cohort_size <= self.num_clients):
                raise ValueError(
                    f"uniform sampling needs 1 <= cohort_size <= C, got {self.cohort_size}"
                )
            if self.accountant != "rdp":
                raise ValueError(
                    "sampling without replacement is accounted with --dp-accountant rdp"
                )
        if self.sampling not in ("poisson", "uniform", "full"):
            raise ValueError(f"sampling must be poisson|uniform|full, got {self.sampling!r}")
        if self.accountant not in ("rdp", "pld"):
            raise ValueError(f"accountant must be rdp|pld, got {self.accountant!r}")

    def event(self, rounds: int, noise_multiplier: float | None = None) -> dp_accounting.DpEvent:
        """The `DpEvent` of `rounds` rounds (at `noise_multiplier`, default z)."""
        z = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        if z == 0:
            return dp_accounting.NonPrivateDpEvent()
        if self.sampling == "poisson":
            one = dp_accounting.PoissonSampledDpEvent(
                self.probability, dp_accounting.GaussianDpEvent(z)
            )
        elif self.sampling == "uniform":
            one = dp_accounting.SampledWithoutReplacementDpEvent(
                self.num_clients, self.cohort_size, dp_accounting.GaussianDpEvent(z / 2.0)
            )
        else:
            one = dp_accounting.GaussianDpEvent(z)
        return dp_accounting.SelfComposedDpEvent(one, int(rounds))

    def make_accountant(self) -> dp_accounting.PrivacyAccountant:
        if self.accountant == "pld":
            return pld.PLDAccountant()
        relation = (
            dp_accounting.NeighboringRelation.REPLACE_ONE
            if self.sampling == "uniform"
            else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
        )
        return rdp.RdpAccountant(neighboring_relation=relation)

    def epsilon(self, rounds: int) -> float:
        """epsilon at `delta` after `rounds` rounds (0 for 0 rounds, inf for z = 0)."""
        return _epsilon(self, int(rounds))

    def calibrated(self, target_epsilon: float, rounds: int) -> PrivacyAccounting:
        """This accounting with z calibrated for `target_epsilon` after `rounds` rounds."""
        z = calibrate_noise(self, target_epsilon, rounds)
        return dataclasses.replace(self, noise_multiplier=z)


@functools.lru_cache(maxsize=4096)
def _epsilon(acc: PrivacyAccounting, rounds: int) -> float:
    if rounds <= 0:
        return 0.0
    if acc.noise_multiplier == 0:
        return math.inf
    with _quiet():
        accountant = acc.make_accountant()
        accountant.compose(acc.event(rounds))
        return float(accountant.get_epsilon(acc.delta))


@functools.lru_cache(maxsize=64)
def calibrate_noise(
    acc: PrivacyAccounting, target_epsilon: float, rounds: int, *, tolerance: float = 1e-3
) -> float:
    """The noise multiplier z (within `tolerance` relative) whose epsilon at `acc.delta` after
    `rounds` rounds is <= `target_epsilon` (`dp_accounting.calibrate_dp_mechanism`)."""
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target epsilon must be a finite number > 0, got {target_epsilon}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    with _quiet():
        z = _calibrate(acc, target_epsilon, rounds)
    # calibrate_dp_mechanism returns the upper end of its bracket (epsilon <= target); refine
    # it by bisection down to the tolerance
    lo, hi = z * (1 - 0.05), z
    eps = lambda v: _epsilon(dataclasses.replace(acc, noise_multiplier=v), rounds)  # noqa: E731
    if eps(lo) <= target_epsilon:
        return float(z)
    while (hi - lo) > tolerance * hi:
        mid = 0.5 * (lo + hi)
        if eps(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return float(hi)


def _calibrate(acc: PrivacyAccounting, target_epsilon: float, rounds: int) -> float:
    return dp_accounting.calibrate_dp_mechanism(
        acc.make_accountant,
        lambda z: acc.event(rounds, z),
        target_epsilon,
        acc.delta,
        bracket_interval=dp_accounting.LowerEndpointAndGuess(1e-3, 1.0),
        tol=None,
    )
