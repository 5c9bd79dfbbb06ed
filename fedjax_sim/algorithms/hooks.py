"""Local-step hooks (`local_hook.LocalHook`) of the published algorithms, composable with
`local_hook.chain` and any aggregator, server optimizer and cohort.

| hook | local direction | state | paper |
|---|---|---|---|
| `proximal(mu)` | `g + mu (w - x_t)` | - | FedProx (Li et al. 2020) |
| `control_variates()` | `g - c_i + c` | rows c_i, server c | SCAFFOLD (Karimireddy+ 2020) |
| `dynamic_regularizer(a)` | `g - h_i + a (w - x_t)` | rows h_i, server h | FedDyn (Acar+ 2021) |
| `client_momentum(m)` | `(1 - m) g + m D` | server D | FedCM (Xu et al. 2021) |
| `sam(rho)` | `g(w + rho g / ||g||)` | - | FedSAM (Qu et al. 2022) |
| `multistep_inertia(m, l)` | `A g(w - P) + M / eta` | server history | FedMIM (Liu et al.) |
| `tilted(t)` | `exp(l / t) / t * g` | - | DR-DSGD (Issaid et al. 2022) |
| `scaled(s)` | `s_i g`, loss `s_i l` | - | AREA spec 7.2 |

`g` is the gradient oracle the hook receives (the loss's gradient, or the previous hook's
direction in a chain), `w` the local iterate, `x_t` the broadcast model, `eta` the client
learning rate of the round.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms.core import tree_add, tree_norm, tree_scale, tree_sub
from fedjax_sim.algorithms.local_hook import HookContext, LocalHook, LocalOutcome, RoundSummary
from fedjax_sim.core.checks import Range, check_number, non_negative, positive

Params = Any


def _zeros(params: Params) -> Params:
    return jax.tree.map(jnp.zeros_like, params)


def _sum_sent(s: RoundSummary) -> Params:
    """The sum over the contributing clients (weight > 0) of the hook's outputs `[M, ...]`."""
    part = s.cohort.weights > 0
    return jax.tree.map(
        lambda o: jnp.sum(jnp.where(part.reshape(-1, *([1] * (o.ndim - 1))), o, 0), axis=0),
        s.outputs,
    )


def _lr(ctx: HookContext, name: str) -> Any:
    if ctx.lr is None:
        raise ValueError(
            f"{name} needs the client learning rate: give client_optimizer as a float or a "
            "schedule, not an optax transformation"
        )
    return ctx.lr


# ------------------------------------------------------------------------------ FedProx
def proximal(mu: float | Callable[[jax.Array], Any]) -> LocalHook:
    """FedProx's proximal term: direction `g + mu (w - x_t)` (Li et al., MLSys 2020). `mu`
    may be a schedule of the round (`mu(round)`, e.g. `1 / s_k` for a prox step s_k)."""
    if not callable(mu):
        non_negative("FedProx mu", mu)

    def direction(value_and_grad, params, batch, carry, ctx):
        loss, grads = value_and_grad(params, batch)
        m = mu(ctx.round) if callable(mu) else mu
        grads = jax.tree.map(lambda g, p, a: g + m * (p - a), grads, params, ctx.anchor)
        return loss, grads, carry

    return LocalHook("proximal", direction)


# ------------------------------------------------------------------------------ SCAFFOLD
def control_variates() -> LocalHook:
    """SCAFFOLD, option II (Karimireddy et al., ICML 2020): direction `g - c_i + c`; after
    K_i local steps `c_i+ = c_i - c + (x_t - y_K) / (K_i eta)`; the server keeps
    `c <- c + (1/C) sum_{i in S} (c_i+ - c_i)`. Rows c_i and c start at 0; each client
    receives c and sends `c_i+ - c_i` (its output), one more model-sized vector each way."""

    def direction(value_and_grad, params, batch, carry, ctx):
        loss, g = value_and_grad(params, batch)
        return loss, jax.tree.map(lambda g_, ci, c_: g_ - ci + c_, g, ctx.row, ctx.server), carry

    def finish(ctx, outcome: LocalOutcome):
        eta = _lr(ctx, "control_variates (SCAFFOLD)")
        scale = -1.0 / (jnp.maximum(outcome.steps, 1) * eta)  # (x_t - y_K)/(K eta)
        row = tree_add(tree_sub(ctx.row, ctx.server), tree_scale(outcome.delta, scale))
        return row, None, tree_sub(row, ctx.row), outcome.update

    def finalize(c, s: RoundSummary, server_step):
        params = server_step(s.update)
        c = tree_add(c, tree_scale(_sum_sent(s), 1.0 / s.cohort.num_clients))
        return c, params, {"control_norm": tree_norm(c)}

    return LocalHook(
        "control_variates",
        direction,
        init_row=_zeros,
        init_server=_zeros,
        finish=finish,
        finalize=finalize,
    )


