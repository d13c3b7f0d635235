"""The dense kind's error pass as ONE Triton kernel on CUDA devices: the GPU twin of the CPU kernel
(pcdist/engine/native.py ``Kernel``, same buffers, same ``run``).

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

__all__ = ["usable", "Kernel"]

BLOCK = 1024


def usable(act, like: Tensor) -> bool:
    """True if the kernel can run this group: float32 nodes on a CUDA device (or any device under the Triton
    interpreter), an activation whose f' it has (as the CPU kernel: not leaky_relu with a negative slope or
    elu with a negative alpha), fewer than 2^31 elements (its int32 offsets), Triton importable, PCDIST_TRITON
    not 0."""
    from .native import act_code

    return (act is not None and act_code(act) is not None and like.dtype == torch.float32
            and like.numel() < 2**31 and chain.triton_allowed(like))


class Kernel:
    """The fused pass bound to one group's buffers: ``au`` [K, B, O] holds a = h_in @ w without the bias
    (``run(fresh=True)``: u = f(a + b) computed on the fly, not stored) or else what f' is computed from
    (u, or a + b where f' needs it), ``u`` the stored u, ``h`` the predicted nodes, ``e`` pi (h - u), ``d``
    e f'(a); ``prec`` the K precisions pi or None. See native.Kernel, whose ``run`` this one's matches."""

    def __init__(self, act, au: Tensor, h: Tensor, e: Tensor, d: Tensor, bias: Tensor, u: Tensor | None = None,
                 prec: Tensor | None = None):
        u = au if u is None else u
        for name, t in (("a", au), ("u", u), ("h", h), ("e", e), ("d", d)):
            if not t.is_contiguous() or t.shape != au.shape or t.dtype != au.dtype:
                raise ValueError(f"triton error kernel: buffer {name} must be contiguous with shape {list(au.shape)}")
        self.act, self.au, self.u, self.h, self.e, self.d = act, au, u, h, e, d
        self.bias, self.prec = bias.contiguous(), prec
        self.K, self.B, self.O = au.shape

    def run(self, fresh: bool, with_d: bool, lr: float | None = None, stepped: int | None = None) -> None:
        if lr is not None and stepped is not None and stepped < self.K:
            self._call(fresh, with_d, lr, 0, stepped)
            self._call(fresh, with_d, None, stepped, self.K)
        else:
            self._call(fresh, with_d, lr, 0, self.K)

    def _call(self, fresh: bool, with_d: bool, lr: float | None, k0: int, k1: int, bufs=None) -> None:
        """The pass over layers [k0, k1) (``bufs``: other buffers of the same shapes, for the probe)."""
        if k1 <= k0:
            return
        au, u, h, e, d, bias, prec = bufs or (self.au, self.u, self.h, self.e, self.d, self.bias, self.prec)
        n = (k1 - k0) * self.B * self.O
        chain._triton().dense_errors[(-(-n // BLOCK),)](
            au[k0:k1], u[k0:k1], h[k0:k1], e[k0:k1], d[k0:k1], bias[k0:k1], h if prec is None else prec[k0:k1],
            n, self.B, self.O, 0.0 if lr is None else float(lr), **chain.act_args(self.act), FRESH=fresh,
            HAS_D=with_d, UPDATE=lr is not None, HAS_P=prec is not None, ACCURATE=not chain.interpreted(),
            BLOCK=BLOCK)

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
