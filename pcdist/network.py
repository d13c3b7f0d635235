"""Predictive-coding networks stored as groups of stacked, same-shape layers.

Shape letters: K layers in a group, B batch, I input width, O output width.
Layer l (1-based, global) maps value node l-1 to value node l; layer L is the
output layer (no activation). ``w_KIO`` holds W_l^T for the K layers of a group,
so the prediction of all K layers is one ``baddbmm(b, h_KBI, w_KIO)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from .activations import Activation, activation_from_module, get_activation
from .energies import check_energy

__all__ = ["LayerSpec", "LayerGroup", "PCNetwork", "group_layers", "mlp_specs"]


@dataclass(frozen=True)
class LayerSpec:
    """One Linear layer: in/out widths and its activation (None for the output layer)."""

    in_features: int
    out_features: int
    activation: Activation | None


def mlp_specs(dims: Sequence[int], activation: str | Activation = "tanh") -> list[LayerSpec]:
    """LayerSpecs of an MLP with widths ``dims`` (input, hidden..., output); no activation on the output."""
    if len(dims) < 2 or any(isinstance(d, bool) or int(d) != d or int(d) < 1 for d in dims):
        raise ValueError(f"model dims must be at least two positive integer widths, got {list(dims)}")
    act = activation if isinstance(activation, Activation) else get_activation(activation)
    L = len(dims) - 1
    return [LayerSpec(int(dims[l]), int(dims[l + 1]), act if l < L - 1 else None) for l in range(L)]


def group_layers(specs: Sequence[LayerSpec], first: int, stop: int) -> list[tuple[int, int]]:
    """Split layers [first, stop) (1-based) into runs [s, t) of equal shape and activation.

    The slice's first layer (layer 1: clamped input, prediction constant during
    inference; or the layer fed by an upstream rank, computed once its input arrives)
    and the output layer L are always groups of their own.
    """
    L = len(specs)
    runs: list[tuple[int, int]] = []
    s = first
    for l in range(first + 1, stop + 1):
        boundary = l == stop or l == first + 1 or l == L or specs[l - 1] != specs[s - 1]
        if boundary:
            runs.append((s, l))
            s = l
    return runs


class LayerGroup(nn.Module):
    """K consecutive layers of one shape and activation: w_KIO [K, I, O], b_KO [K, O]."""

    def __init__(self, first: int, K: int, spec: LayerSpec, dtype=None, device=None):
        super().__init__()
        self.first = first  # global index of the group's first layer
        self.K = K
        self.spec = spec
        kw = dict(dtype=dtype, device=device)
        self.weight = nn.Parameter(torch.empty(K, spec.in_features, spec.out_features, **kw))
        self.bias = nn.Parameter(torch.empty(K, spec.out_features, **kw))

    @property
    def layers(self) -> range:
        return range(self.first, self.first + self.K)

    def forward(self, h_BI: Tensor) -> Tensor:
        """Feed-forward through the K layers in order (a chain: sequential by nature)."""
        act = self.spec.activation
        for k in range(self.K):
            h_BI = torch.addmm(self.bias[k], h_BI, self.weight[k])
            if act is not None:
                h_BI = act(h_BI)
        return h_BI

    def extra_repr(self) -> str:
        s = self.spec
        act = s.activation.name if s.activation else "output"
        return f"layers {self.first}..{self.first + self.K - 1}: {self.K} x ({s.in_features} -> {s.out_features}, {act})"


class PCNetwork(nn.Module):
    """An MLP predictive-coding network; owns the layers [first, stop) of ``specs``.

    A single process owns all layers. Each rank of a layer-parallel run owns one
    contiguous slice, and allocates only that slice's parameters.
    """

    def __init__(
        self,
        specs: Sequence[LayerSpec],
        energy: str = "se",
        layers: tuple[int, int] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init: bool = True,
        seed: int | None = None,
    ):
        super().__init__()
        if not specs:
            raise ValueError("a PCNetwork needs at least one layer")
        self.specs = tuple(specs)
        for l, (s, nxt) in enumerate(zip(self.specs, self.specs[1:]), start=1):
            if s.out_features != nxt.in_features:
                raise ValueError(f"layer {l} outputs {s.out_features} features but layer {l + 1} expects {nxt.in_features}")
        if self.specs[-1].activation is not None:
            raise ValueError("the output layer takes no activation (u_L = a_L)")
        self.energy = check_energy(energy)
        first, stop = layers if layers is not None else (1, len(self.specs) + 1)
        if not 1 <= first < stop <= len(self.specs) + 1:
            raise ValueError(f"layer slice [{first}, {stop}) is not within layers 1..{len(self.specs)}")
        self.first, self.stop = first, stop
        self.groups = nn.ModuleList(
            LayerGroup(s, t - s, self.specs[s - 1], dtype=dtype, device=device) for s, t in group_layers(self.specs, first, stop)
        )
        if init:
            self.reset_parameters(seed)

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_dims(cls, dims: Sequence[int], activation: str | Activation = "tanh", energy: str = "se", **kw) -> "PCNetwork":
        """An MLP with widths ``dims`` (input, hidden..., output), nn.Linear's default init.

        Keywords go to the constructor: ``layers=(a, b)`` for a slice, ``seed``, ``dtype``, ``device``.
        """
        return cls(mlp_specs(dims, activation), energy=energy, **kw)

    @classmethod
    def from_sequential(cls, seq: nn.Sequential, energy: str = "se", layers: tuple[int, int] | None = None) -> "PCNetwork":
        """A PCNetwork with a copy of the weights of Linear, activation, ..., Linear (or of a slice)."""
        specs, linears = _parse_sequential(seq)
        p = linears[0].weight
        net = cls(specs, energy=energy, layers=layers, dtype=p.dtype, device=p.device, init=False)
        state = {}
        for l, lin in enumerate(linears, start=1):
            state[f"layers.{l}.weight"], state[f"layers.{l}.bias"] = lin.weight, lin.bias
        net.load_layer_state_dict(state)
        return net

    def reset_parameters(self, seed: int | None = None) -> None:
        """nn.Linear's default init, U(-1/sqrt(in), 1/sqrt(in)), layer by layer.

        With a ``seed``, layer l draws from its own generator seeded by (seed, l), so
        the weights do not depend on how the layers are split over ranks.
        """
        with torch.no_grad():
            for g in self.groups:
                bound = 1.0 / math.sqrt(g.spec.in_features)
                for l in g.layers:
                    gen = None if seed is None else torch.Generator().manual_seed(seed * 1_000_003 + l)
                    w, b = self.layer_weight(l), self.layer_bias(l)
                    w.copy_(torch.rand(w.shape, generator=gen, dtype=w.dtype).mul_(2 * bound).sub_(bound))
                    b.copy_(torch.rand(b.shape, generator=gen, dtype=b.dtype).mul_(2 * bound).sub_(bound))

    # -- structure ----------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.specs)

    @property
    def dims(self) -> list[int]:
        return [self.specs[0].in_features] + [s.out_features for s in self.specs]

    @property
    def owns_all(self) -> bool:
        return self.first == 1 and self.stop == self.num_layers + 1

    def _locate(self, l: int) -> tuple[LayerGroup, int]:
        for g in self.groups:
            if g.first <= l < g.first + g.K:
                return g, l - g.first
        raise IndexError(f"layer {l} is not owned here (owned: {self.first}..{self.stop - 1})")

    def layer_weight(self, l: int) -> Tensor:
        """W_l^T [in, out] of global layer l, a view into its group's stacked weight."""
        g, k = self._locate(l)
        return g.weight[k]

    def layer_bias(self, l: int) -> Tensor:
        """b_l [out] of global layer l, a view into its group's stacked bias."""
        g, k = self._locate(l)
        return g.bias[k]

    def layer_state_dict(self) -> dict[str, Tensor]:
        """The owned layers' weights keyed by global layer index, in nn.Linear's layout:
        ``layers.{l}.weight`` [out, in] and ``layers.{l}.bias`` [out]."""
        out = {}
        for g in self.groups:
            for l in g.layers:
                out[f"layers.{l}.weight"] = self.layer_weight(l).T.detach().clone()
                out[f"layers.{l}.bias"] = self.layer_bias(l).detach().clone()
        return out

    def load_layer_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load the owned layers from a (possibly larger) dict keyed by global layer index."""
        with torch.no_grad():
            for g in self.groups:
                for l in g.layers:
                    for name, dst in (("weight", self.layer_weight(l).T), ("bias", self.layer_bias(l))):
                        key = f"layers.{l}.{name}"
                        if key not in state:
                            raise KeyError(f"missing {key!r} in the layer state (owned layers {self.first}..{self.stop - 1})")
                        if tuple(state[key].shape) != tuple(dst.shape):
                            raise ValueError(f"{key}: shape {list(state[key].shape)} does not match the model's {list(dst.shape)}")
                        dst.copy_(state[key])

    # -- evaluation ---------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        """One feed-forward pass through the owned layers; on the full network, the logits u_L."""
        for g in self.groups:
            x = g(x)
        return x

    def to_sequential(self) -> nn.Sequential:
        """The current weights as a plain nn.Sequential(Linear, act, ..., Linear)."""
        if not self.owns_all:
            raise RuntimeError("to_sequential needs all layers; this network owns a slice")
        p = self.groups[0].weight
        mods: list[nn.Module] = []
        for l, s in enumerate(self.specs, start=1):
            lin = nn.Linear(s.in_features, s.out_features, dtype=p.dtype, device=p.device)
            with torch.no_grad():
                lin.weight.copy_(self.layer_weight(l).T)
                lin.bias.copy_(self.layer_bias(l))
            mods.append(lin)
            if s.activation is not None:
                mods.append(s.activation.to_module())
        return nn.Sequential(*mods)


def _parse_sequential(seq: nn.Sequential) -> tuple[list[LayerSpec], list[nn.Linear]]:
    """LayerSpecs and Linear modules of Linear, [activation], Linear, ... (flattened)."""
    mods = [m for m in seq.modules() if not isinstance(m, nn.Sequential)]
    specs: list[LayerSpec] = []
    linears: list[nn.Linear] = []
    pending: Activation | None = None
    for i, m in enumerate(mods):
        if isinstance(m, nn.Linear):
            if m.bias is None:
                raise ValueError(f"module {i} ({m}) has no bias; PCNetwork layers need bias=True")
            if linears:
                specs[-1] = LayerSpec(specs[-1].in_features, specs[-1].out_features, pending or Activation("identity"))
            specs.append(LayerSpec(m.in_features, m.out_features, None))
            linears.append(m)
            pending = None
        else:
            if not linears:
                raise ValueError(f"module {i} ({type(m).__name__}) comes before the first nn.Linear")
            if pending is not None:
                raise ValueError(f"module {i} ({type(m).__name__}): two activations in a row are not supported")
            pending = activation_from_module(m)
            if pending.name == "identity":
                pending = Activation("identity")
    if not linears:
        raise ValueError("the Sequential has no nn.Linear layer")
    if pending is not None and pending.name != "identity":
        raise ValueError(f"the output layer must not be followed by an activation (found {pending.name}); "
                         "the output energy acts on u_L = a_L")
    return specs, linears
