"""FedSAM: Qu et al., "Generalized Federated Learning via Sharpness Aware Minimization"
(ICML 2022). Baseline of the FedMIM paper; rules of `docs/specs/fedmim.md` section 2.4.
Every local step is a SAM step on its minibatch xi (the `sam(rho)` hook):

    g = grad f_i(x; xi);  e = rho g / ||g||;  g~ = grad f_i(x + e; xi);  x <- x - eta_l g~

(`e = 0` when `g = 0`; ||.|| is the global norm). The reported train loss is the loss at x.
MoFedSAM is in `fedcm.py`.
"""

from __future__ import annotations

from fedjax_sim.algorithms.compose import Options, preset, synchronous
from fedjax_sim.algorithms.core import Algorithm, LossFn
from fedjax_sim.algorithms.hooks import sam


@preset()
def fedsam(loss_fn: LossFn, *, rho: float = 0.1, options: Options) -> Algorithm:
    """FedSAM: FedAvg whose local steps are SAM steps of radius `rho` (>= 0; 0 is FedAvg;
    0.1 as in the authors' group's code)."""
    return synchronous(loss_fn, options, sam(rho))
