"""The prior of a free bottom node: h_0's Gaussian energy, run as a "layer 0" group.

Shape letters: B batch, S the node's shape (a width for vectors).

When h_0 is free (generative classification, unsupervised PC) it carries the energy

    E_0 = 0.5 pi_0 ||h_0 - m_0||^2          (pi_0 >= 0; m_0 zero, uniform 1/|S|, or learned)

which is the energy of a layer whose prediction is the constant m_0. So the prior is bound
into a Stage like any group of K = 1 layer with no input: its error pass writes
e_0 = pi_0 (h_0 - m_0) into h_0's value gradient (to which layer 1's back-projection adds
-P_1), its feed-forward sets h_0 <- m_0 (the init of a free h_0), and a learned mean gets
dF/dm_0 = -(1/B) sum_B pi_0 (h_0 - m_0) as its weight gradient. A learned mean is a parameter of the
network's first layer slice (``layers.0.mean`` in checkpoints); a fixed one is a constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .base import Binding, BoundGroup, LayerGroup

__all__ = ["Prior", "PRIOR_MEANS", "PriorGroup", "PriorBound"]

PRIOR_MEANS = ("zero", "uniform", "learned")


@dataclass(frozen=True)
class Prior:
    """The prior of a free h_0: precision pi_0 >= 0 and mean m_0: "zero", "uniform" (1/|S| in every
    entry: the init of a free label node) or "learned" (a parameter, starting at zero)."""

    precision: float = 1.0
    mean: str = "zero"

    def __post_init__(self):
        if not (isinstance(self.precision, (int, float)) and not isinstance(self.precision, bool)
                and math.isfinite(self.precision) and self.precision >= 0):
            raise ValueError(f"prior precision must be a finite number >= 0, got {self.precision!r}")
        if self.mean not in PRIOR_MEANS:
            raise ValueError(f"unknown prior mean {self.mean!r}; allowed: {', '.join(PRIOR_MEANS)}")

    def __str__(self) -> str:
        return f"prior on h_0: precision {self.precision:g}, mean {self.mean}"


class PriorGroup(LayerGroup):
    """h_0's prior as layer 0: ``mean`` [1, *S] (a parameter if learned, else a buffer)."""

    def __init__(self, prior: Prior, shape: tuple[int, ...], dtype=None, device=None):
        super().__init__(prior, 0, 1)
        self.shape = tuple(shape)
        kw = dict(dtype=dtype, device=device)
        if prior.mean == "learned":
            self.mean = nn.Parameter(torch.zeros(1, *self.shape, **kw))
        else:
            fill = 0.0 if prior.mean == "zero" else 1.0 / math.prod(self.shape)
            self.register_buffer("mean", torch.full((1, *self.shape), fill, **kw), persistent=False)

    @property
    def learned(self) -> bool:
        return isinstance(self.mean, nn.Parameter)

    def public_params(self, k: int) -> dict[str, Tensor]:
        return {"mean": self.mean[0]} if self.learned else {}

    def reset_layer(self, k: int, generator: torch.Generator | None) -> None:
        if self.learned:
            with torch.no_grad():
                self.mean.zero_()

    def forward(self, h: Tensor) -> Tensor:
        return h

    def bind(self, h_in, h_out, e_out, b: Binding) -> "PriorBound":
        return PriorBound(self, h_out, e_out, b)

    def extra_repr(self) -> str:
        return str(self.kind)


class PriorBound(BoundGroup):
    """The prior's phases over h_0 (``h_out`` [1, B, *S]) and its value gradient (``e_out``)."""

    def __init__(self, g: PriorGroup, h_out: Tensor, e_out: Tensor, b: Binding):
        pi = float(g.kind.precision)
        prec = None if pi == 1.0 else torch.full((1,), pi, dtype=h_out.dtype, device=h_out.device)
        super().__init__(g, None, h_out, e_out, Binding(b.batch_size, free_input=False, prec=prec))
        self.u = g.mean.unsqueeze(1)  # [1, 1, *S]: the constant prediction, broadcast over the batch

    def feedforward(self, rows: slice | None, init: str) -> None:
        self.h_out[:, slice(None) if rows is None else rows] = self.u.detach()
        self.cached = True

    def predict(self) -> None:
        self.cached = True

    def errors(self, with_signal: bool, step_lr: float | None, hold_last: bool = False) -> None:
        self.weigh(torch.sub(self.h_out, self.u.detach(), out=self.e_out))
        if step_lr is not None:
            self.h_out.add_(self.e_out, alpha=-step_lr)

    def backproject(self, target: Tensor, beta: float, alpha: float) -> None:
        raise RuntimeError("the prior of h_0 has no input node to back-project to")

    def weight_grads(self, scale: float) -> None:
        """dF/dm_0 = -(1/B) sum_B pi_0 (h_0 - m_0), from h_0 itself: e_out may hold layer 1's back-projection
        by now (it doubles as h_0's value gradient)."""
        g = self.g
        if g.learned:
            torch.sum(self.h_out - self.u.detach(), dim=1, out=g.mean.grad).mul_(scale * float(g.kind.precision))
