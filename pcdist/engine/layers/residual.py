"""The ``residual`` kind: μPC's layers, u_l = skip * h_{l-1} + a_l (W_l phi(h_{l-1}) + b_l).

Shape letters: K layers in a group, B batch, I input width, O output width.

μPC (Innocenti, Achour, Buckley, NeurIPS 2025, "μPC: Scaling Predictive Coding to 100+
Layer Networks"; jpc's ``make_mlp``, ``make_skip_model`` and ``_get_param_scalings``) trains
residual networks of 128 layers with PC. With L weight layers of width N and input width D:

    layer 1           u_1 = a_1 W_1 x                   a_1 = 1/sqrt(D), no activation, no skip
    hidden l=2..L-1   u_l = h_{l-1} + a_h W_l phi(h_{l-1})   a_h = 1/sqrt(N L)
    output            u_L = a_L W_L phi(h_{L-1})           a_L = 1/N, no skip
    W ~ N(0, 1) elementwise, no biases by default; the activation sits on the input side.

The scalings are stored in each layer's description (``Residual.scale``), computed from the
global N and L when the network is described, so every rank of a layer split uses the same.
Per inference step a group of K equal layers is

    predict    s = phi(h_in);  u = skip * h_in + a (s @ w_KIO + b)        (one GEMM)
    error      e = pi (h_out - u)   (output: d = -pi dE_out/du)
    backproj   t = d @ w_KOI;  P = a t * phi'(h_in) + skip * d;  target <- beta target + alpha P
    weights    dF/dw_KIO = -(a/B) s^T @ d;  dF/db = -(a/B) sum_B d

phi'(h_in) is read from s (as aten's *_backward ops do), or for activations whose derivative
needs the input (gelu) from a copy of h_in taken at prediction time: the fused value step
(pc without momentum) moves h before the back-projection reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import chain, errorpass, gemm, native
from ..activations import Activation, get_activation
from .base import Binding, BoundGroup, LayerGroup, LayerKind, TransposedWeight, accumulate, f32_products, low, \
    product_into

__all__ = ["Residual", "ResidualGroup", "ResidualLinear", "mupc_specs", "mupc_layers"]


@dataclass(frozen=True)
class Residual(LayerKind):
    """u = skip * h + scale * (W phi(h) + b): one μPC layer (the activation phi on the input side)."""

    kind = "residual"
    in_features: int
    out_features: int
    activation: Activation
    scale: float
    skip: bool = True
    bias: bool = False

    def __post_init__(self):
        if self.skip and self.in_features != self.out_features:
            raise ValueError(f"a residual layer with a skip needs in_features == out_features, "
                             f"got {self.in_features} -> {self.out_features}")
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"residual scale must be a finite number > 0, got {self.scale!r}")

    @property
    def in_shape(self) -> tuple[int, ...]:
        return (self.in_features,)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.out_features,)

    def __str__(self) -> str:
        return (f"residual {self.in_features} -> {self.out_features}, phi={self.activation.name}, "
                f"scale={self.scale:.4g}{', skip' if self.skip else ''}{', bias' if self.bias else ''}")

    def flops(self, index: int) -> int:
        """Two GEMMs (predict, back-project) and ~8 elementwise passes; layer 1 predicts once per batch."""
        gemms = 0 if index == 1 else 4 * self.in_features * self.out_features
        return gemms + 8 * self.out_features

    def signature(self) -> dict:
        return {"kind": self.kind, "in": self.in_features, "out": self.out_features,
                "activation": self.activation.name, "scale": float(self.scale), "skip": self.skip, "bias": self.bias}

    def make_group(self, first: int, K: int, dtype=None, device=None) -> "ResidualGroup":
        return ResidualGroup(self, first, K, dtype=dtype, device=device)


def mupc_specs(d_in: int, width: int, depth: int, d_out: int, activation: str | Activation = "relu",
               bias: bool = False) -> list[Residual]:
    """The ``depth`` layers of a μPC network (input, depth - 2 residual hidden layers, output)."""
    for name, v, lo in (("d_in", d_in, 1), ("width", width, 1), ("depth", depth, 2), ("d_out", d_out, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"mupc {name} must be an integer >= {lo}, got {v!r}")
    act = activation if isinstance(activation, Activation) else get_activation(activation)
    L, N = depth, width
    first = Residual(d_in, N, Activation("identity"), 1.0 / math.sqrt(d_in), skip=False, bias=bias)
    hidden = [Residual(N, N, act, 1.0 / math.sqrt(N * L), skip=True, bias=bias)] * (L - 2)
    return [first, *hidden, Residual(N, d_out, act, 1.0 / N, skip=False, bias=bias)]


class ResidualLinear(nn.Module):
    """A plain torch μPC layer: forward(h) = skip * h + scale * linear(phi(h)) (trainable by backprop too)."""

    def __init__(self, in_features: int, out_features: int, activation: str | Activation = "relu",
                 scale: float = 1.0, skip: bool = True, bias: bool = False, dtype=None, device=None,
                 generator: torch.Generator | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.activation = activation if isinstance(activation, Activation) else get_activation(activation)
        self.scale, self.skip = float(scale), bool(skip)
        Residual(in_features, out_features, self.activation, self.scale, self.skip, bias)  # validates
        kw = dict(dtype=dtype, device=device)
        self.weight = nn.Parameter(torch.randn(out_features, in_features, generator=generator, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features, **kw)) if bias else None

    def forward(self, h: Tensor) -> Tensor:
        u = self.scale * F.linear(self.activation(h), self.weight, self.bias)
        return u + h if self.skip else u

    def extra_repr(self) -> str:
        return (f"{self.in_features} -> {self.out_features}, phi={self.activation.name}, scale={self.scale:.4g}, "
                f"skip={self.skip}, bias={self.bias is not None}")


def mupc_layers(d_in: int, width: int, depth: int, d_out: int, activation: str | Activation = "relu",
                bias: bool = False, generator: torch.Generator | None = None, dtype=None,
                device=None) -> nn.ModuleList:
    """μPC's ``depth`` layers as plain torch modules (W ~ N(0, 1)); ``PCNetwork.from_layers`` trains
    them with PC, and ``nn.Sequential(*layers)`` is the same network for backprop."""
    return nn.ModuleList(ResidualLinear(s.in_features, s.out_features, s.activation, s.scale, s.skip, s.bias,
                                        dtype=dtype, device=device, generator=generator)
                         for s in mupc_specs(d_in, width, depth, d_out, activation, bias))


class ResidualGroup(LayerGroup):
    """K equal Residual layers: weight [K, I, O] (W^T stacked), bias [K, O] if the layers have one."""

    reads_errors = True  # P = a t * phi'(h_in) + e reads the layers' own errors
    lowp_params = ("weight",)

    def __init__(self, kind: Residual, first: int, K: int, dtype=None, device=None):
        super().__init__(kind, first, K)
        kw = dict(dtype=dtype, device=device)
        self.weight = nn.Parameter(torch.empty(K, kind.in_features, kind.out_features, **kw))
        self.bias = nn.Parameter(torch.empty(K, kind.out_features, **kw)) if kind.bias else None

    def public_params(self, k: int) -> dict[str, Tensor]:
        out = {"weight": self.weight[k].T}  # nn.Linear's layout [out, in]
        if self.bias is not None:
            out["bias"] = self.bias[k]
        return out

    def reset_layer(self, k: int, generator: torch.Generator | None) -> None:
        """μPC's init: W ~ N(0, 1) (the scale lives in the forward pass), b = 0."""
        with torch.no_grad():
            w = self.weight[k]
            w.T.copy_(torch.randn(w.T.shape, generator=generator, dtype=w.dtype))
            if self.bias is not None:
                self.bias[k].zero_()

    def to_module(self, k: int) -> nn.Module:
        s, p = self.kind, self.weight
        m = ResidualLinear(s.in_features, s.out_features, s.activation, s.scale, s.skip, s.bias,
                           dtype=p.dtype, device=p.device)
        with torch.no_grad():
            for name, v in self.public_params(k).items():
                getattr(m, name).copy_(v)
        return m

    def forward(self, h: Tensor) -> Tensor:
        for k in range(self.K):
            h = self.layer(k, h)
        return h

    def layer(self, k: int, h: Tensor) -> Tensor:
        """Layer k of the group on h: skip * h + scale * (phi(h) W_k + b_k)."""
        s = self.kind
        w = self.weight[k].to(h.dtype)  # bf16's weights: float32 products (the inits near equilibrium)
        u = s.scale * F.linear(s.activation(h), w.T, None if self.bias is None else self.bias[k])
        return u + h if s.skip else u

    def bind(self, h_in, h_out, e_out, b: Binding) -> "ResidualBound":
        return ResidualBound(self, h_in, h_out, e_out, b)


