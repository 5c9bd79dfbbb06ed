"""Personalized federated learning: Ditto, APFL, pFedMe, Per-FedAvg and FedAvg with local
fine-tuning, as local-step hooks and presets of the composable layer (issue 37).

Each preset's `Algorithm.personalize(state, data, ids [K], key)` returns the personal models
of the clients `ids`, leaves `[K, ...]`: their per-client rows (Ditto, APFL, pFedMe; `Rows`
`[C, ...]` built by the hooks' `init_row`, so they stream and shard like every other row) or
k local steps from the global model (Per-FedAvg, FedAvg-FT; one shared helper,
`fine_tuned`). Every preset takes every common option (aggregator incl. DP / robust, server
optimizer, cohort, client map, ...).

| hook | local step (w the local iterate from x_t) | rows | paper |
|---|---|---|---|
| `personal_proximal(lam)` | w: g(w); v: `v - eta_v (g(v) + lam (v - x_t))` | v_i | Ditto |
| `personal_mixture(mixing)` | w: g(w); v: `v - eta_v a g(a v + (1-a) w)` | v_i, a_i | APFL |
| `moreau_envelope(lam, K)` | `lam (w - theta)`, theta: K steps on `h(., w)` | theta_i | pFedMe |
| `meta_gradient(inner_lr)` | `(I - alpha H(w; D'')) g(w - alpha g(w; D); D')` | - | Per-FedAvg |

with `h(theta, w) = f_i(theta; D) + lam/2 ||theta - w||^2`. Shapes: w, v, theta, x_t have
the model's shapes; a_i is `[]` (a row `[C]`); g(p; D) is the gradient oracle the hook
receives (the loss's, or the previous hook's direction in a chain) at p on the step's
minibatch D (`[B, ...]`, padding rows masked). eta is the client learning rate of the round;
the client optimizer applies the returned direction to w (so weight decay, momentum or a box
act on w only; the personal models take the plain SGD steps written here).

**Ditto** (Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021, Algorithm 1). The global model is FedAvg's (plain local steps
from x_t). The personal model v_i (`[C, ...]` rows, v_i = x_0 at init) takes, in every local
step, `v <- v - eta_v (g(v; D) + lam (v - x_t))` with x_t the round's global model.
Resolution: the paper runs s personal steps besides the E global ones; here v takes one step
per local step on the same minibatch D as w, interleaved in the one local scan (the carry
holds v), so s = K. `personalize`: v_i. `lam = 0` is pure local training of v_i.

**APFL** (Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", 2020,
Algorithm 1; `mixing` is the paper's alpha). Local w steps as FedAvg's; the personal v_i
(rows, v_i = x_0 at init) with the mixed model `vbar = a v + (1 - a) w` (w the local
iterate) takes `v <- v - eta_v grad_v f(vbar; D) = v - eta_v a g(vbar; D)`, simultaneous with
w's step (both from the step's pre-step values). a_i = `mixing` is a row too; with
`adaptive=True` it follows the paper's gradient step `a <- a - eta_a <v - w, g(vbar; D)>`
(eta_a = `mixing_lr`), clipped to [0, 1] as in the authors' code (without its 0.02 a
regularizer). `personalize`: `a_i v_i + (1 - a_i) x` with x the global model.

**pFedMe** (T. Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes",
NeurIPS 2020, Algorithm 1). Each local step solves `theta = argmin_theta f_i(theta; D) +
lam/2 ||theta - w||^2` approximately by `inner_steps` (the paper's K) gradient steps
`theta <- theta - personal_lr (g(theta; D) + lam (theta - w))` (a `lax.scan`), then
`w <- w - eta lam (w - theta)` (direction `lam (w - theta)`). Resolution (as the authors'
code): theta starts at x_t in each round and warm-starts from the previous local step's theta
(the carry). The server's `x_{t+1} = (1 - beta) x_t + beta mean_i w_i` is the server
optimizer SGD with learning rate beta on the pseudo-gradient (`server_optimizer=beta`,
default 1.0); the paper's mean is uniform (`CohortSpec(weighting="uniform")`), the default
weights counts. The row theta_i (x_0 at init) keeps the client's last theta;
`personalize`: theta_i. The reported loss is f_i(theta; D) before each step's inner solve.

**Per-FedAvg** (Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with
Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020; alpha =
`inner_lr`, beta = the client learning rate). Local step
`w <- w - beta (I - alpha H(w; D'')) g(w - alpha g(w; D); D')`: variant "fo" drops the
Hessian term, variant "hf" computes the Hessian-vector product exactly (forward-over-reverse
`jax.jvp` of the gradient oracle; the paper's Per-FedAvg (HF) approximates it by finite
differences). Resolution: the local scan draws one minibatch per step (`local_train`); D,
D' (and D'') are its strided halves (thirds) `batch[p::P]`, which keeps their real examples
balanced for every sampling (padding rows come last); give `batch_size = 2B` (`3B`) for the
paper's B. `personalize`: `adapt_steps` SGD steps of size alpha from x on the client's
training data (`fine_tuned`).

**FedAvg-FT** (FedAvg with local fine-tuning, as evaluated by Wang et al., "Federated
Evaluation of On-device Personalization", 2019, and the pFL benchmarks): training is FedAvg;
`personalize`: `finetune_steps` local SGD steps of size `finetune_lr` from x on the client's
training data (`fine_tuned`).

`fine_tuned` (Per-FedAvg, FedAvg-FT): k steps of `core.local_train` per client from the
global model, with the preset's `local` sampling and batch size, client i's key
`client_key(key, i)` (deterministic given `key`), vmapped over `ids`; clients without data
keep x.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from jax import lax

from fedjax_sim.algorithms.compose import Options, preset, synchronous
from fedjax_sim.algorithms.core import (
    Algorithm,
    LocalSpec,
    LossFn,
    Personalize,
    Stragglers,
    client_key,
    float_dtype,
    local_train,
)
from fedjax_sim.algorithms.local_hook import HookContext, LocalHook, LocalOutcome
from fedjax_sim.algorithms.optimizers import ClientOptimizer, client_lr_at
from fedjax_sim.core.checks import Range, check_number, non_negative, positive
from fedjax_sim.core.rows import gather_rows

Params = Any


# ------------------------------------------------------------------------------ helpers
def _keep_carry(ctx: HookContext, outcome: LocalOutcome):
    """`finish`: the final carry (the personal model) is the client's new row."""
    return outcome.carry, None, None, outcome.update


