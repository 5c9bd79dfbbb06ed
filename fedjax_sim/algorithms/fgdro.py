"""Federated group DRO: FGDRO-CVaR, FGDRO-KL, FGDRO-KL-Adam and LocalAdam as presets of the
composable layer (`compose`).

Guo & Yang, "Communication-Efficient Federated Group Distributionally Robust Optimization"
(NeurIPS 2024), Algorithms 1-4. Spec: `docs/specs/fgdro.md` (sections 2.1-2.4, 2.6, 7).

Objective over the N clients (uniform weights), `l_i(w)` = client i's expected loss:
- CVaR: `min_{w,s} (1/N) sum_i (l_i(w) - s)_+ + (K/N) s` = (K/N) x mean of the K largest l_i.
- KL: `min_w t log((1/N) sum_i exp(l_i(w)/t))` with t = `temperature` (the paper's lambda),
  optimal client weights `p = softmax(l/t)`.

One round: every cohort client runs I = `local.steps` local iterations from the broadcast
averaged variables; the per-iteration statistics are local-step hooks with a carry
(`LocalHook.start / direction / finish`): the loss estimates u_i are per-client rows `[C]`
(never averaged), the averaged variables (s / v, m, q) are the hooks' server-side state,
averaged with the aggregation weights (`RoundSummary.mean`, or the stacked `outputs` for the
log-domain v) in `finalize`. `fgdro_kl` chains `kl_weighting` (h = exp(u/t) / v g) with
`local_moments` (m, and q for Adam); `local_adam` is `local_moments` alone.

Resolutions of the paper's gaps (spec section 7), all followed here:
- `h = exp(u/t) / v * grad` (Alg. 2/3 print `exp(u)`); `q = (1-b4) q + b4 h^2` (Alg. 3).
- init `u = 0, s = 0, v = 1, m = 0, q = 0`; subgradient of `(x)_+` at 0 is 0 (strict `>`).
- the threshold step size `eta2` defaults to the client learning rate; no Adam bias
  correction (Alg. 3/4).
- the final averaged model is reported (not a random iterate).
FGDRO-KL keeps `log v` by default (`log_domain=True`): `lv = logaddexp(log(1-b2) + lv,
log(b2) + u/t)`, `h = exp(u/t - lv) g`, server `lv = logsumexp(lv_i) - log N`. This is
mathematically Algorithm 2 and stays finite where `exp(u/t)` overflows float32 (u/t > 88.7);
`log_domain=False` is the paper's literal (naive) form.

Simulator extensions (not in the paper): any client optimizer (a float is the paper's SGD
step), server optimizer, aggregator, cohort of M < N uniform clients (averages over the
cohort; non-participants keep their u), stragglers and client maps of `compose.Options`;
clients without data never contribute to averages and keep their u. With the rows streamed
(`simulate_streamed(state_rows="host")`) the statistics over all N clients' u (objectives,
active count, top-K mean, u and the client weights) are not reported: only the threshold /
log v (the training itself is unchanged).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.compose import Options, preset, synchronous
from fedjax_sim.algorithms.core import Algorithm, CohortSpec, LocalSpec, LossFn, float_dtype
from fedjax_sim.algorithms.local_hook import LocalHook, RoundSummary
from fedjax_sim.core.checks import check_number, is_concrete, non_negative, positive

Params = Any

FGDRO = dict(client_optimizer=0.01, local=LocalSpec(steps=32, batch_size=32))


# ------------------------------------------------------------------------------ objectives
def topk_mean(losses: jax.Array, k: int) -> jax.Array:
    """CVaR of the uniform distribution over clients: mean of the `k` largest entries of
    `losses [N]` = `max {sum_i p_i l_i : p in simplex, p_i <= 1/k}`."""
    return jnp.mean(jax.lax.top_k(losses, k)[0])


def cvar_objective(losses: jax.Array, threshold: jax.Array, k: int) -> jax.Array:
    """`(1/N) sum_i (l_i - s)_+ + (K/N) s` of `losses [N]`; its minimum over s is
    `(K/N) topk_mean(l, K)`."""
    n = losses.shape[0]
    return jnp.mean(jnp.maximum(losses - threshold, 0.0)) + (k / n) * threshold


def cvar_weights(losses: jax.Array, k: int) -> jax.Array:
    """`[N]` optimal CVaR client weights: `1/k` on the k largest losses (ties by index)."""
    top = jax.lax.top_k(losses, k)[1]
    return jnp.zeros(losses.shape, losses.dtype).at[top].set(1.0 / k)


def kl_objective(losses: jax.Array, temperature: Any) -> jax.Array:
    """`t log((1/N) sum_i exp(l_i/t))` of `losses [N]` (logsumexp: overflow-free)."""
    n = losses.shape[0]
    return temperature * (jax.nn.logsumexp(losses / temperature) - math.log(n))


def kl_weights(losses: jax.Array, temperature: Any) -> jax.Array:
    """`[N]` optimal KL client weights `softmax(l/t)`."""
    return jax.nn.softmax(losses / temperature)


# ------------------------------------------------------------------------------ checks
def check_rate(name: str, value: Any) -> None:
    """A moving-average rate in (0, 1] (skipped for traced values)."""
    check_number(name, value, lambda v: 0.0 < v <= 1.0, "in (0, 1]")


def _fgdro_options(o: Options) -> Options:
    """Checks the options of an FGDRO preset; a `CohortSpec` averages uniformly (1/N)."""
    if o.local.epochs is not None:
        raise ValueError(
            "FGDRO runs a fixed number I of local iterations per round: use "
            "LocalSpec(steps=I), not epochs"
        )
    if not isinstance(o.cohort, CohortSpec):
        return o
    if o.cohort.sampling != "uniform":
        raise ValueError(
            f"FGDRO cohorts are uniform without replacement, got sampling={o.cohort.sampling!r}"
        )
    if o.cohort.weighting == "counts" or o.cohort.client_weights is not None:
        raise ValueError("FGDRO averages clients uniformly (1/N): use weighting='uniform'")
    if o.num_clients is not None:
        o.cohort.check(o.num_clients)
    return dataclasses.replace(o, cohort=dataclasses.replace(o.cohort, weighting="uniform"))


def _averaged(server: Any, s: RoundSummary, new: Any) -> Any:
    """The averaged variables `new` (in the old dtypes), or the old ones if nobody
    contributed."""
    contributed = s.contributed
    return jax.tree.map(lambda a, b: jnp.where(contributed, a, b).astype(b.dtype), new, server)


# ------------------------------------------------------------------------------ hooks
def cvar_threshold(
    k: int, num_clients: int, beta1: Any, threshold_lr: Any = None, *, client_metrics: bool = True
) -> LocalHook:
    """The local iteration of Algorithm 1 (Guo & Yang 2024), carry `(u_i, s_i)` (scalars):
    `u = (1-b1) u + b1 l(w)`; `d = 1[u - s > 0]`; `s -= eta2 (K/N - d)`; direction `d g`.
    Rows: u `[C]`; server: the averaged threshold s `[]` (0 at init). `threshold_lr` eta2
    (None: the client learning rate of the round). `client_metrics`: also report the `[C]` u
    and CVaR weights of the top-K u."""
    check_rate("beta1", beta1)
    if threshold_lr is not None:
        non_negative("threshold_lr", threshold_lr)
    k_over_n = k / num_clients

    def direction(value_and_grad, params, batch, carry, ctx):
        u, s = carry
        eta2 = threshold_lr
        if eta2 is None:
            if ctx.lr is None:
                raise ValueError("give threshold_lr with an optax client_optimizer")
            eta2 = ctx.lr
        loss, grads = value_and_grad(params, batch)
        u = (1 - beta1) * u + beta1 * loss
        active = u - s > 0
        s = s - eta2 * (k_over_n - active.astype(s.dtype))
        d = jax.tree.map(lambda g: jnp.where(active, g, jnp.zeros_like(g)), grads)
        return loss, d, (u, s)

    def finish(ctx, outcome):
        u, s = outcome.carry
        return u, s, None, outcome.update

    def finalize(threshold, s: RoundSummary, server_step):
        params = server_step(s.update)
        threshold = _averaged(threshold, s, s.mean)
        u = s.rows
        if u is None:  # streamed rows: no statistics over all clients
            return threshold, params, {"threshold": threshold}
        metrics = {
            "threshold": threshold,
            "cvar_objective": cvar_objective(u, threshold, k),
            "cvar_active": jnp.sum(u > threshold),
            "topk_mean_u": topk_mean(u, k),
        }
        if client_metrics:
            metrics.update(u=u, client_weights=cvar_weights(u, k))
        return threshold, params, metrics

    return LocalHook(
        "cvar",
        direction,
        init_row=lambda params: jnp.zeros((), float_dtype()),
        init_server=lambda params: jnp.zeros((), float_dtype()),
        start=lambda ctx: (ctx.row, ctx.server),
        finish=finish,
        finalize=finalize,
    )


def kl_weighting(
    temperature: Any,
    beta1: Any,
    beta2: Any,
    *,
    log_domain: bool = True,
    client_metrics: bool = True,
) -> LocalHook:
    """The KL statistics of Algorithm 2 (Guo & Yang 2024), carry `(u_i, v_i)` (scalars;
    v = log v when `log_domain`): `u = (1-b1) u + b1 l`; `v = (1-b2) v + b2 exp(u/t)`;
    direction `h = exp(u/t) / v * g`. Rows: u `[C]`; server: the averaged v `[]` (v = 1 at
    init; log v: `logsumexp` over the cohort). `client_metrics`: also report the `[C]` u and
    the weights softmax(u/t)."""
    positive("temperature", temperature)
    check_rate("beta1", beta1)
    check_rate("beta2", beta2)
    if is_concrete(beta2):
        log_keep = math.log1p(-beta2) if beta2 < 1 else -math.inf
        log_new = math.log(beta2)
    else:
        log_keep, log_new = jnp.log1p(-beta2), jnp.log(beta2)

    def direction(value_and_grad, params, batch, carry, ctx):
        u, v = carry
        loss, grads = value_and_grad(params, batch)
        u = (1 - beta1) * u + beta1 * loss
        z = u / temperature
        if log_domain:
            v = jnp.logaddexp(log_keep + v, log_new + z)
            weight = jnp.exp(z - v)
        else:
            e = jnp.exp(z)
            v = (1 - beta2) * v + beta2 * e
            weight = e / v
        # in each leaf's own dtype (a float64 weight must not promote the carry)
        return loss, jax.tree.map(lambda g: weight.astype(g.dtype) * g, grads), (u, v)

    def finish(ctx, outcome):
        u, v = outcome.carry
        return (u, None, v, outcome.update) if log_domain else (u, v, None, outcome.update)

    def finalize(v, s: RoundSummary, server_step):
        params = server_step(s.update)
        weights = s.cohort.weights
        if log_domain:
            new = jax.nn.logsumexp(s.outputs, b=weights) - jnp.log(jnp.sum(weights))
        else:
            new = s.mean
        v = _averaged(v, s, new)
        u = s.rows
        metrics = {"log_v": v if log_domain else jnp.log(v)}
        if u is None:  # streamed rows: no statistics over all clients
            return v, params, metrics
        metrics["kl_objective"] = kl_objective(u, temperature)
        if client_metrics:
            metrics.update(u=u, client_weights=kl_weights(u, temperature))
        return v, params, metrics

    v0 = 0.0 if log_domain else 1.0
    return LocalHook(
        "kl",
        direction,
        init_row=lambda params: jnp.zeros((), float_dtype()),
        init_server=lambda params: jnp.full((), v0, float_dtype()),
        start=lambda ctx: (ctx.row, ctx.server),
        finish=finish,
        finalize=finalize,
    )


def local_moments(beta3: Any, adam: tuple[Any, Any] | None = None) -> LocalHook:
    """The averaged moments of Algorithms 2-4 (Guo & Yang 2024), carry `(m, q)` (pytrees of
    the params' shapes; q None without `adam`): `m = (1-b3) m + b3 h` for the direction h it
    receives; direction `m`, or with `adam=(b4, eps)` `q = (1-b4) q + b4 h^2` and direction
    `m / (sqrt(q) + eps)` (no bias correction). Server: the averaged (m, q), 0 at init."""
    check_rate("beta3", beta3)
    if adam is not None:
        check_rate("beta4", adam[0])
        positive("eps", adam[1])

    def direction(value_and_grad, params, batch, carry, ctx):
        m, q = carry
        loss, h = value_and_grad(params, batch)
        m = jax.tree.map(lambda mi, hi: (1 - beta3) * mi + beta3 * hi, m, h)
        if adam is None:
            return loss, m, (m, q)
        beta4, eps = adam
        q = jax.tree.map(lambda qi, hi: (1 - beta4) * qi + beta4 * hi * hi, q, h)
        return loss, jax.tree.map(lambda mi, qi: mi / (jnp.sqrt(qi) + eps), m, q), (m, q)

    def init_server(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return zeros, (zeros if adam is not None else None)

    return LocalHook(
        "moments",
        direction,
        init_server=init_server,
        start=lambda ctx: ctx.server,
        finish=lambda ctx, outcome: (None, outcome.carry, None, outcome.update),
        finalize=lambda mq, s, server_step: (_averaged(mq, s, s.mean), server_step(s.update), {}),
    )


# ------------------------------------------------------------------------------ presets
@preset(**FGDRO)
def fgdro_cvar(
    loss_fn: LossFn,
    *,
    num_clients: int,
    k: int | None = None,
    threshold_lr: float | None = None,
    beta1: float = 0.1,
    client_metrics: bool = True,
    options: Options,
) -> Algorithm:
    """FGDRO-CVaR (Algorithm 1): minimise the mean of the K largest client losses.

    `num_clients` N (rows u `[N]`); `k` K in 1..N (default `max(1, round(0.2 N))`, spec
    section 7); `client_optimizer` eta1 (a float: SGD); `threshold_lr` eta2 (default the
    client learning rate); `beta1` the loss moving-average rate in (0, 1]; I =
    `local.steps`; `client_metrics`: also log the `[N]` u and CVaR weights of the top-K u.

    Metrics: `threshold` s, `cvar_objective` (the s-form at u), `cvar_active` #{u_i > s},
    `topk_mean_u`, payload (w + s per client, up and down).
    """
    options = _fgdro_options(options)
    k = max(1, round(0.2 * num_clients)) if k is None else k
    if not (isinstance(k, int) and 1 <= k <= num_clients):
        raise ValueError(f"CVaR K must be an integer in [1, {num_clients}], got {k}")
    hook = cvar_threshold(k, num_clients, beta1, threshold_lr, client_metrics=client_metrics)
    return synchronous(loss_fn, options, hook)


@preset(**FGDRO)
def fgdro_kl(
    loss_fn: LossFn,
    *,
    num_clients: int,
    temperature: float = 1.0,
    beta1: float = 0.1,
    beta2: float = 0.1,
    beta3: float = 0.1,
    log_domain: bool = True,
    client_metrics: bool = True,
    options: Options,
) -> Algorithm:
    """FGDRO-KL (Algorithm 2): minimise `t log mean_i exp(l_i/t)`, t = `temperature` > 0
    (large: FedAvg, small: the worst client); `beta1/2/3` the rates of u, v, m in (0, 1];
    `log_domain`: keep log v (overflow-free; default) or the paper's literal v.

    Metrics: `kl_objective` (at u), `log_v`, `u` and `client_weights` softmax(u/t) (if
    `client_metrics`), payload (w, m, v: 2d+1 floats per client, up and down).
    """
    del num_clients  # in options: rows of the [C] state
    options = _fgdro_options(options)
    kl = kl_weighting(
        temperature, beta1, beta2, log_domain=log_domain, client_metrics=client_metrics
    )
    return synchronous(loss_fn, options, kl, local_moments(beta3))


@preset(**{**FGDRO, "client_optimizer": 0.001})
def fgdro_kl_adam(
    loss_fn: LossFn,
    *,
    num_clients: int,
    temperature: float = 1.0,
    beta1: float = 0.1,
    beta2: float = 0.1,
    beta3: float = 0.1,
    beta4: float = 0.001,
    eps: float = 1e-8,
    log_domain: bool = True,
    client_metrics: bool = True,
    options: Options,
) -> Algorithm:
    """FGDRO-KL-Adam (Algorithm 3): FGDRO-KL with Adam-type local steps
    `w -= eta m / (sqrt(q) + eps)`, `q = (1-beta4) q + beta4 h^2` (no bias correction);
    `beta4` in (0, 1], `eps` > 0 (the paper's tau). Payload: w, m, q, v (3d+1 floats per
    client, up and down)."""
    del num_clients
    options = _fgdro_options(options)
    kl = kl_weighting(
        temperature, beta1, beta2, log_domain=log_domain, client_metrics=client_metrics
    )
    return synchronous(loss_fn, options, kl, local_moments(beta3, (beta4, eps)))


@preset(**{**FGDRO, "client_optimizer": 0.001})
def local_adam(
    loss_fn: LossFn,
    *,
    beta3: float = 0.1,
    beta4: float = 0.001,
    eps: float = 1e-8,
    options: Options,
) -> Algorithm:
    """LocalAdam (Algorithm 4, ERM): Adam-type local steps `w -= eta m / (sqrt(q) + eps)`,
    the server averages w, m and q. Equals FGDRO-KL-Adam with temperature -> infinity.
    Payload: w, m, q (3d per client)."""
    options = _fgdro_options(options)
    return synchronous(loss_fn, options, local_moments(beta3, (beta4, eps)))
