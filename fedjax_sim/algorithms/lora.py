"""Federated LoRA: the partition that trains and sends only the adapters, and heterogeneous
ranks with two published aggregation rules (HetLoRA, FLoRA) as local-step hooks.

A LoRA model (`models.transformer(..., lora_rank=r)`) holds beside each adapted kernel `W
[d_in, d_out]` the adapters `lora_a` (A, `[d_in, r]`) and `lora_b` (B, `[r, d_out]`): the
layer computes `x W + s (x A) B`, `s = alpha / r`. `lora_partition()` labels the adapters
shared and everything else frozen, so every preset, aggregator and server optimizer works on
the adapters only, only they travel (`bytes_up`), and the frozen base lives once in the
global model (broadcast to the vmapped clients, never copied per client).

Heterogeneous ranks: client i trains only the first `r_i <= r` ranks of the global rank-r
adapters (`ranks [C]`, e.g. from a device class): a rank mask over the max-rank adapters, so
the cohort stays one vmapped program. The client's forward pass and gradient use the
truncated adapters `A[:, :r_i]`, `B[:r_i]`; the ranks above `r_i` do not move.

The pitfall both rules answer: averaging A and B separately (what FedAvg does on the
adapters) does not average the products, `mean_i(A_i) mean_i(B_i) != mean_i(A_i B_i)` in
general (equal with one client, or when all clients share the same A or the same B).

- `hetlora(ranks, ...)` (Cho et al. 2024, HetLoRA): the client's truncated modules are
  zero-padded to rank r and averaged with the sparsity weights `||A_i B_i||_F / Z` per module
  (times the cohort's weights; `CohortSpec(weighting="uniform")` gives the paper's); with
  `prune_lam > 0`, rank self-pruning: the local loss adds `prune_lam * ||A_tail B_tail||_F`
  over the last ranks `[floor(decay r_i), r_i)` of each module, and a client whose tail
  norm (summed over modules) ends below where it started keeps `max(1, floor(decay r_i))`
  ranks from then on (its row `rows["hetlora"]`).
- `flora(ranks, scale)` (Wang et al. 2024, FLoRA): the server stacks the clients' modules,
  `A = [A_1 ... A_M]`, `B = [p_1 B_1; ...; p_M B_M]`, so `s A B = sum_i p_i s A_i B_i`
  exactly, merges it into the frozen kernels `W <- W + sum_i p_i s A_i B_i` and resets the
  adapters (`B = 0`; A: the global A, see the deviations).

Why hooks, not aggregators: both rules need the clients' modules `x_t + Delta_i` (HetLoRA's
norms, FLoRA's products) while an aggregator sees only the updates `Delta_i`, and FLoRA moves
the frozen base, which only a hook's `finalize` can (it sees the full model,
`RoundSummary.model`, and may return frozen leaves). Both keep the client map fused: the
norm weights ride on the update (`n_i Delta_i` and `n_i` summed, divided in `finalize`, as
FedNova does), FLoRA's products are a summand `sum_i p_i s A_i B_i` formed inside the client
map (equal to the product of the stacked modules; no `[M, ...]` array).

Deviations: one scaling `s = alpha / r` for every rank (the truncation of the rank-r global
module, not `alpha / r_i`); HetLoRA's norms are of `A B` (s cancels in the weights and is
absorbed into `prune_lam`); HetLoRA with clipping or DP aggregators clips `n_i Delta_i`;
FLoRA keeps the global A instead of drawing a fresh one each round (with B = 0 any A is a
LoRA initialisation) and applies the products with server learning rate 1 (the server
optimizer's step on the adapters is discarded by the reset); FLoRA's `bytes_down` counts the
rank-r adapters, not the stacked ones (`sum_i r_i` ranks).

Bytes: a rank-r_i client sends its truncated modules, `r_i` columns of A and rows of B
(`(d_in + d_out) r_i` values per module); the round's update is zero-padded on the server.
Both hooks declare those sizes per client (`LocalHook.update_bytes`, `rank_bytes` x r_i), so
the round's `bytes_up` sums them over the reporting clients and the virtual clock
(`device_model`) times each client's upload at its own size; the client's rank is not
counted (the server reads it from the shapes it receives). This is the plain upload: an
aggregator's own wire format (compression, secure aggregation, whose masked vectors must all
have one length, the padded one) replaces it.

Any synchronous preset with a rule (the CLI's `--algorithm NAME --lora-rule hetlora|flora
--lora-ranks ...`): `with_rule(preset, rule)` chains the rule's hook first, ahead of the
preset's own (`Options.hooks`), e.g. `with_rule(fedprox, "hetlora")`,
`with_rule(fedadam, "hetlora")`; `hetlora_fedavg` and `flora_fedavg` are FedAvg (both
papers' local SGD and server step) with the rule. `client_ranks` gives client i the rank
`ranks[i mod len(ranks)]`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms.core import Algorithm, LossFn, Params
from fedjax_sim.algorithms.fedavg import fedavg
from fedjax_sim.algorithms.local_hook import HookContext, LocalHook, LocalOutcome, RoundSummary
from fedjax_sim.algorithms.partition import Partition, by_path, path_name
from fedjax_sim.core.checks import non_negative

ADAPTER_PATTERN = r"/lora_[ab]$"


def lora_partition() -> Partition:
    """Adapters (`.../lora_a`, `.../lora_b`) shared, every other leaf frozen."""
    return by_path(frozen=rf"^(?!.*{ADAPTER_PATTERN})")


# ------------------------------------------------------------------------------ rank masks
def _kind(path: tuple) -> str | None:
    last = path_name(path).rsplit("/", 1)[-1]
    return last if last in ("lora_a", "lora_b") else None


def max_rank(tree: Params) -> int:
    """r, the rank of the adapters of `tree` (a model or a view)."""
    ranks = {
        np.shape(x)[-1 if _kind(p) == "lora_a" else 0]
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
        if _kind(p)
    }
    if len(ranks) != 1:
        raise ValueError(f"expected LoRA adapters of one rank, found ranks {sorted(ranks)}")
    return ranks.pop()


def truncate(tree: Params, rank: jax.Array) -> Params:
    """`tree` with the adapters' ranks `>= rank` zeroed (`A[:, rank:] = 0`, `B[rank:] = 0`):
    a rank-`rank` module zero-padded to the adapters' rank; other leaves unchanged."""

    def one(path, x):
        kind = _kind(path)
        if kind is None:
            return x
        keep = jnp.arange(x.shape[-1 if kind == "lora_a" else 0]) < rank
        return x * (keep if kind == "lora_a" else keep[:, None]).astype(x.dtype)

    return jax.tree_util.tree_map_with_path(one, tree)


