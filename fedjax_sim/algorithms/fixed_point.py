"""Federated fixed-point algorithms: FedAvg / FedProx as local operators (Algorithm 1) and
their error-feedback versions EF-FedAvg / EF-FedProx (Algorithm 2), with step-size schedules.

Beikmohammadi, Khirirat, Magnusson, "On the Convergence of Federated Learning Algorithms
without Data Similarity" (IEEE Trans. Big Data 2024); spec
`docs/specs/stepsizes_no_similarity.md`.

Round k with schedule value `s_k` (`fedjax_sim.algorithms.schedules`): every client applies a local
operator from the broadcast model, `x_i^k = T_{s_k F_i}^T(x^k)`, and the server averages,
`x^{k+1} = x^k + sum_i w_i (x_i^k - x^k)` (delta form, equal to the paper's mean of models in
exact arithmetic). With a compressor, clients run error feedback (the `error_feedback`
aggregator): `u_i = x_i^k - x^k + e_i`, upload `Q(u_i)`, keep `e_i <- u_i - Q(u_i)`. All of
it is `compose` configured by a `LocalOperator` (local work, client step, hooks):

- `local_sgd`: T local SGD steps, fresh minibatch each, lr `s_k / T` (`divide_by_T=True`, the
  theory) or `s_k` (`False`, the authors' experiments).
- `inexact_prox`: one prox application `prox_{s_k F_i(.; xi)}(x^k)` on one fixed minibatch,
  solved by J GD steps on `F_i(y; xi) + ||y - x^k||^2 / (2 s_k)` (mu = 1/s_k) with inner lr
  `min(inner_lr, s_k)` (`cap_inner_lr=True`, spec 7.2: uncapped lr 0.1 diverges once
  s_k <= 0.05, which the paper's diminishing / step-decay schedules reach). J = 1 with
  `cap_inner_lr=False` is the effective update of the authors' released FedProx runs.
  Spec 7.2 calls the capped solver safe for the fixed schedule; it is not in general: with
  lr = s_k every inner step is `y <- x^k - s_k grad F_i(y; xi)`, which converges only while
  `s_k * lambda_max(hess F_i(.; xi)) < 1`. For the paper's CNN at s = 0.1 the minibatch
  curvature exceeds 10 after ~8 rounds and FedProx diverges (experiments/README.md); pass a
  smaller `inner_lr` (GD on the prox objective is stable while `inner_lr (L + 1/s_k) < 2`).
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
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from fedjax_sim.algorithms.aggregators import error_feedback
from fedjax_sim.algorithms.compose import Options, preset, synchronous
from fedjax_sim.algorithms.compression import Compressor, make
from fedjax_sim.algorithms.core import Algorithm, CohortSpec, LocalSpec, LossFn, Sampling
from fedjax_sim.algorithms.hooks import proximal
from fedjax_sim.algorithms.local_hook import LocalHook
from fedjax_sim.algorithms.schedules import Schedule, constant
from fedjax_sim.core.checks import positive

StepSize = float | Schedule


@dataclasses.dataclass(frozen=True)
class LocalOperator:
    """`T_{sF_i}^T` as client work: local loop, client step and hooks, all functions of the
    round's step size `s_k`.

    Attributes:
      local: the local loop (steps, minibatch size, sampling).
      client_lr: `s_k -> client learning rate` (SGD).
      hooks: `s -> hooks`, with `s` the schedule of the round (e.g. the proximal term 1/s_k).
      name: for messages.
    """

    local: LocalSpec
    client_lr: Callable[[jax.Array], jax.Array]
    hooks: Callable[[Schedule], tuple[LocalHook, ...]] = lambda schedule: ()
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
    return LocalOperator(local, lambda s: s * scale, name="local_sgd")


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
    positive("inner_lr", inner_lr)
    local = LocalSpec(steps=inner_steps, batch_size=batch_size, sampling="fixed")
    lr = (lambda s: jnp.minimum(inner_lr, s)) if cap_inner_lr else (lambda s: inner_lr)
    return LocalOperator(
        local, lr, lambda schedule: (proximal(lambda r: 1.0 / schedule(r)),), "inexact_prox"
    )


def exact_prox_step(schedule: Schedule) -> LocalHook:
    """Hook whose direction is `x - prox_{s F}(x) = s (I + s H)^{-1} grad F(x)` for the
    minibatch loss F and the round's step `s = schedule(round)` (exact when F is quadratic);
    with `optax.sgd(1)` one local step lands on the prox point. `H` is the `[d, d]` Hessian
    of F: meant for small models."""

    def direction(value_and_grad, params, batch, carry, ctx):
        step = schedule(ctx.round)
        loss, grads = value_and_grad(params, batch)
        flat, unravel = ravel_pytree(params)
        grad_flat = ravel_pytree(grads)[0]
        hess = jax.jacfwd(lambda v: ravel_pytree(value_and_grad(unravel(v), batch)[1])[0])(flat)
        system = jnp.eye(flat.shape[0], dtype=hess.dtype) + step * hess
        return loss, unravel(step * jnp.linalg.solve(system, grad_flat)), carry

    return LocalHook("exact_prox", direction)


def exact_prox(batch_size: int | None = None) -> LocalOperator:
    """FedProx's operator in closed form for quadratic losses: `p = prox_{s_k F_i(.; xi)}(x^k)`
    on one fixed minibatch of `batch_size` (None: the client's full data, F_i = f_i)."""
    if batch_size is None:
        local = LocalSpec(steps=1, sampling="full")
    else:
        local = LocalSpec(steps=1, batch_size=batch_size, sampling="fixed")
    return LocalOperator(
        local, lambda s: 1.0, lambda schedule: (exact_prox_step(schedule),), "exact_prox"
    )


def as_schedule(step_size: StepSize) -> Schedule:
    """A float is a constant schedule (a traced scalar too: sweeps over the step size)."""
    if isinstance(step_size, (int, float)):
        return constant(float(step_size))
    if isinstance(step_size, jax.Array) and step_size.ndim == 0:
        positive("step size", step_size)
        return lambda count: jnp.full(jnp.shape(count), step_size)
    if not callable(step_size):
        raise ValueError(f"step size must be a float or a schedule, got {step_size!r}")
    return step_size


def _operator_algorithm(
    loss_fn: LossFn,
    operator: LocalOperator,
    options: Options,
    compressor: Compressor | None,
) -> Algorithm:
    """Algorithm 1 (no `compressor`) or 2 (error feedback) with `operator` and the schedule
    `options.client_optimizer` (`s_k`)."""
    schedule = as_schedule(options.client_optimizer)
    aggregator = options.aggregator
    if compressor is not None:
        if options.num_clients is None:
            raise ValueError("error feedback needs num_clients (rows of the error memory)")
        aggregator = error_feedback(compressor, aggregator)
    o = dataclasses.replace(
        options,
        client_optimizer=lambda r: operator.client_lr(schedule(r)),
        local=operator.local,
        aggregator=aggregator,
    )
    return synchronous(loss_fn, o, *operator.hooks(schedule))


def fixed_point(
    loss_fn: LossFn,
    *,
    operator: LocalOperator,
    step_size: StepSize,
    compressor: Compressor | None = None,
    num_clients: int | None = None,
    **options,
) -> Algorithm:
    """Algorithm 1 (`compressor=None`) or Algorithm 2 (error feedback with `compressor`, per-
    client error memory for `num_clients` clients) with local `operator` and schedule
    `step_size` (`s_k`, a float or `fedjax_sim.algorithms.schedules` schedule of the round);
    `options` are `compose.Options` (default uniform weighting, as the paper)."""
    o = dataclasses.replace(
        Options(cohort=CohortSpec(weighting="uniform")),
        client_optimizer=step_size,
        num_clients=num_clients,
        **options,
    )
    return _operator_algorithm(loss_fn, operator, o, compressor)


# ------------------------------------------------------------------------------ named algorithms
def _compressor(compressor: Compressor | str | None, fraction: float) -> Compressor | None:
    if compressor is None or not isinstance(compressor, str):
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


def _sgd_operator(local: LocalSpec, divide_by_T: bool, name: str) -> LocalOperator:
    if local.epochs is not None:
        raise ValueError(f"{name} runs a fixed number of local steps T; set local.steps")
    steps, batch = local.steps, local.batch_size
    return local_sgd(steps, batch, divide_by_T=divide_by_T, sampling=local.sampling)


FIXED_POINT = dict(
    client_optimizer=0.1,
    local=LocalSpec(steps=30, batch_size=64),
    cohort=CohortSpec(weighting="uniform"),
)


@preset(fixed=("weight_decay",), **FIXED_POINT)
def fp_fedavg(
    loss_fn: LossFn,
    *,
    divide_by_T: bool = True,
    compressor: Compressor | str | None = None,
    compression_fraction: float = 0.01,
    options: Options,
) -> Algorithm:
    """Full-precision FedAvg of Beikmohammadi et al. (Alg. 1): T = local.steps SGD steps with
    lr s_k/T (or s_k); `client_optimizer` is the step size s_k (a float or a schedule). With
    a `compressor` (a `compression` compressor or its name; top-k / random-k keep
    `compression_fraction`): Alg. 2, error feedback with per-client memory (`num_clients`)
    around `aggregator` (the mean by default) — `ef_fedavg`."""
    op = _sgd_operator(options.local, divide_by_T, "fp_fedavg")
    return _operator_algorithm(loss_fn, op, options, _compressor(compressor, compression_fraction))


@preset(fixed=("local", "weight_decay"), **FIXED_POINT)
def fp_fedprox(
    loss_fn: LossFn,
    *,
    inner_steps: int = 30,
    inner_lr: float = 0.1,
    batch_size: int | None = 64,
    cap_inner_lr: bool = True,
    exact: bool = False,
    compressor: Compressor | str | None = None,
    compression_fraction: float = 0.01,
    options: Options,
) -> Algorithm:
    """Full-precision FedProx of Beikmohammadi et al. (Alg. 1): one prox_{s_k F_i(.; xi)} per
    round with s_k = `client_optimizer` (inner GD solver, or `exact=True` closed form for
    quadratic losses). With a `compressor`: Alg. 2, error feedback — `ef_fedprox`."""
    op = _prox_operator(inner_steps, inner_lr, batch_size, cap_inner_lr, exact)
    return _operator_algorithm(loss_fn, op, options, _compressor(compressor, compression_fraction))


# Alg. 2 of Beikmohammadi et al.: the paper's top-1% uploads with error feedback
ef_fedavg = functools.partial(fp_fedavg, compressor="top_k")
ef_fedprox = functools.partial(fp_fedprox, compressor="top_k")
