"""A decoder-only transformer for next-token prediction, with optional LoRA adapters, and
pretrained checkpoints.

The network (GPT-2's block layout, pre-norm): token embedding + learned position embedding,
`num_layers` blocks of `x + attn(LN(x))`, `x + mlp(LN(x))` (causal multi-head
self-attention with projections `query`, `key`, `value`, `out`; MLP `mlp_in` -> GELU ->
`mlp_out`), a final LayerNorm and the `head` projection to the vocabulary. Inputs `[B, T]`
integer token ids with `T <= context`; outputs `[B, T, vocab]` logits of every next token
(`loss_kind="next_token"`: see `models.base`; right padding with `pad_id` is masked out of the
loss, and causal attention keeps it from reaching any valid position).

LoRA (Hu et al. 2021): with `lora_rank=r > 0`, each projection named in `lora_targets`
computes `x W + b + (alpha / r) (x A) B` beside its kernel W (`[d_in, d_out]`): `lora_a`
(`[d_in, r]`, the paper's A transposed, Gaussian `N(0, 1/d_in)`) and `lora_b` (`[r, d_out]`,
zeros), so at initialisation the model is the base model exactly. The parameter paths are
those of the base model plus the adapters (`params/block_0/attn/query/{kernel, bias, lora_a,
lora_b}`): a base checkpoint loads into a LoRA model (`with_pretrained`), and `merge_lora`
folds the adapters back into the kernels (`W + (alpha / r) A B`). Which leaves train and
travel is a `Partition` (`algorithms.lora.lora_partition`: adapters shared, the rest frozen).
Every projection is `lora_dense`, whose custom JVP makes the backward pass a chain of row-major
GEMMs on XLA:CPU (1.5x LoRA's round on CPU; benchmarks/README.md, issue 39); its derivatives,
forward and reverse, are those of the plain expression.

Checkpoints: `save_params` writes a flax msgpack file (`flax.serialization`); `load_params`
reads it, or an orbax checkpoint directory; `pretrained_init` makes a model start from one.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from fedjax_sim.models.base import Model
from fedjax_sim.models.nets import from_module

Params = Any
PROJECTIONS = ("query", "key", "value", "out", "mlp_in", "mlp_out")
ADAPTERS = ("lora_a", "lora_b")


def lora_scale(rank: int, alpha: float | None) -> float:
    """LoRA's scaling `alpha / rank` (`alpha=None`: `alpha = rank`, scale 1)."""
    return 1.0 if alpha is None else float(alpha) / rank