def _modules(tree: Params, prefix: tuple = ()) -> dict[tuple, dict]:
    """`{path of a module: its dict}` of the dicts holding both `lora_a` and `lora_b`."""
    out = {}
    if isinstance(tree, dict):
        if isinstance(tree.get("lora_a"), jax.Array | np.ndarray) and "lora_b" in tree:
            out[prefix] = tree
        for k, v in tree.items():
            out.update(_modules(v, (*prefix, k)))
    return out


def products(tree: Params) -> dict[tuple, jax.Array]:
    """`{module path: A B}` (`[d_in, d_out]`, unscaled) of every adapted module."""
    return {p: m["lora_a"] @ m["lora_b"] for p, m in _modules(tree).items()}


def _per_module(tree: Params, values: dict[tuple, jax.Array], default: float) -> Params:
    """A tree of `tree`'s structure holding at each adapter leaf its module's value (others:
    `default`)."""

    def one(path, x):
        if _kind(path) is None:
            return jnp.asarray(default, x.dtype)
        keys = tuple(getattr(k, "key", k) for k in path[:-1])
        return values[keys].astype(x.dtype)

    return jax.tree_util.tree_map_with_path(one, tree)


def _client_rank(ranks: jax.Array, ctx: HookContext) -> jax.Array:
    rank = ranks[ctx.client]
    return rank if ctx.row is None else jnp.minimum(rank, ctx.row)


def _check_ranks(ranks: Sequence[int] | np.ndarray) -> jax.Array:
    r = np.asarray(ranks)
    if r.ndim != 1 or r.size == 0 or not np.issubdtype(r.dtype, np.integer) or r.min() < 1:
        raise ValueError(f"ranks must be a [C] array of ints >= 1, got {ranks!r}")
    return jnp.asarray(r, jnp.int32)