# ------------------------------------------------------------------------------ FedDyn
def dynamic_regularizer(regularization: float) -> LocalHook:
    """FedDyn (Acar et al., ICLR 2021) with coefficient `a = regularization`: direction
    `g - h_i + a (w - x_t)`; `h_i <- h_i - a Delta_i`; the server keeps
    `h <- h + (1/C) sum_{i in S} (h_i+ - h_i)` and moves the model after its step by `- h / a`
    (`x_{t+1} = mean x_i - h / a` with the server's SGD(1); an empty round keeps x_t). The
    clients' `h_i+ - h_i` is an output the server recomputes from their updates (not sent);
    h stays on the server."""
    positive("FedDyn regularization", regularization)
    a = regularization

    def direction(value_and_grad, params, batch, carry, ctx):
        loss, g = value_and_grad(params, batch)
        d = jax.tree.map(lambda g_, hi, p, x: g_ - hi + a * (p - x), g, ctx.row, params, ctx.anchor)
        return loss, d, carry

    def finish(ctx, outcome):
        row = tree_sub(ctx.row, tree_scale(outcome.delta, a))
        return row, None, tree_sub(row, ctx.row), outcome.update

    def finalize(h, s: RoundSummary, server_step):
        h = tree_add(h, tree_scale(_sum_sent(s), 1.0 / s.cohort.num_clients))
        params = server_step(s.update)
        moved = tree_sub(params, tree_scale(h, 1.0 / a))
        params = jax.tree.map(lambda m, p: jnp.where(s.contributed, m, p), moved, params)
        return h, params, {"h_norm": tree_norm(h)}

    return LocalHook(
        "dynamic_regularizer",
        direction,
        init_row=_zeros,
        init_server=_zeros,
        prepare=lambda h, cohort, params, key: (None, None),
        finish=finish,
        finalize=finalize,
        not_sent=("output",),
    )


# ------------------------------------------------------------------------------ FedCM
def client_momentum(momentum: float) -> LocalHook:
    """FedCM (Xu et al. 2021): direction `(1 - m) g + m D` with the server's momentum
    `D_{t+1} = -Delta_t / (eta K)` (0 at init, broadcast with x_t). `m = 0` is FedAvg;
    `multistep_inertia((m,), (0,))` is the same algorithm for a constant learning rate."""
    check_number("client momentum", momentum, Range(0, 1, hi_open=True))
    weight = 1.0 - momentum  # FedCM's alpha, the weight of the local gradient

    def direction(value_and_grad, params, batch, carry, ctx):
        loss, g = value_and_grad(params, batch)
        d = jax.tree.map(lambda g_, m_: weight * g_ + (1.0 - weight) * m_, g, ctx.server)
        return loss, d, carry

    def finalize(d, s: RoundSummary, server_step):
        params = server_step(s.update)
        eta = s.lr
        if eta is None:
            raise ValueError("client_momentum needs a float or schedule client_optimizer")
        # -Delta / (eta K), as the displacement x_t - (x_t + Delta): the server-side D of FedCM
        moved = tree_sub(s.params, tree_add(s.params, s.update))
        d = tree_scale(moved, 1.0 / (eta * s.local_steps))
        return d, params, {"momentum_norm": tree_norm(d)}

    return LocalHook(
        "client_momentum",
        direction,
        init_server=_zeros,
        finalize=finalize,
    )


# ------------------------------------------------------------------------------ SAM
def sam(rho: float) -> LocalHook:
    """Sharpness-aware local steps (FedSAM, Qu et al., ICML 2022): the gradient at
    `w + rho g / ||g||` on the same minibatch (`e = 0` when `g = 0`; global norm); the
    reported loss is the loss at `w`. Put it first in a chain (MoFedSAM:
    `chain(sam(rho), client_momentum(m))`)."""
    non_negative("SAM radius rho", rho)

    def direction(value_and_grad, params, batch, carry, ctx):
        loss, g = value_and_grad(params, batch)
        norm = tree_norm(g)
        scale = jnp.where(norm > 0, rho / jnp.where(norm > 0, norm, 1.0), 0.0)
        perturbed = jax.tree.map(lambda p, g_: p + scale * g_, params, g)
        _, g_tilde = value_and_grad(perturbed, batch)
        return loss, g_tilde, carry

    return LocalHook("sam", direction)


# ------------------------------------------------------------------------------ FedMIM
def _weights(name: str, values: float | Sequence[float]) -> tuple[float, ...]:
    values = (values,) if isinstance(values, numbers.Real) else tuple(values)
    for v in values:
        if not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
            raise ValueError(f"FedMIM {name} weights must be finite numbers >= 0, got {values}")
    return tuple(float(v) for v in values)


