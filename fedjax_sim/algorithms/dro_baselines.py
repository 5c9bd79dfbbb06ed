"""The federated DRO baselines of the FGDRO paper: DRFA and (federated) DR-DSGD.

Spec: `../shared/specs/fgdro.md` section 2.5 (the FGDRO paper gives no baseline details; the
spec fixes them). Uniform client averaging as in FGDRO (`fedjax_sim.algorithms.fgdro`).

DRFA: Deng, Kamani, Mahdavi, "Distributionally Robust Federated Averaging" (NeurIPS 2020).
Minimax `min_w max_{lam in simplex} sum_i lam_i l_i(w)` (CVaR with K = 1). Server state: the
model and the client weights `lam [C]` (init uniform, or `initial_weights`, e.g. the authors'
`n_i / n`). One `step` = one round:
- draw the snapshot step `t' ~ Uniform{1..I}` (authors' code: 1..I-1);
- full participation (`cohort.size=None`, the spec's recommended variant): all clients run I
  local SGD steps from w, `w = sum_i lam_i w_i(I)`, `w_snap = sum_i lam_i w_i(t')`, and every
  client returns one minibatch loss at `w_snap`, `v_i = loss_i`;
- partial participation (`cohort.size=m`, the paper's algorithm): m training clients drawn
  i.i.d. ~ lam (with replacement; a client drawn twice trains on the same minibatches, i.e.
  counts twice), `w = mean_D w_i(I)`, `w_snap = mean_D w_i(t')`; m loss clients U drawn
  uniformly without replacement, `v_i = (N/m) loss_i(w_snap)` for i in U, else 0;
- `lam = Proj_simplex(lam + gamma I v)` with `gamma = dual_lr * dual_lr_decay^round` (the
  authors' code decays by 0.9 per round and floors lam at 1e-3: `weight_floor`).
The KL-regularised variant (DRFA-Prox) is not implemented.

DR-DSGD: Issaid, Elgabli, Bennis, "DR-DSGD: A Distributionally Robust Decentralized Learning
Algorithm over Graphs" (TMLR 2022). Minimises `sum_i exp(l_i(w)/mu)` with the plug-in
minibatch estimate `w_i -= eta (1/mu) exp(l/mu) grad l` (l = minibatch loss at w_i; biased
for small batches). Federated adaptation (spec): gossip mixing replaced by exact uniform
averaging every I local steps; built on the FedAvg round with a `grad_fn` hook. The
exponential is not clipped (as in the paper): a large `l/mu` overflows, so choose mu > max loss.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_sim.algorithms.compose import Options, preset, synchronous
from fedjax_sim.algorithms.core import (
    COHORT,
    EXTRA,
    LOCAL,
    Algorithm,
    CohortSpec,
    GradFn,
    LocalSpec,
    LossFn,
    Params,
    client_key,
    float_dtype,
    local_train,
    map_cohort,
    minibatch,
    payload_metrics,
    round_key,
    tree_norm,
    tree_sub,
)
from fedjax_sim.algorithms.hooks import tilted
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.events import sample_cohort
from fedjax_sim.parallel import ClientMap


# ------------------------------------------------------------------------------ DRFA
def project_simplex(v: jax.Array) -> jax.Array:
    """Euclidean projection of `v [N]` onto the probability simplex (sort-based, exact)."""
    n = v.shape[0]
    srt = jnp.sort(v)[::-1]
    css = jnp.cumsum(srt) - 1.0
    rho = jnp.sum(srt - css / jnp.arange(1, n + 1, dtype=v.dtype) > 0)
    theta = css[rho - 1] / rho.astype(v.dtype)
    return jnp.maximum(v - theta, 0.0)


def snapshot_step(key: jax.Array, round_: jax.Array, steps: int) -> jax.Array:
    """DRFA's snapshot step `t'` of a round, uniform in `{1..steps}` (derived from the key)."""
    return jax.random.randint(
        jax.random.fold_in(round_key(key, round_, EXTRA), 0), (), 1, steps + 1
    )


def snapshot_grad_fn(t_snap: jax.Array) -> GradFn:
    """Local-step hook that stores the model after `t_snap` steps; `aux = (snapshot, step)`.
    (The hook sees the pre-step model of step k, i.e. w(k); w(I) is the returned model.)"""

    def grad_fn(value_and_grad, params, batch, aux):
        snap, k = aux
        snap = jax.tree.map(lambda p, s: jnp.where(k == t_snap, p, s), params, snap)
        loss, grads = value_and_grad(params, batch)
        return loss, grads, (snap, k + 1)

    return grad_fn


@struct.dataclass
class DRFAState:
    params: Params  # global model w
    weights: jax.Array  # [C] client weights lam (in the simplex)
    round: jax.Array  # [] int32


def drfa(
    loss_fn: LossFn,
    *,
    num_clients: int,
    learning_rate: float = 0.01,
    dual_lr: float = 0.01,
    dual_lr_decay: float = 1.0,
    weight_floor: float = 0.0,
    initial_weights: jax.Array | None = None,
    local: LocalSpec = LocalSpec(steps=32, batch_size=32),
    cohort: CohortSpec = CohortSpec(),
    client_map: ClientMap = ClientMap(),
    client_metrics: bool = True,
) -> Algorithm:
    """DRFA (Deng et al. 2020): local SGD for w, projected ascent on the client weights.

    Args:
      num_clients: N. learning_rate: local SGD step. dual_lr: gamma (weights ascent step).
      dual_lr_decay: gamma multiplier per round (authors' code: 0.9).
      weight_floor: floor lam_i at this value and renormalise (authors' code: 1e-3).
      initial_weights: `[N]` initial lam (normalised; default uniform).
      local: I = `local.steps` local SGD steps per round.
      cohort: `size=None` -> full-participation variant, `size=m` -> the sampled variant
        (training clients ~ lam with replacement, loss clients uniform); only `size` is used.

    Metrics: `client_weights` lam (if `client_metrics`), `snapshot_step`, `weights_max`,
    payload (training clients: 2d up, d down; loss clients: 1 up, d down).
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if not learning_rate >= 0:
        raise ValueError(f"learning_rate must be >= 0, got {learning_rate}")
    if not dual_lr >= 0:
        raise ValueError(f"dual_lr must be >= 0, got {dual_lr}")
    if not 0 < dual_lr_decay <= 1:
        raise ValueError(f"dual_lr_decay must be in (0, 1], got {dual_lr_decay}")
    if not 0 <= weight_floor * num_clients < 1:
        raise ValueError(f"weight_floor must be in [0, 1/N), got {weight_floor}")
    if local.epochs is not None:
        raise ValueError("DRFA runs a fixed number I of local steps: use LocalSpec(steps=I)")
    cohort.check(num_clients)
    size = cohort.size
    if initial_weights is not None:
        lam0 = jnp.asarray(initial_weights, float_dtype())
        if lam0.shape != (num_clients,) or not bool(jnp.all(lam0 >= 0) & (jnp.sum(lam0) > 0)):
            raise ValueError(
                f"initial_weights must be [{num_clients}] non-negative with a positive sum"
            )
        lam0 = lam0 / jnp.sum(lam0)
    else:
        lam0 = jnp.full((num_clients,), 1.0 / num_clients, float_dtype())
    optimizer = optax.sgd(learning_rate)
    steps = local.steps

    def init(params: Params, key: jax.Array) -> DRFAState:
        del key
        return DRFAState(params, lam0, jnp.int32(0))

    def step(state: DRFAState, data: FederatedData, key: jax.Array):
        if data.num_clients != num_clients:
            raise ValueError(
                f"drfa was built for num_clients={num_clients}, data has {data.num_clients}"
            )
        params, lam = state.params, state.weights
        t_snap = snapshot_step(key, state.round, steps)
        if size is None:
            idx, weights = jnp.arange(num_clients, dtype=jnp.int32), lam
        else:
            idx = jax.random.choice(
                round_key(key, state.round, COHORT), num_clients, (size,), p=lam
            ).astype(jnp.int32)
            weights = jnp.ones((size,), lam.dtype)
        local_key = round_key(key, state.round, LOCAL)
        grad_fn = snapshot_grad_fn(t_snap)

        def client_fn(cid):
            res = local_train(
                params,
                data.client(cid),
                client_key(local_key, cid),
                loss_fn=loss_fn,
                optimizer=optimizer,
                max_steps=steps,
                batch_size=local.batch_size,
                sampling=local.sampling,
                grad_fn=grad_fn,
                aux=(params, jnp.int32(0)),
            )
            snap = jax.tree.map(
                lambda f, s: jnp.where(t_snap == steps, f, s), res.params, res.aux[0]
            )
            return (tree_sub(res.params, params), tree_sub(snap, params), res.loss), None

        out = map_cohort(client_fn, idx, weights, client_map=client_map)
        mean_delta, mean_snap, train_loss = out.mean
        new_params = jax.tree.map(lambda p, d: (p + d).astype(p.dtype), params, mean_delta)
        w_snap = jax.tree.map(lambda p, d: (p + d).astype(p.dtype), params, mean_snap)

        extra = round_key(key, state.round, EXTRA)
        if size is None:
            loss_ids, scale = jnp.arange(num_clients, dtype=jnp.int32), 1.0
        else:
            loss_ids = sample_cohort(jax.random.fold_in(extra, 1), num_clients, size)
            scale = num_clients / size
        loss_key = jax.random.fold_in(extra, 2)

        def snapshot_loss(cid):
            batch = minibatch(
                data.client(cid), client_key(loss_key, cid), 0, local.batch_size, local.sampling
            )
            return loss_fn(w_snap, batch)

        losses = client_map.map(snapshot_loss, loss_ids)
        v = jnp.zeros((num_clients,), lam.dtype).at[loss_ids].add(scale * losses)
        gamma = dual_lr * dual_lr_decay ** state.round.astype(lam.dtype)
        new_lam = project_simplex(lam + gamma * steps * v)
        if weight_floor > 0:
            new_lam = jnp.maximum(new_lam, weight_floor)
            new_lam = new_lam / jnp.sum(new_lam)

        n_train, n_loss = jnp.int32(idx.shape[0]), jnp.int32(loss_ids.shape[0])
        up_train = payload_metrics(params, n_train, n_train, up_models=2, down_models=1)
        loss_scalar = jnp.zeros((), losses.dtype)
        up_loss = payload_metrics(loss_scalar, n_loss, jnp.int32(0))
        down_snap = payload_metrics(params, jnp.int32(0), n_loss)
        metrics = {
            "train_loss": train_loss,
            "participants": n_train,
            "update_norm": tree_norm(mean_delta),
            "snapshot_step": t_snap,
            "snapshot_loss_max": jnp.max(losses),
            "weights_max": jnp.max(new_lam),
            **{k: up_train[k] + up_loss[k] + down_snap[k] for k in ("bytes_up", "bytes_down")},
        }
        if client_metrics:
            metrics["client_weights"] = new_lam
        return DRFAState(new_params, new_lam, state.round + 1), metrics

    return Algorithm(init, step)


# ------------------------------------------------------------------------------ DR-DSGD
@preset(
    client_optimizer=0.01,
    local=LocalSpec(steps=32, batch_size=32),
    cohort=CohortSpec(weighting="uniform"),
)
def dr_dsgd(loss_fn: LossFn, *, temperature: float = 2.0, options: Options) -> Algorithm:
    """DR-DSGD (Issaid et al. 2022), federated: local steps `w -= eta (1/t) exp(l/t) grad l`
    with t = `temperature` (> 0; the paper's mu, its theory assumes > 1), uniform averaging
    every I = `local.steps` steps (payload d per client, up and down)."""
    cohort = options.cohort
    if isinstance(cohort, CohortSpec):
        if cohort.weighting == "counts":
            raise ValueError("DR-DSGD averages clients uniformly: use weighting='uniform'")
        cohort = dataclasses.replace(cohort, weighting="uniform")
    return synchronous(loss_fn, dataclasses.replace(options, cohort=cohort), tilted(temperature))
