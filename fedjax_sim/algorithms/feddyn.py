"""FedDyn: Acar et al., "Federated Learning Based on Dynamic Regularization" (ICLR 2021).
Baseline of the FedMIM paper (its "prox-weight" a = 0.1); update rules of
`docs/specs/fedmim.md` section 2.4, as the preset `dynamic_regularizer(a)` hook:

    local (K steps from theta = x_t):  theta <- theta - eta_l (g_i(theta) - h_i + a (theta - x_t))
    h_i <- h_i - a (theta_K - x_t)                                    (i in S_t only)
    server:  h <- h - a (1/C) sum_{i in S_t} (theta_{i,K} - x_t)
             x_{t+1} = mean_{i in S_t} theta_{i,K} - h / a

The last line is the server optimizer (default SGD with lr 1) applied to the corrected update
`mean Delta_i - h / a`. Only cohort rows of h_i are read and written: O(M d) per round. An
empty round (Bernoulli cohort with nobody selected) keeps x, h and every h_i.
"""

from __future__ import annotations

from fedjax_sim.algorithms.compose import Options, preset, synchronous
from fedjax_sim.algorithms.core import Algorithm, LossFn
from fedjax_sim.algorithms.hooks import dynamic_regularizer


@preset()
def feddyn(
    loss_fn: LossFn, *, num_clients: int, regularization: float = 0.1, options: Options
) -> Algorithm:
    """FedDyn with coefficient `regularization` (FedDyn's alpha, > 0) and per-client h_i."""
    del num_clients  # in options: rows of the [C, ...] state
    return synchronous(loss_fn, options, dynamic_regularizer(regularization))
