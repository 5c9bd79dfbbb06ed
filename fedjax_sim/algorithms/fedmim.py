"""FedMIM: Liu, Sun, Ding, Shen, Liu, Tao, "Enhance Local Consistency in Federated Learning:
A Multi-Step Inertial Momentum Approach", exactly Algorithm 1 as resolved in
`docs/specs/fedmim.md` (sections 2.1-2.3).

Weights alpha_0..alpha_{J-1} >= 0 (sum < 1; `momentum` here) and beta_0..beta_{J-1} >= 0
(`lookahead` here), index j = 0 the MOST RECENT increment (the paper's Table III is 1-based:
its alpha_1 is momentum[0] here). `A = 1 - sum_j alpha_j`. The server keeps the last J
global increments `delta_{t-j} = (x_{t-j-1} - x_{t-j}) / K` (a `[J, ...]` buffer, zero at init, i.e.
x_{-J} = ... = x_{-1} = x_0). Round t:

    M_t = sum_j alpha_j delta_{t-j}    (inertial shift)     P_t = sum_j beta_j delta_{t-j}
    each cohort client, K steps from x_t:   x <- x - M_t - A eta_l(t) grad f_i(x - P_t; xi)
    x_{t+1} = mean of the cohort's x_{i,K};   push delta_{t+1} = (x_t - x_{t+1}) / K

J = 0 or all alpha = beta = 0 is FedAvg (bit for bit); J = 1, beta = 0 is FedCM with momentum
alpha_0 (exact for a constant lr). The preset is the `multistep_inertia` hook: its direction
`A g(x - P_t) + M_t / eta_l(t)` makes the client SGD step `x - eta_l(t) * direction` exactly
the update above (and alpha = beta = 0 gives FedAvg's operations bit for bit). The history
holds the actual global increments, so any server optimizer may be used (default SGD(1), the
paper's mean).

Decisions (spec section 7): the look-ahead uses Algorithm 1's scale (item 1); every client
knows the history (one global buffer, item 3); weight decay either in the loss
(`Model.with_l2`: evaluated at the look-ahead point and damped by A, the spec's resolution,
item 5) or at the iterate (`weight_decay=`: `x <- x - M - A eta g - eta wd x`, the optax SGD
placement); K is the static local-step count (`LocalSpec.steps`, or the longest client's
count with `LocalSpec(epochs=...)`: use equal-size clients then, item 11).
The server mean uses `CohortSpec.weighting` (the paper's 1/S is `weighting="uniform"`,
identical to count weighting for equal-size clients). With Bernoulli participation an empty
round keeps x_t and pushes delta = 0 (spec 2.3). `bytes_down` counts the cohort's copies of
x_t only (the paper broadcasts x_t to every client so that all of them hold the history).
"""

from __future__ import annotations

from collections.abc import Sequence

from fedjax_sim.algorithms.compose import Options, preset, synchronous
from fedjax_sim.algorithms.core import Algorithm, LossFn
from fedjax_sim.algorithms.hooks import multistep_inertia


@preset()
def fedmim(
    loss_fn: LossFn,
    *,
    momentum: float | Sequence[float] = (0.6, 0.3),
    lookahead: float | Sequence[float] | None = (0.9, 0.1),
    options: Options,
) -> Algorithm:
    """FedMIM (Algorithm 1) with J = len(momentum) inertial steps: `momentum` the paper's
    alpha (newest first, >= 0, sum < 1; default its best (0.6, 0.3); a float is J = 1, `()`
    is FedAvg), `lookahead` its beta (same length; None: zeros; default (0.9, 0.1))."""
    return synchronous(loss_fn, options, multistep_inertia(momentum, lookahead))
