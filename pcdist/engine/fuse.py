"""Fuse N independent modules of one architecture into a single batched module.

``fuse(module_list)`` stacks the modules' parameters and buffers into ``[N, *P]``
tensors and runs all N modules in one batched call (no Python loop over N).

Shape-suffix legend:
    N   number of fused modules
    B   a module's own batch dims (any number, possibly none)
    M   B flattened into one dim
    P   a parameter's own shape, so a stacked parameter is ``[N, *P]``
    I   in-features, O out-features (Linear)
    C   in-channels, D out-channels, H W height and width, K the kernel dims (Conv2d)
    G   groups of the grouped convolution
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

__all__ = ["fuse", "FusedModules"]

# Parameter-free activations that act elementwise: applied to [N, B, O] as is.
_ELEMENTWISE = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU,
    nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.LogSigmoid, nn.Hardtanh,
    nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign, nn.Tanhshrink,
    nn.Hardshrink, nn.Softshrink, nn.Threshold,
)
PATHS = ("linear", "sequential_linear", "conv2d", "vmap")


def fuse(modules: Iterable[nn.Module]) -> FusedModules:
    """Stack N same-architecture modules into a FusedModules that runs them in one batched call."""
    return FusedModules(modules)


class FusedModules(nn.Module):
    """N same-architecture modules run at once over stacked ``[N, *P]`` parameters and buffers.

    ``forward(x_NB)`` feeds ``x_NB[n]`` to module n and returns ``[N, B, ...out]``;
    ``forward(x_B, shared_input=True)`` feeds the same ``x_B`` to every module.
    The stacked tensors live in the submodule ``stacked`` under module 0's names
    (``fused.stacked.weight``, ``fused.stacked.0.bias``, ...), so ``parameters()``,
    optimizers and ``state_dict`` see them. The original modules are not updated
    until ``write_back()`` is called.

    ``path`` names how forward runs, chosen from module 0's exact type:
      "linear"            nn.Linear: one bmm / baddbmm.
      "sequential_linear" nn.Sequential of nn.Linear and parameter-free elementwise
                          activations (ReLU, GELU, Tanh, ...): a chain of baddbmm + activations.
      "conv2d"            nn.Conv2d with padding_mode "zeros": one convolution with N times the groups.
      "vmap"              anything else: torch.func.vmap of functional_call over a meta copy of module 0.

    Buffers are supported (only modules with buffers, such as BatchNorm, take the
    vmap path): they are stacked, passed through vmap, and in training mode
    BatchNorm running statistics update per module in the stacked buffers.
    Forwards that read a buffer as a Python number (e.g. BatchNorm with
    momentum=None) are not supported: vmap raises. Randomness such as Dropout is
    drawn independently per module. Forwards may only read tensors that are
    registered parameters or buffers (the template copy lives on the meta device).
    """

    def __init__(self, modules: Iterable[nn.Module]):
        super().__init__()
        modules = list(modules)
        _check_modules(modules)
        self.n = len(modules)
        self.path = _choose_path(modules[0])
        self.stacked = _stack_state(modules)
        # Plain attributes, not submodules: they must stay out of parameters() and state_dict.
        self._originals = tuple(modules)
        object.__setattr__(self, "_template", copy.deepcopy(modules[0]).to("meta"))
        self._chain = _linear_chain(self._template) if self.path == "sequential_linear" else []
        self.train(modules[0].training)

    def __len__(self) -> int:
        """Return N, the number of fused modules."""
        return self.n

    def extra_repr(self) -> str:
        """Describe the fused module as N, path and module 0's type."""
        return f"n={self.n}, path={self.path!r}, module={type(self._template).__name__}"

    def train(self, mode: bool = True) -> FusedModules:
        """Set training mode here and on the template module that the vmap path calls."""
        super().train(mode)
        self._template.train(mode)
        return self

    def forward(self, x: torch.Tensor, shared_input: bool = False) -> torch.Tensor:
        """Run module n on x[n] ([N, B, ...] -> [N, B, ...out]), or every module on x if shared_input."""
        if not shared_input:
            self._check_leading_dim(x)
        if self.path == "vmap":
            return self._forward_vmap(x, shared_input)
        x_NB = x.expand(self.n, *x.shape) if shared_input else x
        if self.path == "linear":
            return _linear_NBO(x_NB, self.stacked.weight, _bias(self.stacked))
        if self.path == "sequential_linear":
            return self._forward_chain(x_NB)
        return self._forward_conv2d(x_NB)

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy slice n of every stacked parameter and buffer into module n's own tensors, in place."""
        stacked = dict(itertools.chain(self.stacked.named_parameters(), self.stacked.named_buffers()))
        for n, module in enumerate(self._originals):
            for name, t_P in itertools.chain(module.named_parameters(), module.named_buffers()):
                t_P.copy_(stacked[name][n])

    def _check_leading_dim(self, x: torch.Tensor) -> None:
        """Raise ValueError unless x has one leading slice per fused module."""
        if x.dim() == 0 or x.shape[0] != self.n:
            got = x.shape[0] if x.dim() > 0 else "missing (0-d input)"
            raise ValueError(
                f"input leading dim is {got} but {self.n} modules are fused: pass x of shape "
                f"[{self.n}, B, ...] (shape given: {tuple(x.shape)}), or use shared_input=True"
            )

    def _forward_chain(self, h_NB: torch.Tensor) -> torch.Tensor:
        """Run the Linear/activation chain: baddbmm for each Linear, activations on [N, B, O] as is."""
        for name, act in self._chain:
            if act is not None:
                h_NB = act(h_NB)
            else:
                layer = getattr(self.stacked, name)
                h_NB = _linear_NBO(h_NB, layer.weight, _bias(layer))
        return h_NB

    def _forward_conv2d(self, x_NBCHW: torch.Tensor) -> torch.Tensor:
        """Run N convolutions as one with N*groups groups: [N, B, C, H, W] -> [N, B, D, H', W']."""
        if x_NBCHW.dim() not in (4, 5):
            raise ValueError(f"conv2d path expects [N, B, C, H, W] or [N, C, H, W], got shape {tuple(x_NBCHW.shape)}")
        unbatched = x_NBCHW.dim() == 4
        if unbatched:
            x_NBCHW = x_NBCHW.unsqueeze(1)
        N, B, C, H, W = x_NBCHW.shape
        w_NDCK = self.stacked.weight
        b_ND = _bias(self.stacked)
        x_BGHW = x_NBCHW.transpose(0, 1).reshape(B, N * C, H, W)
        w_GCK = w_NDCK.reshape(N * w_NDCK.shape[1], *w_NDCK.shape[2:])
        b_G = None if b_ND is None else b_ND.reshape(-1)
        conv = self._template
        y_BGHW = F.conv2d(x_BGHW, w_GCK, b_G, conv.stride, conv.padding, conv.dilation, conv.groups * N)
        y_NBDHW = y_BGHW.reshape(B, N, w_NDCK.shape[1], *y_BGHW.shape[-2:]).transpose(0, 1)
        return y_NBDHW.squeeze(1) if unbatched else y_NBDHW

    def _forward_vmap(self, x: torch.Tensor, shared_input: bool) -> torch.Tensor:
        """Run functional_call of the meta template under vmap over the stacked parameters and buffers."""
        params_NP = dict(self.stacked.named_parameters())
        buffers_NP = dict(self.stacked.named_buffers())
        x_dim = None if shared_input else 0
        if shared_input and not params_NP and not buffers_NP:
            x, x_dim = x.expand(self.n, *x.shape), 0  # vmap needs at least one batched input

        def call(p_P, b_P, x_B):
            return functional_call(self._template, (p_P, b_P), (x_B,))

        return vmap(call, in_dims=(0, 0, x_dim), randomness="different")(params_NP, buffers_NP, x)


