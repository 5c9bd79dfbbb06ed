"""FedAvg and its family as presets of the composable layer (`compose`): FedAvg, FedSGD,
FedProx, FedOpt (FedAvgM, FedAdam, FedYogi, FedAdagrad) and FedNova.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data"
(AISTATS 2017); Li et al., "Federated Optimization in Heterogeneous Networks" (MLSys 2020);
Reddi et al., "Adaptive Federated Optimization" (ICLR 2021); Wang et al., "Tackling the
Objective Inconsistency Problem in Heterogeneous Federated Optimization" (NeurIPS 2020).

Round t: sample a cohort S_t; each client runs local training from x_t with the client
optimizer and sends `Delta_i = x_i - x_t` through the aggregator (default the weighted mean);
the server applies its optax optimizer to the pseudo-gradient `-Delta`. With
`server_optimizer=1.0` (SGD, lr 1) this is plain FedAvg `x_{t+1} = sum_i w_i x_i / sum_i w_i`.
Every preset takes the `compose.Options` (client/server optimizer, local work, cohort,
aggregator, weight decay, stragglers, client map).

Note on Reddi et al.: their FedAdam uses Adam without bias correction and epsilon (tau)
outside the square root (`fedadam.fedadam_reddi`); `optax.adam` (`fedadam` here) is
bias-corrected.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.compose import Options, preset, synchronous
from fedjax_sim.algorithms.core import Algorithm, LocalSpec, LossFn, Stragglers, tree_scale
from fedjax_sim.algorithms.hooks import proximal
from fedjax_sim.algorithms.local_hook import LocalHook
from fedjax_sim.core.checks import check_number, positive


@preset(stragglers=Stragglers(policy="drop"))
def fedavg(loss_fn: LossFn, *, options: Options) -> Algorithm:
    """FedAvg (McMahan et al. 2017): local SGD, weighted mean of the updates, any server
    optimizer and aggregator (e.g. `aggregator=error_feedback(TopK(fraction=0.01))` with
    `num_clients=C` is EF-FedAvg). FedAvg drops stragglers (Li et al. 2020)."""
    return synchronous(loss_fn, options)


@preset(server_optimizer=0.1, fixed=("client_optimizer", "local", "weight_decay", "stragglers"))
def fedsgd(loss_fn: LossFn, *, batch_size: int | None = None, options: Options) -> Algorithm:
    """FedSGD: one gradient per client per round (its whole data unless `batch_size`),
    averaged and applied by the server optimizer (a float is SGD with that learning rate)."""
    local = (
        LocalSpec(steps=1, sampling="full")
        if batch_size is None
        else LocalSpec(steps=1, batch_size=batch_size)
    )
    # client SGD with lr 1: the update is exactly -grad
    o = dataclasses.replace(options, client_optimizer=optax.sgd(1.0), local=local)
    return synchronous(loss_fn, o)


@preset(stragglers=Stragglers(policy="partial"))
def fedprox(loss_fn: LossFn, *, mu: float = 0.01, options: Options) -> Algorithm:
    """FedProx (Li et al. 2020): local steps on `f_i(w) + mu/2 ||w - x_t||^2` (`mu >= 0`);
    stragglers keep their partial work (`stragglers=Stragglers(0.9)` is the paper's 90 %)."""
    return synchronous(loss_fn, options, proximal(mu))


def named_server_optimizer(
    name: str,
    learning_rate: float,
    *,
    momentum: float = 0.9,
    b1: float = 0.9,
    b2: float = 0.99,
    eps: float = 1e-3,
) -> optax.GradientTransformation:
    """Server optimizers of Reddi et al. by name: sgd, momentum (FedAvgM), adam (FedAdam),
    yogi (FedYogi), adagrad (FedAdagrad). `eps` is their tau (adaptivity)."""
    if name == "momentum":
        check_number("server momentum", momentum, lambda v: 0 <= v < 1, "in [0, 1)")
    if name in ("adam", "yogi"):
        check_number("server b1", b1, lambda v: 0 <= v < 1, "in [0, 1)")
        check_number("server b2", b2, lambda v: 0 <= v < 1, "in [0, 1)")
    if name in ("adam", "yogi", "adagrad"):
        positive("server eps", eps)
    if name == "sgd":
        return optax.sgd(learning_rate)
    if name == "momentum":
        return optax.sgd(learning_rate, momentum=momentum)
    if name == "adam":
        return optax.adam(learning_rate, b1=b1, b2=b2, eps=eps)
    if name == "yogi":
        return optax.yogi(learning_rate, b1=b1, b2=b2, eps=eps)
    if name == "adagrad":
        return optax.adagrad(learning_rate, eps=eps)
    raise ValueError(f"unknown server optimizer {name!r}; choose sgd|momentum|adam|yogi|adagrad")


@preset(server_optimizer=0.01, stragglers=Stragglers(policy="drop"))
def fedopt(
    loss_fn: LossFn,
    *,
    server: str = "adam",
    momentum: float = 0.9,
    b1: float = 0.9,
    b2: float = 0.99,
    eps: float = 1e-3,
    options: Options,
) -> Algorithm:
    """FedOpt (Reddi et al. 2021): FedAvg with a named server optimizer (see
    `named_server_optimizer`) whose learning rate is `server_optimizer` (a float; an optax
    transformation is used as it is); `fedavgm`, `fedadam`, `fedyogi`, `fedadagrad` are its
    presets."""
    opt = options.server_optimizer
    if not isinstance(opt, optax.GradientTransformation):
        opt = named_server_optimizer(server, opt, momentum=momentum, b1=b1, b2=b2, eps=eps)
    return synchronous(loss_fn, dataclasses.replace(options, server_optimizer=opt))


fedavgm = functools.partial(fedopt, server="momentum")
fedadam = functools.partial(fedopt, server="adam")
fedyogi = functools.partial(fedopt, server="yogi")
fedadagrad = functools.partial(fedopt, server="adagrad")


def normalized_steps() -> LocalHook:
    """FedNova's normalisation (Wang et al. 2020, plain local SGD): client i sends
    `Delta_i / tau_i` (tau_i its executed local steps) and reports tau_i; the server scales
    the weighted mean by `tau_eff = sum_i w_i tau_i / sum_i w_i`."""

    def finish(ctx, outcome):
        tau = outcome.steps.astype(jax.dtypes.canonicalize_dtype(jnp.float64))
        return None, tau, None, tree_scale(outcome.update, 1.0 / jnp.maximum(outcome.steps, 1))

    def finalize(server, s, server_step):
        return server, server_step(tree_scale(s.update, s.mean)), {}

    return LocalHook("normalized_steps", finish=finish, finalize=finalize)


@preset()
def fednova(loss_fn: LossFn, *, options: Options) -> Algorithm:
    """FedNova (Wang et al., NeurIPS 2020) with local SGD: normalized averaging
    `x_{t+1} = x_t + tau_eff sum_i w_i Delta_i / tau_i`, which removes the objective
    inconsistency of unequal local work (`LocalSpec(epochs=...)`, stragglers)."""
    return synchronous(loss_fn, options, normalized_steps())
