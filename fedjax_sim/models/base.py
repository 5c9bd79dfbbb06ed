"""`Model`: a flax (or plain) network bundled with its masked loss and evaluation.

A model is `apply(params, x) -> outputs`; the loss is a masked mean over the examples of a
`Batch` (padding rows carry mask 0), plus an optional L2 penalty `l2/2 ||params||^2` that is
part of each client's objective `f_i` (FedLPS' lambda, AREA's nu, FedMIM's weight decay).

Sequence models (`loss_kind="next_token"`, the transformer) predict every position of a window:
`x [B, T]` token ids, `y [B]` the token after the window (Shakespeare's and the synthetic
next-token task's layout), outputs `[B, T, V]` logits; position t's target is `x[:, t + 1]`
(`y` for the last one). Targets equal to `pad_id` (right padding) are masked out besides the
padding rows, and the loss is the mean over the valid target tokens; `evaluate`'s `count`
counts those tokens, so `loss / count` is the per-token loss (log-perplexity).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.data.federated import Batch

Params = Any
Array = jax.Array

LOSSES = ("softmax_ce", "squared", "next_token")


def masked_mean(values: Array, mask: Array) -> Array:
    """`sum(mask * values) / max(sum(mask), 1)`: 0 (not NaN) for an all-padding batch."""
    mask = mask.astype(values.dtype)
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def l2_norm_sq(params: Params) -> Array:
    return sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params))


@dataclasses.dataclass(frozen=True)
class Model:
    """`init(key) -> params`, `apply(params, x [B, *feature_shape]) -> outputs`.

    Attributes:
      loss_kind: "softmax_ce" (integer labels, outputs are logits `[B, K]`), "squared"
        (`0.5 (output - y)^2`, outputs `[B]`) or "next_token" (outputs `[B, T, V]` logits of
        every next token of `x [B, T]`, the last one's target `y [B]`).
      l2: coefficient of `l2/2 ||params||^2` added to the loss.
      pad_id: "next_token" only: the padding token id, whose targets are masked out (None:
        no padding token).
    """

    init: Callable[[jax.Array], Params]
    apply: Callable[[Params, Array], Array]
    loss_kind: str = "softmax_ce"
    l2: float = 0.0
    name: str = "model"
    pad_id: int | None = None

    def __post_init__(self):
        if self.loss_kind not in LOSSES:
            raise ValueError(f"loss_kind must be one of {LOSSES}, got {self.loss_kind!r}")
        if self.l2 < 0:
            raise ValueError(f"l2 must be >= 0, got {self.l2}")
        if self.pad_id is not None and self.loss_kind != "next_token":
            raise ValueError("pad_id is for loss_kind='next_token'")

    def example_losses(self, params: Params, x: Array, y: Array) -> Array:
        out = self.apply(params, x)
        if self.loss_kind == "softmax_ce":
            return optax.softmax_cross_entropy_with_integer_labels(out, y.astype(jnp.int32))
        if self.loss_kind == "next_token":
            losses, valid = self._token_losses(out, x, y)
            return jnp.sum(losses * valid, -1) / jnp.maximum(jnp.sum(valid, -1), 1.0)
        return 0.5 * jnp.square(out - y)

    def _token_losses(self, logits: Array, x: Array, y: Array) -> tuple[Array, Array]:
        """`(losses [B, T], valid [B, T] float)` of next-token prediction."""
        targets = next_tokens(x, y)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        valid = jnp.ones_like(losses) if self.pad_id is None else targets != self.pad_id
        return losses, valid.astype(losses.dtype)

    def loss(self, params: Params, batch: Batch) -> Array:
        """Masked mean loss of a batch (+ L2 penalty): the `loss_fn` of every algorithm
        (`next_token`: the mean over the batch's valid target tokens)."""
        if self.loss_kind == "next_token":
            losses, valid = self._token_losses(self.apply(params, batch.x), batch.x, batch.y)
            value = masked_mean(losses, valid * batch.mask.astype(losses.dtype)[:, None])
        else:
            value = masked_mean(self.example_losses(params, batch.x, batch.y), batch.mask)
        if self.l2:
            value = value + 0.5 * self.l2 * l2_norm_sq(params)
        return value

    def evaluate(self, params: Params, batch: Batch) -> dict[str, Array]:
        """Sums over the valid examples of a batch: `loss`, `correct` (classification) and
        `count`; divide by `count` after summing over batches."""
        out = self.apply(params, batch.x)
        mask = batch.mask.astype(jnp.float32)
        if self.loss_kind == "next_token":
            losses, valid = self._token_losses(out, batch.x, batch.y)
            correct = (jnp.argmax(out, -1) == next_tokens(batch.x, batch.y)).astype(jnp.float32)
            mask = valid * mask[:, None]
        elif self.loss_kind == "softmax_ce":
            losses = optax.softmax_cross_entropy_with_integer_labels(out, batch.y.astype(jnp.int32))
            correct = (jnp.argmax(out, -1) == batch.y).astype(jnp.float32)
        else:
            losses = 0.5 * jnp.square(out - batch.y)
            correct = jnp.zeros_like(losses)
        return {
            "loss": jnp.sum(losses * mask),
            "correct": jnp.sum(correct * mask),
            "count": jnp.sum(mask),
        }

    def with_l2(self, l2: float) -> Model:
        return dataclasses.replace(self, l2=l2)


def next_tokens(x: Array, y: Array) -> Array:
    """`[B, T]` int32 targets of next-token prediction: `x[:, 1:]` then `y`."""
    x = x.astype(jnp.int32)
    return jnp.concatenate([x[:, 1:], y.astype(jnp.int32).reshape(-1, 1)], axis=1)