def _bias(module: nn.Module) -> torch.Tensor | None:
    """Return the module's registered `bias` tensor, or None if it has none."""
    return getattr(module, "bias", None)


def _linear_NBO(x_NBI: torch.Tensor, w_NOI: torch.Tensor, b_NO: torch.Tensor | None) -> torch.Tensor:
    """Apply N linear maps at once, y[n] = x[n] @ w[n].T + b[n], for any batch dims B."""
    N, I = x_NBI.shape[0], x_NBI.shape[-1]
    x_NMI = x_NBI.reshape(N, math.prod(x_NBI.shape[1:-1]), I)
    w_NIO = w_NOI.transpose(1, 2)
    if b_NO is None:
        y_NMO = torch.bmm(x_NMI, w_NIO)
    else:
        y_NMO = torch.baddbmm(b_NO.unsqueeze(1), x_NMI, w_NIO)
    return y_NMO.reshape(*x_NBI.shape[:-1], w_NOI.shape[1])


def _choose_path(module: nn.Module) -> str:
    """Return the forward path for modules shaped like this one (see FusedModules.path)."""
    kind = type(module)
    if kind is nn.Linear:
        return "linear"
    if kind is nn.Sequential and _is_linear_chain(module):
        return "sequential_linear"
    if kind is nn.Conv2d and module.padding_mode == "zeros":
        return "conv2d"
    return "vmap"


