"""Federated group DRO: FGDRO-CVaR, FGDRO-KL, FGDRO-KL-Adam and LocalAdam.

Guo & Yang, "Communication-Efficient Federated Group Distributionally Robust Optimization"
(NeurIPS 2024), Algorithms 1-4. Spec: `../shared/specs/fgdro.md` (sections 2.1-2.4, 2.6, 7).

Objective over the N clients (uniform weights), `l_i(w)` = client i's expected loss:
- CVaR: `min_{w,s} (1/N) sum_i (l_i(w) - s)_+ + (K/N) s` = (K/N) x mean of the K largest l_i.
- KL: `min_w lambda log((1/N) sum_i exp(l_i(w)/lambda))`, optimal client weights
  `p = softmax(l/lambda)`.

One `step` is one communication round: every participating client runs I = `local.steps`
local iterations from the broadcast averaged variables (a `lax.scan` inside the foundation's
`local_train`; the per-iteration statistics u_i, s_i, v_i, m_i, q_i ride in its `aux` carry
and the local direction comes from the `grad_fn` hook), then the server averages uniformly.
Averaged variables (w, s / w, m, v / w, m, q, v) are identical on every client after a round,
so the state keeps one server copy of each; the local loss estimates `u` (never averaged) are
per-client state stacked on axis 0 (`[C]`).

Resolutions of the paper's gaps (spec section 7), all followed here:
- `h = exp(u/lambda) / v * grad` (Alg. 2/3 print `exp(u)`); `q = (1-b4) q + b4 h^2` (Alg. 3).
- init `u = 0, s = 0, v = 1, m = 0, q = 0`; subgradient of `(x)_+` at 0 is 0 (strict `>`).
- the threshold step size `eta2` defaults to `eta1`; no Adam bias correction (Alg. 3/4).
- constant step sizes; the final averaged model is reported (not a random iterate).
FGDRO-KL keeps `log v` by default (`log_domain=True`): `lv = logaddexp(log(1-b2) + lv,
log(b2) + u/lambda)`, `h = exp(u/lambda - lv) g`, server `lv = logsumexp(lv_i) - log N`. This
is mathematically Algorithm 2 and stays finite where `exp(u/lambda)` overflows float32
(u/lambda > 88.7); `log_domain=False` is the paper's literal (naive) form.

Simulator extensions (not in the paper): a uniform cohort of M < N clients per round
(`cohort=CohortSpec(size=M)`; averages over the cohort, non-participants keep their u); clients
without data never contribute to averages and keep their u. Per-round lr schedules and
straggler models are not supported (the paper has neither).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_sim.algorithms.core import (
    COHORT,
    LOCAL,
    Algorithm,
    CohortResult,
    CohortSpec,
    GradFn,
    LocalSpec,
    LossFn,
    Metrics,
    Params,
    client_key,
    float_dtype,
    local_train,
    map_cohort,
    payload_metrics,
    round_key,
    tree_norm,
    tree_sub,
)
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.parallel import ClientMap


# ------------------------------------------------------------------------------ objectives
def topk_mean(losses: jax.Array, k: int) -> jax.Array:
    """CVaR of the uniform distribution over clients: mean of the `k` largest entries of
    `losses [N]` = `max {sum_i p_i l_i : p in simplex, p_i <= 1/k}`."""
    return jnp.mean(jax.lax.top_k(losses, k)[0])


def cvar_objective(losses: jax.Array, threshold: jax.Array, k: int) -> jax.Array:
    """`(1/N) sum_i (l_i - s)_+ + (K/N) s`; its minimum over s is `(K/N) topk_mean(l, K)`."""
    n = losses.shape[0]
    return jnp.mean(jnp.maximum(losses - threshold, 0.0)) + (k / n) * threshold


def cvar_weights(losses: jax.Array, k: int) -> jax.Array:
    """`[N]` optimal CVaR client weights: `1/k` on the k largest losses (ties by index)."""
    top = jax.lax.top_k(losses, k)[1]
    return jnp.zeros(losses.shape, losses.dtype).at[top].set(1.0 / k)


def kl_objective(losses: jax.Array, lam: float) -> jax.Array:
    """`lambda log((1/N) sum_i exp(l_i/lambda))` (computed with logsumexp: overflow-free)."""
    n = losses.shape[0]
    return lam * (jax.nn.logsumexp(losses / lam) - math.log(n))


def kl_weights(losses: jax.Array, lam: float) -> jax.Array:
    """`[N]` optimal KL client weights `softmax(l/lambda)`."""
    return jax.nn.softmax(losses / lam)


# ------------------------------------------------------------------------------ states
@struct.dataclass
class CVaRState:
    """FGDRO-CVaR: averaged model and threshold, per-client loss estimates."""

    params: Params  # averaged model w
    threshold: jax.Array  # [] averaged threshold s
    u: jax.Array  # [C] local loss moving averages (never averaged)
    round: jax.Array  # [] int32


@struct.dataclass
class KLState:
    """FGDRO-KL / FGDRO-KL-Adam: averaged model, momentum m, second moment q (KL-Adam only,
    else None) and the global statistic v; per-client loss estimates u."""

    params: Params  # averaged model w
    m: Params  # averaged gradient momentum
    q: Params | None  # averaged second moment (KL-Adam), None for FGDRO-KL
    v: jax.Array  # [] log v (log_domain) or v: estimate of (1/N) sum_j exp(l_j/lambda)
    u: jax.Array  # [C] local loss moving averages
    round: jax.Array  # [] int32
    log_domain: bool = struct.field(pytree_node=False, default=True)

    @property
    def log_v(self) -> jax.Array:
        return self.v if self.log_domain else jnp.log(self.v)


@struct.dataclass
class LocalAdamState:
    """LocalAdam: averaged model and averaged Adam moments."""

    params: Params
    m: Params
    q: Params
    round: jax.Array  # [] int32


# ------------------------------------------------------------------------------ local hooks
def _scale(weight: jax.Array, grads: Params) -> Params:
    """`weight * g` in each leaf's own dtype (a float64 weight must not promote the carry)."""
    return jax.tree.map(lambda g: weight.astype(g.dtype) * g, grads)