def _masked_direction(ranks: jax.Array, penalty=None):
    """Gradient of the truncated model (and `penalty(truncated params, rank)`), masked."""

    def direction(value_and_grad, params, batch, carry, ctx):
        rank = _client_rank(ranks, ctx)
        w = truncate(params, rank)
        loss, grads = value_and_grad(w, batch)
        if penalty is not None:
            value, extra = jax.value_and_grad(penalty)(w, rank)
            loss = loss + value
            grads = jax.tree.map(jnp.add, grads, extra)
        return loss, truncate(grads, rank), carry

    return direction


def _padded_update(ctx: HookContext, outcome: LocalOutcome, rank: jax.Array) -> Params:
    """`pad(x_i) - x_t`: the client's truncated modules zero-padded, as an update from x_t."""
    final = jax.tree.map(jnp.add, ctx.anchor, outcome.update)
    return jax.tree.map(jnp.subtract, truncate(final, rank), ctx.anchor)


def rank_bytes(tree: Params) -> int:
    """Bytes one rank of every adapted module of `tree` (a model or a view) takes: a column
    of A and a row of B, `d_in + d_out` values per module at their dtypes' sizes."""
    return sum(
        m["lora_a"].shape[0] * m["lora_a"].dtype.itemsize
        + m["lora_b"].shape[1] * m["lora_b"].dtype.itemsize
        for m in _modules(tree).values()
    )


def _update_bytes(ranks: jax.Array):
    """`LocalHook.update_bytes` of rank-r_i clients: `rank_bytes x r_i` (`r_i` capped by the
    client's pruned rank, its row, where it has one)."""

    def update_bytes(view, ids, row):
        rank = ranks[ids] if row is None else jnp.minimum(ranks[ids], row)
        return jnp.float32(rank_bytes(view)) * rank.astype(jnp.float32)

    return update_bytes


# ------------------------------------------------------------------------------ HetLoRA
def _safe_norm(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(x)) + jnp.finfo(x.dtype).tiny)


def tail_norm(tree: Params, rank: jax.Array, decay: float) -> jax.Array:
    """`sum over modules ||A_tail B_tail||_F`, the tail the ranks `[floor(decay rank),
    rank)` (HetLoRA's self-pruning regulariser)."""
    start = jnp.floor(decay * rank).astype(jnp.int32)

    def one(m):
        r = m["lora_a"].shape[-1]
        keep = ((jnp.arange(r) >= start) & (jnp.arange(r) < rank)).astype(m["lora_a"].dtype)
        return _safe_norm((m["lora_a"] * keep) @ m["lora_b"])

    return sum(one(m) for m in _modules(tree).values())


def hetlora(
    ranks: Sequence[int] | np.ndarray,
    *,
    prune_lam: float = 0.0,
    decay: float = 0.99,
) -> LocalHook:
    """HetLoRA (Cho et al. 2024): heterogeneous ranks `ranks [C]` (each <= the adapters'
    rank), zero-padding and sparsity-weighted aggregation; rank self-pruning with
    `prune_lam > 0` (regulariser weight) and `decay` (the paper's gamma: the ranks kept
    when pruning). Hook `"hetlora"`; metric `hetlora_rank` (the cohort's mean rank). See the
    module docstring for the rules and the deviations."""
    ranks = _check_ranks(ranks)
    non_negative("prune_lam", prune_lam)
    if not 0.0 < decay < 1.0:
        raise ValueError(f"decay must be in (0, 1), got {decay}")
    pruning = prune_lam > 0

    def penalty(w, rank):
        return prune_lam * tail_norm(w, rank, decay)

    def finish(ctx, outcome):
        rank = _client_rank(ranks, ctx)
        update = _padded_update(ctx, outcome, rank)
        final = truncate(jax.tree.map(jnp.add, ctx.anchor, update), rank)
        norms = {p: _safe_norm(v) for p, v in products(final).items()}
        weights = _per_module(update, norms, 1.0)
        row = ctx.row
        if pruning:
            before = tail_norm(truncate(ctx.anchor, rank), rank, decay)
            pruned = jnp.maximum(1, jnp.floor(decay * rank)).astype(jnp.int32)
            row = jnp.where(tail_norm(final, rank, decay) < before, pruned, rank)
        sent = jax.tree.map(jnp.multiply, update, weights)
        return row, weights, rank.astype(jnp.float32), sent

    def finalize(server, summary: RoundSummary, server_step):
        mean = summary.mean  # sum_i w_i n_i / sum_i w_i per leaf
        update = jax.tree.map(
            lambda u, n: jnp.where(n > 0, u / jnp.where(n > 0, n, 1.0), 0.0),
            summary.update,
            mean,
        )
        weights = summary.cohort.weights
        m = weights > 0
        rank = jnp.sum(jnp.where(m, summary.outputs, 0.0)) / jnp.maximum(jnp.sum(m), 1)
        return server, server_step(update), {"hetlora_rank": rank}

    return LocalHook(
        "hetlora",
        direction=_masked_direction(ranks, penalty if pruning else None),
        init_row=(lambda view: jnp.int32(max_rank(view))) if pruning else None,
        finish=finish,
        finalize=finalize,
        # the server computes the norms from the modules it receives, their ranks from
        # the shapes
        not_sent=("summand", "output"),
        update_bytes=_update_bytes(ranks),
    )


