"""The dense kind's error pass as ONE Triton kernel on CUDA devices: the GPU twin of the CPU kernel
(pcdist/engine/native.py ``Kernel``, same buffers, same ``run``); the residual kind's three passes
(``ResidualKernel``, the twin of native.ResidualKernel) and the conv kind's two (``ConvKernel``: bias,
activation and pooling; the errors, the value step and the signal back through the pooling) likewise.

Per inference step a hidden dense group computes, over its [K, B, O] buffers,

    u = f(a + b);  e = pi (h - u);  d = e f'(a + b);  h <- h - x_lr e   (or e kept, for the boundary message)

which torch runs as five to six elementwise kernels (the bias broadcast, f, h - u, pi e, f', the value step),
each a launch and a pass over memory; on a GPU, replayed as a CUDA graph, those small kernels are most of a
shallow or narrow step, and in a wide one their memory passes are most of what is not matmul (docs/gpu.md).
Here they are one kernel, four streams (read a and h, write d and h). The derivatives are the CPU kernel's
formulas (from u where u determines f', from a + b where it does not: ``Activation.needs_input``).

Before a group uses it, it is run once on a probe of the group's own shape against the torch ops (``agrees``):
a kernel that fails to build or disagrees is not used (one warning), so the worst case is the torch ops'
speed. ``PCDIST_TRITON=0`` turns it off (with the fused feed-forward chain, pcdist/engine/chain.py). Under
``TRITON_INTERPRET=1`` the same kernel runs on a CPU (tests/test_chain.py, tests/chain_checks.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import chain
from .native import ErrorPass, act_code
from .nodes import is_channels_last, stacked_zeros

__all__ = ["usable", "conv_usable", "Kernel", "ResidualKernel", "ConvKernel"]

BLOCK = 1024


def usable(act, like: Tensor) -> bool:
    """True if the kernel can run this group: float32 nodes on a CUDA device (or any device under the Triton
    interpreter), an activation whose f' it has (as the CPU kernel: not leaky_relu with a negative slope or
    elu with a negative alpha), at most chain.MAX_ELEMENTS elements (its int32 offsets), Triton importable,
    PCDIST_TRITON not 0."""
    return (act is not None and act_code(act) is not None and like.dtype == torch.float32
            and like.numel() <= chain.MAX_ELEMENTS and chain.triton_allowed(like))


def _launch(name: str, n: int, *args, **consts) -> None:
    """The elementwise kernel ``name`` over n elements, BLOCK a program (nothing for n = 0)."""
    if n:
        chain.launch(name, (-(-n // BLOCK),), *args, BLOCK=BLOCK, **consts)


def conv_usable(act, pool: str | None, window: list[int], stride: list[int], padding: list[int], conv_size: int,
                like: Tensor, *bufs: Tensor) -> bool:
    """True if ConvKernel can run a conv group: ``usable``'s conditions on its nodes ``like``, fewer than 2^31
    elements in its convolutions' output too (``conv_size``), pooling (if any) in windows that do not overlap and
    have no padding (the conv layers' 2 x 2 / 2: a window's signal then goes to its own elements only) of at most
    127 elements (the window offset is kept in an int8), and the group's nodes ``like`` and buffers ``bufs`` dense
    in one layout, row-major or channels-last (a layer-parallel boundary's may be neither)."""
    tiles = pool is None or (list(stride) == list(window) and not any(padding) and window[0] * window[1] < 128)
    cl = is_channels_last(like)
    dense = all(is_channels_last(b) == cl and (cl or b.is_contiguous()) for b in (like, *bufs))
    return tiles and conv_size <= chain.MAX_ELEMENTS and usable(act, like) and dense


class Kernel(ErrorPass):
    """The fused pass of native.ErrorPass (its buffers, checks and ``run``) as one Triton kernel."""

    who = "triton error kernel"

    def _call(self, fresh: bool, with_d: bool, lr: float | None, k0: int, k1: int, bufs=None) -> None:
        """The pass over layers [k0, k1) (``bufs``: other buffers of the same shapes, for the probe)."""
        if k1 <= k0:
            return
        au, u, h, e, d, bias, prec = bufs or (self.au, self.u, self.h, self.e, self.d, self.bias, self.prec)
        n = (k1 - k0) * self.B * self.O
        chain.launch("dense_errors", (-(-n // BLOCK),), au[k0:k1], u[k0:k1], h[k0:k1], e[k0:k1], d[k0:k1],
                     bias[k0:k1], h if prec is None else prec[k0:k1], n, self.B, self.O,
                     0.0 if lr is None else float(lr), **chain.act_args(self.act), FRESH=fresh, HAS_D=with_d,
                     UPDATE=lr is not None, HAS_P=prec is not None, BLOCK=BLOCK)

    def agrees(self, what: str) -> bool:
        """The kernel on a probe of this group's shape (two layers at most, random values) against the torch ops,
        fresh with d and stored with the value step; False (and one warning) where it fails or disagrees."""
        k = min(self.K, 2)
        g = torch.Generator(device=self.au.device).manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, generator=g, device=self.au.device, dtype=self.au.dtype)

        a, h, bias = rand(k, self.B, self.O), rand(k, self.B, self.O), 0.1 * rand(k, self.O)
        prec = None if self.prec is None else 0.5 + rand(k).abs()
        pi = 1.0 if prec is None else prec.view(-1, 1, 1)
        x = a + bias.unsqueeze(1)
        u = self.act.forward(x)
        e_want = pi * (h - u)
        d_want = self.act.grad(e_want, x, u, out=torch.empty_like(x))
        keep = x if self.act.needs_input else u  # what a group whose u is stored keeps in au

        def run():
            e, d, h1, h2 = torch.empty_like(a), torch.empty_like(a), h.clone(), h.clone()
            self._call(True, True, None, 0, k, (a, a, h1, e, d, bias, prec))
            d2 = torch.empty_like(a)
            self._call(False, True, 0.25, 0, k, (keep.clone(), u, h2, torch.empty_like(a), d2, bias, prec))
            return [e, d, h1, d2, h2]

        return chain.checked(run, lambda: [e_want, d_want, h, d_want, h - 0.25 * e_want], what,
                             ("error kernel", "torch ops"))


class ResidualKernel:
    """The residual kind's elementwise passes as Triton kernels: the GPU twin of native.ResidualKernel (same
    buffers, same ``activate``, ``errors`` and ``backproject``; see there), one launch each where torch ops take
    two to four."""

    def __init__(self, act, h_in: Tensor, s: Tensor, x: Tensor | None, u: Tensor, h_out: Tensor, e: Tensor,
                 t: Tensor | None, prec: Tensor | None = None):
        like = [b for b in (h_in, s, x, u, h_out, e, t, prec) if b is not None]
        if any(not b.is_contiguous() or b.dtype != u.dtype for b in like):
            raise ValueError("triton residual kernel: every buffer must be contiguous and of one dtype")
        self.act, self.h_in, self.s, self.x, self.u, self.h_out, self.e, self.t, self.prec = \
            act, h_in, s, x, u, h_out, e, t, prec
        self.per_layer = u[0].numel()

    def _act(self) -> dict:
        args = chain.act_args(self.act)
        args["bt"] = args.pop("beta")  # the kernel's beta is the back-projection's
        return args

    def activate(self, bufs=None) -> None:
        src, s, x = bufs or (self.h_in, self.s, self.x)
        _launch("res_act", src.numel(), src, s, s if x is None else x, src.numel(), **chain.act_args(self.act),
                     STORE_X=x is not None)

    def errors(self, lr: float | None, stepped: int, bufs=None) -> None:
        u, h, e, prec = bufs or (self.u, self.h_out, self.e, self.prec)
        _launch("res_errors", u.numel(), u, h, e, h if prec is None else prec, u.numel(),
                     stepped * self.per_layer, self.per_layer, 0.0 if lr is None else float(lr),
                     HAS_P=prec is not None, UPDATE=lr is not None)

    def backproject(self, target: Tensor, skip: Tensor | None, beta: float, alpha_a: float, alpha_e: float,
                    bufs=None) -> None:
        """target = beta * target + alpha_a * t * phi'(h_in) (+ alpha_e * skip, the skip term's errors)."""
        t, s, x = bufs or (self.t, self.s, self.x)
        if target.numel() != t.numel() or (skip is not None and skip.numel() != t.numel()):
            raise ValueError("triton residual kernel: target and skip must have the back-projection's shape")
        _launch("res_backproject", t.numel(), s, s if x is None else x, t, t if skip is None else skip, target,
                     t.numel(), float(beta), float(alpha_a), float(alpha_e), **self._act(), HAS_X=x is not None,
                     HAS_E=skip is not None, HAS_BETA=beta != 0.0)

    def agrees(self, what: str) -> bool:
        """The three passes on a probe of this group's shape (two layers at most) against the torch ops."""
        k = min(self.u.shape[0], 2)
        g = torch.Generator(device=self.u.device).manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, generator=g, device=self.u.device, dtype=self.u.dtype)

        shape_in, shape_out = (k, *self.s.shape[1:]), (k, *self.u.shape[1:])
        h_in, t, tgt = rand(*shape_in), rand(*shape_in), rand(*shape_in)
        u, h = rand(*shape_out), rand(*shape_out)
        e_skip = rand(*shape_in) if shape_in == shape_out else None
        prec = None if self.prec is None else 0.5 + rand(k).abs()
        keep_x = self.x is not None
        s_want = self.act.forward(h_in)
        e_want = (1.0 if prec is None else prec.view(-1, 1, 1)) * (h - u)
        stepped = k - 1
        bp = self.act.grad(t, h_in, s_want, out=torch.empty_like(t))
        bp_want = 0.5 * tgt + 0.3 * bp + (0.0 if e_skip is None else 0.7 * e_skip)

        def run():
            s, x = torch.empty_like(h_in), torch.empty_like(h_in) if keep_x else None
            self.activate((h_in, s, x))
            h1, e = h.clone(), torch.empty_like(h)
            self.errors(0.25, stepped, (u, h1, e, prec))
            out = tgt.clone()
            self.backproject(out, e_skip, 0.5, 0.3, 0.7, (t, s, x))
            return [s, *([x] if keep_x else []), e, h1, out]

        def want():
            h1 = h.clone()
            h1[:stepped] -= 0.25 * e_want[:stepped]
            return [s_want, *([h_in] if keep_x else []), e_want, h1, bp_want]

        return chain.checked(run, want, what, ("residual kernel", "torch ops"))


class ConvKernel:
    """The conv kind's elementwise passes as two Triton kernels (pcdist/engine/layers/conv.py; on a CPU torch
    ops run them, there being no C kernel for conv layers). Per layer and inference step torch runs the bias add
    (a pass of its own after cuDNN's convolution), f, the pooling, and then h - u, the weighting, the pooling's
    backward (a fill and a scatter), f' and the value step: seven to nine kernels, and over the images of a conv
    net, as wide as the convolution's output, most of a step's memory traffic outside the convolutions. Here
    ``activate`` (bias, f and pooling, from the convolution's output: one pass, one launch a layer) and
    ``errors`` (e, the value step and the signal d at the convolution's output: one launch a group). The pooling
    windows do not overlap (``conv_usable``), so ``activate`` keeps each window's largest element's offset in
    an int8 (torch's max pooling keeps an int64 index), and ``errors`` writes d over each window, 0 off the
    largest element: elements in no window (the border in floor mode) are never written (d starts at 0).

    ``a`` holds the pre-activation x = conv + bias (f' is computed from it: f(x) is not stored), ``u`` the
    pooled f(x), ``idx`` the window offsets (max pooling). ``node_cl``: the nodes (u, h, e, idx) are
    channels-last, ``src_cl``: the convolution-sized images (its output, a, d) are (pcdist/engine/nodes.py).
    Checked against the torch ops on a probe of the group's shapes and layouts when it is built (``agrees``)."""

    def __init__(self, act, pool: str | None, window: list[int], node_cl: bool = False, src_cl: bool = False):
        self.act, self.pool, self.window = act, pool, (window if pool else [1, 1])
        self.node_cl, self.src_cl = node_cl, src_cl
        self._pool_code = {None: 0, "max": 1, "avg": 2}[pool]

    def _launch(self, name: str, n: int, *args, **consts) -> None:
        _launch(name, n, *args, **chain.act_args(self.act), POOL=self._pool_code, KH=self.window[0],
                KW=self.window[1], NODE_CL=self.node_cl, SRC_CL=self.src_cl, **consts)

    def activate(self, src: Tensor, bias: Tensor | None, a: Tensor, u: Tensor, idx: Tensor | None) -> None:
        """One layer (or rows of it): a = src + bias (src [N, C, H, W], the convolution without its bias; bias
        [C]), u [N, C, PH, PW] = pool(f(a)), idx the window offset of each max (max pooling)."""
        src = src.contiguous(memory_format=torch.channels_last if self.src_cl else torch.contiguous_format)
        N, C, H, W = src.shape
        self._launch("conv_act_pool", u.numel(), src, src if bias is None else bias, a, u,
                     u if idx is None else idx, u.numel(), C, H, W, u.shape[-2], u.shape[-1], HAS_B=bias is not None)

    def errors(self, a: Tensor, u: Tensor, h: Tensor, e: Tensor, d: Tensor, idx: Tensor | None, prec: Tensor | None,
               lr: float | None, stepped: int, with_d: bool) -> None:
        """Over a group's [K, B, C, PH, PW] nodes: e = pi (h - u); h -= lr e on the first ``stepped`` layers (lr
        given); d [K, B, C, H, W] = pool'(e) f'(a) (``with_d``)."""
        per = u[0].numel()
        self._launch("conv_errors", u.numel(), a, u, h, e, d, u if idx is None else idx, h if prec is None else prec,
                     u.numel(), per, stepped * per, u.shape[-3], a.shape[-2], a.shape[-1], u.shape[-2], u.shape[-1],
                     0.0 if lr is None else float(lr), HAS_D=with_d, UPDATE=lr is not None, HAS_P=prec is not None)

    def agrees(self, a_shape: tuple[int, ...], u_shape: tuple[int, ...], bias: bool, prec: bool, device,
               what: str, src_dtype: torch.dtype = torch.float32) -> bool:
        """Both passes on a probe of a group's shapes (a [K, B, C, H, W], u [K, B, C, PH, PW]; two layers at
        most; the convolution's output in ``src_dtype``, bfloat16 under precision="bf16") against autograd
        through torch's bias add, f and pooling, with the value step on the first layer only; False (and one
        warning) where they fail or disagree."""
        from .layers.conv import pooled

        k = min(a_shape[0], 2)
        a_shape, u_shape = (k, *a_shape[1:]), (k, *u_shape[1:])
        g = torch.Generator(device=device).manual_seed(0)

        def rand(*shape, cl=False):
            t = torch.randn(*shape, generator=g, device=device)
            return stacked_zeros(shape, True, device=device).copy_(t) if cl else t

        def empty(shape, cl, **kw):
            return stacked_zeros(shape, cl, device=device, **kw)

        src, h = rand(*a_shape, cl=self.src_cl).to(src_dtype), rand(*u_shape, cl=self.node_cl)
        b = 0.1 * rand(k, a_shape[2]) if bias else None
        pi = 0.5 + rand(k).abs() if prec else None
        flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731

        def run():
            a, u, e, d = empty(a_shape, self.src_cl), empty(u_shape, self.node_cl), torch.empty_like(h), \
                empty(a_shape, self.src_cl)
            idx = empty(u_shape, self.node_cl, dtype=torch.int8) if self.pool == "max" else None
            for j in range(k):
                self.activate(src[j], None if b is None else b[j], a[j], u[j], None if idx is None else idx[j])
            h1 = h.clone()
            self.errors(a, u, h1, e, d, idx, pi, 0.25, 1, True)
            return [u, e, h1, d]

        def want():
            x = src.float() if b is None else src.float() + b.view(k, 1, -1, 1, 1)
            x = flat(x).requires_grad_(True)
            with torch.enable_grad():
                u = pooled(self.act(x), self.pool, self.window).reshape(u_shape)
                e = (1.0 if pi is None else pi.view(-1, 1, 1, 1, 1)) * (h - u.detach())
                (d,) = torch.autograd.grad(u, x, e)
            h1 = h.clone()
            h1[:1] -= 0.25 * e[:1]
            return [u.detach(), e, h1, d.reshape(a_shape)]

        return chain.checked(run, want, what, ("conv kernel", "torch ops"))