def _like(new: Params, old: Params) -> Params:
    """`new` in `old`'s dtypes (a carry keeps its dtype, e.g. float32 params under x64)."""
    return jax.tree.map(lambda n, o: n.astype(o.dtype), new, old)


def _step_size(value: Any, ctx: HookContext, what: str) -> Any:
    """`value`, or the client learning rate of the round when it is None."""
    if value is not None:
        return value
    if ctx.lr is None:
        raise ValueError(f"{what}=None takes the client learning rate, unknown for optax")
    return ctx.lr


def _check_client_lr(what: str, value: Any, options: Options) -> None:
    """A step size None takes the client learning rate: refused for an optax optimizer."""
    if value is None and client_lr_at(options.client_optimizer, jnp.int32(0)) is None:
        raise ValueError(
            f"{what}=None takes the client learning rate: give {what}, or client_optimizer "
            "as a float or a schedule (not an optax transformation)"
        )


def _check_count(what: str, value: Any, lowest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"{what} must be an int >= {lowest}, got {value!r}")


def personal_rows(name: str) -> Personalize:
    """`personalize` reading the personal models from the hook `name`'s rows."""

    def personalize(state, data, ids, key):
        return gather_rows(state.rows[name], ids)

    return personalize


def fine_tuned(loss_fn: LossFn, steps: int, lr: ClientOptimizer, local: LocalSpec) -> Personalize:
    """`personalize` of `steps` local SGD steps of size `lr` (a float, or a schedule read at
    `state.round`) from the global model on each client's training data, with `local`'s
    sampling and batch size and client i's key `client_key(key, i)`, vmapped over `ids`;
    clients without data keep the global model."""

    def personalize(state, data, ids, key):
        x = state.params
        optimizer = optax.sgd(client_lr_at(lr, state.round))

        def one(cid):
            client = data.client(cid)
            return local_train(
                x,
                client,
                client_key(key, cid),
                loss_fn=loss_fn,
                optimizer=optimizer,
                max_steps=max(steps, 1),
                num_steps=jnp.where(client.count > 0, steps, 0),
                batch_size=local.batch_size,
                sampling=local.sampling,
            ).params

        return jax.vmap(one)(ids)

    return personalize