def check_inertia(
    momentum: float | Sequence[float], lookahead: float | Sequence[float] | None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Validated `(momentum, lookahead)` of equal length J (lookahead None: zeros);
    `sum(momentum) < 1`."""
    momentum = _weights("momentum", momentum)
    lookahead = (0.0,) * len(momentum) if lookahead is None else _weights("lookahead", lookahead)
    if len(lookahead) != len(momentum):
        raise ValueError(
            f"FedMIM momentum and lookahead must have the same length J, got J={len(momentum)} "
            f"momentum weights and {len(lookahead)} lookahead weights"
        )
    if not sum(momentum) < 1:
        raise ValueError(
            f"FedMIM needs sum(momentum) < 1 (A = 1 - sum > 0), got sum = {sum(momentum)}"
        )
    return momentum, lookahead


def multistep_inertia(
    momentum: float | Sequence[float], lookahead: float | Sequence[float] | None = None
) -> LocalHook:
    """FedMIM's multi-step inertial momentum (Liu et al., Algorithm 1; spec fedmim.md 2.1-2.3).

    The server keeps the last J global increments `delta_{t-j} = (x_{t-j-1} - x_{t-j}) / K`
    (`[J, ...]`, zero at init; j = 0 the most recent). With `M = sum_j m_j delta_{t-j}`,
    `P = sum_j l_j delta_{t-j}` and `A = 1 - sum_j m_j`, each local SGD step is
    `w <- w - M - A eta g(w - P)` (direction `A g(w - P) + M / eta`). J = 0 or all weights 0
    is FedAvg bit for bit."""
    momentum, lookahead = check_inertia(momentum, lookahead)
    num = len(momentum)
    damping = 1.0 - sum(momentum)  # A

    def combine(weights, history):
        return jax.tree.map(
            lambda h: jnp.tensordot(jnp.asarray(weights, h.dtype), h, axes=1), history
        )

    def direction(value_and_grad, params, batch, carry, ctx):
        inertia, shift = ctx.server
        inv_lr = 1.0 / _lr(ctx, "multistep_inertia (FedMIM)")
        loss, g = value_and_grad(tree_sub(params, shift), batch)
        d = jax.tree.map(lambda g_, m: damping * g_ + m * inv_lr, g, inertia)
        return loss, d, carry

    def prepare(history, cohort, params, key):
        return (combine(momentum, history), combine(lookahead, history)), None

    def finalize(history, s: RoundSummary, server_step):
        params = server_step(s.update)
        metrics = {"inertia_norm": tree_norm(combine(momentum, history))}
        if num:
            newest = tree_scale(tree_sub(s.params, params), 1.0 / s.local_steps)
            history = jax.tree.map(lambda h, d: jnp.concatenate([d[None], h[:-1]]), history, newest)
        return history, params, metrics

    return LocalHook(
        "multistep_inertia",
        direction,
        init_server=lambda p: jax.tree.map(lambda x: jnp.zeros((num, *x.shape), x.dtype), p),
        prepare=prepare,
        finalize=finalize,
        # the clients form M and P from the models x_t they received (spec fedmim.md 2.2)
        not_sent=("broadcast",),
    )


# ------------------------------------------------------------------------------ DR-DSGD
def tilted(temperature: float) -> LocalHook:
    """Exponentially tilted local steps (DR-DSGD, Issaid et al. 2022): direction
    `(1/t) exp(l/t) g` with `l` the minibatch loss (the plug-in gradient of `sum_i
    exp(l_i / t)`; not clipped: choose t above the largest loss)."""
    positive("temperature", temperature)

    def direction(value_and_grad, params, batch, carry, ctx):
        loss, grads = value_and_grad(params, batch)
        weight = jnp.exp(loss / temperature) / temperature
        return loss, jax.tree.map(lambda g: weight.astype(g.dtype) * g, grads), carry

    return LocalHook("tilted", direction)


# ------------------------------------------------------------------------------ client scale
def scaled(scale: Any) -> LocalHook:
    """Client i minimises `s_i * loss` (`scale [C]`; the AREA spec's `f_i = (n_i / n) fhat_i`,
    section 7.2): loss and gradient times `s_i`."""
    s = np.asarray(scale)
    if s.ndim != 1 or not np.isfinite(s).all() or s.min() < 0:
        raise ValueError("client_scale must be a [C] array of finite values >= 0")
    table = jnp.asarray(s)

    def direction(value_and_grad, params, batch, carry, ctx):
        loss, grads = value_and_grad(params, batch)
        si = table[ctx.client]
        return loss * si, tree_scale(grads, si.astype(loss.dtype)), carry

    return LocalHook("scaled", direction)
