"""DeepPCR: a chain x_l = f_l(x_{l-1}), l = 1..L, solved in O(log L) parallel steps.

Shape letters: L layers, B batch, I input width, O output width (I = O = D for a chain).

Danieli et al. (NeurIPS 2023). Newton's method on the whole chain at once: at the
current guess, the correction obeys the linear recurrence

    d_l = d_{l-1} @ M_l + r_l,   d_0 = 0,   r_l = f_l(x_{l-1}) - x_l,

with M_l the per-sample Jacobian of f_l (row-vector convention: M_l = W_l * f'(a_l)).
That recurrence is solved by parallel cyclic reduction (a Kogge-Stone scan): for
s = 1, 2, 4, ..., in parallel over l,

    r_l <- r_l + r_{l-s} @ M_l,   M_l <- M_{l-s} @ M_l,

ceil(log2 L) batched matmul rounds and no loop over layers. A linear chain (the
backward pass) needs one scan; a nonlinear one a few Newton iterations. The work is
O(B D^3 L log L) against O(B D^2 L) for the loop, so it pays off for deep, narrow
chains where the loop's per-layer launch overhead dominates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .activations import Activation, activation_from_module

__all__ = ["ChainResult", "NotConverged", "scan_linear", "solve", "solve_fn", "solve_linear", "chain_vjp",
           "stack_chain"]


class NotConverged(RuntimeError):
    """Newton's method did not reach the tolerance within max_iters."""


@dataclass
class ChainResult:
    states: Tensor  # [L + 1, B, D]: x_0 (the input) .. x_L
    iterations: int  # Newton iterations taken
    residual: float  # max |f_l(x_{l-1}) - x_l| at the returned states
    converged: bool


def scan_linear(M_LBIO: Tensor, r_LBO: Tensor) -> Tensor:
    """All y_l of y_l = y_{l-1} @ M_l + r_l (y_0 = 0, l = 1..L) by parallel cyclic reduction.

    M_LBIO may be [L, B, I, O] (per sample) or [L, 1, I, O] (shared); r_LBO is [L, B, O].
    """
    L = r_LBO.shape[0]
    r, M, s = r_LBO, M_LBIO, 1
    while s < L:
        # Element l now covers layers (l - 2s, l]: compose it with the segment that ends at l - s.
        r = torch.cat([r[:s], torch.matmul(r[:-s].unsqueeze(-2), M[s:]).squeeze(-2) + r[s:]])
        if 2 * s < L:  # the products are only needed by later rounds
            M = torch.cat([M[:s], torch.matmul(M[:-s], M[s:])])
        s *= 2
    return r


def stack_chain(layers) -> tuple[Tensor, Tensor, Activation]:
    """(w_LIO, b_LO, activation) of an nn.Sequential of Linear + one elementwise activation per block,
    all of one width and one activation; or pass such a tuple through."""
    if isinstance(layers, tuple):
        return layers
    mods = list(layers)
    linears = [m for m in mods if isinstance(m, nn.Linear)]
    acts = [activation_from_module(m) for m in mods if not isinstance(m, nn.Linear)]
    order = mods[::2] if acts else mods  # (Tanh, Linear or Linear, Linear, Tanh, Tanh was solved as Linear, Tanh, ...)
    if not linears or len(acts) not in (len(linears), 0) or len(set(acts)) > 1 or \
            not all(isinstance(m, nn.Linear) for m in order):
        raise ValueError("a DeepPCR chain is Linear, activation, Linear, activation, ... with one activation, in "
                         "that order")
    D = linears[0].in_features
    if any(l.in_features != D or l.out_features != D or l.bias is None for l in linears):
        raise ValueError(f"every Linear of a DeepPCR chain must map {D} -> {D} features with a bias")
    w = torch.stack([l.weight.detach().T for l in linears])
    b = torch.stack([l.bias.detach() for l in linears])
    return w, b, acts[0] if acts else Activation("identity")


