"""The ``conv`` kind: Conv1d / Conv2d + elementwise activation, optionally pooled, as one PC layer.

Shape letters: K layers in a group, B batch, C channels, H, W spatial sizes (a 1-D layer is
run as 2-D with H = 1, so every op below is the 2-D one).

    predict    a = conv(h_in, W) + b;  z = f(a);  u = pool(z)    (u = z without pooling)
    error      e = pi (h_out - u);  d = pool'(e) * f'(a)                (d = -dE/da; max pooling
               routes e to the saved argmax positions, average pooling spreads it)
    backproj   target <- beta * target + alpha * conv_input_grad(d, W)    (P = -dE/dh_in)
    weights    dF/dW = -(1/B) conv_weight_grad(h_in, d);  dF/db = -(1/B) sum d

The value node of a conv layer is [B, C, H, W] ([B, C, L] for 1-D). Activation and pooling
run on all K layers of a group at once (the K x B images are one batch); the convolutions
themselves run layer by layer into the group's preallocated buffers (aten's ``convolution``
and ``convolution_backward``, which pick the best algorithm per shape), or as one grouped
convolution of all K layers (``GroupedConv``: K times the groups, the layers side by side in
the channels), where that is faster (PCDIST_CONV_GROUPED). On CUDA devices with
Triton the bias, f and pooling are one kernel a layer, and the error, the value step and d one a
group (pcdist/engine/errorpass.py ``ConvKernel``, checked against these torch ops when the group
is built).

The image nodes that 2-D convolutions read may be stored channels-last (NHWC, ``channels_last_nodes``:
by default on CPUs with oneDNN, PCDIST_CHANNELS_LAST=1 everywhere; pcdist/engine/nodes.py), and then so are
the groups' own buffers and a copy of their weights: the layout oneDNN's and cuDNN's tensor-core
convolutions (TF32, bfloat16) read and write without reordering. Every op above takes either layout; results
equal the row-major ones to round-off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import errorpass
from ..activations import Activation
from ..arguments import env_choice
from ..gemm import timed
from ..nodes import is_channels_last, stacked_zeros
from ..precision import tf32_convolutions
from .base import Binding, BoundGroup, DerivedWeight, LayerGroup, LayerKind, accumulate
from .dense import Dense

__all__ = ["Conv", "ConvGroup", "POOLS", "pooled", "channels_last_nodes"]

POOLS = ("max", "avg")
_aten = torch.ops.aten


def _out_size(size: int, k: int, s: int, p: int, d: int = 1) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def pooled(z: Tensor, pool: str | None, window: list[int]) -> Tensor:
    """z [N, C, H, W] pooled in windows of ``window`` with that stride and no padding (the torch reference of
    the fused conv kernel, pcdist/engine/errorpass.py)."""
    if pool is None:
        return z
    return (F.max_pool2d if pool == "max" else F.avg_pool2d)(z, window, window)


def channels_last_nodes(specs, first: int, stop: int, dtype: torch.dtype, device: torch.device,
                        conv_dtype: torch.dtype | None = None) -> frozenset[int]:
    """The nodes a Stage of layers [first, stop) stores channels-last: every node that a 2-D conv layer reads (node
    n, read by layer n + 1), and one that a 2-D conv layer writes for a dense layer (which reads it in that order:
    pcdist/engine/layers/dense.py), on a network not split into layer slices (a layer-parallel boundary is sent as
    it is stored). A run of equal nodes is one tensor, so it is channels-last only if all of its nodes are; any
    other reader (a module layer: any code) keeps its node row-major. ``dtype``: the nodes', ``conv_dtype``: the
    convolutions' operands' (bfloat16 under precision="bf16"; default ``dtype``).

    PCDIST_CHANNELS_LAST: ``auto`` (default) where it was measured faster: on CPUs with oneDNN, float32 or
    bfloat16 nodes (a conv step 1.06-1.24x faster on 2 cores, ``python benchmarks/conv.py``); on GPUs where
    cuDNN's convolutions run on tensor cores, bfloat16 operands or float32 ones in TF32 (precision bf16 or tf32:
    VGG-5's replayed step 1.39x and 1.40x faster on an H200, the small CNN 1.07x, the 17-conv stack 1.00x;
    ``benchmarks/gpu.py``), not in IEEE float32 (VGG-5 0.98x, the small CNN 0.82x); ``1`` always, ``0`` never."""
    mode = env_choice("PCDIST_CHANNELS_LAST")
    if mode == "auto":
        conv_dtype = conv_dtype or dtype
        if device.type == "cpu":
            on = torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16)
        else:
            on = device.type == "cuda" and (conv_dtype in (torch.bfloat16, torch.float16) or (
                conv_dtype == torch.float32 and tf32_convolutions()))
        mode = "1" if on else "0"
    if mode == "0" or first != 1 or stop != len(specs) + 1:
        return frozenset()
    conv2d = [isinstance(s, Conv) and len(s.spatial) == 2 for s in specs]
    return frozenset(n for n, s in enumerate(specs) if conv2d[n] or (
        n > 0 and conv2d[n - 1] and isinstance(s, Dense) and s.input_shape is not None and len(s.input_shape) == 3))


@dataclass(frozen=True)
class Conv(LayerKind):
    """One convolution layer on a [C, *spatial] node: conv, activation, then optional pooling.

    Tuples have one entry per spatial dimension (1 for Conv1d, 2 for Conv2d). ``pool``: None,
    "max" or "avg" (zero padding; average pooling counts the padding, as torch's default).
    """

    kind = "conv"
    in_channels: int
    out_channels: int
    spatial: tuple[int, ...]
    kernel_size: tuple[int, ...]
    activation: Activation | None
    stride: tuple[int, ...] = (1, 1)
    padding: tuple[int, ...] = (0, 0)
    dilation: tuple[int, ...] = (1, 1)
    groups: int = 1
    bias: bool = True
    pool: str | None = None
    pool_kernel: tuple[int, ...] = ()
    pool_stride: tuple[int, ...] = ()
    pool_padding: tuple[int, ...] = ()

    def __post_init__(self):
        n = len(self.spatial)
        if n not in (1, 2):
            raise ValueError(f"conv layers are 1-D or 2-D, got spatial size {self.spatial}")
        for name in ("kernel_size", "stride", "padding", "dilation") + (("pool_kernel", "pool_stride", "pool_padding")
                                                                         if self.pool else ()):
            if len(getattr(self, name)) != n:
                raise ValueError(f"conv {name}={getattr(self, name)} needs {n} entries (spatial size {self.spatial})")
        if self.pool is not None and self.pool not in POOLS:
            raise ValueError(f"unknown pooling {self.pool!r}; allowed: max, avg")
        if self.in_channels % self.groups or self.out_channels % self.groups:
            raise ValueError(f"conv groups={self.groups} must divide in_channels={self.in_channels} and "
                             f"out_channels={self.out_channels}")
        if any(s < 1 for s in self.conv_spatial) or any(s < 1 for s in self.out_shape[1:]):
            raise ValueError(f"conv layer on a {list(self.in_shape)} node leaves no output "
                             f"(conv gives {list(self.conv_spatial)}, then {list(self.out_shape[1:])})")

    @property
    def in_shape(self) -> tuple[int, ...]:
        return (self.in_channels, *self.spatial)

    @property
    def conv_spatial(self) -> tuple[int, ...]:
        """Spatial size after the convolution (before pooling)."""
        return tuple(_out_size(*t) for t in zip(self.spatial, self.kernel_size, self.stride, self.padding,
                                                  self.dilation))

    @property
    def out_shape(self) -> tuple[int, ...]:
        sp = self.conv_spatial
        if self.pool is not None:
            sp = tuple(_out_size(*t) for t in zip(sp, self.pool_kernel, self.pool_stride, self.pool_padding))
        return (self.out_channels, *sp)

    def __str__(self) -> str:
        act = self.activation.name if self.activation else "none"
        pool = f", {self.pool}pool {self.pool_kernel}" if self.pool else ""
        return (f"conv{len(self.spatial)}d {list(self.in_shape)} -> {list(self.out_shape)}, k={self.kernel_size} "
                f"s={self.stride} p={self.padding}, {act}{pool}")

    def flops(self, index: int) -> int:
        """The convolution (predict) and its input gradient (back-projection, not on layer 1)."""
        macs = self.out_channels * math.prod(self.conv_spatial) * (self.in_channels // self.groups) \
            * math.prod(self.kernel_size)
        return (2 if index == 1 else 4) * macs + 8 * self.out_channels * math.prod(self.conv_spatial)

    def signature(self) -> dict:
        sig = {"kind": self.kind, "in": list(self.in_shape), "out": list(self.out_shape),
               "activation": None if self.activation is None else self.activation.name}
        sig.update({k: getattr(self, k) for k in ("kernel_size", "stride", "padding", "dilation", "groups", "bias",
                                                  "pool", "pool_kernel", "pool_stride", "pool_padding")})
        return {k: list(v) if isinstance(v, tuple) else v for k, v in sig.items()}

    def check(self, index: int, is_output: bool) -> None:
        if is_output:
            raise ValueError(f"layer {index} (the conv kind) cannot be the output layer: for images at the top "
                             "(a conv decoder) give the convolution as a module (PCNetwork.from_layers takes it as "
                             "the module kind), or end the network with nn.Flatten() and an nn.Linear")
        if self.activation is None:
            raise ValueError(f"layer {index} is a hidden conv layer without an activation "
                             "(use Activation('identity') for a linear one)")

    def make_group(self, first: int, K: int, dtype=None, device=None) -> "ConvGroup":
        return ConvGroup(self, first, K, dtype=dtype, device=device)

    # -- the 2-D view of a 1-D layer -----------------------------------------------------
    def as_2d(self, t: tuple[int, ...], fill: int) -> list[int]:
        return [fill, *t] if len(self.spatial) == 1 else list(t)


_GROUPED: dict[tuple, bool] = {}


def grouped_mode() -> str:
    """PCDIST_CONV_GROUPED: ``auto`` (default: on CUDA devices where timed faster, see ``GroupedConv``), ``1`` (always,
    where a group has two layers or more), ``0`` (never: layer by layer)."""
    return env_choice("PCDIST_CONV_GROUPED")


class GroupedConv:
    """A conv group's K convolutions as one: the K layers' images side by side in the channels ([B, K C, H, W]),
    their weights stacked ([K D, C / groups, kh, kw]: a view of [K, D, ...]) and K times the groups. A narrow deep
    stack's convolutions are small kernels that leave most of a GPU idle (the 17-conv stack: about 10 us each,
    some 500 a step); grouped, a phase is one kernel K times as large, for two copies between the group's
    [K, B, ...] nodes and the grouped layout. ``auto`` times both ways on the group's own operands the first time a
    shape is seen (a convolution and its input gradient, as cuDNN's benchmark mode chooses an algorithm) and keeps
    the choice for the process; grouped where it is at least 10% faster. The results equal the layer-by-layer
    ones to round-off (the same products, summed by another algorithm)."""

    def __init__(self, x2: Tensor, conv_shape: tuple[int, ...], w_conv: DerivedWeight, conv_args: tuple, cl: bool,
                 dtype: torch.dtype):
        K, B, C = x2.shape[:3]
        D = conv_shape[2]
        self.K, self.C, self.D, self.w_conv = K, C, D, w_conv
        *args, groups = conv_args
        self.conv_args, self.args = conv_args, (*args, K * groups)  # a layer's; all K layers' at once
        kw = dict(dtype=dtype, device=x2.device)
        self.x = stacked_zeros((B, K * C, *x2.shape[3:]), cl, **kw)  # the input, the conv's dtype (bf16: cast here)
        self.d = stacked_zeros((B, K * D, *conv_shape[3:]), cl, **kw)  # the signal at the convolutions' output
        self.x_K = self.x.unflatten(1, (K, C)).transpose(0, 1)  # [K, B, C, H, W] views of the grouped buffers
        self.d_K = self.d.unflatten(1, (K, D)).transpose(0, 1)

    def weight(self) -> Tensor:
        return self.w_conv.get().flatten(0, 1)

    def forward(self, x2: Tensor, bias: Tensor | None = None) -> Tensor:
        """The K layers' convolutions of x2 [K, B, C, H, W] (plus ``bias`` [K, D]): a [K, B, D, H', W'] view."""
        self.x_K.copy_(x2)
        out = _aten.convolution(self.x, self.weight(), None if bias is None else bias.flatten(), *self.args)
        return out.unflatten(1, (self.K, self.D)).transpose(0, 1)

    def input_grad(self, d: Tensor) -> Tensor:
        """The gradient at the K layers' inputs of the signal d [K, B, D, H', W']: a [K, B, C, H, W] view."""
        self.d_K.copy_(d)
        gin = _aten.convolution_backward(self.d, self.x, self.weight(), None, *self.args, [True, False, False])[0]
        return gin.unflatten(1, (self.K, self.C)).transpose(0, 1)

    def weight_grads(self, x2: Tensor, d: Tensor, bias: bool) -> tuple[Tensor, Tensor | None]:
        """The gradients of the K layers' weights [K, D, C / groups, kh, kw] (and biases [K, D]) at x2 and d."""
        self.x_K.copy_(x2)
        self.d_K.copy_(d)
        _, gw, gb = _aten.convolution_backward(self.d, self.x, self.weight(), [self.K * self.D] if bias else None,
                                               *self.args, [False, True, bias])
        return gw.unflatten(0, (self.K, self.D)), None if gb is None else gb.view(self.K, self.D)

    def faster(self, x2: Tensor, d: Tensor) -> bool:
        """``auto``'s choice for this shape (decided once per process): a forward and an input gradient of all K
        layers, grouped against layer by layer, timed on the current CUDA stream."""
        w, conv_args = self.w_conv.get(), self.conv_args
        key = (tuple(x2.shape), x2.stride(), tuple(w.shape), w.stride(), w.dtype, self.d.shape, repr(conv_args),
               x2.device)  # the conv arguments hold lists
        if key not in _GROUPED:
            def layer_by_layer():
                for k in range(self.K):
                    x = x2[k].to(w.dtype)
                    _aten.convolution(x, w[k], None, *conv_args)
                    _aten.convolution_backward(d[k].to(w.dtype), x, w[k], None, *conv_args, [True, False, False])

            _GROUPED[key] = (timed(lambda: (self.forward(x2), self.input_grad(d)), 10, x2.device)
                             < 0.9 * timed(layer_by_layer, 10, x2.device))
        return _GROUPED[key]


class ConvGroup(LayerGroup):
    """K equal conv layers: weight [K, C_out, C_in / groups, *kernel] (nn.Conv's layout), bias [K, C_out]."""

    lowp_params = ("weight",)

    def __init__(self, kind: Conv, first: int, K: int, dtype=None, device=None):
        super().__init__(kind, first, K)
        kw = dict(dtype=dtype, device=device)
        self.weight = nn.Parameter(torch.empty(K, kind.out_channels, kind.in_channels // kind.groups,
                                               *kind.kernel_size, **kw))
        self.bias = nn.Parameter(torch.empty(K, kind.out_channels, **kw)) if kind.bias else None

    def public_params(self, k: int) -> dict[str, Tensor]:
        out = {"weight": self.weight[k]}
        if self.bias is not None:
            out["bias"] = self.bias[k]
        return out

    def reset_layer(self, k: int, generator: torch.Generator | None) -> None:
        """nn.Conv's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias."""
        bound = 1.0 / math.sqrt(self.weight[k][0].numel())
        with torch.no_grad():
            for t in self.public_params(k).values():
                t.copy_(torch.rand(t.shape, generator=generator, dtype=t.dtype).mul_(2 * bound).sub_(bound))

    def to_module(self, k: int) -> nn.Module:
        s, p = self.kind, self.weight
        conv_cls = nn.Conv1d if len(s.spatial) == 1 else nn.Conv2d
        conv = conv_cls(s.in_channels, s.out_channels, s.kernel_size, s.stride, s.padding, s.dilation, s.groups,
                        bias=s.bias, dtype=p.dtype, device=p.device)
        with torch.no_grad():
            for name, t in self.public_params(k).items():
                getattr(conv, name).copy_(t)
        mods = [conv, s.activation.to_module()]
        if s.pool == "max":
            mods.append((nn.MaxPool1d if len(s.spatial) == 1 else nn.MaxPool2d)(s.pool_kernel, s.pool_stride,
                                                                                  s.pool_padding))
        elif s.pool == "avg":
            mods.append((nn.AvgPool1d if len(s.spatial) == 1 else nn.AvgPool2d)(s.pool_kernel, s.pool_stride,
                                                                                  s.pool_padding))
        return nn.Sequential(*mods)

    def forward(self, h: Tensor) -> Tensor:
        for k in range(self.K):
            h = self.to_module_ops(k, h)
        return h

    def to_module_ops(self, k: int, h: Tensor) -> Tensor:
        """Layer k on a batch h [B, C, *spatial], differentiable (evaluation and the reference)."""
        s = self.kind
        conv = F.conv1d if len(s.spatial) == 1 else F.conv2d
        b = None if self.bias is None else self.bias[k]
        w = self.weight[k].to(h.dtype)  # bf16's weights: float32 convolutions (the inits near equilibrium)
        h = s.activation(conv(h, w, b, s.stride, s.padding, s.dilation, s.groups))
        if s.pool is not None:
            one = len(s.spatial) == 1
            pool = {"max": F.max_pool1d if one else F.max_pool2d, "avg": F.avg_pool1d if one else F.avg_pool2d}[s.pool]
            h = pool(h, s.pool_kernel, s.pool_stride, s.pool_padding)
        return h

    def layer(self, k: int, h: Tensor) -> Tensor:
        return self.to_module_ops(k, h)

    def bind(self, h_in, h_out, e_out, b: Binding) -> "ConvBound":
        return ConvBound(self, h_in, h_out, e_out, b)


class ConvBound(BoundGroup):
    """A ConvGroup's phases over a Stage's buffers, everything in 2-D form."""

    def __init__(self, g: ConvGroup, h_in: Tensor, h_out: Tensor, e_out: Tensor, b: Binding):
        super().__init__(g, h_in, h_out, e_out, b)
        B = b.batch_size
        s: Conv = g.kind
        K, self.one_d = self.K, len(s.spatial) == 1
        to2 = (lambda t: t.unsqueeze(-2)) if self.one_d else (lambda t: t)
        self.x2, self.h2, self.e2 = to2(h_in), to2(h_out), to2(e_out)  # [K, B, C, H, W]
        self.w2 = to2(g.weight)  # [K, C_out, C_in / groups, kh, kw]
        # Channels-last input nodes (PCDIST_CHANNELS_LAST): the convolutions' outputs, the buffers of their size and
        # a copy of the weights (refreshed after each weight change) are channels-last too, the node-sized ones
        # take the output nodes' layout.
        cl_in, cl_out = is_channels_last(self.x2), is_channels_last(self.h2)
        self.w_conv = DerivedWeight(self.w2, lambda w: w, cl_in,
                                    lambda t: stacked_zeros(t.shape, True, dtype=t.dtype, device=t.device))
        self.bias = g.bias
        self.act, self.pool = s.activation, s.pool
        self.conv_args = (s.as_2d(s.stride, 1), s.as_2d(s.padding, 0), s.as_2d(s.dilation, 1), False, [0, 0], s.groups)
        kw = dict(dtype=h_out.dtype, device=g.weight.device)
        self.lowp = g.weight.dtype != h_out.dtype  # bfloat16 convolutions, float32 nodes (precision="bf16")
        conv_shape = (K, B, s.out_channels, *s.as_2d(s.conv_spatial, 1))
        if self.pool is not None:
            self.pool_args = (s.as_2d(s.pool_kernel, 1), s.as_2d(s.pool_stride, 1), s.as_2d(s.pool_padding, 0))
        node_shape = (K, B, s.out_channels, *s.as_2d(s.out_shape[1:], 1))
        # The bias, f and pooling in one kernel a layer, e, the value step and the signal in one a group (Triton
        # on GPUs, checked once against the torch ops below); None: those torch ops.
        self.kernel = None
        if errorpass.conv_usable(self.act, self.pool, *(self.pool_args if self.pool else ([1, 1], [1, 1], [0, 0])),
                                 math.prod(conv_shape), self.h2, self.e2):
            kernel = errorpass.ConvKernel(self.act, self.pool, self.pool_args[0] if self.pool else None, cl_out, cl_in)
            if kernel.agrees(conv_shape, node_shape, self.bias is not None, self.prec is not None, kw["device"],
                             f"conv layers {self.first}..{self.first + K - 1}", g.weight.dtype):
                self.kernel = kernel
        self.a = stacked_zeros(conv_shape, cl_in, **kw)  # the pre-activation (the kernel computes f' from it)
        self.d = torch.zeros_like(self.a)  # zero where no pooling window reaches (the kernel never writes there)
        self.grouped = self._grouped(conv_shape, cl_in)
        if self.grouped is not None and self.kernel is not None:  # the grouped convolution's output, per layer
            self.src = stacked_zeros(conv_shape, cl_in, dtype=g.weight.dtype, device=kw["device"])
        if self.kernel is not None:
            self.u = stacked_zeros(node_shape, cl_out, **kw)
            self.idx = stacked_zeros(node_shape, cl_out, dtype=torch.int8, device=kw["device"]) \
                if self.pool == "max" else None
            return
        self.z = self.a if not self.act.needs_input else torch.empty_like(self.a)  # f(a)
        if self.pool is None:
            self.u = self.z
            self.dz = None
        else:
            self.u = stacked_zeros(node_shape, cl_out, **kw)
            self.idx = torch.empty_like(self.u, dtype=torch.int64) if self.pool == "max" else None
            self.dz = torch.empty_like(self.a)  # dE/dz: the error routed back through the pooling

    def _grouped(self, conv_shape: tuple[int, ...], cl: bool) -> GroupedConv | None:
        """The group's convolutions as one grouped convolution (PCDIST_CONV_GROUPED), or None: layer by layer."""
        mode = grouped_mode()
        if self.K < 2 or mode == "0" or (mode == "auto" and (self.x2.device.type != "cuda"
                                                             or torch.cuda.is_current_stream_capturing())):
            return None
        grouped = GroupedConv(self.x2, conv_shape, self.w_conv, self.conv_args, cl, self.g.weight.dtype)
        return grouped if mode == "1" or grouped.faster(self.x2, self.d) else None

    @staticmethod
    def _flat(t: Tensor) -> Tensor:
        """[K, B, C, H, W] -> [K * B, C, H, W]: activation and pooling see all K layers as one batch."""
        return t.reshape(-1, *t.shape[2:])

    def _activate_and_pool(self, a: Tensor, z: Tensor, u: Tensor, idx: Tensor | None) -> None:
        self.act.forward(a, out=z)
        if self.pool == "max":
            _aten.max_pool2d_with_indices.out(z, *self.pool_args, [1, 1], False, out=u, indices=idx)
        elif self.pool == "avg":
            _aten.avg_pool2d.out(z, *self.pool_args, False, True, None, out=u)

    def _layer(self, k: int, x: Tensor, rows=slice(None)) -> None:
        """Layer k's convolution of x and its f and pooling, into rows ``rows`` of a, z, u (and the max's
        indices)."""
        if self.kernel is not None:  # the convolution without its bias: the kernel adds it as it reads
            w = self.w_conv.get()[k]
            out = _aten.convolution(x if not self.lowp else x.to(w.dtype), w, None, *self.conv_args)
            self.kernel.activate(out, None if self.bias is None else self.bias[k], self.a[k][rows], self.u[k][rows],
                                 None if self.idx is None else self.idx[k][rows])
            return
        a, z, u = self.a[k][rows], self.z[k][rows], self.u[k][rows]
        self._conv(k, x, a)
        self._activate_and_pool(a, z, u, None if self.pool != "max" else self.idx[k][rows])

    def _conv(self, k: int, x: Tensor, out: Tensor) -> None:
        b, w = None if self.bias is None else self.bias[k], self.w_conv.get()[k]
        if self.lowp:  # the convolution in bfloat16, the bias added in the nodes' dtype
            out.copy_(_aten.convolution(x.to(w.dtype), w, None, *self.conv_args))
            if b is not None:
                out.add_(b.view(-1, *[1] * (out.dim() - 2)))
            return
        _aten.convolution.out(x, w, b, *self.conv_args, out=out)

    def _grads(self, k: int, mask: list[bool], bias_sizes=None):
        """convolution_backward of layer k at its input and signal (cast to bfloat16 under precision="bf16")."""
        d, x, w = self.d[k], self.x2[k], self.w_conv.get()[k]
        if self.lowp:
            d, x = d.to(w.dtype), x.to(w.dtype)
        return _aten.convolution_backward(d, x, w, bias_sizes, *self.conv_args, mask)

    def feedforward(self, rows: slice | None, init: str) -> None:
        sel = slice(None) if rows is None else rows
        h = self.x2[0][sel]
        for k in range(self.K):
            self._layer(k, h, sel)
            h = self.u[k][sel]
        self.h2[:, sel].copy_(self.u[:, sel])
        self.cached = True

    def predict(self) -> None:
        if self.kernel is not None:
            if self.grouped is not None:  # the convolutions at once, then the kernel's bias, f and pooling per layer
                self.src.copy_(self.grouped.forward(self.x2))
                for k in range(self.K):
                    self.kernel.activate(self.src[k], None if self.bias is None else self.bias[k], self.a[k],
                                         self.u[k], None if self.idx is None else self.idx[k])
            else:
                for k in range(self.K):
                    self._layer(k, self.x2[k])
            self.cached = True
            return
        if self.grouped is not None:
            self.a.copy_(self.grouped.forward(self.x2, None if self.lowp else self.bias))
            if self.lowp and self.bias is not None:  # the bias added in the nodes' dtype, as _conv does
                self.a.add_(self.bias.view(*self.bias.shape, *[1] * (self.a.dim() - 3)).unsqueeze(1))
        else:
            for k in range(self.K):
                self._conv(k, self.x2[k], self.a[k])
        f = self._flat
        self._activate_and_pool(f(self.a), f(self.z), f(self.u), None if self.pool != "max" else f(self.idx))
        self.cached = True

    def errors(self, with_signal: bool, step_lr: float | None, hold_last: bool = False) -> None:
        if not self.cached:
            self.predict()
        if self.kernel is not None:
            self.kernel.errors(self.a, self.u, self.h2, self.e2, self.d, self.idx, self.prec, step_lr,
                               self.K - 1 if hold_last else self.K, with_signal)
            return
        self.weigh(torch.sub(self.h2, self.u, out=self.e2))
        if with_signal:
            f = self._flat
            dz = self.e2
            if self.pool == "max":
                dz = self.dz
                _aten.max_pool2d_with_indices_backward.grad_input(f(self.e2), f(self.z), *self.pool_args, [1, 1], False,
                                                                  f(self.idx), grad_input=f(dz))
            elif self.pool == "avg":
                dz = self.dz
                _aten.avg_pool2d_backward.grad_input(f(self.e2), f(self.z), *self.pool_args, False, True, None,
                                                     grad_input=f(dz))
            self.act.grad(dz, self.a, self.z, out=self.d)
        if step_lr is not None:
            stepped = self.K - 1 if hold_last else self.K
            self.h2[:stepped].add_(self.e2[:stepped], alpha=-step_lr)

    def backproject(self, target: Tensor, beta: float, alpha: float) -> None:
        t2 = target.unsqueeze(-2) if self.one_d else target
        if self.grouped is not None:
            accumulate(t2, self.grouped.input_grad(self.d), beta, alpha)
            return
        for k in range(self.K):
            accumulate(t2[k], self._grads(k, [True, False, False])[0], beta, alpha)

    def weight_grads(self, scale: float) -> None:
        g = self.g
        wg2 = g.weight.grad.unsqueeze(-2) if self.one_d else g.weight.grad
        bias_sizes = None if g.bias is None else [g.bias.shape[1]]
        if self.grouped is not None:
            gw, gb = self.grouped.weight_grads(self.x2, self.d, g.bias is not None and not self.lowp)
            torch.mul(gw, scale, out=wg2)
            if g.bias is not None:  # under bf16 the bias's gradient sums the signal in the nodes' dtype
                torch.mul(gb if gb is not None else self.d.sum((1, 3, 4)), scale, out=g.bias.grad)
            return
        for k in range(self.K):
            _, gw, gb = self._grads(k, [False, True, g.bias is not None and not self.lowp], bias_sizes)
            torch.mul(gw, scale, out=wg2[k])
            if g.bias is not None:  # under bf16 the bias's gradient sums the signal in the nodes' dtype
                torch.mul(gb if gb is not None else self.d[k].sum((0, 2, 3)), scale, out=g.bias.grad[k])

    def weights_changed(self) -> None:
        super().weights_changed()
        self.w_conv.invalidate()
