"""Flax networks (logistic regression, MLP, small CNN) and linear least-squares regression.

Each builder takes the per-example `input_shape` and returns a `Model`. Inputs of any shape
are flattened for dense models; the CNN reshapes flat inputs to `image_shape`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_sim.models.base import Model


def from_module(module: nn.Module, input_shape: Sequence[int], name: str, **kw) -> Model:
    dummy = jnp.zeros((1, *input_shape), jnp.float32)
    return Model(
        init=lambda key: module.init(key, dummy)["params"],
        apply=lambda params, x: module.apply({"params": params}, x),
        name=name,
        **kw,
    )


class _MLP(nn.Module):
    hidden: tuple[int, ...]
    num_outputs: int

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_outputs)(x)


class _SliceConv(nn.Module):
    """SAME, stride-1 convolution as one matmul over stacked shifted slices (im2col by
    slicing). Same parameters (`kernel [k, k, C, F]`, `bias [F]`) and outputs as `nn.Conv`,
    but fast inside loops on XLA:CPU, where `lax.conv` in a while-loop body (every local step
    under `lax.scan`) runs ~7x slower than outside (jax-ml/jax#12868)."""

    features: int
    kernel_size: int

    @nn.compact
    def __call__(self, x):
        k, c = self.kernel_size, x.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (k, k, c, self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        h, w = x.shape[1:3]
        lo, hi = (k - 1) // 2, k // 2
        xp = jnp.pad(x, ((0, 0), (lo, hi), (lo, hi), (0, 0)))
        patches = jnp.concatenate(
            [xp[:, i : i + h, j : j + w] for i in range(k) for j in range(k)], axis=-1
        )  # [B, H, W, k*k*C], (i, j, c) order = kernel.reshape
        return patches @ kernel.reshape(k * k * c, self.features) + bias


class _CNN(nn.Module):
    image_shape: tuple[int, ...]
    channels: tuple[int, ...]
    dense: int
    num_outputs: int
    kernel_size: int = 3
    conv: str = "lax"

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], *self.image_shape))
        k = self.kernel_size
        for layer, ch in enumerate(self.channels):
            if self.conv == "slices":  # named like nn.Conv: parameters are interchangeable
                x = nn.relu(_SliceConv(ch, k, name=f"Conv_{layer}")(x))
            else:
                x = nn.relu(nn.Conv(ch, (k, k), padding="SAME")(x))
            if min(x.shape[1:3]) >= 2:
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(self.dense)(x))
        return nn.Dense(self.num_outputs)(x)


def logistic_regression(input_shape: Sequence[int], num_classes: int, *, l2: float = 0.0) -> Model:
    """Multinomial logistic regression (one dense layer on flattened inputs)."""
    return from_module(_MLP((), num_classes), input_shape, "logistic", l2=l2)


def mlp(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    hidden: Sequence[int] = (200, 200),
    l2: float = 0.0,
) -> Model:
    """ReLU multi-layer perceptron on flattened inputs (McMahan et al.'s 2NN by default)."""
    return from_module(_MLP(tuple(hidden), num_classes), input_shape, "mlp", l2=l2)


def image_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    if len(input_shape) == 3:
        return tuple(input_shape)
    if len(input_shape) == 2:
        return (*input_shape, 1)
    side = math.isqrt(int(math.prod(input_shape)))
    if side * side != math.prod(input_shape):
        raise ValueError(f"cannot view input of shape {tuple(input_shape)} as a square image")
    return (side, side, 1)


def cnn(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    channels: Sequence[int] = (32, 64),
    dense: int = 128,
    kernel_size: int = 3,
    conv: str = "lax",
    l2: float = 0.0,
) -> Model:
    """Small CNN: [kxk conv + ReLU + 2x2 max-pool] per channel count, dense, output
    (`kernel_size=5, channels=(32, 64), dense=512` is the classic two-layer CIFAR/FEMNIST CNN).

    `conv="slices"` computes each convolution as one matmul over shifted slices (same
    parameters and outputs as the default `lax.conv`): several times faster for local training
    on CPU, where convolutions inside `lax.scan` are slow. Flat inputs (e.g. digits' 64
    features) are viewed as square single-channel images."""
    if conv not in ("lax", "slices"):
        raise ValueError(f"conv must be 'lax' or 'slices', got {conv!r}")
    module = _CNN(image_shape(input_shape), tuple(channels), dense, num_classes, kernel_size, conv)
    return from_module(module, input_shape, "cnn", l2=l2)


def linear_regression(dim: int, *, l2: float = 0.0) -> Model:
    """`apply({"w": [dim]}, x [B, dim]) = x @ w` with squared loss; zeros at init."""
    return Model(
        init=lambda key: {"w": jnp.zeros((dim,), jnp.float32)},
        apply=lambda params, x: x @ params["w"],
        loss_kind="squared",
        l2=l2,
        name="linear_regression",
    )


def count_params(params) -> int:
    return int(sum(p.size for p in jax.tree.leaves(params)))