# ------------------------------------------------------------------------------ Ditto
def personal_proximal(lam: Any, personal_lr: Any = None) -> LocalHook:
    """Ditto's personal model (Li et al., ICML 2021): w takes the plain gradient; the row
    v_i (x_0 at init, carried through the local steps) takes
    `v <- v - eta_v (g(v; D) + lam (v - x_t))` on the same minibatch D (`eta_v =
    personal_lr`, None: the client learning rate)."""
    non_negative("Ditto lam", lam)
    if personal_lr is not None:
        positive("Ditto personal_lr", personal_lr)

    def direction(value_and_grad, params, batch, v, ctx):
        loss, g = value_and_grad(params, batch)
        _, gv = value_and_grad(v, batch)
        eta = _step_size(personal_lr, ctx, "personal_lr")
        new = jax.tree.map(lambda v_, g_, x: v_ - eta * (g_ + lam * (v_ - x)), v, gv, ctx.anchor)
        return loss, g, _like(new, v)

    return LocalHook(
        "personal_proximal",
        direction,
        init_row=lambda params: params,
        start=lambda ctx: ctx.row,
        finish=_keep_carry,
    )


@preset()
def ditto(
    loss_fn: LossFn,
    *,
    num_clients: int,
    lam: float = 0.1,
    personal_lr: float | None = None,
    options: Options,
) -> Algorithm:
    """Ditto (Li et al., ICML 2021): FedAvg for the global model; personal models v_i
    (rows of all `num_clients` clients) trained on `f_i(v) + lam/2 ||v - x_t||^2` with step
    `personal_lr` (None: the client learning rate) in the same local steps."""
    del num_clients  # in options: rows of the [C, ...] state
    _check_client_lr("Ditto personal_lr", personal_lr, options)
    hook = personal_proximal(lam, personal_lr)
    return synchronous(loss_fn, options, hook)._replace(personalize=personal_rows(hook.name))


# ------------------------------------------------------------------------------ APFL
def personal_mixture(
    mixing: Any, personal_lr: Any = None, *, adaptive: bool = False, mixing_lr: Any = None
) -> LocalHook:
    """APFL's personal model (Deng et al. 2020): w takes the plain gradient; the row
    `{"model": v_i, "mixing": a_i}` (x_0 and `mixing` at init) takes, from the step's
    pre-step values, `v <- v - eta_v a g(a v + (1 - a) w; D)` and with `adaptive`
    `a <- clip(a - eta_a <v - w, g(a v + (1 - a) w; D)>, 0, 1)` (`eta_v = personal_lr`,
    `eta_a = mixing_lr`; None: the client learning rate)."""
    check_number("APFL mixing", mixing, Range(0, 1))
    if personal_lr is not None:
        positive("APFL personal_lr", personal_lr)
    if mixing_lr is not None:
        positive("APFL mixing_lr", mixing_lr)

    def direction(value_and_grad, params, batch, carry, ctx):
        v, a = carry["model"], carry["mixing"]
        loss, g = value_and_grad(params, batch)
        mixed = _like(jax.tree.map(lambda v_, w: a * v_ + (1 - a) * w, v, params), params)
        _, gm = value_and_grad(mixed, batch)
        eta = _step_size(personal_lr, ctx, "personal_lr")
        new_v = _like(jax.tree.map(lambda v_, g_: v_ - eta * a * g_, v, gm), v)
        if adaptive:
            slope = sum(
                jnp.sum((v_ - w) * g_)
                for v_, w, g_ in zip(*map(jax.tree.leaves, (v, params, gm)), strict=True)
            )
            eta_a = _step_size(mixing_lr, ctx, "mixing_lr")
            a = jnp.clip(a - eta_a * slope, 0.0, 1.0).astype(a.dtype)
        return loss, g, {"model": new_v, "mixing": a}

    return LocalHook(
        "personal_mixture",
        direction,
        init_row=lambda params: {"model": params, "mixing": jnp.asarray(mixing, float_dtype())},
        start=lambda ctx: ctx.row,
        finish=_keep_carry,
    )


