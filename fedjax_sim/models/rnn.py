"""Character-level recurrent models for next-character prediction (federated Shakespeare).

LEAF's Shakespeare model (Caldas et al. 2018; McMahan et al. 2017 use the same shape): an
8-dimensional character embedding, two stacked LSTM layers of 256 units, and a dense layer on
the last step's output giving logits over the vocabulary. `char_gru` swaps the cells for GRUs.
Inputs are `[B, seq_len]` integer character ids; outputs `[B, vocab]` logits of the next one.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

from fedjax_sim.models.base import Model
from fedjax_sim.models.nets import from_module

CELLS = {"lstm": nn.OptimizedLSTMCell, "gru": nn.GRUCell}


class _CharRNN(nn.Module):
    vocab_size: int
    embed_dim: int
    hidden: tuple[int, ...]
    cell: str
    num_outputs: int

    @nn.compact
    def __call__(self, x):
        h = nn.Embed(self.vocab_size, self.embed_dim)(x.astype(jnp.int32))  # [B, T, E]
        for width in self.hidden:
            h = nn.RNN(CELLS[self.cell](width))(h)  # [B, T, width]
        return nn.Dense(self.num_outputs)(h[:, -1])  # [B, K]


def char_rnn(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    cell: str = "lstm",
    embed_dim: int = 8,
    hidden: Sequence[int] = (256, 256),
    vocab_size: int | None = None,
    l2: float = 0.0,
) -> Model:
    """Embedding -> stacked `cell` ("lstm" | "gru") layers -> dense on the last step.

    `input_shape` is `(seq_len,)`; `vocab_size` defaults to `num_classes` (inputs and targets
    share the character alphabet, as in Shakespeare)."""
    if cell not in CELLS:
        raise ValueError(f"cell must be one of {sorted(CELLS)}, got {cell!r}")
    if len(input_shape) != 1:
        raise ValueError(f"char_rnn expects inputs of shape (seq_len,), got {tuple(input_shape)}")
    if not hidden or min(hidden) < 1 or embed_dim < 1:
        raise ValueError(f"hidden widths and embed_dim must be >= 1, got {hidden}, {embed_dim}")
    vocab = num_classes if vocab_size is None else vocab_size
    module = _CharRNN(vocab, embed_dim, tuple(hidden), cell, num_classes)
    return from_module(module, input_shape, f"char_{cell}", l2=l2)


def char_lstm(input_shape: Sequence[int], num_classes: int, **kwargs) -> Model:
    """Character LSTM (LEAF Shakespeare: embed 8, 2 x LSTM 256, dense)."""
    return char_rnn(input_shape, num_classes, cell="lstm", **kwargs)


def char_gru(input_shape: Sequence[int], num_classes: int, **kwargs) -> Model:
    """Character GRU (embed 8, 2 x GRU 256, dense)."""
    return char_rnn(input_shape, num_classes, cell="gru", **kwargs)
