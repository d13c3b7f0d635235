"""The ``dense`` kind: Linear + elementwise activation, u_l = f(W_l h_{l-1} + b_l).

Shape letters: K layers in a group, B batch, I input width, O output width.

K equal layers store w_KIO [K, I, O] (W_l^T stacked, so the prediction of all K is one
``baddbmm(b, h_KBI, w_KIO)``) and b_KO [K, O]. Per inference step a hidden group is

    predict    a = baddbmm(b, h_in, w_KIO);  u = f(a)
    error      e = pi (h_out - u);  d = e * f'(a)     (d = -dE/da; output: the energy's signal)
    backproj   target <- beta * target + alpha * d @ w_KOI        (one GEMM, P = W^T d)
    weights    dF/dw_KIO = -(1/B) h_in^T @ d;  dF/db = -(1/B) sum_B d

On CPUs the elementwise work between the GEMMs is one pass per group (pcdist/engine/native.py):
a = bmm(h_in, w) and then b, f, e (with the layers' precisions pi), f' and (pc without
momentum) the value step's own-error term h_out -= x_lr * e in a single kernel (u is never
stored). The output layer (no activation) with the squared-error energy and a clamped target
computes d = y - b - h W as one GEMM on the precomputed y - b.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .. import chain, errorpass, gemm, native
from ..activations import Activation
from ..nodes import is_channels_last
from .base import (Binding, BoundGroup, DerivedWeight, LayerGroup, LayerKind, TransposedWeight, accumulate_product,
                   f32_products, low, lowp, product_into)

__all__ = ["Dense", "DenseGroup", "INITS"]

INITS = ("default", "orthogonal")


@dataclass(frozen=True)
class Dense(LayerKind):
    """One Linear layer: in/out widths and its activation (None for the output layer: u_L = a_L).

    ``init``: "default" (nn.Linear's U(-1/sqrt(in), 1/sqrt(in))) or "orthogonal" (W orthogonal,
    bias 0: keeps the signal's norm through deep plain MLPs). ``bias=False``: no bias (u = f(W h)).
    ``input_shape``: the shape of the input node when it is not a vector (an image after
    nn.Flatten: the layer reads it flattened, in_features = its size).
    """

    kind = "dense"
    in_features: int
    out_features: int
    activation: Activation | None
    init: str = field(default="default")
    bias: bool = True
    input_shape: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.init not in INITS:
            raise ValueError(f"unknown dense init {self.init!r}; allowed: {', '.join(INITS)}")
        if self.input_shape is not None and math.prod(self.input_shape) != self.in_features:
            raise ValueError(f"dense input_shape {list(self.input_shape)} has {math.prod(self.input_shape)} "
                             f"elements, not in_features={self.in_features}")

    @property
    def in_shape(self) -> tuple[int, ...]:
        return (self.in_features,) if self.input_shape is None else tuple(self.input_shape)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.out_features,)

    def __str__(self) -> str:
        act = self.activation.name if self.activation else "output"
        return (f"dense {self.in_features} -> {self.out_features}, {act}"
                + ("" if self.init == "default" else f", {self.init} init"))

    def flops(self, index: int) -> int:
        """A layer predicts (one GEMM), back-projects (another) and does elementwise work.

        Layer 1 does neither GEMM during PC inference: its input is clamped, so its
        prediction is computed once per batch and it has no free node to project to.
        """
        gemms = 0 if index == 1 else 4 * self.in_features * self.out_features
        return gemms + 6 * self.out_features

    def signature(self) -> dict:
        act = self.activation
        sig = {"kind": self.kind, "in": self.in_features, "out": self.out_features,
               "activation": None if act is None else act.name}
        if not self.bias:
            sig["bias"] = False
        if self.input_shape is not None:
            sig["in_shape"] = list(self.input_shape)
        return sig

    def check(self, index: int, is_output: bool) -> None:
        if is_output and self.activation is not None:
            raise ValueError("the output layer takes no activation (u_L = a_L)")
        if not is_output and self.activation is None:
            raise ValueError(f"layer {index} is a hidden dense layer without an activation "
                             "(use Activation('identity') for a linear layer)")

    def make_group(self, first: int, K: int, dtype=None, device=None) -> "DenseGroup":
        return DenseGroup(self, first, K, dtype=dtype, device=device)


class DenseGroup(LayerGroup):
    """K consecutive Dense layers of one shape and activation: weight [K, I, O] (W^T), bias [K, O]."""

    lowp_params = ("weight",)

    def __init__(self, kind: Dense, first: int, K: int, dtype=None, device=None):
        super().__init__(kind, first, K)
        kw = dict(dtype=dtype, device=device)
        self.weight = nn.Parameter(torch.empty(K, kind.in_features, kind.out_features, **kw))
        if kind.bias:
            self.bias = nn.Parameter(torch.empty(K, kind.out_features, **kw))
        else:  # the phases add a zero bias, so bias-free layers take the same fused path
            self.bias = None
            self.register_buffer("zero_bias", torch.zeros(K, kind.out_features, **kw), persistent=False)

    @property
    def spec(self) -> Dense:
        return self.kind

    @property
    def b_KO(self) -> Tensor:
        """The biases [K, O] (zeros for bias-free layers)."""
        return self.zero_bias if self.bias is None else self.bias

    def public_params(self, k: int) -> dict[str, Tensor]:
        out = {"weight": self.weight[k].T}  # nn.Linear's layout
        if self.bias is not None:
            out["bias"] = self.bias[k]
        return out

    def reset_layer(self, k: int, generator: torch.Generator | None) -> None:
        w, b = self.weight[k], self.b_KO[k]
        with torch.no_grad():
            if self.kind.init == "orthogonal":
                q = torch.empty(w.T.shape, dtype=w.dtype)
                w.T.copy_(nn.init.orthogonal_(q, generator=generator))
                b.zero_()
                return
            bound = 1.0 / math.sqrt(self.kind.in_features)
            w.copy_(torch.rand(w.shape, generator=generator, dtype=w.dtype).mul_(2 * bound).sub_(bound))
            if self.bias is not None:
                b.copy_(torch.rand(b.shape, generator=generator, dtype=b.dtype).mul_(2 * bound).sub_(bound))

    def to_module(self, k: int) -> nn.Module:
        s, p = self.kind, self.weight
        lin = nn.Linear(s.in_features, s.out_features, bias=s.bias, dtype=p.dtype, device=p.device)
        with torch.no_grad():
            for name, t in self.public_params(k).items():
                getattr(lin, name).copy_(t)
        mods = ([] if s.input_shape is None else [nn.Flatten()]) + [lin] + \
            ([] if s.activation is None else [s.activation.to_module()])
        return mods[0] if len(mods) == 1 else nn.Sequential(*mods)

    def forward(self, h_BI: Tensor) -> Tensor:
        act = self.kind.activation
        if self.kind.input_shape is not None:
            h_BI = h_BI.flatten(1)
        for k in range(self.K):
            h_BI = torch.addmm(self.b_KO[k], h_BI, self.weight[k])
            if act is not None:
                h_BI = act(h_BI)
        return h_BI

    def layer(self, k: int, h: Tensor) -> Tensor:
        act = self.kind.activation
        a = torch.addmm(self.b_KO[k], h.flatten(1) if self.kind.input_shape is not None else h,
                      self.weight[k].to(h.dtype))  # bf16's weights: float32 products (the inits near equilibrium)
        return a if act is None else act(a)

    def bind(self, h_in, h_out, e_out, b: Binding) -> "DenseBound":
        return DenseBound(self, h_in, h_out, e_out, b)


class DenseBound(BoundGroup):
    """A DenseGroup's phases over a Stage's buffers.

    Parameter views are taken once: optimizers update parameters in place, and the
    trainer rebuilds its Stage if a parameter's storage is replaced.
    """

    def __init__(self, g: DenseGroup, h_in, h_out, e_out, b: Binding):
        # An image node is read flattened (a free view of the block); a channels-last one [K, B, C, H, W]
        # (PCDIST_CHANNELS_LAST) in its storage order (h, w, c), with the weight's rows copied into that order.
        self.hwc = g.kind.input_shape is not None and len(g.kind.input_shape) == 3 and is_channels_last(h_in)
        if g.kind.input_shape is not None:
            h_in = self._flat(h_in)
        super().__init__(g, h_in, h_out, e_out, b)
        K, B = self.K, b.batch_size
        self.act = g.kind.activation
        self.w_KIO, self.w_hwc = g.weight, None
        if self.hwc:
            C, H, W = g.kind.input_shape
            self.w_hwc = DerivedWeight(g.weight, lambda w: w.view(K, C, H, W, -1).permute(0, 2, 3, 1, 4), True)
            self.w_KIO = self.w_hwc.get().view(g.weight.shape)  # the copy, refreshed at each weight change
            self._grad_hwc = torch.empty_like(self.w_KIO)
        self.w_t = TransposedWeight(self.w_KIO, copy=b.static_weights)
        self.b_K1O = g.b_KO.unsqueeze(1)
        kw = dict(dtype=h_out.dtype, device=g.weight.device)
        self.lowp = g.weight.dtype != h_out.dtype  # bfloat16 products, float32 nodes (precision="bf16")
        self.f32 = self.lowp and f32_products(h_out)  # those products written in float32 by the GEMM (CUDA)
        self.baddbmm, self.bmm = gemm.functions(h_out)  # cuBLAS, or a Triton GEMM where faster (CUDA)
        self.a = torch.empty(K, B, g.kind.out_features, **kw)
        # u overwrites a unless f'(a) must be read from a itself (gelu).
        self.u = self.a if self.act is None or not self.act.needs_input else torch.empty_like(self.a)
        self.d = torch.empty_like(self.a)
        self.layers = [(g.b_KO[k], self.w_KIO[k], self.a[k], self.u[k]) for k in range(K)]  # for the chain
        # Squared-error output, clamped target: d_L = y - b_L - h W_L is one GEMM on the precomputed y - b_L.
        se = self.is_output and self.energy.residual and not self.free_output
        self._y_minus_b = torch.empty_like(self.a) if se else None
        self._ymb_stale = True  # y - b is refreshed on first use after each weight change (or new batch)
        # f, the error, f' and the value step in one pass (the C kernel on CPUs, Triton on GPUs, checked once
        # against torch); None: separate torch ops. It reads a (u itself, except for gelu, whose f' needs its
        # input) and, unless fresh, u.
        self.kernel = None
        if not self.is_output and self.e_out.is_contiguous():
            args = (self.act, self.a, self.h_out, self.e_out, self.d, g.b_KO)
            if native.usable(self.act, self.a):
                self.kernel = native.Kernel(*args, u=self.u, prec=self.prec)
            elif errorpass.usable(self.act, self.a) and (kernel := errorpass.Kernel(*args, u=self.u, prec=self.prec)) \
                    .agrees(f"dense layers {self.first}..{self.first + K - 1}"):
                self.kernel = kernel
        # The feed-forward chain of K >= 2 square layers as one kernel (GPU; checked on first use).
        kind = g.kind
        self.fused_chain = None if self.is_output or kind.input_shape is not None or not self.h_out.is_contiguous() \
            or self.lowp else chain.usable(self.a, self.act, K, kind.in_features, kind.out_features) or None

    # -- feed-forward init ----------------------------------------------------------
    def feedforward(self, rows: slice | None, init: str) -> None:
        act = self.act
        h = self.h_in[0] if rows is None else self.h_in[0][rows]
        if init == "deeppcr" and self.K > 1 and not self.is_output:
            self._chain_deeppcr(h, rows)
            return
        if self.fused_chain and self._chain_agrees():
            chain.dense_chain(self.h_in[0], self.w_KIO, self.g.b_KO, self.a, self.u, self.h_out, act, rows)
            self.cached = True
            return
        relu = act is not None and act.name == "relu"  # bias + relu as the GEMM's epilogue: one kernel a layer
        for b, w, a, u in self.layers:
            if rows is not None:
                a, u = a[rows], u[rows]
            if self.lowp:
                torch.add(b, lowp(h, w), out=a)
            elif relu:
                h = torch._addmm_activation(b, h, w, out=u)
                continue
            else:
                torch.addmm(b, h, w, out=a)
            h = a if act is None else act.forward(a, out=u)
        if not self.is_output or self.free_output:
            if rows is None:
                self.h_out.copy_(self.u)
            else:
                self.h_out[:, rows].copy_(self.u[:, rows])
        self.cached = True

    def _chain_agrees(self) -> bool:
        """The fused chain against the torch chain on a probe, once (bookkeeping of the first step)."""
        if self.fused_chain is True:
            with torch.no_grad():
                h0 = torch.randn(self.h_in.shape[1:], generator=torch.Generator(self.a.device).manual_seed(0),
                                 device=self.a.device).to(self.a.dtype)

                def run():
                    a, u, h = torch.empty_like(self.a), torch.empty_like(self.u), torch.empty_like(self.a)
                    u = a if self.u is self.a else u
                    chain.dense_chain(h0, self.w_KIO, self.g.b_KO, a, u, h, self.act)
                    return [u, h]

                def reference():
                    x, want = h0, []
                    for k in range(self.K):
                        x = self.act(torch.addmm(self.g.b_KO[k], x, self.w_KIO[k]))
                        want.append(x)
                    return [torch.stack(want)] * 2

                ok = chain.checked(run, reference, f"dense layers {self.first}..{self.first + self.K - 1}")
            self.fused_chain = "yes" if ok else None
        return self.fused_chain is not None

    def _chain_deeppcr(self, h_BI: Tensor, rows: slice | None) -> None:
        """The group's K chained predictions solved at once; a and u then follow from one GEMM."""
        from ..deeppcr import solve

        states = solve((self.w_KIO.to(h_BI.dtype), self.g.b_KO, self.act), h_BI).states  # [K + 1, B, O]
        sel = slice(None) if rows is None else rows
        self.h_out[:, sel].copy_(states[1:])
        a = self.a[:, sel]
        self._product(self.h_in[:, sel], a, self.b_K1O)
        self.act.forward(a, out=self.u[:, sel])
        self.cached = True

    # -- inference ------------------------------------------------------------------
    def predict(self, activate: bool = True) -> None:
        """a = b + h_in @ w; u = f(a): one kernel each for all K layers. ``activate=False``
        leaves a = h_in @ w, for the fused kernel to add b and apply f."""
        if activate:
            self._product(self.h_in, self.a, self.b_K1O)
            if self.act is not None:
                self.act.forward(self.a, out=self.u)
            self.cached = True
        else:
            self._product(self.h_in, self.a)

    def _product(self, h: Tensor, out: Tensor, bias: Tensor | None = None) -> None:
        """out = bias + h @ w_KIO (in bfloat16 products under precision="bf16")."""
        if self.lowp:
            product_into(out, h, self.w_KIO, self.f32, bias)
        elif bias is not None:
            self.baddbmm(bias, h, self.w_KIO, out=out)
        else:
            self.bmm(h, self.w_KIO, out=out)

    def errors(self, with_signal: bool, step_lr: float | None, hold_last: bool = False) -> None:
        """e = h_out - u and d = e * f'(a) (if ``with_signal``), predicting first if stale; with
        ``step_lr`` also h_out -= step_lr * e (``hold_last``: on all nodes but the last), and e
        is then left unwritten where the kernel takes that step (only the held node's e is read,
        as the boundary message). The output layer writes its energy's signal d = -pi dE_out/du."""
        if self.is_output:
            if self._y_minus_b is not None:
                if self._ymb_stale:
                    torch.sub(self.h_out, self.b_K1O, out=self._y_minus_b)
                    self._ymb_stale = False
                if self.lowp:
                    torch.sub(self._y_minus_b, lowp(self.h_in, self.w_KIO), out=self.d)
                else:
                    self.baddbmm(self._y_minus_b, self.h_in, self.w_KIO, alpha=-1.0, out=self.d)
                self.energy.scale_signal(self.d)
            else:
                if not self.cached:
                    self.predict()
                self.energy.signal(self.u[0], self.h_out[0], self.d[0])
            return
        stepped = self.K - 1 if hold_last else self.K
        if self.kernel is not None:
            # The kernel does not store u: only layer 1 under a clamped input reuses it, for the whole batch.
            fresh = not self.cached and self.free_input
            if fresh:
                self.predict(activate=False)
            elif not self.cached:
                self.predict()
            self.kernel.run(fresh, with_signal, step_lr, stepped)
            return
        if not self.cached:
            self.predict()
        self.weigh(torch.sub(self.h_out, self.u, out=self.e_out))
        if with_signal:
            self.act.grad(self.e_out, self.a, self.u, out=self.d)
        if step_lr is not None:
            self.h_out[:stepped].add_(self.e_out[:stepped], alpha=-step_lr)

    def _flat(self, t: Tensor) -> Tensor:
        """Image nodes [K, B, *image] as [K, B, I] (a view), in the order the weight's rows are read."""
        return t.permute(0, 1, 3, 4, 2).flatten(2) if self.hwc else t.flatten(2)

    def backproject(self, target: Tensor, beta: float, alpha: float) -> None:
        if target.dim() > 3:  # an image node
            target = self._flat(target)
        if self.lowp:
            accumulate_product(target, self.d, self.w_t.get(), beta, alpha, self.f32)
        else:
            self.baddbmm(target, self.d, self.w_t.get(), beta=beta, alpha=alpha, out=target)

    def weight_grads(self, scale: float) -> None:
        w, b = self.g.weight, self.g.bias
        grad = w.grad if self.w_hwc is None else self._grad_hwc  # the rows in the order h_in is read
        if self.lowp:
            torch.mul(low(self.h_in.transpose(1, 2), self.d.to(w.dtype), w.dtype), scale, out=grad)
        else:
            self.baddbmm(grad, self.h_in.transpose(1, 2), self.d, beta=0.0, alpha=scale, out=grad)
        if self.w_hwc is not None:  # back into nn.Linear's (c, h, w) order
            self.w_hwc.view(w.grad).copy_(grad.view(self.w_hwc.get().shape))
        if b is not None:
            torch.sum(self.d, dim=1, out=b.grad).mul_(scale)

    def weights_changed(self) -> None:
        self.cached = False
        if self.w_hwc is not None:  # refreshed now: every phase reads it
            self.w_hwc.invalidate()
            self.w_hwc.get()
        self.w_t.invalidate()
        self._ymb_stale = True
