"""Energies of the output layer: se, ce, bce, zero, or any callable.

Shape letters: B batch, O output width (an output node of any shape is read flattened).

The output layer's energy E_out(u_L, h_L) compares the prediction u_L with the top node h_L
(the clamped target, or a free node). With the layer's precision pi_L the network's energy
holds pi_L * E_out, and the engine needs three things of it, per sample:

    signal      d = -pi_L dE_out/du_L      what the output layer back-projects and learns from
    value       pi_L * E_out               summed over the batch (the logged energy)
    value_grad  pi_L dE_out/dh_L           the gradient of a free top node

    se    0.5 ||h - u||^2                  d = h - u                  dE/dh = h - u
    ce    -sum_k h_k log_softmax(u)_k      d = h - softmax(u) sum(h)  (no minimum in h)
    bce   sum_k softplus(u_k) - h_k u_k    d = h - sigmoid(u)         (linear in h)
          (Bernoulli with logits u: images in [0, 1])
    zero  0                                d = 0                      0   (PCX's zero_energy)
    a callable ``energy(u, target) -> [B]`` per-sample energies; d and dE/dh by autograd.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ENERGIES", "FREE_TOP_ENERGIES", "OutputEnergy", "check_energy", "energy_name"]

ENERGIES = ("se", "ce", "bce", "zero")
FREE_TOP_ENERGIES = ("se", "zero")
"""Named energies with a minimum in h_L, so that a free top node can follow its gradient (and callables)."""


def check_energy(energy):
    """The energy (a name of ENERGIES or a callable), or a ValueError listing the allowed ones."""
    if callable(energy) or energy in ENERGIES:
        return energy
    raise ValueError(f"unknown energy {energy!r}; allowed: 'se' (squared error), 'ce' (cross-entropy), 'bce' "
                     "(Bernoulli with logits), 'zero' (no output energy) or a callable energy(u, target) -> [B]")


def energy_name(energy) -> str:
    """A printable name: the energy's own, or the callable's."""
    return energy if isinstance(energy, str) else getattr(energy, "__name__", type(energy).__name__)


class OutputEnergy:
    """The output energy of one bound output group, scaled by its precision ``prec`` (a one-element view
    of the Stage's precisions, None for pi_L = 1: no extra pass)."""

    def __init__(self, energy, prec: Tensor | None = None):
        self.energy = check_energy(energy)
        self.name = energy if isinstance(energy, str) else "callable"
        self.prec = prec

    def check_free_top(self) -> None:
        """Refuse a free top node under an energy without a minimum in it (ce, bce)."""
        if self.name not in FREE_TOP_ENERGIES and self.name != "callable":
            raise ValueError(f"the output energy {self.name!r} has no minimum in the top node, so h_L cannot be "
                             f"free; use one of {', '.join(FREE_TOP_ENERGIES)} or a callable")

    def _scale(self, t: Tensor) -> Tensor:
        return t if self.prec is None else t.mul_(self.prec)

    def signal(self, u_BO: Tensor, y_BO: Tensor, out_BO: Tensor) -> Tensor:
        """out = -pi dE_out/du."""
        n = self.name
        if n == "se":
            torch.sub(y_BO, u_BO, out=out_BO)
        elif n == "ce":
            torch.softmax(u_BO, dim=-1, out=out_BO)
            out_BO.mul_(y_BO.sum(-1, keepdim=True))
            torch.sub(y_BO, out_BO, out=out_BO)
        elif n == "bce":
            torch.sigmoid(u_BO, out=out_BO)
            torch.sub(y_BO, out_BO, out=out_BO)
        elif n == "zero":
            return out_BO.zero_()
        else:
            out_BO.copy_(self._autograd(u_BO, y_BO, 0)).neg_()
        return self._scale(out_BO)

    def scale_signal(self, d_BO: Tensor) -> Tensor:
        """d *= pi: for a kind that computed the unscaled signal itself (the dense kind's fused se GEMM)."""
        return self._scale(d_BO)

    def value(self, u_BO: Tensor, y_BO: Tensor, d_BO: Tensor) -> Tensor:
        """Batch SUM of pi E_out (se read from the signal d = pi (y - u): 0.5 ||d||^2 / pi), in float32 at least."""
        if u_BO.dtype.itemsize < 4:  # bfloat16 nodes: the energy sums in float32
            u_BO, y_BO, d_BO = u_BO.float(), y_BO.float(), d_BO.float()
        n = self.name
        if n == "se":
            sq = 0.5 * d_BO.square().sum()
            if self.prec is None:
                return sq
            return torch.where(self.prec > 0, sq / self.prec.clamp_min(torch.finfo(d_BO.dtype).tiny), 0.0).sum()
        if n == "ce":
            e = -(y_BO * torch.log_softmax(u_BO, dim=-1)).sum()
        elif n == "bce":
            e = (F.softplus(u_BO) - y_BO * u_BO).sum()
        elif n == "zero":
            return u_BO.new_zeros(())
        else:
            e = self._call(u_BO, y_BO).sum()
        return e if self.prec is None else (e * self.prec).sum()

    def value_grad(self, u_BO: Tensor, y_BO: Tensor, d_BO: Tensor, out_BO: Tensor) -> Tensor:
        """out = pi dE_out/dh_L, the gradient of a free top node (se: the signal itself)."""
        n = self.name
        if n == "se":
            return out_BO.copy_(d_BO)
        if n == "zero":
            return out_BO.zero_()
        self.check_free_top()
        return self._scale(out_BO.copy_(self._autograd(u_BO, y_BO, 1)))

    def _call(self, u_BO: Tensor, y_BO: Tensor) -> Tensor:
        e = self.energy(u_BO, y_BO)
        if not isinstance(e, Tensor) or tuple(e.shape) != (u_BO.shape[0],):
            got = list(e.shape) if isinstance(e, Tensor) else type(e).__name__
            raise ValueError(f"the energy callable {energy_name(self.energy)} must return per-sample energies of "
                             f"shape [{u_BO.shape[0]}], got {got}")
        return e

    def _autograd(self, u_BO: Tensor, y_BO: Tensor, which: int) -> Tensor:
        """dE/du (which 0) or dE/dtarget (which 1) of the callable, summed over the batch."""
        with torch.enable_grad():
            args = [u_BO.detach(), y_BO.detach()]
            args[which].requires_grad_(True)
            (g,) = torch.autograd.grad(self._call(*args).sum(), args[which], allow_unused=True)
        return torch.zeros_like(args[which]) if g is None else g
