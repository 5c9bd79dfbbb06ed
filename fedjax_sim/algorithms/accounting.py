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
is at most a target, by bisection in a bracket: RDP's over `Z_RANGE`; PLD's from RDP's z
downwards, never below where a PLD table is affordable (`pld_floor`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from typing import Any, Literal

from fedjax_sim.core import extras

dp_accounting = extras.load("dp_accounting", "privacy", "fedjax_sim.algorithms.accounting")

Sampling = Literal["poisson", "uniform", "full"]

Z_RANGE = (1e-3, 1e3)
"""Noise multipliers a calibration searches (a target outside their epsilons is refused;
above 1e3 RDP's epsilon stalls at its largest order's bound and then drops to 0)."""
PLD_INTERVAL = 1e-3
"""Value discretization interval of the PLD accountant. Measured against dp_accounting's
default 1e-4: epsilon 4e-4 higher (relative, still an upper bound), 8x faster, 10x smaller."""
PLD_MAX_ENTRIES = 5e5
"""Largest PLD table (`pld_entries`) an evaluation may build: about 2 s per evaluation on a
loaded CPU core (z = 1e-3 over 20 rounds would need 4e10 entries at interval 1e-4, 301 GiB)."""


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
        """A fresh RDP or PLD accountant of dp_accounting for this sampling."""
        if self.accountant == "pld":
            return dp_accounting.pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL)
        relation = (
            dp_accounting.NeighboringRelation.REPLACE_ONE
            if self.sampling == "uniform"
            else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
        )
        return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)

    @property
    def sampling_rate(self) -> float:
        """The probability that a given client takes part in a round (q, M / C or 1)."""
        if self.sampling == "poisson":
            return float(self.probability)
        if self.sampling == "uniform":
            return self.cohort_size / self.num_clients
        return 1.0

    def record(self) -> dict[str, Any]:
        """Every field, the sampling rate and the expected cohort, for a run's history."""
        rate = self.sampling_rate
        return {
            **dataclasses.asdict(self),
            "sampling_rate": rate,
            "expected_cohort": rate * self.num_clients,
        }

    def check(self, rounds: int) -> None:
        """ValueError (one line) if the PLD accountant cannot afford z over `rounds` rounds."""
        if self.accountant != "pld" or self.noise_multiplier == 0:
            return
        floor = pld_floor(self, rounds)
        if self.noise_multiplier < floor:
            raise ValueError(
                f"noise multiplier {self.noise_multiplier:g} over {rounds} rounds is below "
                f"{floor:.4g}, where a PLD table exceeds {PLD_MAX_ENTRIES:g} entries: use the "
                "rdp accountant"
            )

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


def _pld_scale(acc: PrivacyAccounting, rounds: int) -> tuple[float, float]:
    """(a, b) of the PLD table size estimate `(a / z^2 + b / z) / PLD_INTERVAL`.

    Full participation: the privacy loss of T Gaussian rounds is Gaussian with std
    sqrt(T) / z, kept to about +-8 std (16 sqrt(T) / z; 20 here). Poisson sampling: one
    round's loss spans about 1 / (2 z^2) + 10 / z, and k rounds that all sample the client
    (probability q^k, kept down to 1e-15) add up: k = min(T, 34.5 / ln(1 / q)) spans. Measured
    at interval 1e-3 (entries / estimate): full z = 3, T = 4: 1.3e4 / 1.5e4; z = 0.027,
    T = 20: 2.7e6 / 3.3e6; Poisson q = 0.1, z = 0.027, T = 20: 1.2e7 / 1.6e7; q = 0.01,
    z = 0.2, T = 1000: 4.1e5 / 4.7e5."""
    if acc.sampling == "full" or acc.probability == 1:
        return 0.0, 20.0 * math.sqrt(rounds)
    k = min(rounds, 34.5 / -math.log(acc.probability))
    return k / 2.0, 10.0 * k


def pld_entries(acc: PrivacyAccounting, rounds: int, noise_multiplier: float) -> float:
    """An upper estimate of the size of the PLD table of `rounds` rounds at z."""
    a, b = _pld_scale(acc, rounds)
    return (a / noise_multiplier**2 + b / noise_multiplier) / PLD_INTERVAL


def pld_floor(acc: PrivacyAccounting, rounds: int) -> float:
    """The smallest z whose PLD table over `rounds` rounds is affordable:
    `pld_entries = PLD_MAX_ENTRIES`, solved for u = 1 / z (a u^2 + b u = n I)."""
    a, b = _pld_scale(acc, rounds)
    c = PLD_MAX_ENTRIES * PLD_INTERVAL
    u = c / b if a == 0 else (math.sqrt(b * b + 4.0 * a * c) - b) / (2.0 * a)
    return 1.0 / u


@functools.lru_cache(maxsize=64)
def calibrate_noise(
    acc: PrivacyAccounting, target_epsilon: float, rounds: int, *, tolerance: float = 1e-3
) -> float:
    """The smallest noise multiplier z (to `tolerance` relative) whose epsilon at `acc.delta`
    after `rounds` rounds is <= `target_epsilon`.

    RDP: bisection of z over `Z_RANGE`. PLD: RDP's z is the upper end of the bracket (RDP's
    epsilon bounds the true one from above, PLD's is within its discretization of it); the
    lower end shrinks from it by 0.8 until epsilon exceeds the target, never below
    `pld_floor(acc, rounds)`. ValueError (one line) for a target out of reach in that range.
    """
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target epsilon must be a finite number > 0, got {target_epsilon}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")

    def eps(z: float) -> float:
        return _epsilon(dataclasses.replace(acc, noise_multiplier=z), rounds)

    if acc.accountant == "rdp":
        lo, hi = Z_RANGE
        if eps(hi) > target_epsilon:
            raise ValueError(
                f"target epsilon {target_epsilon:g} at delta {acc.delta:g} after {rounds} rounds "
                f"needs a noise multiplier above {hi:g}"
            )
        if eps(lo) <= target_epsilon:
            raise ValueError(
                f"target epsilon {target_epsilon:g} is met already at noise multiplier {lo:g} "
                f"(epsilon {eps(lo):.4g}): no privacy to speak of"
            )
        return _bisect(eps, target_epsilon, lo, hi, tolerance)
    hi = calibrate_noise(dataclasses.replace(acc, accountant="rdp"), target_epsilon, rounds)
    floor = pld_floor(acc, rounds)
    while hi >= floor and eps(hi) > target_epsilon:  # PLD's discretization above RDP's bound
        hi *= 1.25
    lo = hi
    while lo > floor and eps(lo) <= target_epsilon:
        hi, lo = lo, max(floor, 0.8 * lo)
    if lo < floor or eps(lo) <= target_epsilon:  # below the floor: never evaluated
        raise ValueError(
            f"target epsilon {target_epsilon:g} after {rounds} rounds needs a noise multiplier "
            f"below {floor:.4g}, where a PLD table exceeds {PLD_MAX_ENTRIES:g} entries: use the "
            "rdp accountant"
        )
    return _bisect(eps, target_epsilon, lo, hi, tolerance)


def _bisect(
    eps: Callable[[float], float], target: float, lo: float, hi: float, tolerance: float
) -> float:
    """Geometric bisection of a bracket with eps(lo) > target >= eps(hi): the upper end once
    hi <= lo (1 + tolerance)."""
    while hi > lo * (1.0 + tolerance):
        mid = math.sqrt(lo * hi)
        if eps(mid) <= target:
            hi = mid
        else:
            lo = mid
    return float(hi)