def _mixed_personalize(name: str) -> Personalize:
    """APFL's personal models `a_i v_i + (1 - a_i) x` from the hook `name`'s rows."""
    rows = personal_rows(name)

    def personalize(state, data, ids, key):
        row = rows(state, data, ids, key)
        a = row["mixing"]

        def mix(v, x):
            ak = a.reshape(-1, *(1,) * x.ndim).astype(v.dtype)
            return ak * v + (1 - ak) * x[None]

        return jax.tree.map(mix, row["model"], state.params)

    return personalize


@preset()
def apfl(
    loss_fn: LossFn,
    *,
    num_clients: int,
    mixing: float = 0.25,
    personal_lr: float | None = None,
    adaptive: bool = False,
    mixing_lr: float | None = None,
    options: Options,
) -> Algorithm:
    """APFL (Deng, Kamani, Mahdavi 2020): FedAvg for the global model; personal models v_i
    (rows of all `num_clients` clients) trained through the mixture `mixing v + (1 -
    mixing) w` (`mixing` the paper's alpha in [0, 1]; `adaptive`: a per-client alpha learned
    with step `mixing_lr`); `personal_lr` / `mixing_lr` None: the client learning rate."""
    del num_clients  # in options: rows of the [C, ...] state
    _check_client_lr("APFL personal_lr", personal_lr, options)
    if adaptive:
        _check_client_lr("APFL mixing_lr", mixing_lr, options)
    hook = personal_mixture(mixing, personal_lr, adaptive=adaptive, mixing_lr=mixing_lr)
    return synchronous(loss_fn, options, hook)._replace(personalize=_mixed_personalize(hook.name))


# ------------------------------------------------------------------------------ pFedMe
def moreau_envelope(lam: Any, personal_lr: Any, inner_steps: int) -> LocalHook:
    """pFedMe's local step (T. Dinh et al., NeurIPS 2020): `inner_steps` gradient steps
    `theta <- theta - personal_lr (g(theta; D) + lam (theta - w))` (theta carried, x_t at the
    round's start), then the direction `lam (w - theta)`; the row theta_i (x_0 at init) is
    the last theta."""
    positive("pFedMe lam", lam)
    positive("pFedMe personal_lr", personal_lr)
    _check_count("pFedMe inner_steps", inner_steps, 1)

    def direction(value_and_grad, params, batch, theta, ctx):
        def inner(th, _):
            loss, g = value_and_grad(th, batch)
            new = jax.tree.map(
                lambda t, g_, w: t - personal_lr * (g_ + lam * (t - w)), th, g, params
            )
            return _like(new, th), loss

        theta, losses = lax.scan(inner, theta, None, length=inner_steps)
        return losses[0], jax.tree.map(lambda w, t: lam * (w - t), params, theta), theta

    return LocalHook(
        "moreau_envelope",
        direction,
        init_row=lambda params: params,
        start=lambda ctx: ctx.anchor,
        finish=_keep_carry,
    )


@preset()
def pfedme(
    loss_fn: LossFn,
    *,
    num_clients: int,
    lam: float = 15.0,
    personal_lr: float = 0.01,
    inner_steps: int = 5,
    options: Options,
) -> Algorithm:
    """pFedMe (T. Dinh, Tran, Nguyen, NeurIPS 2020): each local step solves the Moreau
    envelope's `argmin_theta f_i(theta) + lam/2 ||theta - w||^2` by `inner_steps` steps of
    size `personal_lr` and moves w toward theta; the server's beta is
    `server_optimizer=beta` (1.0: the mean); personal models theta_i are rows of all
    `num_clients` clients."""
    del num_clients  # in options: rows of the [C, ...] state
    hook = moreau_envelope(lam, personal_lr, inner_steps)
    return synchronous(loss_fn, options, hook)._replace(personalize=personal_rows(hook.name))