# ------------------------------------------------------------------------------ FLoRA
def flora(ranks: Sequence[int] | np.ndarray, scale: float) -> LocalHook:
    """FLoRA (Wang et al. 2024): heterogeneous ranks `ranks [C]`; the server stacks the
    clients' modules, merges `sum_i p_i scale A_i B_i` into the frozen kernels and resets the
    adapters (B = 0). `scale` is the model's `alpha / r` (`models.transformer.lora_scale`).
    Hook `"flora"`; metric `flora_merged_norm` (`||sum_i p_i s A_i B_i||` over modules). See
    the module docstring for the deviations."""
    ranks = _check_ranks(ranks)

    def finish(ctx, outcome):
        rank = _client_rank(ranks, ctx)
        update = _padded_update(ctx, outcome, rank)
        final = jax.tree.map(jnp.add, ctx.anchor, update)
        summand = {path_key(p): scale * v for p, v in products(final).items()}
        return ctx.row, summand, rank, update

    def finalize(server, summary: RoundSummary, server_step):
        if summary.model is None:
            raise ValueError("flora needs RoundSummary.model (the full global model)")
        server_step(summary.update)  # the server optimizer's state; the adapters are reset
        merged = summary.mean  # {module: sum_i p_i s A_i B_i}

        def walk(node, prefix):
            if not isinstance(node, dict):
                return node
            out = {k: walk(v, (*prefix, k)) for k, v in node.items()}
            key = path_key(prefix)
            if key in merged:
                out["kernel"] = node["kernel"] + merged[key].astype(node["kernel"].dtype)
                out["lora_b"] = jnp.zeros_like(node["lora_b"])
            return out

        model = walk(summary.model, ())
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(v)) for v in merged.values()))
        return server, model, {"flora_merged_norm": norm}

    return LocalHook(
        "flora",
        direction=_masked_direction(ranks),
        finish=finish,
        finalize=finalize,
        # the server forms the products from the stacked modules, the ranks from the shapes
        not_sent=("summand", "output"),
        update_bytes=_update_bytes(ranks),
    )


# ------------------------------------------------------------------------------ presets
def client_ranks(ranks: Sequence[int], num_clients: int) -> np.ndarray:
    """`[C]` ranks: client i gets `ranks[i mod len(ranks)]` (the CLI's `--lora-ranks`)."""
    return np.asarray(ranks, np.int32)[np.arange(num_clients) % len(ranks)]


def device_class_ranks(ranks: Sequence[int], speeds: np.ndarray) -> np.ndarray:
    """`[C]` ranks by device class (the CLI's `--lora-ranks-by speed`): the clients sorted by
    compute speed `speeds [C]` (ties by id) are cut into `len(ranks)` classes of equal size
    (up to one client), and the k-th slowest class gets the k-th smallest rank."""
    speeds = np.asarray(speeds)
    if speeds.ndim != 1 or speeds.size == 0:
        raise ValueError(f"speeds must be a non-empty [C] array, got shape {speeds.shape}")
    num_clients = speeds.size
    order = np.argsort(speeds, kind="stable")
    rank_class = np.empty(num_clients, np.int64)
    rank_class[order] = np.arange(num_clients) * len(ranks) // num_clients
    return np.sort(np.asarray(ranks, np.int32))[rank_class]


