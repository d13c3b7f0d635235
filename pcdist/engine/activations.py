"""Elementwise activations with their fused derivative kernels.

Each activation gives u = f(a), computed in place where that is exact, and the
error signal d = e * f'(a) as ONE kernel (aten's ``*_backward`` ops), written into
a preallocated buffer. Most derivatives are read from the output u, so the
pre-activation buffer can be overwritten by u; gelu, silu, softplus and mish (and
leaky_relu with a negative slope, elu with a negative alpha) need the input a itself
and say so with ``needs_input``.

Any other elementwise torch module has no entry here: a layer that uses one runs
through the module kind (pcdist/engine/layers/module.py), with autograd's VJPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Activation", "ACTIVATIONS", "ELEMENTWISE_MODULES", "FUSED_MODULES", "SUPPORTED_MODULES",
           "activation_from_module", "get_activation", "stock"]

_aten = torch.ops.aten

ACTIVATIONS = ("tanh", "relu", "leaky_relu", "gelu", "hard_tanh", "sigmoid", "identity", "silu", "softplus", "elu",
               "mish")


@dataclass(frozen=True)
class Activation:
    """f and e * f'(a) for one elementwise activation; hashable, so layers group by it."""

    name: str
    negative_slope: float = 0.01  # leaky_relu
    approximate: str = "none"  # gelu: "none" (erf) or "tanh"
    min_val: float = -1.0  # hard_tanh
    max_val: float = 1.0  # hard_tanh
    beta: float = 1.0  # softplus
    threshold: float = 20.0  # softplus: linear above beta * a > threshold
    alpha: float = 1.0  # elu

    def __post_init__(self):
        if self.name not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.name!r}; allowed: {', '.join(ACTIVATIONS)}")
        if self.approximate not in ("none", "tanh"):
            raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {self.approximate!r}")
        if not (math.isfinite(self.min_val) and math.isfinite(self.max_val) and self.min_val < self.max_val):
            raise ValueError(f"hard_tanh needs min_val < max_val, got {self.min_val}, {self.max_val}")
        if not (math.isfinite(self.beta) and self.beta > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"softplus needs a finite beta > 0 and elu a finite alpha, got {self.beta}, {self.alpha}")

    @property
    def needs_input(self) -> bool:
        """True if f'(a) cannot be read from u = f(a), so a must be kept."""
        return (self.name in ("gelu", "silu", "softplus", "mish")
                or (self.name == "leaky_relu" and self.negative_slope < 0)
                or (self.name == "elu" and self.alpha < 0))

    def __call__(self, a: Tensor) -> Tensor:
        """u = f(a) into a new tensor (differentiable by autograd)."""
        return self.forward(a)

    def forward(self, a: Tensor, out: Tensor | None = None) -> Tensor:
        """u = f(a), written into ``out`` if given (which may be ``a`` itself unless needs_input)."""
        n = self.name
        if n == "tanh":
            return torch.tanh(a, out=out)
        if n == "sigmoid":
            return torch.sigmoid(a, out=out)
        if n == "relu":  # out=None: F.relu, whose autograd takes f'(0) = 0 as grad() does (clamp's takes 1)
            return F.relu(a) if out is None else torch.clamp(a, min=0, out=out)
        if n == "hard_tanh":
            return F.hardtanh(a, self.min_val, self.max_val) if out is None else \
                torch.clamp(a, self.min_val, self.max_val, out=out)
        if n == "leaky_relu":
            if out is None:
                return F.leaky_relu(a, self.negative_slope)
            return _aten.leaky_relu.out(a, self.negative_slope, out=out)
        if n == "gelu":
            if out is None:
                return F.gelu(a, approximate=self.approximate)
            return _aten.gelu.out(a, approximate=self.approximate, out=out)
        if n == "silu":
            return F.silu(a) if out is None else _aten.silu.out(a, out=out)
        if n == "softplus":
            return F.softplus(a, self.beta, self.threshold) if out is None else \
                _aten.softplus.out(a, self.beta, self.threshold, out=out)
        if n == "elu":
            return F.elu(a, self.alpha) if out is None else _aten.elu.out(a, self.alpha, 1, 1, out=out)
        if n == "mish":
            return F.mish(a) if out is None else _aten.mish.out(a, out=out)
        return a if out is None or out is a else out.copy_(a)  # identity

    def grad(self, e: Tensor, a: Tensor, u: Tensor, out: Tensor) -> Tensor:
        """out = e * f'(a), one fused kernel; ``a`` is only read when needs_input."""
        n = self.name
        if n == "tanh":
            return _aten.tanh_backward.grad_input(e, u, grad_input=out)
        if n == "sigmoid":
            return _aten.sigmoid_backward.grad_input(e, u, grad_input=out)
        if n == "relu":
            return _aten.threshold_backward.grad_input(e, u, 0, grad_input=out)
        if n == "hard_tanh":
            return _aten.hardtanh_backward.grad_input(e, u, self.min_val, self.max_val, grad_input=out)
        if n == "leaky_relu":
            src, is_result = (a, False) if self.needs_input else (u, True)
            return _aten.leaky_relu_backward.grad_input(e, src, self.negative_slope, is_result, grad_input=out)
        if n == "gelu":
            return _aten.gelu_backward.grad_input(e, a, approximate=self.approximate, grad_input=out)
        if n == "silu":
            return _aten.silu_backward.grad_input(e, a, grad_input=out)
        if n == "softplus":
            return _aten.softplus_backward.grad_input(e, a, self.beta, self.threshold, grad_input=out)
        if n == "elu":
            src, is_result = (a, False) if self.needs_input else (u, True)
            return _aten.elu_backward.grad_input(e, self.alpha, 1, 1, is_result, src, grad_input=out)
        if n == "mish":  # aten has no out= form of mish_backward: two passes
            return out.copy_(_aten.mish_backward(e, a))
        return out if out is e else out.copy_(e)  # identity

    def to_module(self) -> nn.Module:
        """The equivalent torch.nn module."""
        n = self.name
        if n == "tanh":
            return nn.Tanh()
        if n == "sigmoid":
            return nn.Sigmoid()
        if n == "relu":
            return nn.ReLU()
        if n == "hard_tanh":
            return nn.Hardtanh(self.min_val, self.max_val)
        if n == "leaky_relu":
            return nn.LeakyReLU(self.negative_slope)
        if n == "gelu":
            return nn.GELU(approximate=self.approximate)
        if n == "silu":
            return nn.SiLU()
        if n == "softplus":
            return nn.Softplus(self.beta, self.threshold)
        if n == "elu":
            return nn.ELU(self.alpha)
        if n == "mish":
            return nn.Mish()
        return nn.Identity()