def _residual_and_jacobian(w_LIO, b_LO, act, x_LBD: Tensor) -> tuple[Tensor, Tensor]:
    """r_l = f_l(x_{l-1}) - x_l and M_l = W_l * f'(a_l) for all l at once (x_LBD holds x_0..x_L)."""
    a = torch.baddbmm(b_LO.unsqueeze(1), x_LBD[:-1], w_LIO)
    u = act(a)
    fprime = act.grad(torch.ones_like(a), a, u, out=torch.empty_like(a))
    M = w_LIO.unsqueeze(1) * fprime.unsqueeze(-2)  # [L, B, I, O]
    return u - x_LBD[1:], M


def _generic_chain(blocks, like: Tensor):
    """Residual-and-Jacobian function of L identical D -> D modules, through torch.func.

    Every block's output and per-sample Jacobian are computed for all L layers and B
    samples at once (vmap over stacked parameters, jacrev per sample).
    """
    import copy

    from torch.func import functional_call, jacrev, stack_module_state, vmap

    blocks = list(blocks)
    params, buffers = stack_module_state(blocks)
    params = {k: v.detach().to(like) for k, v in params.items()}
    buffers = {k: v.to(like.device) for k, v in buffers.items()}
    base = copy.deepcopy(blocks[0]).to("meta")

    def f(p, bf, x_D):
        return functional_call(base, (p, bf), (x_D,))

    f_all = vmap(vmap(f, in_dims=(None, None, 0)))
    jac_all = vmap(vmap(jacrev(f, argnums=2), in_dims=(None, None, 0)))

    def residual_and_jacobian(x_LBD: Tensor) -> tuple[Tensor, Tensor]:
        fx = f_all(params, buffers, x_LBD[:-1])
        J = jac_all(params, buffers, x_LBD[:-1])  # [L, B, D_out, D_in]
        return fx - x_LBD[1:], J.transpose(-1, -2)  # row-vector convention: M = J^T

    return residual_and_jacobian, len(blocks)


def _chain(layers, like: Tensor):
    """(residual_and_jacobian, L) for a Linear + activation chain (analytic) or a list of modules (generic)."""
    if isinstance(layers, (list, nn.ModuleList)):
        return _generic_chain(layers, like)
    w, b, act = stack_chain(layers)
    w, b = w.to(like), b.to(like)
    return (lambda x: _residual_and_jacobian(w, b, act, x)), w.shape[0]


def solve(layers, x0: Tensor, max_iters: int | None = None, tol: float | None = None,
          init: Tensor | None = None, raise_on_failure: bool = True) -> ChainResult:
    """All L + 1 states of the chain from the input batch x0 [B, D], by Newton + parallel cyclic reduction.

    ``layers``: an nn.Sequential of Linear + activation blocks of one width, or (w_LIO, b_LO,
    Activation) (analytic Jacobians), or a list / nn.ModuleList of L identical D -> D modules, one
    per step of the chain (Jacobians through torch.func).
    Stops when max |f_l(x_{l-1}) - x_l| <= tol (default: 16 x the dtype epsilon x the input scale);
    after max_iters (default L + 1, the bound for exact arithmetic) it raises NotConverged, or returns
    with converged=False when raise_on_failure is False.
    """
    residual_and_jacobian, L = _chain(layers, x0)
    return solve_fn(residual_and_jacobian, L, x0, max_iters, tol, init, raise_on_failure)


