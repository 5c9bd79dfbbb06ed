"""SCAFFOLD, option II: Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning" (ICML 2020). Baseline of the FedMIM paper; update rules of
`docs/specs/fedmim.md` section 2.4, as the preset `control_variates()` hook:

    local (K_i steps from y = x_t):  y <- y - eta_l (g_i(y) - c_i + c)
    c_i+ = c_i - c + (x_t - y_K) / (K_i eta_l)                       (option II)
    server:  x_{t+1} = x_t + eta_g Delta_t,   Delta_t = weighted mean of (y_K - x_t)
             c <- c + (1/C) sum_{i in S_t} (c_i+ - c_i);  c_i <- c_i+ for i in S_t only

eta_l is the client learning rate of round t (a float or a schedule); the server step is any
server optimizer (a float eta_g is SGD). Only cohort rows of `c_i` are read and written, so
a round costs O(M d). An empty round (Bernoulli cohort with nobody selected) changes nothing
but the round counter. The paper's 1/S mean is `weighting="uniform"` (identical to the
default count weighting for equal-size clients).
"""

from __future__ import annotations

from fedjax_sim.algorithms.compose import Options, preset, synchronous
from fedjax_sim.algorithms.core import Algorithm, LossFn
from fedjax_sim.algorithms.hooks import control_variates


@preset()
def scaffold(loss_fn: LossFn, *, num_clients: int, options: Options) -> Algorithm:
    """SCAFFOLD (option II) with control variates c_i for all `num_clients` clients."""
    del num_clients  # in options: rows of the [C, ...] state
    return synchronous(loss_fn, options, control_variates())