def _moments(
    m: Params, q: Params | None, h: Params, beta3: float, adam: tuple[float, float] | None
) -> tuple[Params, Params | None, Params]:
    """`m = (1-b3) m + b3 h`; with `adam=(b4, tau)` also `q = (1-b4) q + b4 h^2` and the
    direction `m / (sqrt(q) + tau)` (no bias correction), else the direction is `m`."""
    m = jax.tree.map(lambda mi, hi: (1 - beta3) * mi + beta3 * hi, m, h)
    if adam is None:
        return m, q, m
    beta4, tau = adam
    q = jax.tree.map(lambda qi, hi: (1 - beta4) * qi + beta4 * hi * hi, q, h)
    return m, q, jax.tree.map(lambda mi, qi: mi / (jnp.sqrt(qi) + tau), m, q)


def cvar_grad_fn(*, k_over_n: float, beta1: float, threshold_lr: float) -> GradFn:
    """Local iteration of Algorithm 1 as a `local_train` hook; `aux = (u_i, s_i)`.

    `u = (1-b1) u + b1 l(w)`; `d = 1[u - s_old > 0]`; `s -= eta2 (K/N - d)`; direction
    `d * grad` (applied by SGD with step eta1)."""

    def grad_fn(value_and_grad, params, batch, aux):
        u, s = aux
        loss, grads = value_and_grad(params, batch)
        u = (1 - beta1) * u + beta1 * loss
        active = u - s > 0
        s = s - threshold_lr * (k_over_n - active.astype(s.dtype))
        direction = jax.tree.map(lambda g: jnp.where(active, g, jnp.zeros_like(g)), grads)
        return loss, direction, (u, s)

    return grad_fn


def kl_grad_fn(
    *,
    lam: float,
    beta1: float,
    beta2: float,
    beta3: float,
    log_domain: bool = True,
    adam: tuple[float, float] | None = None,
) -> GradFn:
    """Local iteration of Algorithm 2 (or 3 with `adam=(beta4, tau)`); `aux = (u, v, m, q)`
    with v = log v when `log_domain`.

    `u = (1-b1) u + b1 l`; `v = (1-b2) v + b2 exp(u/lambda)`; `h = exp(u/lambda)/v * grad`;
    `m = (1-b3) m + b3 h`; direction `m` (KL) or `m/(sqrt(q)+tau)` (KL-Adam)."""
    log_keep, log_new = math.log1p(-beta2) if beta2 < 1 else -math.inf, math.log(beta2)

    def grad_fn(value_and_grad, params, batch, aux):
        u, v, m, q = aux
        loss, grads = value_and_grad(params, batch)
        u = (1 - beta1) * u + beta1 * loss
        z = u / lam
        if log_domain:
            v = jnp.logaddexp(log_keep + v, log_new + z)
            weight = jnp.exp(z - v)
        else:
            e = jnp.exp(z)
            v = (1 - beta2) * v + beta2 * e
            weight = e / v
        m, q, direction = _moments(m, q, _scale(weight, grads), beta3, adam)
        return loss, direction, (u, v, m, q)

    return grad_fn