class ResidualBound(BoundGroup):
    """A ResidualGroup's phases over a Stage's buffers (see the module docstring)."""

    def __init__(self, g: ResidualGroup, h_in, h_out, e_out, b: Binding):
        super().__init__(g, h_in, h_out, e_out, b)
        B = b.batch_size
        kind: Residual = g.kind
        self.act, self.a, self.skip = kind.activation, float(kind.scale), kind.skip
        self.identity = self.act.name == "identity"
        self.w_KIO = g.weight
        self.w_t = TransposedWeight(g.weight, copy=b.static_weights)
        self.b_K1O = None if g.bias is None else g.bias.unsqueeze(1)
        kw = dict(dtype=h_out.dtype, device=g.weight.device)
        self.lowp = g.weight.dtype != h_out.dtype  # bfloat16 products, float32 nodes (precision="bf16")
        self.f32 = self.lowp and f32_products(h_out)  # those products written in float32 by the GEMM (CUDA)
        self.baddbmm, self.bmm = gemm.functions(h_out)  # cuBLAS, or a Triton GEMM where faster (CUDA)
        K, I, O = self.K, kind.in_features, kind.out_features
        self.s = h_in if self.identity else torch.empty(K, B, I, **kw)  # phi(h_in)
        # phi'(h_in) of gelu-like activations needs h_in itself, which the fused value step moves.
        back = self.free_input
        self.x = torch.empty(K, B, I, **kw) if back and self.act.needs_input else None
        self.u = torch.empty(K, B, O, **kw)
        self.d = torch.empty(K, B, O, **kw) if self.is_output else e_out  # -dE/du
        self.t = torch.empty(K, B, I, **kw) if back else None
        # phi, the error with the value step, and the back-projection's elementwise part, one pass each (the C
        # kernel on CPUs, Triton on GPUs, checked once against torch); None: torch ops.
        self.kernel = None
        if h_in.is_contiguous() and self.d.is_contiguous():
            args = (self.act, h_in, self.s, self.x, self.u, h_out, self.d, self.t, self.prec)
            if native.usable(self.act, self.u):
                self.kernel = native.ResidualKernel(*args)
            elif errorpass.usable(self.act, self.u) and (kernel := errorpass.ResidualKernel(*args)) \
                    .agrees(f"residual layers {self.first}..{self.first + K - 1}"):
                self.kernel = kernel
        # The feed-forward chain of K >= 2 square layers as one kernel (GPU; checked on first use).
        self.fused_chain = None if self.is_output or not (h_in.is_contiguous() and h_out.is_contiguous()) \
            or self.lowp else chain.usable(self.u, self.act, K, I, O) or None

    def _predict(self, h: Tensor, s: Tensor, x: Tensor | None, w: Tensor, b: Tensor | None, u: Tensor) -> None:
        """u = skip * h + a (phi(h) @ w + b) for one layer ([B, I] operands) or all K ([K, B, I])."""
        mm = self.baddbmm if h.dim() == 3 else torch.addmm
        if self.kernel is not None and h is self.h_in:  # all K layers at once
            if not self.identity or x is not None:
                self.kernel.activate()
        else:
            if not self.identity:
                self.act.forward(h, out=s)
            if x is not None:
                x.copy_(h)
        if self.lowp:  # a (phi(h) @ w + b) with the product on bfloat16 operands, the sums in the nodes' dtype
            product_into(u, s, w, self.f32, b, self.a)
            if self.skip:
                u.add_(h)
        elif b is not None:
            mm(b, s, w, beta=self.a, alpha=self.a, out=u)
            if self.skip:
                u.add_(h)
        elif self.skip:
            mm(h, s, w, alpha=self.a, out=u)
        else:
            mm(u, s, w, beta=0.0, alpha=self.a, out=u)

    def feedforward(self, rows: slice | None, init: str) -> None:
        sel = slice(None) if rows is None else rows
        if init == "deeppcr" and self.K > 1 and not self.is_output:
            self._chain_deeppcr(sel)
            return
        if self.fused_chain and self._chain_agrees():
            chain.residual_chain(self.h_in[0], self.w_KIO, self.g.bias, None if self.identity else self.s, self.x,
                                 self.u, self.h_out, self.act, self.a, self.skip, rows)
            self.cached = True
            return
        h = self.h_in[0][sel]
        for k in range(self.K):
            s = h if self.identity else self.s[k][sel]
            x = None if self.x is None else self.x[k][sel]
            b = None if self.b_K1O is None else self.b_K1O[k]
            u = self.u[k][sel]
            self._predict(h, s, x, self.w_KIO[k], b, u)
            h = u
        if not self.is_output or self.free_output:
            self.h_out[:, sel].copy_(self.u[:, sel])
        self.cached = True

    def _chain_agrees(self) -> bool:
        """The fused chain against the layers' own forward on a probe, once (bookkeeping of the first step)."""
        if self.fused_chain is True:
            with torch.no_grad():
                h0 = torch.randn(self.h_in.shape[1:], generator=torch.Generator(self.u.device).manual_seed(0),
                                 device=self.u.device).to(self.u.dtype)

                def run():
                    s = None if self.identity else torch.empty_like(self.s)
                    x = None if self.x is None else torch.empty_like(self.x)
                    u, h = torch.empty_like(self.u), torch.empty_like(self.u)
                    chain.residual_chain(h0, self.w_KIO, self.g.bias, s, x, u, h, self.act, self.a, self.skip)
                    return [u, h]

                def reference():
                    want, v = [], h0
                    for k in range(self.K):
                        want.append(self.g.layer(k, v))
                        v = want[-1]
                    return [torch.stack(want)] * 2

                ok = chain.checked(run, reference, f"residual layers {self.first}..{self.first + self.K - 1}")
            self.fused_chain = "yes" if ok else None
        return self.fused_chain is not None

    def _chain_deeppcr(self, sel: slice) -> None:
        """The K chained predictions by Newton + parallel cyclic reduction; s, u then from one GEMM."""
        from ..deeppcr import solve_fn

        w, b, a, act, skip = self.w_KIO.to(self.u.dtype), self.g.bias, self.a, self.act, self.skip

        def residual_and_jacobian(x_LBD: Tensor) -> tuple[Tensor, Tensor]:
            h = x_LBD[:-1]
            s = act(h)
            u = torch.baddbmm(h if skip else torch.zeros_like(h), s, w, alpha=a)
            if b is not None:
                u = u + a * b.unsqueeze(1)
            fprime = act.grad(torch.ones_like(h), h, s, out=torch.empty_like(h))
            M = a * fprime.unsqueeze(-1) * w.unsqueeze(1)  # [L, B, I, O]: du/dh in the row convention
            if skip:
                M = M + torch.eye(w.shape[1], dtype=w.dtype, device=w.device)
            return u - x_LBD[1:], M

        states = solve_fn(residual_and_jacobian, self.K, self.h_in[0][sel]).states
        self.h_out[:, sel].copy_(states[1:])
        x = None if self.x is None else self.x[:, sel]
        self._predict(self.h_in[:, sel], self.s[:, sel], x, self.w_KIO, self.b_K1O, self.u[:, sel])
        self.cached = True

    def predict(self) -> None:
        self._predict(self.h_in, self.s, self.x, self.w_KIO, self.b_K1O, self.u)
        self.cached = True

    def errors(self, with_signal: bool, step_lr: float | None, hold_last: bool = False) -> None:
        if not self.cached:
            self.predict()
        if self.is_output:
            self.energy.signal(self.u[0], self.h_out[0], self.d[0])
            return
        stepped = self.K - 1 if hold_last else self.K
        if self.kernel is not None:
            self.kernel.errors(step_lr, stepped)
            return
        self.weigh(torch.sub(self.h_out, self.u, out=self.e_out))
        if step_lr is not None:
            self.h_out[:stepped].add_(self.e_out[:stepped], alpha=-step_lr)

    def backproject(self, target: Tensor, beta: float, alpha: float) -> None:
        if self.lowp:
            product_into(self.t, self.d, self.w_t.get(), self.f32)
            t = self.t
        else:
            t = self.bmm(self.d, self.w_t.get(), out=self.t)  # d @ W^T
        if self.kernel is not None:
            self.kernel.backproject(target, self.d if self.skip else None, beta, alpha * self.a, alpha)
            return
        if not self.identity:
            self.act.grad(t, self.x, self.s, out=t)  # * phi'(h_in)
        accumulate(target, t, beta, alpha * self.a)
        if self.skip:
            target.add_(self.d, alpha=alpha)

    def weight_grads(self, scale: float) -> None:
        g = self.g
        w = g.weight
        if self.lowp:
            torch.mul(low(self.s.transpose(1, 2), self.d.to(w.dtype), w.dtype), scale * self.a, out=w.grad)
        else:
            self.baddbmm(w.grad, self.s.transpose(1, 2), self.d, beta=0.0, alpha=scale * self.a, out=w.grad)
        if g.bias is not None:
            torch.sum(self.d, dim=1, out=g.bias.grad).mul_(scale * self.a)

    def weights_changed(self) -> None:
        self.cached = False
        self.w_t.invalidate()
