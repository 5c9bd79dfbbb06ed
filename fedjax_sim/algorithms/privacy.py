"""User-level differential privacy as an aggregator: DP-FedAvg with fixed or adaptive clipping.

McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language Models"
(ICLR 2018) (DP-FedAvg); Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private
Learning with Adaptive Clipping" (NeurIPS 2021) (adaptive clipping, their Algorithm 1).

Round t, cohort S_t (Poisson / Bernoulli with probability q, or M uniformly without
replacement, or everybody):

    client i:  Delta_i <- Delta_i min(1, C_t / ||Delta_i||)          (global L2 norm)
               b_i     <- 1[||Delta_i|| <= C_t] - 1/2                (adaptive clipping only)
    server:    update  = (sum_i Delta_i + N(0, (z_Delta C_t)^2 I)) / m      m = E|S_t|
               b_bar   = (sum_i b_i + N(0, sigma_b^2)) / m + 1/2
               C_{t+1} = C_t exp(-eta_C (b_bar - gamma))                  (geometric update)

The denominator m is the *expected* cohort size (q C, M or C), a constant: dividing by the
realised count would leak who took part (and `optax.contrib.differentially_private_aggregate`
divides by the leading-axis length, i.e. counts padding slots of a masked cohort). The noise
multiplier `z` is that of the whole release: with adaptive clipping the update's noise
multiplier is `z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2` (Andrew et al., Thm. 1), so that the
update and the count together are one Gaussian mechanism with multiplier `z` and the
accountant (`fedjax_sim.algorithms.accounting`) counts one event per round.

Requirements and deviations (stated):
- The cohort weights must be 1 for participants and 0 for padding / empty clients
  (`CohortSpec(weighting="uniform")`; the CLI sets it): with example-count weights the
  sensitivity would be `max_i n_i C`. The metric `dp_unit_weights` is 1 when that holds.
- Clipping uses `jax_privacy.clipping.clip_pytree` (global norm over all leaves).
- A round in which no client took part leaves the model unchanged (`compose` skips the
  server update when the total weight is 0); with Poisson cohorts this happens with
  probability (1 - q)^C, negligible for the settings the accountant is used with.
- Compression composes as `compressed(Q, dp_mean(...))` (compress, then clip, so the
  sensitivity bound holds); the server optimizer sees the noised update (DP-FedAdam etc.).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.aggregators import Aggregator
from fedjax_sim.algorithms.core import CohortSpec, float_dtype
from fedjax_sim.core import extras
from fedjax_sim.core.checks import non_negative, positive
from fedjax_sim.data.federated import tree_size_bytes

SERVER_NOISE = 0x7FFFFFFF  # folded into the uplink key for the server's noise (not a client id)


@dataclasses.dataclass(frozen=True)
class AdaptiveClipping:
    """Andrew et al. (2021) adaptive clipping: the clip norm tracks the `target_quantile`
    (gamma) of the cohort's update norms by the geometric rule with `learning_rate` (eta_C);
    `count_noise` is sigma_b, the std of the noise on the count of unclipped updates (None:
    the paper's m / 20)."""

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise: float | None = None

    def __post_init__(self):
        if not 0.0 < self.target_quantile < 1.0:
            raise ValueError(f"target_quantile must be in (0, 1), got {self.target_quantile}")
        positive("adaptive clipping learning_rate", self.learning_rate)
        if self.count_noise is not None:
            non_negative("count_noise", self.count_noise)


def expected_cohort_size(cohort: CohortSpec, num_clients: int) -> float:
    """m = E|S_t|: q C for Bernoulli (Poisson) cohorts, M for uniform ones, C for full
    participation. Proportional sampling (with replacement) is refused."""
    if cohort.sampling == "bernoulli":
        return float(cohort.probability) * num_clients
    if cohort.sampling == "proportional":
        raise ValueError("DP needs uniform or bernoulli cohorts, not proportional sampling")
    return float(num_clients if cohort.size is None else cohort.size)


def update_noise_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2 (Andrew et al. 2021, Thm. 1); z if sigma_b = 0
    or z = 0."""
    if noise_multiplier == 0 or count_noise == 0:
        return float(noise_multiplier)
    rest = noise_multiplier**-2 - (2.0 * count_noise) ** -2
    if rest <= 0:
        raise ValueError(
            f"adaptive clipping: the count noise sigma_b={count_noise} leaves no budget for "
            f"the update at noise multiplier {noise_multiplier}: need 2 sigma_b > z"
        )
    return float(rest**-0.5)


def dp_mean(
    noise_multiplier: float,
    clip_norm: float,
    expected_cohort: float,
    *,
    adaptive: AdaptiveClipping | None = None,
) -> Aggregator:
    """DP-FedAvg's aggregator (see the module docstring).

    Args:
      noise_multiplier: z >= 0 (noise std / sensitivity of the whole per-round release).
      clip_norm: C > 0 (the initial clip norm with `adaptive`).
      expected_cohort: m = E|S_t| > 0, the fixed denominator (`expected_cohort_size`).
      adaptive: adaptive clipping (Andrew et al. 2021), or None for a fixed C.

    Sent per client: `(clipped Delta_i, b_i)`; server state `{"clip": [] C_t}`. Metrics:
    `dp_clip_norm` (C_t used this round), `dp_unclipped_fraction` (noised b_bar; adaptive
    only), `dp_unit_weights`.
    """
    clip_pytree = extras.load("jax_privacy.clipping", "privacy", "dp_mean").clip_pytree
    non_negative("noise multiplier", noise_multiplier)
    positive("clip norm", clip_norm)
    positive("expected cohort size", expected_cohort)
    sigma_b = 0.0
    if adaptive is not None:
        sigma_b = expected_cohort / 20.0 if adaptive.count_noise is None else adaptive.count_noise
        if noise_multiplier == 0:
            sigma_b = 0.0
    z_update = update_noise_multiplier(noise_multiplier, sigma_b)
    m = float(expected_cohort)

    def init(params, num_clients):
        return {"clip": jnp.asarray(clip_norm, float_dtype())}, {}

    def encode(update, rows, key, server):
        c = server["clip"]
        clipped, norm = clip_pytree(update, c)  # (clipped tree, its original norm)
        return (clipped, (norm <= c).astype(jnp.float32) - 0.5), rows

    def reduce(server, total, weight, stacked, cohort, key):
        total_update, count = total
        c = server["clip"]
        key = jax.random.fold_in(key, SERVER_NOISE)
        k_update, k_count = jax.random.split(key)
        leaves, treedef = jax.tree.flatten(total_update)
        keys = jax.random.split(k_update, len(leaves))
        noised = [
            (x + (z_update * c) * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype) / m
            for x, k in zip(leaves, keys, strict=True)
        ]
        update = jax.tree.unflatten(treedef, noised)
        unit = jnp.all((cohort.weights == 0) | (cohort.weights == 1)).astype(jnp.float32)
        metrics = {"dp_clip_norm": c, "dp_unit_weights": unit}
        if adaptive is not None:
            b_bar = (count + sigma_b * jax.random.normal(k_count, ())) / m + 0.5
            c = c * jnp.exp(-adaptive.learning_rate * (b_bar - adaptive.target_quantile))
            metrics["dp_unclipped_fraction"] = b_bar
        return update, {"clip": c.astype(float_dtype())}, metrics

    return Aggregator(
        init=init,
        encode=encode,
        reduce=reduce,
        payload=lambda params: float(tree_size_bytes(params)) + (4.0 if adaptive else 0.0),
        private=True,
    )


def dp_noise_std(noise_multiplier: float, clip_norm: float, expected_cohort: float) -> float:
    """The per-coordinate std of the noise in the update: z C / m (fixed clipping)."""
    return noise_multiplier * clip_norm / expected_cohort


__all__ = [
    "AdaptiveClipping",
    "dp_mean",
    "dp_noise_std",
    "expected_cohort_size",
    "update_noise_multiplier",
]