def adam_grad_fn(*, beta3: float, beta4: float, tau: float) -> GradFn:
    """Local iteration of Algorithm 4 (LocalAdam); `aux = (m, q)`."""

    def grad_fn(value_and_grad, params, batch, aux):
        m, q = aux
        loss, grads = value_and_grad(params, batch)
        m, q, direction = _moments(m, q, grads, beta3, (beta4, tau))
        return loss, direction, (m, q)

    return grad_fn


# ------------------------------------------------------------------------------ validation
def _check_beta(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value}")


def _check_common(num_clients: int, learning_rate: float, local: LocalSpec, cohort: CohortSpec):
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if not learning_rate >= 0:
        raise ValueError(f"learning_rate must be >= 0, got {learning_rate}")
    if local.epochs is not None:
        raise ValueError(
            "FGDRO runs a fixed number I of local iterations per round: use "
            "LocalSpec(steps=I), not epochs"
        )
    if cohort.sampling != "uniform":
        raise ValueError(
            f"FGDRO cohorts are uniform without replacement, got sampling={cohort.sampling!r}"
        )
    if cohort.weighting == "counts":
        raise ValueError("FGDRO averages clients uniformly (1/N): use weighting='uniform'")
    cohort.check(num_clients)


def _check_data(data: FederatedData, num_clients: int) -> None:
    if data.num_clients != num_clients:
        raise ValueError(
            f"the algorithm was built for num_clients={num_clients}, "
            f"but the data has {data.num_clients} clients"
        )


# ------------------------------------------------------------------------------ the round
def _local_round(
    loss_fn: LossFn,
    params: Params,
    round_: jax.Array,
    data: FederatedData,
    key: jax.Array,
    *,
    learning_rate: float,
    local: LocalSpec,
    cohort: CohortSpec,
    client_map: ClientMap,
    grad_fn: GradFn,
    local_state: Any,
    client_aux: Callable[[Any], Any],
    averaged: Callable[[Any], Any],
    kept: Callable[[Any], Any],
) -> tuple[jax.Array, jax.Array, CohortResult]:
    """Runs I local iterations on every cohort client from the broadcast `params`.

    `local_state` is the per-client state `[C, ...]` (gathered at the cohort);
    `client_aux(local_i)` builds a client's initial hook state from its row and the broadcast
    server variables; `averaged(aux)` picks the variables averaged by the server (uniformly
    over cohort clients with data: `CohortResult.mean = (mean delta, mean train loss, mean
    averaged)`); `kept(aux)` the stacked per-client outputs. Keys match FedAvg's, so with the
    same hyper-parameters clients see the same minibatches as in `fedavg`."""
    idx, _ = cohort.sample(round_key(key, round_, COHORT), data.counts)
    weights = (data.counts[idx] > 0).astype(float_dtype())
    local_key = round_key(key, round_, LOCAL)
    optimizer = optax.sgd(learning_rate)

    def client_fn(cid, local_part):
        res = local_train(
            params,
            data.client(cid),
            client_key(local_key, cid),
            loss_fn=loss_fn,
            optimizer=optimizer,
            max_steps=local.steps,
            batch_size=local.batch_size,
            sampling=local.sampling,
            grad_fn=grad_fn,
            aux=client_aux(local_part),
        )
        summand = (tree_sub(res.params, params), res.loss, averaged(res.aux))
        return summand, kept(res.aux)

    gathered = jax.tree.map(lambda a: a[idx], local_state)
    return idx, weights, map_cohort(client_fn, idx, weights, gathered, client_map=client_map)