def solve_fn(residual_and_jacobian, L: int, x0: Tensor, max_iters: int | None = None, tol: float | None = None,
             init: Tensor | None = None, raise_on_failure: bool = True, max_bytes: float = 2 ** 30) -> ChainResult:
    """``solve`` for a chain given by its residual-and-Jacobian function: x_LBD [L + 1, B, D] ->
    (r [L, B, D] with r_l = f_l(x_{l-1}) - x_l, M [L, B, D, D] with M_l = df_l/dx in the row-vector
    convention, d_l = d_{l-1} @ M_l). Layer kinds with analytic Jacobians (pcdist.layers) use it.

    The per-sample Jacobians and their products hold about 4 x L x B x D^2 numbers at once (at 512
    layers of width 128 and batch 64: 2.1 GB each in float32, 4.3 GB in float64), so a batch whose
    Jacobians would pass ``max_bytes`` is solved in chunks of rows (samples are independent)."""
    D = x0.shape[-1] if x0.dim() > 1 else 1
    rows = max(1, int(max_bytes // max(1, 4 * L * D * D * x0.element_size())))
    if x0.dim() > 1 and rows < x0.shape[0]:
        parts = [solve_fn(residual_and_jacobian, L, x0[i : i + rows], max_iters, tol,
                          None if init is None else init[:, i : i + rows], raise_on_failure, max_bytes)
                 for i in range(0, x0.shape[0], rows)]
        return ChainResult(torch.cat([p.states for p in parts], dim=1), max(p.iterations for p in parts),
                           max(p.residual for p in parts), all(p.converged for p in parts))
    max_iters = L + 1 if max_iters is None else max_iters
    x = torch.empty(L + 1, *x0.shape, dtype=x0.dtype, device=x0.device)
    x[0] = x0
    x[1:] = 0.0 if init is None else init
    scale = 1.0 + float(x0.abs().max())
    tol = 16 * torch.finfo(x0.dtype).eps * scale if tol is None else tol
    with torch.no_grad():
        for it in range(max_iters + 1):
            r, M = residual_and_jacobian(x)
            res = float(r.abs().max())
            if res <= tol or not math.isfinite(res) or it == max_iters:
                break
            x[1:] += scan_linear(M, r)
    converged = res <= tol
    if not converged and raise_on_failure:
        raise NotConverged(f"DeepPCR: residual {res:.3g} > tol {tol:.3g} after {it} Newton iterations "
                           f"(L={L}); raise max_iters or use the sequential pass")
    return ChainResult(x, it, res, converged)


def solve_linear(M_LBIO: Tensor, r_LBO: Tensor) -> Tensor:
    """The linear chain y_l = y_{l-1} @ M_l + r_l (y_0 = 0) in a single reduction; returns y_1..y_L."""
    if M_LBIO.dim() != 4 or r_LBO.dim() != 3 or M_LBIO.shape[0] != r_LBO.shape[0]:
        raise ValueError(f"expected M [L, B, I, O] and r [L, B, O], got {list(M_LBIO.shape)} and {list(r_LBO.shape)}")
    return scan_linear(M_LBIO, r_LBO)


def chain_vjp(layers, states: Tensor, grad_out: Tensor) -> Tensor:
    """The backward pass of the chain in one reduction: dLoss/dx_l for l = 0..L given dLoss/dx_L.

    g_{l-1} = (g_l * f'(a_l)) @ W_l^T, as a linear chain run from the output to the input.
    """
    w, b, act = stack_chain(layers)
    w, b = w.to(states), b.to(states)
    a = torch.baddbmm(b.unsqueeze(1), states[:-1], w)
    fprime = act.grad(torch.ones_like(a), a, act(a), out=torch.empty_like(a))
    # Reversed chain, k = 1..L over layers l = L + 1 - k: g_{l-1} = g_l @ N_l with N_l = diag(f'(a_l)) W_l^T,
    # started by r_1 = g_L @ N_L (no other inputs).
    N = (fprime.unsqueeze(-1) * w.transpose(1, 2).unsqueeze(1)).flip(0)  # [L, B, O, I]
    r = torch.zeros(w.shape[0], *grad_out.shape, dtype=grad_out.dtype, device=grad_out.device)
    r[0] = torch.matmul(grad_out.unsqueeze(-2), N[0]).squeeze(-2)
    ys = scan_linear(N, r)  # ys[k - 1] = g_{L - k}
    return torch.cat([ys.flip(0), grad_out.unsqueeze(0)])