def _is_linear_chain(seq: nn.Sequential) -> bool:
    """Tell whether seq holds only nn.Linear and elementwise activations, with at least one Linear."""
    kinds = [type(m) for m in seq]
    return nn.Linear in kinds and all(k is nn.Linear or k in _ELEMENTWISE for k in kinds)


def _linear_chain(seq: nn.Sequential) -> list[tuple[str, nn.Module | None]]:
    """List seq's items as (name, None) for a Linear or (name, activation) for an activation."""
    return [(name, None if type(m) is nn.Linear else m) for name, m in seq.named_children()]


def _stack_state(modules: list[nn.Module]) -> nn.Module:
    """Stack the modules' parameters and buffers into [N, *P] tensors in a tree named like module 0."""
    params_NP, buffers_NP = stack_module_state(modules)
    ref_params = dict(modules[0].named_parameters())
    persistent = set(modules[0].state_dict().keys())
    root = nn.Module()
    for name, p_NP in params_NP.items():
        owner, leaf = _owner(root, name)
        owner.register_parameter(leaf, nn.Parameter(p_NP.detach(), requires_grad=ref_params[name].requires_grad))
    for name, b_NP in buffers_NP.items():
        owner, leaf = _owner(root, name)
        owner.register_buffer(leaf, b_NP, persistent=name in persistent)
    return root


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """Return (submodule, leaf name) for a dotted name, creating empty submodules on the way."""
    *path, leaf = name.split(".")
    owner = root
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    return owner, leaf


def _check_modules(modules: list) -> None:
    """Raise ValueError naming the index and the difference unless all modules can be fused."""
    if not modules:
        raise ValueError("fuse() needs at least one module, got an empty list")
    for n, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"item {n} is of type {type(m).__name__}, not an nn.Module")
    m0 = modules[0]
    owners: dict[int, tuple[int, str]] = {}
    for n, m in enumerate(modules):
        if type(m) is not type(m0):
            raise ValueError(f"module {n} has type {type(m).__name__}, but module 0 has type {type(m0).__name__}")
        if m.training != m0.training:
            raise ValueError(f"module {n} has training={m.training}, but module 0 has training={m0.training}")
        _check_same_tensors(n, "parameter", dict(m.named_parameters()), dict(m0.named_parameters()))
        _check_same_tensors(n, "buffer", dict(m.named_buffers()), dict(m0.named_buffers()))
        _check_same_config(n, m, m0)
        _check_not_shared(n, m, owners)


def _check_same_tensors(n: int, kind: str, mine: dict, ref: dict) -> None:
    """Raise ValueError if module n's parameters (or buffers) differ from module 0's in name or layout."""
    if list(mine) != list(ref):
        raise ValueError(f"module {n} has {kind}s {list(mine)}, but module 0 has {kind}s {list(ref)}")
    for name, t in mine.items():
        for attr in ("shape", "dtype", "device", "requires_grad"):
            a, b = getattr(t, attr), getattr(ref[name], attr)
            if a != b:
                a, b = (tuple(a), tuple(b)) if attr == "shape" else (a, b)
                raise ValueError(f"module {n} {kind} '{name}' has {attr} {a}, but module 0 has {attr} {b}")


def _check_same_config(n: int, module: nn.Module, ref: nn.Module) -> None:
    """Raise ValueError if module n's repr (its structure and configuration) differs from module 0's."""
    lines, ref_lines = repr(module).splitlines(), repr(ref).splitlines()
    for a, b in itertools.zip_longest(lines, ref_lines, fillvalue="<missing>"):
        if a != b:
            raise ValueError(f"module {n} is configured differently from module 0: {a.strip()!r} vs {b.strip()!r}")


def _check_not_shared(n: int, module: nn.Module, owners: dict[int, tuple[int, str]]) -> None:
    """Raise ValueError if module n holds a tensor already owned by another module in the list."""
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        k, other = owners.setdefault(id(t), (n, name))
        if k != n:
            raise ValueError(
                f"module {n} '{name}' is the same tensor as module {k} '{other}'; fused modules must be independent"
            )