def _finish(
    params: Params, idx: jax.Array, weights: jax.Array, out: CohortResult
) -> tuple[Params, jax.Array, Any, Metrics]:
    """Server side shared by all four: `w = w + mean delta` (exactly FedAvg's averaging with
    server lr 1), and the common metrics."""
    mean_delta, train_loss, mean_avg = out.mean
    contributed = out.total_weight > 0
    new_params = jax.tree.map(
        lambda p, d: jnp.where(contributed, p + d, p).astype(p.dtype), params, mean_delta
    )
    participants = jnp.sum(weights > 0)
    metrics = {
        "train_loss": train_loss,
        "participants": participants,
        "update_norm": tree_norm(mean_delta),
    }
    return new_params, contributed, mean_avg, metrics


def _keep_if(contributed: jax.Array, new: Any, old: Any) -> Any:
    """New averaged values (in the old dtypes: weights may be float64), or the old ones if no
    client contributed."""
    return jax.tree.map(lambda a, b: jnp.where(contributed, a, b).astype(b.dtype), new, old)


def _scatter_local(old: jax.Array, idx: jax.Array, new: jax.Array, has_data: jax.Array):
    """Writes the cohort's new local values back to `[C]` (clients without data keep theirs)."""
    return old.at[idx].set(jnp.where(has_data, new, old[idx]))


# ------------------------------------------------------------------------------ FGDRO-CVaR
def fgdro_cvar(
    loss_fn: LossFn,
    *,
    num_clients: int,
    k: int | None = None,
    learning_rate: float = 0.01,
    threshold_lr: float | None = None,
    beta1: float = 0.1,
    local: LocalSpec = LocalSpec(steps=32, batch_size=32),
    cohort: CohortSpec = CohortSpec(),
    client_map: ClientMap = ClientMap(),
    client_metrics: bool = True,
) -> Algorithm:
    """FGDRO-CVaR (Algorithm 1): minimise the mean of the K largest client losses.

    Args:
      loss_fn: `loss_fn(params, batch)`, e.g. `model.loss`.
      num_clients: N (the per-client state is `[N]`; must match the data).
      k: K in 1..N (default `max(1, round(0.2 N))`, spec section 7).
      learning_rate: eta1 (model step). threshold_lr: eta2 (threshold step; default eta1).
      beta1: loss moving-average rate in (0, 1].
      local: I = `local.steps` local iterations of batch `local.batch_size` per round.
      cohort: participation (default: all clients, as in the paper).
      client_metrics: also log `[N]` arrays (u, CVaR weights of the top-K u) every round.

    Metrics: `threshold` s, `cvar_objective` (the s-form evaluated at u), `cvar_active`
    #{u_i > s}, `topk_mean_u`, payload bytes (w + s per client, up and down).
    """
    _check_common(num_clients, learning_rate, local, cohort)
    k = max(1, round(0.2 * num_clients)) if k is None else k
    if not (isinstance(k, int) and 1 <= k <= num_clients):
        raise ValueError(f"CVaR K must be an integer in [1, {num_clients}], got {k}")
    _check_beta("beta1", beta1)
    threshold_lr = learning_rate if threshold_lr is None else threshold_lr
    if not threshold_lr >= 0:
        raise ValueError(f"threshold_lr must be >= 0, got {threshold_lr}")
    grad_fn = cvar_grad_fn(k_over_n=k / num_clients, beta1=beta1, threshold_lr=threshold_lr)

    def init(params: Params, key: jax.Array) -> CVaRState:
        del key
        dt = float_dtype()
        return CVaRState(params, jnp.zeros((), dt), jnp.zeros((num_clients,), dt), jnp.int32(0))

    def step(state: CVaRState, data: FederatedData, key: jax.Array):
        _check_data(data, num_clients)
        idx, weights, out = _local_round(
            loss_fn,
            state.params,
            state.round,
            data,
            key,
            learning_rate=learning_rate,
            local=local,
            cohort=cohort,
            client_map=client_map,
            grad_fn=grad_fn,
            local_state=state.u,
            client_aux=lambda u: (u, state.threshold),
            averaged=lambda a: a[1],
            kept=lambda a: a[0],
        )
        params, contributed, mean_s, metrics = _finish(state.params, idx, weights, out)
        s = _keep_if(contributed, mean_s, state.threshold)
        u = _scatter_local(state.u, idx, out.outputs, weights > 0)
        metrics.update(
            threshold=s,
            cvar_objective=cvar_objective(u, s, k),
            cvar_active=jnp.sum(u > s),
            topk_mean_u=topk_mean(u, k),
            **payload_metrics((state.params, s), metrics["participants"], jnp.int32(idx.shape[0])),
        )
        if client_metrics:
            metrics.update(u=u, client_weights=cvar_weights(u, k))
        return CVaRState(params, s, u, state.round + 1), metrics

    return Algorithm(init, step)