class LoRADense(nn.Module):
    """`x W + b`, plus `scale (x A) B` with `rank > 0` (params `lora_a [d_in, r]`, `lora_b
    [r, d_out]`; B = 0 at initialisation)."""

    features: int
    rank: int = 0
    scale: float = 1.0

    @nn.compact
    def __call__(self, x):
        d_in = x.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (d_in, self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        adapter = None
        if self.rank:
            a = self.param("lora_a", nn.initializers.normal(stddev=d_in**-0.5), (d_in, self.rank))
            b = self.param("lora_b", nn.initializers.zeros_init(), (self.rank, self.features))
            adapter = (a, b)
        return lora_dense(x, kernel, bias, adapter, self.scale)


def _kept(z):
    """`z`, materialised: XLA may not fold a transpose of it into a dot."""
    return jax.lax.optimization_barrier(z)


def _via_copy_of_t(w):
    """`w` `[m, n]` read through a kept copy of `w.T`: a backward dot `g @ w.T` then reads
    that copy as a row-major `[n, m]` operand."""
    return _kept(w.T).T


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _dense_rows(x, kernel, bias, adapter, scale):
    y = x @ kernel + bias  # [N, d_out]
    if adapter is not None:
        a, b = adapter
        y = y + scale * ((x @ a) @ b)
    return y


def _dense_rows_jvp(scale, primals, tangents):
    """The tangent of `x W + b + s (x A) B`, written so that its transpose, the backward pass,
    runs every dot as a row-major GEMM `[m, k] @ [k, n]`: transposes of the operands it
    contracts are kept materialised (`_kept`), so XLA cannot fold them into the dots'
    dimension numbers, which sends a dot to XLA:CPU's generic kernel (a few GFLOP/s on the
    adapters' rank-r dots; benchmarks/README.md, issue 39). Backward dots, with g the output's
    cotangent `[N, d_out]` and v = g B^T `[N, r]`: dx = g [W^T] + s v [A^T], dW = [x^T] g,
    dA = s ([v^T] x)^T, dB = s [(x A)^T] g, brackets marking the kept copies. Inputs that are
    not differentiated (symbolic zeros: a frozen kernel) cost nothing."""
    x, kernel, bias, adapter = primals
    dx, dkernel, dbias, dadapter = tangents
    live = lambda t: not isinstance(t, jax.custom_derivatives.SymbolicZero)
    y = _dense_rows(x, kernel, bias, adapter, scale)
    terms = []
    if live(dx):
        terms.append(dx @ _via_copy_of_t(kernel))
    if live(dkernel):
        terms.append(_via_copy_of_t(x) @ dkernel)
    if live(dbias):
        terms.append(jnp.broadcast_to(dbias, y.shape))
    if adapter is not None:
        a, b = adapter
        da, db = dadapter
        low_rank = []  # tangents of x A, [N, r]
        if live(dx):
            low_rank.append(dx @ _via_copy_of_t(a))
        if live(da):
            low_rank.append(_kept(_kept(da.T) @ x.T).T)
        if low_rank:
            terms.append(scale * (sum(low_rank) @ _via_copy_of_t(b)))
        if live(db):
            terms.append(scale * (_via_copy_of_t(_kept(x @ a)) @ db))
    return y, sum(terms) if terms else jnp.zeros_like(y)


_dense_rows.defjvp(_dense_rows_jvp, symbolic_zeros=True)


def lora_dense(x, kernel, bias, adapter=None, scale: float = 1.0):
    """`x W + b`, plus `scale (x A) B` with `adapter=(A, B)`, over the last axis of `x`
    (`[..., d_in]` -> `[..., d_out]`). Differentiable in every argument, forward and reverse
    mode; its reverse mode is laid out for XLA:CPU's GEMMs (`_dense_rows_jvp`)."""
    y = _dense_rows(x.reshape(-1, x.shape[-1]), kernel, bias, adapter, float(scale))
    return y.reshape(*x.shape[:-1], y.shape[-1])


class _Block(nn.Module):
    d_model: int
    num_heads: int
    d_ff: int
    ranks: dict[str, int]
    scale: float

    def dense(self, name: str, features: int) -> LoRADense:
        return LoRADense(features, self.ranks.get(name, 0), self.scale, name=name)

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        h = self.num_heads
        y = nn.LayerNorm(name="ln_attn")(x)
        split = lambda z: z.reshape(b, t, h, d // h)
        q = split(self.dense("query", d)(y))
        k = split(self.dense("key", d)(y))
        v = split(self.dense("value", d)(y))
        logits = jnp.einsum("bqhc,bkhc->bhqk", q, k) / jnp.sqrt(d // h).astype(x.dtype)
        causal = jnp.tril(jnp.ones((t, t), bool))
        logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
        attn = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(logits, -1), v).reshape(b, t, d)
        x = x + self.dense("out", d)(attn)
        y = nn.LayerNorm(name="ln_mlp")(x)
        y = self.dense("mlp_out", d)(nn.gelu(self.dense("mlp_in", self.d_ff)(y)))
        return x + y


class _Transformer(nn.Module):
    vocab_size: int
    context: int
    d_model: int
    num_layers: int
    num_heads: int
    d_ff: int
    num_outputs: int
    ranks: dict[str, int]
    scale: float

    @nn.compact
    def __call__(self, x):
        tokens = x.astype(jnp.int32)
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the context {self.context}")
        pos = self.param(
            "pos_embed", nn.initializers.normal(stddev=0.02), (self.context, self.d_model)
        )
        h = nn.Embed(self.vocab_size, self.d_model, name="embed")(tokens) + pos[:t]
        for i in range(self.num_layers):
            h = _Block(self.d_model, self.num_heads, self.d_ff, self.ranks, self.scale,
                       name=f"block_{i}")(h)  # fmt: skip
        h = nn.LayerNorm(name="ln_final")(h)
        return nn.Dense(self.num_outputs, name="head")(h)


def transformer(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    d_model: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    d_ff: int | None = None,
    vocab_size: int | None = None,
    lora_rank: int = 0,
    lora_alpha: float | None = None,
    lora_targets: Sequence[str] = PROJECTIONS,
    pad_id: int | None = None,
    l2: float = 0.0,
) -> Model:
    """Decoder-only transformer over windows of `input_shape = (context,)` token ids;
    `num_classes` is the vocabulary of the targets (`vocab_size`, that of the inputs,
    defaults to it). `d_ff` defaults to `4 d_model`. `lora_rank > 0` adds LoRA adapters of
    that rank to the projections named in `lora_targets` (of `PROJECTIONS`), scaled by
    `lora_alpha / lora_rank` (`lora_alpha=None`: scale 1)."""
    if len(input_shape) != 1:
        raise ValueError(f"transformer expects inputs of shape (context,), got {input_shape}")
    d_ff = 4 * d_model if d_ff is None else d_ff
    if min(input_shape[0], d_model, num_layers, num_heads, d_ff, num_classes) < 1:
        raise ValueError("context, d_model, num_layers, num_heads, d_ff, vocab must be >= 1")
    if d_model % num_heads:
        raise ValueError(f"d_model {d_model} is not divisible by num_heads {num_heads}")
    if lora_rank < 0 or int(lora_rank) != lora_rank:
        raise ValueError(f"lora_rank must be an int >= 0, got {lora_rank}")
    bad = sorted(set(lora_targets) - set(PROJECTIONS))
    if bad or (lora_rank and not lora_targets):
        raise ValueError(f"lora_targets must be a non-empty subset of {PROJECTIONS}, got {bad}")
    if lora_alpha is not None and not lora_alpha > 0:
        raise ValueError(f"lora_alpha must be > 0, got {lora_alpha}")
    ranks = {name: int(lora_rank) for name in lora_targets} if lora_rank else {}
    scale = lora_scale(lora_rank, lora_alpha) if lora_rank else 1.0
    vocab = num_classes if vocab_size is None else vocab_size
    module = _Transformer(
        vocab, int(input_shape[0]), d_model, num_layers, num_heads, d_ff, num_classes, ranks, scale
    )
    name = f"transformer_lora{lora_rank}" if lora_rank else "transformer"
    return from_module(module, input_shape, name, l2=l2, loss_kind="next_token", pad_id=pad_id)


# ------------------------------------------------------------------------------ LoRA params
def _is_adapter_module(node: Any) -> bool:
    return isinstance(node, dict) and "lora_a" in node and "lora_b" in node


def merge_lora(params: Params, scale: float) -> Params:
    """The base model's params: every adapted kernel `W + scale A B`, adapters dropped (load
    them into the same transformer without LoRA)."""

    def walk(node):
        if _is_adapter_module(node):
            out = {k: v for k, v in node.items() if k not in ADAPTERS}
            out["kernel"] = node["kernel"] + scale * (node["lora_a"] @ node["lora_b"])
            return out
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(params)


def with_pretrained(params: Params, pretrained: Params) -> Params:
    """`params` (e.g. a fresh LoRA model's) with every leaf of `pretrained` (e.g. a base
    checkpoint's) put at the same path. Refused: a pretrained leaf missing from `params` or of
    another shape, and a leaf of `params` missing from `pretrained` but the LoRA adapters."""
    flat = {_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(params)}
    given = {_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(pretrained)}
    extra = sorted(set(given) - set(flat))
    if extra:
        raise ValueError(f"pretrained parameters {extra} are not in the model")
    missing = sorted(n for n in set(flat) - set(given) if n.rsplit("/", 1)[-1] not in ADAPTERS)
    if missing:
        raise ValueError(f"the checkpoint lacks the model's parameters {missing}")
    for n, v in given.items():
        if np.shape(v) != np.shape(flat[n]):
            raise ValueError(f"{n}: checkpoint shape {np.shape(v)} != model {np.shape(flat[n])}")

    def pick(path, leaf):
        n = _name(path)
        return jnp.asarray(given[n], jnp.result_type(leaf)) if n in given else leaf

    return jax.tree_util.tree_map_with_path(pick, params)


def pretrained_init(model: Model, pretrained: Params) -> Model:
    """`model` whose `init(key)` is `with_pretrained(model.init(key), pretrained)`: a run
    (`simulate`, the CLI's `--pretrained`) starts from the checkpoint, the LoRA adapters at
    their initialisation. The checks of `with_pretrained` run when `init` is traced."""
    init = model.init
    return dataclasses.replace(model, init=lambda key: with_pretrained(init(key), pretrained))


def _name(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


# ------------------------------------------------------------------------------ checkpoints
def save_params(path: str | os.PathLike, params: Params) -> None:
    """Writes `params` as a flax msgpack file (`flax.serialization.msgpack_serialize`)."""
    state = flax.serialization.to_state_dict(jax.device_get(params))
    with open(path, "wb") as f:
        f.write(flax.serialization.msgpack_serialize(state))


def load_params(path: str | os.PathLike) -> Params:
    """Params from a flax msgpack file (`save_params`, `flax.serialization.to_bytes`) or an
    orbax checkpoint directory (`orbax.checkpoint.StandardCheckpointer().save(path, params)`):
    nested dicts of numpy arrays; give them to `with_pretrained`."""
    path = os.fspath(path)
    if os.path.isdir(path):
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(os.path.abspath(path))
        return jax.tree.map(np.asarray, restored)
    with open(path, "rb") as f:
        return flax.serialization.msgpack_restore(f.read())


def adapter_paths(params: Params) -> list[str]:
    """Paths of the LoRA adapter leaves (`.../lora_a`, `.../lora_b`)."""
    pattern = re.compile(r"/lora_[ab]$")
    return [n for n in (_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(params))
            if pattern.search(n)]  # fmt: skip
