"""pfl-research's CIFAR-10 benchmark CNN (`simple_cnn` of pfl-research's
`benchmarks/model/pytorch/cnn.py`, the model of its "7-72x faster" CIFAR-10 benchmark).

conv(C->32, 3x3, VALID) -> ReLU -> conv(32->64, 3x3, VALID) -> ReLU -> max-pool 2x2 -> flatten
(12,544 for 32x32 inputs) -> dense 128 -> ReLU -> dense num_classes: 1,626,442 parameters on
32x32x3 inputs and 10 classes. Initialisation as pfl's: Glorot (Xavier) uniform weights,
PyTorch-default biases U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

Differences from pfl's PyTorch module, stated once: pfl's has Dropout(0.25) after the pool and
Dropout(0.5) after the hidden dense layer; this one has none (`Model.apply` takes no random
key; dropout is two elementwise masks, a negligible share of a step's FLOPs). Flax's NHWC
layout flattens in (h, w, c) order instead of PyTorch's (c, h, w), which only permutes the
rows of the first dense layer. Convolutions are im2col + matmul by default (`lenet`'s
`Im2colConv`: the same function as `nn.Conv(padding="VALID")` up to float summation order,
fast in XLA:CPU training loops, differentiable forward and backward); `conv="xla"` uses `lax`
convolutions, ~40x slower per local step on XLA:CPU (measured single-threaded, jaxlib 0.10.2:
761 ms vs 20 ms; `lax` forward and input-gradient convolutions with an im2col weight gradient:
36 ms). The second ReLU runs after the max-pool: they commute (`max` is monotone and ReLU's
derivative is 0 wherever a window's maximum is <= 0), so values and gradients are those of
pfl's order, with 4x fewer elements through the ReLU and its gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn

from fedjax_sim.models.base import Model
from fedjax_sim.models.lenet import Im2colConv, torch_bias_init
from fedjax_sim.models.nets import from_module, image_shape

CHANNELS = (32, 64)
DENSE = 128


class _SimpleCNN(nn.Module):
    image_shape: tuple[int, ...]
    num_outputs: int
    conv: str = "im2col"

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], *self.image_shape))
        glorot = nn.initializers.xavier_uniform()
        for i, ch in enumerate(CHANNELS):
            inits = dict(kernel_init=glorot, bias_init=torch_bias_init(x.shape[-1] * 9))
            if self.conv == "im2col":
                x = Im2colConv(ch, (3, 3), name=f"Conv_{i}", **inits)(x)
            else:
                x = nn.Conv(ch, (3, 3), padding="VALID", name=f"Conv_{i}", **inits)(x)
            x = nn.relu(x) if i == 0 else x  # the last ReLU after the pool (they commute)
        b, h, w, c = x.shape  # 2x2 max-pool, stride 2 (sides are even: checked by simple_cnn)
        x = nn.relu(x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4)).reshape(b, -1))
        for width in (DENSE, self.num_outputs):
            x = nn.Dense(width, kernel_init=glorot, bias_init=torch_bias_init(x.shape[-1]))(x)
            x = nn.relu(x) if width == DENSE else x
        return x


def simple_cnn(
    input_shape: Sequence[int], num_classes: int, *, conv: str = "im2col", l2: float = 0.0
) -> Model:
    """pfl-research's 2-conv CIFAR CNN (module docstring); `conv` "im2col" or "xla".
    Inputs `[B, H, W, C]` or flat `[B, H * W * C]`; H - 4 and W - 4 must be even."""
    if conv not in ("im2col", "xla"):
        raise ValueError(f"simple_cnn conv must be 'im2col' or 'xla', got {conv!r}")
    image = image_shape(input_shape)
    if image[0] < 6 or image[1] < 6 or image[0] % 2 or image[1] % 2:
        raise ValueError(f"simple_cnn needs even image sides of at least 6, got {image}")
    module = _SimpleCNN(image, num_classes, conv)
    return from_module(module, input_shape, "simple_cnn", l2=l2)


def conv_macs(image: Sequence[int], num_classes: int) -> list[int]:
    """Multiply-adds per example of each matmul layer (conv 1, conv 2, dense, output): the
    FLOP model of the benchmarks (`bench.workloads.layer_macs`)."""
    h, w, c = image
    macs = [
        (h - 2) * (w - 2) * 9 * c * CHANNELS[0],
        (h - 4) * (w - 4) * 9 * CHANNELS[0] * CHANNELS[1],
    ]
    flat = (h - 4) // 2 * ((w - 4) // 2) * CHANNELS[1]
    return macs + [flat * DENSE, DENSE * num_classes]