# ------------------------------------------------------------------------------ FGDRO-KL(-Adam)
def _kl_family(
    loss_fn: LossFn,
    *,
    num_clients: int,
    lam: float,
    learning_rate: float,
    beta1: float,
    beta2: float,
    beta3: float,
    adam: tuple[float, float] | None,
    log_domain: bool,
    local: LocalSpec,
    cohort: CohortSpec,
    client_map: ClientMap,
    client_metrics: bool,
) -> Algorithm:
    _check_common(num_clients, learning_rate, local, cohort)
    if not lam > 0:
        raise ValueError(f"KL regularisation lambda must be > 0, got {lam}")
    for name, value in (("beta1", beta1), ("beta2", beta2), ("beta3", beta3)):
        _check_beta(name, value)
    if adam is not None:
        _check_beta("beta4", adam[0])
        if not adam[1] > 0:
            raise ValueError(f"tau must be > 0, got {adam[1]}")
    grad_fn = kl_grad_fn(
        lam=lam, beta1=beta1, beta2=beta2, beta3=beta3, log_domain=log_domain, adam=adam
    )

    def init(params: Params, key: jax.Array) -> KLState:
        del key
        dt = float_dtype()
        zeros = jax.tree.map(jnp.zeros_like, params)
        v0 = jnp.zeros((), dt) if log_domain else jnp.ones((), dt)
        return KLState(
            params=params,
            m=zeros,
            q=zeros if adam is not None else None,
            v=v0,
            u=jnp.zeros((num_clients,), dt),
            round=jnp.int32(0),
            log_domain=log_domain,
        )

    def step(state: KLState, data: FederatedData, key: jax.Array):
        _check_data(data, num_clients)
        # averaged: m, q and (linear domain) v; log-domain v is combined by logsumexp below
        idx, weights, out = _local_round(
            loss_fn,
            state.params,
            state.round,
            data,
            key,
            learning_rate=learning_rate,
            local=local,
            cohort=cohort,
            client_map=client_map,
            grad_fn=grad_fn,
            local_state=state.u,
            client_aux=lambda u: (u, state.v, state.m, state.q),
            averaged=lambda a: (a[2], a[3], None if log_domain else a[1]),
            kept=lambda a: (a[0], a[1]),
        )
        params, contributed, (m, q, mean_v), metrics = _finish(state.params, idx, weights, out)
        u_new, v_clients = out.outputs
        if log_domain:
            v = jax.nn.logsumexp(v_clients, b=weights) - jnp.log(jnp.sum(weights))
        else:
            v = mean_v
        m, q, v = _keep_if(contributed, (m, q, v), (state.m, state.q, state.v))
        u = _scatter_local(state.u, idx, u_new, weights > 0)
        new = KLState(params, m, q, v, u, state.round + 1, log_domain)
        shared = (state.params, state.m, state.q, state.v)  # w, m, (q), v: 2d+1 or 3d+1
        metrics.update(
            kl_objective=kl_objective(u, lam),
            log_v=new.log_v,
            **payload_metrics(shared, metrics["participants"], jnp.int32(idx.shape[0])),
        )
        if client_metrics:
            metrics.update(u=u, client_weights=kl_weights(u, lam))
        return new, metrics

    return Algorithm(init, step)