def get_activation(name: str, **kwargs) -> Activation:
    """An Activation by name ("tanh", "relu", ...), with its options as keywords."""
    return Activation(name, **kwargs)


FUSED_MODULES = (nn.Tanh, nn.Sigmoid, nn.ReLU, nn.LeakyReLU, nn.GELU, nn.Hardtanh, nn.Identity, nn.SiLU, nn.Softplus,
                 nn.ELU, nn.Mish)
"""The torch.nn activation classes with an Activation (as torch computes them: ``stock``)."""


def stock(module: nn.Module, classes) -> bool:
    """``module`` is one of torch's ``classes`` as torch computes it: not a subclass with a forward of its own,
    not parametrized (weight_norm, spectral_norm, ...), without forward hooks. Only such a module is read as a
    fused kind (its weights and options); any other computes what its own code says (the module kind)."""
    from torch.nn.utils import parametrize

    base = next((c for c in (classes if isinstance(classes, tuple) else (classes,)) if isinstance(module, c)), None)
    return (base is not None and type(module).forward is base.forward and not parametrize.is_parametrized(module)
            and not module._forward_hooks and not module._forward_pre_hooks)


def activation_from_module(module: nn.Module) -> Activation:
    """The Activation equivalent to a torch.nn activation module (as torch computes it: ``stock``)."""
    if isinstance(module, FUSED_MODULES) and not stock(module, FUSED_MODULES):
        raise ValueError(f"{type(module).__name__} is a {type(module).__mro__[1].__name__} that computes its own "
                         f"forward (a subclass, a parametrization or a hook): not a fused activation")
    if isinstance(module, nn.Tanh):
        return Activation("tanh")
    if isinstance(module, nn.Sigmoid):
        return Activation("sigmoid")
    if isinstance(module, nn.ReLU):
        return Activation("relu")
    if isinstance(module, nn.LeakyReLU):
        return Activation("leaky_relu", negative_slope=float(module.negative_slope))
    if isinstance(module, nn.GELU):
        return Activation("gelu", approximate=module.approximate)
    if isinstance(module, nn.Hardtanh):  # also nn.ReLU6 (a Hardtanh(0, 6))
        return Activation("hard_tanh", min_val=float(module.min_val), max_val=float(module.max_val))
    if isinstance(module, nn.Identity):
        return Activation("identity")
    if isinstance(module, nn.SiLU):
        return Activation("silu")
    if isinstance(module, nn.Softplus):
        return Activation("softplus", beta=float(module.beta), threshold=float(module.threshold))
    if isinstance(module, nn.ELU):
        return Activation("elu", alpha=float(module.alpha))
    if isinstance(module, nn.Mish):
        return Activation("mish")
    raise ValueError(f"unsupported activation module {type(module).__name__}; supported: {SUPPORTED_MODULES}")


SUPPORTED_MODULES = "Tanh, ReLU, LeakyReLU, GELU, Hardtanh (and ReLU6), Sigmoid, Identity, SiLU, Softplus, ELU, Mish"
"""The torch.nn activation modules with an Activation (the fused paths), as messages name them."""

ELEMENTWISE_MODULES = (nn.Hardswish, nn.Hardsigmoid, nn.SELU, nn.CELU, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid,
                       nn.Softshrink, nn.Hardshrink, nn.Threshold, nn.PReLU)
"""torch's other elementwise activation modules: no Activation, so a layer with one runs through the
module kind (autograd's VJPs instead of a fused pass)."""