RULES = {"hetlora": hetlora, "flora": flora}  # the CLI's `--lora-rule`


def with_rule(factory: Callable[..., Algorithm], rule: str) -> Callable[..., Algorithm]:
    """`factory` (a synchronous preset: one that takes `hooks`) with the heterogeneous-rank
    rule `rule` (`"hetlora"` | `"flora"`, `RULES`) first in its chain of hooks: a factory
    taking the preset's arguments and the rule's (`ranks [C]`; HetLoRA's `prune_lam`,
    `decay`; FLoRA's `scale`). First in the chain, the rule sees the loss's gradient and the
    client's own update, and its `finalize` wraps the preset's hooks and server optimizer:
    FedProx's proximal term acts on the rank-masked direction (the ranks above r_i keep
    x_t), FedAdam's Adam steps on HetLoRA's sparsity-weighted mean. FLoRA resets the
    adapters after merging, so a server optimizer's step on them (and any later hook's move
    of the model) is discarded: FLoRA's products enter the base at server learning rate 1,
    with any preset (its paper's step; the server optimizer's state still updates)."""
    if rule not in RULES:
        raise ValueError(f"unknown LoRA rule {rule!r}; choose {' or '.join(RULES)}")
    name = getattr(factory, "__name__", None) or getattr(factory.func, "__name__", "factory")
    params = inspect.signature(factory).parameters
    if "hooks" not in params:
        raise ValueError(
            f"{name} takes no hooks (asynchronous, or its chain is fixed): the LoRA rule "
            f"{rule} needs a synchronous preset"
        )
    own = [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        for p in inspect.signature(RULES[rule]).parameters.values()
    ]
    clash = sorted({p.name for p in own} & set(params))
    if clash:
        raise ValueError(f"{name} has its own {clash}: it cannot take the rule {rule}")
    rule_names = {p.name for p in own}

    def combined(loss_fn: LossFn, **kwargs: Any) -> Algorithm:
        hook = RULES[rule](**{k: kwargs.pop(k) for k in rule_names & set(kwargs)})
        return factory(loss_fn, hooks=(hook, *kwargs.pop("hooks", ())), **kwargs)

    combined.__name__ = combined.__qualname__ = f"{name}_{rule}"
    combined.__doc__ = f"{name} with the LoRA rule {rule} (`lora.with_rule`)."
    signature = inspect.signature(factory)
    combined.__signature__ = signature.replace(parameters=[*params.values(), *own])
    combined.defaults = getattr(factory, "defaults", None) or factory.func.defaults
    return combined


hetlora_fedavg = with_rule(fedavg, "hetlora")  # FedAvg with HetLoRA (both papers' FedAvg)
flora_fedavg = with_rule(fedavg, "flora")  # FedAvg with FLoRA's stacking


def path_key(path: tuple) -> str:
    """`"block_0/attn/query"`: a module's key in FLoRA's summands."""
    return "/".join(str(k) for k in path)


# ------------------------------------------------------------------------------ references
def stacked_product(a: Sequence[np.ndarray], b: Sequence[np.ndarray], weights) -> np.ndarray:
    """FLoRA's stacking in NumPy: `[A_1 ... A_M] [p_1 B_1; ...; p_M B_M]` with `p = w / sum
    w` (clients' ranks may differ)."""
    p = np.asarray(weights, np.float64) / np.sum(weights)
    a_stack = np.concatenate([np.asarray(x, np.float64) for x in a], axis=1)
    b_stack = np.concatenate(
        [pi * np.asarray(x, np.float64) for pi, x in zip(p, b, strict=True)], axis=0
    )
    return a_stack @ b_stack


__all__ = [
    "RULES",
    "client_ranks",
    "device_class_ranks",
    "flora",
    "flora_fedavg",
    "hetlora",
    "hetlora_fedavg",
    "lora_partition",
    "max_rank",
    "products",
    "rank_bytes",
    "stacked_product",
    "tail_norm",
    "truncate",
    "with_rule",
]
