"""Energies of the clamped output node.

Shape letters: B batch, O output width. Every energy gives, per sample, its value
and the error signal d = -dE_out/du_L that the output layer back-projects.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ENERGIES", "check_energy", "output_signal", "output_energy"]

ENERGIES = ("se", "ce")


def check_energy(name: str) -> str:
    """The energy name, or a ValueError listing the allowed ones."""
    if name not in ENERGIES:
        raise ValueError(f"unknown energy {name!r}; allowed: 'se' (squared error), 'ce' (cross-entropy)")
    return name


def output_signal(energy: str, u_BO: Tensor, y_BO: Tensor, out_BO: Tensor) -> Tensor:
    """out = -dE_out/du: y - u for "se"; y - softmax(u) * sum(y) for "ce"."""
    if energy == "se":
        return torch.sub(y_BO, u_BO, out=out_BO)
    torch.softmax(u_BO, dim=-1, out=out_BO)
    out_BO.mul_(y_BO.sum(-1, keepdim=True))
    return torch.sub(y_BO, out_BO, out=out_BO)


def output_energy(energy: str, u_BO: Tensor, y_BO: Tensor, d_BO: Tensor) -> Tensor:
    """Batch SUM of E_out: 0.5 ||y - u||^2 ("se", read from d = y - u) or -sum y log_softmax(u) ("ce")."""
    if energy == "se":
        return 0.5 * d_BO.square().sum()
    return -(y_BO * torch.log_softmax(u_BO, dim=-1)).sum()
