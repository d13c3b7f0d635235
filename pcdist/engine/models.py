"""Convolutional PC networks: a user-listed conv stack (``cnn``), PCX's VGG-5 / VGG-7, and a conv
decoder (``deconv``) that puts images at the top node for generative and unsupervised PC.

Each conv layer is one PC layer (a value node after its activation and pooling); the
network ends with nn.Flatten and dense layers, the last of which is the output layer.

PCX's VGG networks ("Benchmarking Predictive Coding Networks -- Made Simple", ICLR 2025;
the JAX library pcx, ``examples/discriminative_experiments/VGG5/*/PC_*.py`` and
``VGG7/*/PC_*.py``), on 3 x 32 x 32 images, every conv 3 x 3 with stride 1, max pooling 2 / 2:

    VGG-5  conv 128 p1 pool, conv 256 p1 pool, conv 512 p1 pool, conv 512 p1 pool, linear 2048 -> classes
    VGG-7  conv 128 p1 pool, conv 128 p1, conv 256 p1 pool, conv 256 p0, conv 512 p1 pool, conv 512 p0,
           linear 512 -> classes
"""

from __future__ import annotations

import math
from typing import Sequence

from torch import nn

from .activations import Activation, get_activation
from .layers import Conv, Dense, LayerKind, ModuleKind

__all__ = ["VGG", "conv_specs", "vgg_specs", "cnn_specs", "deconv_specs"]

# (out channels, padding, pooling) of each 3 x 3 conv layer
VGG = {
    "vgg5": [(128, 1, "max"), (256, 1, "max"), (512, 1, "max"), (512, 1, "max")],
    "vgg7": [(128, 1, "max"), (128, 1, None), (256, 1, "max"), (256, 0, None), (512, 1, "max"), (512, 0, None)],
}


def conv_specs(in_shape: Sequence[int], convs: Sequence[tuple], head: Sequence[int],
               d_out: int, activation: str | Activation) -> list[LayerKind]:
    """Conv layers ``convs`` = (out channels, kernel size, padding, pooling: None, "max" or "avg"[, stride];
    stride 1 unless given, pooling 2 / 2) on input nodes of ``in_shape`` [C, L] (Conv1d) or [C, H, W]
    (Conv2d), then nn.Flatten, dense hidden layers of widths ``head`` and a dense output layer of ``d_out``."""
    act = activation if isinstance(activation, Activation) else get_activation(activation)
    shape = tuple(int(d) for d in in_shape)
    if len(shape) not in (2, 3):
        raise ValueError(f"a conv network needs inputs [C, L] or [C, H, W], got samples of shape {list(shape)}")
    n = len(shape) - 1
    specs: list[LayerKind] = []
    for c_out, k, p, pool, *stride in convs:
        s = int(stride[0]) if stride else 1
        pool_args = (pool, (2,) * n, (2,) * n, (0,) * n) if pool else (None, (), (), ())
        spec = Conv(shape[0], int(c_out), shape[1:], (int(k),) * n, act, (s,) * n, (int(p),) * n, (1,) * n, 1, True,
                    *pool_args)
        specs.append(spec)
        shape = spec.out_shape
    widths = [math.prod(shape), *map(int, head), int(d_out)]
    for i in range(len(widths) - 1):
        last = i == len(widths) - 2
        specs.append(Dense(widths[i], widths[i + 1], None if last else act,
                           input_shape=shape if i == 0 else None))
    return specs


def vgg_specs(variant: str, in_shape: Sequence[int], d_out: int, activation: str | Activation = "gelu") -> list:
    """PCX's VGG-5 or VGG-7 (see the module docstring) for inputs ``in_shape`` (3 x 32 x 32 as published)."""
    if variant not in VGG:
        raise ValueError(f"unknown VGG variant {variant!r}; allowed: {', '.join(VGG)}")
    return conv_specs(in_shape, [(c, 3, p, pool) for c, p, pool in VGG[variant]], [], d_out, activation)


def cnn_specs(in_shape: Sequence[int], channels: Sequence[int], kernel_size: int, pool: Sequence[str],
              head: Sequence[int], d_out: int, activation: str | Activation, stride: Sequence[int] = (),
              padding: Sequence[int] = ()) -> list:
    """A conv stack of ``channels`` (Conv1d on signals [C, L], Conv2d on images [C, H, W]; kernel
    ``kernel_size``, ``stride`` and ``padding`` per layer, by default 1 and "same" for odd kernels; ``pool``
    per layer: max, avg or none), then dense ``head`` widths and the output layer."""
    for key, vals in (("model.pool", pool), ("model.stride", stride), ("model.padding", padding)):
        if vals and len(vals) != len(channels):
            raise ValueError(f"{key} has {len(vals)} entries but model.channels {len(channels)}: one per conv layer")
    stride = list(stride) or [1] * len(channels)
    padding = list(padding) or [kernel_size // 2] * len(channels)
    convs = [(c, kernel_size, p, None if pl == "none" else pl, s)
             for c, pl, s, p in zip(channels, pool, stride, padding)]
    return conv_specs(in_shape, convs, head, d_out, activation)


def deconv_specs(d_in: int, out_shape: Sequence[int], channels: Sequence[int], kernel_size: int,
                 activation: str | Activation) -> list[LayerKind]:
    """A conv decoder from a vector h_0 of ``d_in`` to images of ``out_shape`` [C, H, W] at h_L: a dense layer
    to ``channels[0]`` x H/2^n x W/2^n (n = len(channels)), then n layers of 2x nearest upsampling + a
    ``kernel_size`` conv ("same" padding) + activation, each doubling the size (the last one's output has
    ``channels[-1]`` channels at H x W), then the output conv to C channels (no activation: the output
    energy reads u_L). The upsampling layers and the output run as the module kind (pcdist.layers)."""
    act = activation if isinstance(activation, Activation) else get_activation(activation)
    C, H, W = (int(d) for d in out_shape) if len(out_shape) == 3 else (0, 0, 0)
    n = len(channels)
    if len(out_shape) != 3 or H % 2**n or W % 2**n:
        raise ValueError(f"model.name=deconv makes images [C, H, W] with H and W divisible by 2^{n} "
                         f"(len(model.channels) = {n} upsamplings), got samples of shape {list(out_shape)}")
    if kernel_size % 2 == 0:
        raise ValueError(f"model.kernel_size={kernel_size}: deconv needs an odd kernel ('same' padding)")
    h, w, pad = H // 2**n, W // 2**n, kernel_size // 2
    specs: list[LayerKind] = [Dense(int(d_in), channels[0] * h * w, act)]
    shape: tuple[int, ...] = (channels[0] * h * w,)
    c_in = channels[0]
    for i, c_out in enumerate(channels):
        mods = [nn.Unflatten(1, (c_in, h, w))] if i == 0 else []
        mods += [nn.Upsample(scale_factor=2.0, mode="nearest"), nn.Conv2d(c_in, int(c_out), kernel_size, padding=pad),
                 act.to_module()]
        specs.append(ModuleKind.of(nn.Sequential(*mods), shape, len(specs) + 1))
        shape, c_in, h, w = specs[-1].out_shape, int(c_out), h * 2, w * 2
    specs.append(ModuleKind.of(nn.Conv2d(c_in, C, kernel_size, padding=pad), shape, len(specs) + 1))
    return specs
