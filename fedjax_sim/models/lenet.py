"""The CNN of Beikmohammadi et al. (IEEE Trans. Big Data 2024), a Caffe-style LeNet.

conv(1->20, 5x5, VALID) -> max-pool 2x2 -> ReLU -> conv(20->50, 5x5, VALID) -> max-pool 2x2
-> ReLU -> flatten (800 for 28x28 inputs) -> dense 500 -> ReLU -> dense 10: 431,080
parameters on 28x28x1 inputs. Initialisation is PyTorch's default (spec
`docs/specs/stepsizes_no_similarity.md` section 4): weights and biases ~
U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in_channels * kh * kw (conv) or in_features.
Flax's NHWC layout flattens in (h, w, c) order instead of PyTorch's (c, h, w); that only
permutes the rows of the first dense layer and changes nothing else.

Convolutions are computed as im2col + matmul by default (`conv="im2col"`, same parameters and
the same function as `nn.Conv(padding="VALID")` up to float summation order). Reason: on XLA
CPU (jaxlib 0.10.2) a convolution's gradient inside a `lax.scan`/`while` body (every local
training loop) keeps a non-canonical layout and runs ~5-8x slower than outside a loop (measured
on this project's 2-core machine: 10 SGD steps of this CNN at batch 32 took 2.2-4.9 s in a scan
vs 0.2-0.5 s unrolled; im2col: 0.55 s in a scan). `conv="xla"` uses `lax` convolutions (better
on accelerators).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_sim.models.base import Model
from fedjax_sim.models.nets import from_module, image_shape

# U(-1/sqrt(fan_in), 1/sqrt(fan_in)) = variance_scaling(1/3, fan_in, uniform) for the kernel
torch_kernel_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def torch_bias_init(fan_in: int):
    """PyTorch's bias init for a layer with `fan_in` inputs."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class Im2colConv(nn.Module):
    """A VALID, stride-1 convolution as im2col + matmul; parameters as `nn.Conv`'s
    (`kernel [kh, kw, c_in, c_out]`, `bias [c_out]`)."""

    features: int
    kernel_size: tuple[int, int]
    kernel_init: nn.initializers.Initializer
    bias_init: nn.initializers.Initializer

    @nn.compact
    def __call__(self, x):  # [B, H, W, C] -> [B, H - kh + 1, W - kw + 1, features]
        kh, kw = self.kernel_size
        c_in = x.shape[-1]
        kernel = self.param("kernel", self.kernel_init, (kh, kw, c_in, self.features))
        bias = self.param("bias", self.bias_init, (self.features,))
        h, w = x.shape[1] - kh + 1, x.shape[2] - kw + 1
        cols = jnp.concatenate(
            [x[:, i : i + h, j : j + w, :] for i in range(kh) for j in range(kw)], axis=-1
        )  # [B, h, w, kh * kw * c_in], (i, j, c) order = the kernel's row-major order
        return cols @ kernel.reshape(kh * kw * c_in, self.features) + bias


class _LeNet(nn.Module):
    image_shape: tuple[int, ...]
    channels: tuple[int, int]
    dense: int
    num_outputs: int
    conv: str = "im2col"

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], *self.image_shape))
        for i, ch in enumerate(self.channels):
            fan_in = x.shape[-1] * 25
            inits = dict(kernel_init=torch_kernel_init, bias_init=torch_bias_init(fan_in))
            if self.conv == "im2col":
                x = Im2colConv(ch, (5, 5), name=f"Conv_{i}", **inits)(x)
            else:
                x = nn.Conv(ch, (5, 5), padding="VALID", name=f"Conv_{i}", **inits)(x)
            b, h, w, c = x.shape  # 2x2 max-pool, stride 2 (even sizes)
            x = nn.relu(x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4)))
        x = x.reshape((x.shape[0], -1))
        for width in (self.dense, self.num_outputs):
            layer = nn.Dense(
                width, kernel_init=torch_kernel_init, bias_init=torch_bias_init(x.shape[-1])
            )
            x = layer(x)
            if width == self.dense:
                x = nn.relu(x)
        return x


def lenet(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    channels: Sequence[int] = (20, 50),
    dense: int = 500,
    l2: float = 0.0,
    conv: str = "im2col",
) -> Model:
    """The paper's CNN (431,080 parameters for 28x28x1 inputs and 10 classes); `conv` is
    "im2col" (fast in CPU training loops) or "xla" (`lax` convolutions)."""
    if conv not in ("im2col", "xla"):
        raise ValueError(f"lenet conv must be 'im2col' or 'xla', got {conv!r}")
    if len(channels) != 2:
        raise ValueError(f"lenet has two conv layers, got channels={tuple(channels)}")
    image = image_shape(input_shape)
    if image[0] % 4 or image[1] % 4 or min(image[:2]) < 16:
        raise ValueError(
            f"lenet needs images of at least 16x16 with sides divisible by 4, got {image}"
        )
    module = _LeNet(image, tuple(channels), dense, num_classes, conv)
    return from_module(module, input_shape, "lenet", l2=l2)
