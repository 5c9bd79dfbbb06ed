"""Federated fixed-point algorithms: FedAvg / FedProx as local operators (Algorithm 1) and
their error-feedback versions EF-FedAvg / EF-FedProx (Algorithm 2), with step-size schedules.

Beikmohammadi, Khirirat, Magnusson, "On the Convergence of Federated Learning Algorithms
without Data Similarity" (IEEE Trans. Big Data 2024); spec
`../shared/specs/stepsizes_no_similarity.md`.

Round k with schedule value `s_k` (`fedjax_sim.schedules`): every client applies a local
operator from the broadcast model, `x_i^k = T_{s_k F_i}^T(x^k)`, and the server averages,
`x^{k+1} = x^k + sum_i w_i (x_i^k - x^k)` (delta form, equal to the paper's mean of models in
exact arithmetic). With a compressor, clients run error feedback (`ErrorFeedback`):
`u_i = x_i^k - x^k + e_i`, upload `Q(u_i)`, keep `e_i <- u_i - Q(u_i)`. All of it is
`local_update_round` (fedavg.py) configured by a `LocalOperator`:

- `local_sgd`: T local SGD steps, fresh minibatch each, lr `s_k / T` (`divide_by_T=True`, the
  theory) or `s_k` (`False`, the authors' experiments).
- `inexact_prox`: one prox application `prox_{s_k F_i(.; xi)}(x^k)` on one fixed minibatch,
  solved by J GD steps on `F_i(y; xi) + ||y - x^k||^2 / (2 s_k)` (mu = 1/s_k) with inner lr
  `min(inner_lr, s_k)` (`cap_inner_lr=True`, spec 7.2: uncapped lr 0.1 diverges once
  s_k <= 0.05, which the paper's diminishing / step-decay schedules reach). J = 1 with
  `cap_inner_lr=False` is the effective update of the authors' released FedProx runs.
- `exact_prox`: the exact prox for quadratic losses, `p = x - s (I + s H)^{-1} grad F(x)`
  (closed form from the Hessian of the minibatch loss; for non-quadratic losses this is one
  Newton step on the prox subproblem, not the exact prox).

Deviations from the paper: aggregation weights are configurable (`cohort.weighting`: uniform =
paper, counts = the authors' code, spec 7.5); minibatches are drawn with replacement by default
(spec 7.9 allows it; `sampling="epoch"` draws without replacement); partial participation is
possible through `cohort` (not in the paper; non-sending clients keep their error, spec 7.10).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from fedjax_sim.algorithms.core import (
    Algorithm,
    CohortSpec,
    GradFn,
    LocalSpec,
    LossFn,
    Params,
    Sampling,
    Stragglers,
)
from fedjax_sim.algorithms.fedavg import local_update_round
from fedjax_sim.algorithms.fedprox import proximal_grad_fn
from fedjax_sim.compression import Compressor, ErrorFeedback, make
from fedjax_sim.parallel import ClientMap
from fedjax_sim.schedules import Schedule, constant

StepSize = float | Schedule


@dataclasses.dataclass(frozen=True)
class LocalOperator:
    """`T_{sF_i}^T` as a configuration of `local_train`.

    Attributes:
      local: the local loop (steps, minibatch size, sampling).
      optimizer: `s_k -> client optimizer` for the round.
      make_grad_fn: optional `(x^k, s_k) -> grad_fn` hook (proximal term, exact prox).
      name: for messages.
    """

    local: LocalSpec
    optimizer: Callable[[jax.Array], optax.GradientTransformation]
    make_grad_fn: Callable[[Params, jax.Array], GradFn] | None = None
    name: str = "operator"


def local_sgd(
    steps: int = 30,
    batch_size: int = 64,
    *,
    divide_by_T: bool = True,
    sampling: Sampling = "replacement",
) -> LocalOperator:
    """FedAvg's operator: `steps` = T SGD steps `y <- y - eta grad F_i(y; xi_t)`, fresh xi_t,
    `eta = s_k / T` (`divide_by_T`, theory) or `s_k` (the authors' experiments)."""
    local = LocalSpec(steps=steps, batch_size=batch_size, sampling=sampling)
    scale = 1.0 / steps if divide_by_T else 1.0
    return LocalOperator(local, lambda s: optax.sgd(s * scale), None, "local_sgd")


def inexact_prox(
    inner_steps: int = 30,
    inner_lr: float = 0.1,
    batch_size: int = 64,
    *,
    cap_inner_lr: bool = True,
) -> LocalOperator:
    """FedProx's operator solved inexactly: J = `inner_steps` GD steps on ONE minibatch xi,
    `y <- y - lr (grad F_i(y; xi) + (y - x^k) / s_k)`, `lr = min(inner_lr, s_k)` if
    `cap_inner_lr` else `inner_lr` (spec 7.2)."""
    if not inner_lr > 0:
        raise ValueError(f"inner_lr must be > 0, got {inner_lr}")
    local = LocalSpec(steps=inner_steps, batch_size=batch_size, sampling="fixed")

    def optimizer(s):
        return optax.sgd(jnp.minimum(inner_lr, s) if cap_inner_lr else inner_lr)

    return LocalOperator(
        local, optimizer, lambda anchor, s: proximal_grad_fn(anchor, 1.0 / s), "inexact_prox"
    )


def exact_prox_grad_fn(step: jax.Array) -> GradFn:
    """Hook whose direction is `x - prox_{s F}(x) = s (I + s H)^{-1} grad F(x)` for the
    minibatch loss F (exact when F is quadratic); with `optax.sgd(1)` one local step lands on
    the prox point. `H` is the `[d, d]` Hessian of F: meant for small models."""

    def grad_fn(value_and_grad, params, batch, aux):
        loss, grads = value_and_grad(params, batch)
        flat, unravel = ravel_pytree(params)
        grad_flat = ravel_pytree(grads)[0]
        hess = jax.jacfwd(lambda v: ravel_pytree(value_and_grad(unravel(v), batch)[1])[0])(flat)
        system = jnp.eye(flat.shape[0], dtype=hess.dtype) + step * hess
        return loss, unravel(step * jnp.linalg.solve(system, grad_flat)), aux

    return grad_fn


def exact_prox(batch_size: int | None = None) -> LocalOperator:
    """FedProx's operator in closed form for quadratic losses: `p = prox_{s_k F_i(.; xi)}(x^k)`
    on one fixed minibatch of `batch_size` (None: the client's full data, F_i = f_i)."""
    if batch_size is None:
        local = LocalSpec(steps=1, sampling="full")
    else:
        local = LocalSpec(steps=1, batch_size=batch_size, sampling="fixed")
    return LocalOperator(
        local, lambda s: optax.sgd(1.0), lambda anchor, s: exact_prox_grad_fn(s), "exact_prox"
    )


def as_schedule(step_size: StepSize) -> Schedule:
    """A float is a constant schedule."""
    if isinstance(step_size, (int, float)):
        return constant(float(step_size))
    if not callable(step_size):
        raise ValueError(f"step_size must be a float or a schedule, got {step_size!r}")
    return step_size


def fixed_point(
    loss_fn: LossFn,
    *,
    operator: LocalOperator,
    step_size: StepSize,
    compressor: Compressor | None = None,
    num_clients: int | None = None,
    cohort: CohortSpec = CohortSpec(weighting="uniform"),
    server_optimizer: float | optax.GradientTransformation = 1.0,
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """Algorithm 1 (`compressor=None`) or Algorithm 2 (error feedback with `compressor`, per-
    client error memory for `num_clients` clients) with local `operator` and schedule
    `step_size` (`s_k`, a float or `fedjax_sim.schedules` schedule of the round)."""
    schedule = as_schedule(step_size)
    uplink = None
    if compressor is not None:
        if num_clients is None:
            raise ValueError("error feedback needs num_clients (rows of the error memory)")
        uplink = ErrorFeedback(compressor, num_clients)
    make_round_grad_fn = None
    if operator.make_grad_fn is not None:
        make_round_grad_fn = lambda anchor, r: operator.make_grad_fn(anchor, schedule(r))
    return local_update_round(
        loss_fn,
        client_optimizer=lambda r: operator.optimizer(schedule(r)),
        server_optimizer=server_optimizer,
        local=operator.local,
        cohort=cohort,
        stragglers=Stragglers(),
        client_map=client_map,
        make_round_grad_fn=make_round_grad_fn,
        uplink=uplink,
    )


# ------------------------------------------------------------------------------ named algorithms
def _compressor(compressor: Compressor | str, fraction: float) -> Compressor:
    if not isinstance(compressor, str):
        return compressor
    if compressor in ("top_k", "random_k"):
        return make(compressor, fraction=fraction)
    return make(compressor)


def _prox_operator(
    inner_steps: int, inner_lr: float, batch_size: int | None, cap_inner_lr: bool, exact: bool
) -> LocalOperator:
    if exact:
        return exact_prox(batch_size)
    return inexact_prox(inner_steps, inner_lr, batch_size or 64, cap_inner_lr=cap_inner_lr)


def fp_fedavg(
    loss_fn: LossFn,
    *,
    step_size: StepSize = 0.1,
    local: LocalSpec = LocalSpec(steps=30, batch_size=64),
    divide_by_T: bool = True,
    cohort: CohortSpec = CohortSpec(weighting="uniform"),
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """Full-precision FedAvg of Beikmohammadi et al. (Alg. 1): T = local.steps SGD steps with
    lr s_k/T (or s_k), s_k from a step-size schedule."""
    if local.epochs is not None:
        raise ValueError("fp_fedavg runs a fixed number of local steps T; set local.steps")
    op = local_sgd(local.steps, local.batch_size, divide_by_T=divide_by_T, sampling=local.sampling)
    return fixed_point(
        loss_fn, operator=op, step_size=step_size, cohort=cohort, client_map=client_map
    )


def fp_fedprox(
    loss_fn: LossFn,
    *,
    step_size: StepSize = 0.1,
    inner_steps: int = 30,
    inner_lr: float = 0.1,
    batch_size: int | None = 64,
    cap_inner_lr: bool = True,
    exact: bool = False,
    cohort: CohortSpec = CohortSpec(weighting="uniform"),
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """Full-precision FedProx of Beikmohammadi et al. (Alg. 1): one prox_{s_k F_i(.; xi)} per
    round (inner GD solver, or `exact=True` closed form for quadratic losses)."""
    op = _prox_operator(inner_steps, inner_lr, batch_size, cap_inner_lr, exact)
    return fixed_point(
        loss_fn, operator=op, step_size=step_size, cohort=cohort, client_map=client_map
    )


def ef_fedavg(
    loss_fn: LossFn,
    *,
    num_clients: int,
    compressor: Compressor | str = "top_k",
    compression_fraction: float = 0.01,
    step_size: StepSize = 0.1,
    local: LocalSpec = LocalSpec(steps=30, batch_size=64),
    divide_by_T: bool = True,
    cohort: CohortSpec = CohortSpec(weighting="uniform"),
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """Error-feedback FedAvg (Alg. 2 of Beikmohammadi et al.): compressed (top-1% by default)
    uploads with per-client error memory."""
    if local.epochs is not None:
        raise ValueError("ef_fedavg runs a fixed number of local steps T; set local.steps")
    op = local_sgd(local.steps, local.batch_size, divide_by_T=divide_by_T, sampling=local.sampling)
    return fixed_point(
        loss_fn,
        operator=op,
        step_size=step_size,
        compressor=_compressor(compressor, compression_fraction),
        num_clients=num_clients,
        cohort=cohort,
        client_map=client_map,
    )


def ef_fedprox(
    loss_fn: LossFn,
    *,
    num_clients: int,
    compressor: Compressor | str = "top_k",
    compression_fraction: float = 0.01,
    step_size: StepSize = 0.1,
    inner_steps: int = 30,
    inner_lr: float = 0.1,
    batch_size: int | None = 64,
    cap_inner_lr: bool = True,
    exact: bool = False,
    cohort: CohortSpec = CohortSpec(weighting="uniform"),
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """Error-feedback FedProx (Alg. 2 of Beikmohammadi et al.): one prox per round, compressed
    (top-1% by default) uploads with per-client error memory."""
    op = _prox_operator(inner_steps, inner_lr, batch_size, cap_inner_lr, exact)
    return fixed_point(
        loss_fn,
        operator=op,
        step_size=step_size,
        compressor=_compressor(compressor, compression_fraction),
        num_clients=num_clients,
        cohort=cohort,
        client_map=client_map,
    )
