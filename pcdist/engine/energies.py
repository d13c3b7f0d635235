"""Output energies: small objects in a registry (se, ce, bce, zero, and yours), or any callable.

Shape letters: B batch, O output width (an output node of any shape is read flattened).

The output layer's energy E_out(u_L, h_L) compares the prediction u_L with the top node h_L (the
clamped target, or a free node). With the layer's precision pi_L the network's energy holds
pi_L * E_out; an ``Energy`` gives the engine, per sample:

    signal      d = -dE_out/du_L           what the output layer back-projects and learns from
    value       pi_L * E_out               summed over the batch (the logged energy)
    top_grad    pi_L dE_out/dh_L           the gradient of a free top node
    mean        the top node it expects from u_L (what a prediction at test time reads)

    se    0.5 ||h - u||^2                  d = h - u                  dE/dh = h - u     mean u
    ce    -sum_k h_k log_softmax(u)_k      d = h - softmax(u) sum(h)  (no minimum in h) mean softmax(u)
    bce   sum_k softplus(u_k) - h_k u_k    d = h - sigmoid(u)         (linear in h)     mean sigmoid(u)
          (Bernoulli with logits u: images in [0, 1])
    zero  0                                d = 0                      0                  (PCX's zero_energy)
    a callable ``energy(u, target) -> [B]`` per-sample energies; d and dE/dh by autograd.

``register_energy(MyEnergy())`` adds one by its ``name``: ``PCNetwork(..., energy="my")`` and
``model.energy=my`` then take it, in every layer kind that can be the output. Nothing in pcdist
switches on an energy's name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ENERGIES", "Energy", "OutputEnergy", "register_energy", "energy_of", "check_energy", "energy_name",
           "FREE_TOP_ENERGIES"]


class Energy:
    """An output energy E_out(u, h) per sample (see the module docstring); subclasses set ``name`` and
    override ``signal`` and ``value`` (and ``top_grad`` where h_L may be free, ``mean`` where it is not u)."""

    name = "?"
    free_top = False
    """E_out has a minimum in the top node, so h_L may be free (inferred)."""
    residual = False
    """The signal is h - u (se): the dense kind then computes it as one GEMM on the precomputed h - b."""
    probabilities = False
    """``mean`` gives class probabilities (``python -m pcdist predict`` writes them)."""

    def signal(self, u_BO: Tensor, y_BO: Tensor, out_BO: Tensor) -> Tensor:
        """out = -dE/du (unscaled)."""
        raise NotImplementedError

    def value(self, u_BO: Tensor, y_BO: Tensor, d_BO: Tensor, prec: Tensor | None) -> Tensor:
        """Batch SUM of pi E, given the signal d as the output layer holds it (scaled by pi)."""
        raise NotImplementedError

    def top_grad(self, u_BO: Tensor, y_BO: Tensor, d_BO: Tensor, prec: Tensor | None, out_BO: Tensor) -> Tensor:
        """out = pi dE/dh, the gradient of a free top node (d: the signal scaled by pi)."""
        raise ValueError(_not_free(self.name))

    def mean(self, u: Tensor) -> Tensor:
        """The top node this energy expects from the prediction u."""
        return u

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _not_free(name: str) -> str:
    return (f"the output energy {name!r} has no minimum in the top node, so h_L cannot be free; use one of "
            f"{', '.join(n for n, e in ENERGIES.items() if e.free_top)} or a callable")


def _scaled(e: Tensor, prec: Tensor | None) -> Tensor:
    return e if prec is None else (e * prec).sum()


class SquaredError(Energy):
    """0.5 ||h - u||^2 (a Gaussian top node)."""

    name, free_top, residual = "se", True, True

    def signal(self, u_BO, y_BO, out_BO):
        return torch.sub(y_BO, u_BO, out=out_BO)

    def value(self, u_BO, y_BO, d_BO, prec):  # read from d = pi (y - u): 0.5 ||d||^2 / pi
        sq = 0.5 * d_BO.square().sum()
        if prec is None:
            return sq
        return torch.where(prec > 0, sq / prec.clamp_min(torch.finfo(d_BO.dtype).tiny), 0.0).sum()

    def top_grad(self, u_BO, y_BO, d_BO, prec, out_BO):
        return out_BO.copy_(d_BO)


class CrossEntropy(Energy):
    """-sum_k h_k log_softmax(u)_k (a categorical top node; its minimum is not in h)."""

    name, probabilities = "ce", True

    def signal(self, u_BO, y_BO, out_BO):
        torch.softmax(u_BO, dim=-1, out=out_BO)
        out_BO.mul_(y_BO.sum(-1, keepdim=True))
        return torch.sub(y_BO, out_BO, out=out_BO)

    def value(self, u_BO, y_BO, d_BO, prec):
        return _scaled(-(y_BO * torch.log_softmax(u_BO, dim=-1)).sum(), prec)

    def mean(self, u):
        return torch.softmax(u, dim=-1)


class BinaryCrossEntropy(Energy):
    """sum_k softplus(u_k) - h_k u_k (Bernoulli top nodes with logits u; linear in h)."""

    name = "bce"

    def signal(self, u_BO, y_BO, out_BO):
        torch.sigmoid(u_BO, out=out_BO)
        return torch.sub(y_BO, out_BO, out=out_BO)

    def value(self, u_BO, y_BO, d_BO, prec):
        return _scaled((F.softplus(u_BO) - y_BO * u_BO).sum(), prec)

    def mean(self, u):
        return torch.sigmoid(u)


class Zero(Energy):
    """0: the top node only passes on the errors of the layers below (PCX's zero_energy)."""

    name, free_top = "zero", True

    def signal(self, u_BO, y_BO, out_BO):
        return out_BO.zero_()

    def value(self, u_BO, y_BO, d_BO, prec):
        return u_BO.new_zeros(())

    def top_grad(self, u_BO, y_BO, d_BO, prec, out_BO):
        return out_BO.zero_()


class FromCallable(Energy):
    """Any ``energy(u, target) -> [B]`` per-sample energies; its signal and gradient by autograd."""

    name, free_top = "callable", True

    def __init__(self, fn):
        self.fn = fn

    def signal(self, u_BO, y_BO, out_BO):
        return out_BO.copy_(self._autograd(u_BO, y_BO, 0)).neg_()

    def value(self, u_BO, y_BO, d_BO, prec):
        return _scaled(self._call(u_BO, y_BO).sum(), prec)

    def top_grad(self, u_BO, y_BO, d_BO, prec, out_BO):
        out_BO.copy_(self._autograd(u_BO, y_BO, 1))
        return out_BO if prec is None else out_BO.mul_(prec)

    def _call(self, u_BO: Tensor, y_BO: Tensor) -> Tensor:
        e = self.fn(u_BO, y_BO)
        if not isinstance(e, Tensor) or tuple(e.shape) != (u_BO.shape[0],):
            got = list(e.shape) if isinstance(e, Tensor) else type(e).__name__
            raise ValueError(f"the energy callable {energy_name(self.fn)} must return per-sample energies of "
                             f"shape [{u_BO.shape[0]}], got {got}")
        return e

    def _autograd(self, u_BO: Tensor, y_BO: Tensor, which: int) -> Tensor:
        """dE/du (which 0) or dE/dtarget (which 1) of the callable, summed over the batch: zeros where it does not
        read that argument (a penalty on u alone, under a free top), an error where it reads neither (detached)."""
        with torch.enable_grad():
            args = [u_BO.detach().requires_grad_(True), y_BO.detach().requires_grad_(True)]
            e = self._call(*args).sum()
            if not e.requires_grad:
                raise ValueError(f"the energy callable {energy_name(self.fn)} returned energies without a gradient "
                                 f"(torch.autograd cannot differentiate them: a .detach(), .item(), numpy or an "
                                 f"integer op in it?); pcdist takes dE/du from autograd")
            (g,) = torch.autograd.grad(e, args[which], allow_unused=True)
        return torch.zeros_like(args[which]) if g is None else g


ENERGIES: dict[str, Energy] = {}
"""The registry: name -> Energy (``register_energy`` adds to it)."""


def register_energy(energy: Energy, name: str | None = None) -> Energy:
    """Add ``energy`` to the registry under ``name`` (default its own); returns it."""
    if not isinstance(energy, Energy):
        raise TypeError(f"register_energy takes a pcdist Energy (subclass pcdist.engine.energies.Energy), got "
                        f"{energy!r}")
    ENERGIES[name or energy.name] = energy
    return energy


for _e in (SquaredError(), CrossEntropy(), BinaryCrossEntropy(), Zero()):
    register_energy(_e)

FREE_TOP_ENERGIES = tuple(n for n, e in ENERGIES.items() if e.free_top)
"""Named energies with a minimum in h_L, so that a free top node can follow its gradient (and callables)."""


def check_energy(energy):
    """The energy as given (a registered name, an Energy or a callable), or a ValueError listing the allowed ones."""
    if isinstance(energy, Energy) or (callable(energy) and not isinstance(energy, str)) or energy in ENERGIES:
        return energy
    raise ValueError(f"unknown energy {energy!r}; allowed: {', '.join(repr(n) for n in ENERGIES)} (registered: "
                     "se squared error, ce cross-entropy, bce Bernoulli with logits, zero no output energy), an "
                     "Energy, or a callable energy(u, target) -> [B]")


def energy_of(energy) -> Energy:
    """The Energy for a registered name, an Energy, or a callable."""
    energy = check_energy(energy)
    if isinstance(energy, Energy):
        return energy
    return ENERGIES[energy] if isinstance(energy, str) else FromCallable(energy)


def energy_name(energy) -> str:
    """A printable name: a registered name, the Energy's own, or the callable's."""
    if isinstance(energy, str):
        return energy
    if isinstance(energy, Energy):
        return energy.name
    return getattr(energy, "__name__", type(energy).__name__)


class OutputEnergy:
    """The output energy of one bound output group, scaled by its precision ``prec`` (a one-element view
    of the Stage's precisions, None for pi_L = 1: no extra pass). Values are summed in float32 at least."""

    def __init__(self, energy, prec: Tensor | None = None):
        self.energy = energy_of(energy)
        self.name = self.energy.name
        self.prec = prec

    @property
    def residual(self) -> bool:
        return self.energy.residual

    def check_free_top(self) -> None:
        """Refuse a free top node under an energy without a minimum in it (ce, bce)."""
        if not self.energy.free_top:
            raise ValueError(_not_free(self.name))

    def _scale(self, t: Tensor) -> Tensor:
        return t if self.prec is None else t.mul_(self.prec)

    def signal(self, u_BO: Tensor, y_BO: Tensor, out_BO: Tensor) -> Tensor:
        """out = -pi dE_out/du."""
        return self._scale(self.energy.signal(u_BO, y_BO, out_BO))

    def scale_signal(self, d_BO: Tensor) -> Tensor:
        """d *= pi: for a kind that computed the unscaled signal itself (the dense kind's fused se GEMM)."""
        return self._scale(d_BO)

    def value(self, u_BO: Tensor, y_BO: Tensor, d_BO: Tensor) -> Tensor:
        """Batch SUM of pi E_out, in float32 at least."""
        if u_BO.dtype.itemsize < 4:  # bfloat16 nodes: the energy sums in float32
            u_BO, y_BO, d_BO = u_BO.float(), y_BO.float(), d_BO.float()
        return self.energy.value(u_BO, y_BO, d_BO, self.prec)

    def value_grad(self, u_BO: Tensor, y_BO: Tensor, d_BO: Tensor, out_BO: Tensor) -> Tensor:
        """out = pi dE_out/dh_L, the gradient of a free top node."""
        return self.energy.top_grad(u_BO, y_BO, d_BO, self.prec, out_BO)