# ------------------------------------------------------------------------------ Per-FedAvg
VARIANTS = ("fo", "hf")


def _parts(batch: Any, num: int) -> list[Any]:
    """The strided parts `batch[p::num]` of a minibatch (balanced real examples: padding rows
    come last in every sampling)."""
    return [jax.tree.map(lambda a, p=p: a[p::num], batch) for p in range(num)]


def meta_gradient(inner_lr: Any, variant: Literal["fo", "hf"] = "fo") -> LocalHook:
    """Per-FedAvg's local direction (Fallah et al., NeurIPS 2020) on the strided parts D, D'
    (D'') of the step's minibatch: `g(w - alpha g(w; D); D')` ("fo"), times
    `(I - alpha H(w; D''))` ("hf": an exact Hessian-vector product), alpha = `inner_lr`."""
    non_negative("Per-FedAvg inner_lr", inner_lr)
    if variant not in VARIANTS:
        raise ValueError(f"Per-FedAvg variant must be one of {VARIANTS}, got {variant!r}")
    num = 2 if variant == "fo" else 3

    def direction(value_and_grad, params, batch, carry, ctx):
        parts = _parts(batch, num)
        loss, g = value_and_grad(params, parts[0])
        adapted = jax.tree.map(lambda w, g_: w - inner_lr * g_, params, g)
        _, d = value_and_grad(adapted, parts[1])
        if variant == "hf":

            def grad(p):
                return value_and_grad(p, parts[2])[1]

            _, hvp = jax.jvp(grad, (params,), (d,))
            d = jax.tree.map(lambda d_, h: d_ - inner_lr * h, d, hvp)
        return loss, d, carry

    return LocalHook("meta_gradient", direction)


@preset()
def per_fedavg(
    loss_fn: LossFn,
    *,
    inner_lr: float = 0.01,
    variant: str = "fo",
    adapt_steps: int = 1,
    options: Options,
) -> Algorithm:
    """Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020): local MAML steps `w <- w -
    beta (I - alpha H) g(w - alpha g(w; D); D')` (beta the client learning rate, alpha =
    `inner_lr`; `variant` "fo" without, "hf" with the exact Hessian term; D, D', D'' the
    halves / thirds of each minibatch); personal models: `adapt_steps` steps of size alpha
    from the global model on the client's data."""
    _check_count("Per-FedAvg adapt_steps", adapt_steps, 0)
    hook = meta_gradient(inner_lr, variant)
    personalize = fine_tuned(loss_fn, adapt_steps, inner_lr, options.local)
    return synchronous(loss_fn, options, hook)._replace(personalize=personalize)


# ------------------------------------------------------------------------------ FedAvg-FT
def check_finetune(name: str, steps: int, lr: float | None, options: Options) -> ClientOptimizer:
    """The fine-tuning step size of `name` (`lr`, None: the client learning rate), after
    checking `steps >= 0` and `lr > 0` (ValueError naming the parameter)."""
    _check_count(f"{name} finetune_steps", steps, 0)
    if lr is not None:
        positive(f"{name} finetune_lr", lr)
    _check_client_lr(f"{name} finetune_lr", lr, options)
    return options.client_optimizer if lr is None else lr


@preset(stragglers=Stragglers(policy="drop"))
def fedavg_ft(
    loss_fn: LossFn,
    *,
    finetune_steps: int = 5,
    finetune_lr: float | None = None,
    options: Options,
) -> Algorithm:
    """FedAvg with local fine-tuning (Wang et al. 2019; the pFL benchmarks): FedAvg training;
    personal models: `finetune_steps` local SGD steps of size `finetune_lr` (None: the client
    learning rate) from the global model on the client's data."""
    lr = check_finetune("FedAvg-FT", finetune_steps, finetune_lr, options)
    personalize = fine_tuned(loss_fn, finetune_steps, lr, options.local)
    return synchronous(loss_fn, options)._replace(personalize=personalize)