def fgdro_kl(
    loss_fn: LossFn,
    *,
    num_clients: int,
    lam: float = 1.0,
    learning_rate: float = 0.01,
    beta1: float = 0.1,
    beta2: float = 0.1,
    beta3: float = 0.1,
    log_domain: bool = True,
    local: LocalSpec = LocalSpec(steps=32, batch_size=32),
    cohort: CohortSpec = CohortSpec(),
    client_map: ClientMap = ClientMap(),
    client_metrics: bool = True,
) -> Algorithm:
    """FGDRO-KL (Algorithm 2): minimise `lambda log mean_i exp(l_i/lambda)`.

    Args:
      num_clients: N. lam: lambda > 0 (large lambda -> FedAvg, small -> worst client).
      learning_rate: eta. beta1/beta2/beta3: moving-average rates of u, v, m in (0, 1].
      log_domain: keep log v (overflow-free; default) or the paper's literal v.
      local, cohort, client_map, client_metrics: as in `fgdro_cvar`.

    Metrics: `kl_objective` (at u), `log_v`, `client_weights` softmax(u/lambda), payload
    (w, m, v: 2d+1 floats per client, up and down).
    """
    return _kl_family(
        loss_fn,
        num_clients=num_clients,
        lam=lam,
        learning_rate=learning_rate,
        beta1=beta1,
        beta2=beta2,
        beta3=beta3,
        adam=None,
        log_domain=log_domain,
        local=local,
        cohort=cohort,
        client_map=client_map,
        client_metrics=client_metrics,
    )


def fgdro_kl_adam(
    loss_fn: LossFn,
    *,
    num_clients: int,
    lam: float = 1.0,
    learning_rate: float = 0.001,
    beta1: float = 0.1,
    beta2: float = 0.1,
    beta3: float = 0.1,
    beta4: float = 0.001,
    tau: float = 1e-8,
    log_domain: bool = True,
    local: LocalSpec = LocalSpec(steps=32, batch_size=32),
    cohort: CohortSpec = CohortSpec(),
    client_map: ClientMap = ClientMap(),
    client_metrics: bool = True,
) -> Algorithm:
    """FGDRO-KL-Adam (Algorithm 3): FGDRO-KL with Adam-type local steps
    `w -= eta m / (sqrt(q) + tau)`, `q = (1-beta4) q + beta4 h^2` (no bias correction).

    Args are those of `fgdro_kl` plus beta4 in (0, 1] and tau > 0. Payload: w, m, q, v
    (3d+1 floats per client, up and down).
    """
    return _kl_family(
        loss_fn,
        num_clients=num_clients,
        lam=lam,
        learning_rate=learning_rate,
        beta1=beta1,
        beta2=beta2,
        beta3=beta3,
        adam=(beta4, tau),
        log_domain=log_domain,
        local=local,
        cohort=cohort,
        client_map=client_map,
        client_metrics=client_metrics,
    )


# ------------------------------------------------------------------------------ LocalAdam
def local_adam(
    loss_fn: LossFn,
    *,
    num_clients: int,
    learning_rate: float = 0.001,
    beta3: float = 0.1,
    beta4: float = 0.001,
    tau: float = 1e-8,
    local: LocalSpec = LocalSpec(steps=32, batch_size=32),
    cohort: CohortSpec = CohortSpec(),
    client_map: ClientMap = ClientMap(),
) -> Algorithm:
    """LocalAdam (Algorithm 4, ERM): Adam-type local steps, server averages w, m and q.

    Equals FGDRO-KL-Adam with lambda -> infinity. Payload: w, m, q (3d per client)."""
    _check_common(num_clients, learning_rate, local, cohort)
    _check_beta("beta3", beta3)
    _check_beta("beta4", beta4)
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    grad_fn = adam_grad_fn(beta3=beta3, beta4=beta4, tau=tau)

    def init(params: Params, key: jax.Array) -> LocalAdamState:
        del key
        zeros = jax.tree.map(jnp.zeros_like, params)
        return LocalAdamState(params, zeros, zeros, jnp.int32(0))

    def step(state: LocalAdamState, data: FederatedData, key: jax.Array):
        _check_data(data, num_clients)
        idx, weights, out = _local_round(
            loss_fn,
            state.params,
            state.round,
            data,
            key,
            learning_rate=learning_rate,
            local=local,
            cohort=cohort,
            client_map=client_map,
            grad_fn=grad_fn,
            local_state=None,  # LocalAdam keeps no per-client state
            client_aux=lambda _: (state.m, state.q),
            averaged=lambda a: a,
            kept=lambda a: None,
        )
        params, contributed, (m, q), metrics = _finish(state.params, idx, weights, out)
        m, q = _keep_if(contributed, (m, q), (state.m, state.q))
        metrics.update(
            payload_metrics(
                (state.params, state.m, state.q), metrics["participants"], jnp.int32(idx.shape[0])
            )
        )
        return LocalAdamState(params, m, q, state.round + 1), metrics

    return Algorithm(init, step)
