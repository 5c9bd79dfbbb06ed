"""SCAFFOLD, option II: Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning" (ICML 2020). Baseline of the FedMIM paper; update rules of
`../shared/specs/fedmim.md` section 2.4.

State: global model x, server control variate c, and client control variates c_i for ALL C
clients stacked on axis 0 (`[C, ...]`), all zero at init. Round t, cohort S_t:

    local (K_i steps from y = x_t):  y <- y - eta_l (g_i(y) - c_i + c)
    c_i+ = c_i - c + (x_t - y_K) / (K_i eta_l)                       (option II)
    server:  x_{t+1} = x_t + eta_g Delta_t,   Delta_t = weighted mean of (y_K - x_t)
             c <- c + (1/C) sum_{i in S_t} (c_i+ - c_i);  c_i <- c_i+ for i in S_t only

eta_l is the learning rate of round t (`client_lr` may be a per-round schedule). K_i is the
number of local steps client i executed (K for every client unless `LocalSpec(epochs=...)`).
Only cohort rows of `c_i` are read and written (`.at[idx].set`), so a round costs O(M d), not
O(C d). An empty round (Bernoulli cohort with nobody selected) changes nothing but the round
counter. Deviations: none (aggregation weights follow `CohortSpec.weighting`; the paper's
1/S mean is `weighting="uniform"`, identical to the default count weighting for equal-size
clients).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from fedjax_sim.algorithms.core import (
    Algorithm,
    CohortSpec,
    LocalSpec,
    LossFn,
    Params,
    server_optimizer_from,
    server_update,
    tree_add,
    tree_norm,
    tree_scale,
    tree_sub,
)
from fedjax_sim.algorithms.stateful import check_cohort, client_state_round
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.parallel import ClientMap
from fedjax_sim.schedules import LearningRate, client_sgd, lr_at


@struct.dataclass
class ScaffoldState:
    params: Params  # x_t
    opt_state: Any  # server optimizer (SGD with eta_g) state
    control: Params  # c
    client_controls: Params  # c_i, leaves [C, ...]
    round: jax.Array  # [] int32


def control_variate_grad_fn(c_i: Params, c: Params):
    """Local-step hook: direction `g - c_i + c`."""

    def grad_fn(value_and_grad, params, batch, aux):
        loss, g = value_and_grad(params, batch)
        return loss, jax.tree.map(lambda g_, ci, c_: g_ - ci + c_, g, c_i, c), aux

    return grad_fn


def scaffold(
    loss_fn: LossFn,
    *,
    num_clients: int,
    client_lr: LearningRate = 0.1,
    weight_decay: float = 0.0,
    server_lr: float = 1.0,
    local: LocalSpec = LocalSpec(),
    cohort: CohortSpec = CohortSpec(),
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """SCAFFOLD (option II) with control variates for all `num_clients` clients.

    Args:
      loss_fn: `loss_fn(params, batch)`, e.g. `model.loss`.
      num_clients: C, the number of clients of the data (rows of the `[C, ...]` state).
      client_lr: local SGD learning rate eta_l, a float or a per-round schedule
        (`schedules.round_decay(0.1, 0.998)` is the FedMIM paper's).
      weight_decay: decay `wd * y` added to the local direction (`optax.add_decayed_weights`).
      server_lr: global learning rate eta_g.
      local, cohort, client_map: local work, participation (uniform or Bernoulli), mapping.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    check_cohort(cohort)
    client_optimizer = client_sgd(client_lr, weight_decay)
    server_opt = server_optimizer_from(server_lr)

    def init(params: Params, key: jax.Array) -> ScaffoldState:
        del key
        zeros = jax.tree.map(jnp.zeros_like, params)
        return ScaffoldState(
            params=params,
            opt_state=server_opt.init(params),
            control=zeros,
            client_controls=jax.tree.map(
                lambda p: jnp.zeros((num_clients, *p.shape), p.dtype), params
            ),
            round=jnp.int32(0),
        )

    def step(state: ScaffoldState, data: FederatedData, key: jax.Array):
        x, c = state.params, state.control
        eta = lr_at(client_lr, state.round)

        def update_client(c_i, delta, steps):
            scale = -1.0 / (jnp.maximum(steps, 1) * eta)  # (x_t - y_K)/(K eta) = -Delta/(K eta)
            return tree_add(tree_sub(c_i, c), tree_scale(delta, scale))

        out = client_state_round(
            x,
            state.client_controls,
            data,
            key,
            state.round,
            loss_fn=loss_fn,
            client_optimizer=client_optimizer,
            local=local,
            cohort=cohort,
            client_map=client_map,
            make_grad_fn=lambda c_i: control_variate_grad_fn(c_i, c),
            update_client=update_client,
            up_models=2.0,
            down_models=2.0,
        )
        params, opt_state = server_update(
            x, out.mean_delta, server_opt, state.opt_state, apply=out.contributed
        )
        control = tree_add(c, tree_scale(out.state_change_sum, 1.0 / data.num_clients))
        new = ScaffoldState(params, opt_state, control, out.client_state, state.round + 1)
        return new, {**out.metrics, "control_norm": tree_norm(control)}

    return Algorithm(init, step)
