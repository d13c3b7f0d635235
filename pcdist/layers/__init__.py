"""Layer kinds: every kind of PC layer the engine fuses, one file each.

* ``dense`` (``Dense``, alias ``LayerSpec``): Linear + elementwise activation, the fused
  MLP path with its native CPU kernel (pcdist/layers/dense.py);
* ``residual`` (``Residual``): μPC's scaled residual layers, the path that trains
  100+ layer networks (pcdist/layers/residual.py).

``base.py`` defines the interface a kind implements; ``group_layers`` stacks runs of
equal layers into groups; ``kind_from_module`` picks the fastest kind for a torch module.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor, nn

from ..activations import Activation, activation_from_module
from .base import BoundGroup, LayerGroup, LayerKind, seeded_generator
from .dense import Dense, DenseGroup
from .residual import Residual, ResidualGroup, ResidualLinear, mupc_layers, mupc_specs

LayerSpec = Dense  # the name of the dense kind before there were other kinds

__all__ = ["LayerKind", "LayerGroup", "BoundGroup", "Dense", "DenseGroup", "LayerSpec", "Residual", "ResidualGroup",
           "ResidualLinear", "group_layers", "kind_from_module", "mupc_layers", "mupc_specs", "seeded_generator"]


def group_layers(kinds: Sequence[LayerKind], first: int, stop: int) -> list[tuple[int, int]]:
    """Split layers [first, stop) (1-based) into runs [s, t) of equal fuse keys.

    The slice's first layer (layer 1: clamped input, prediction constant during
    inference; or the layer fed by an upstream rank, computed once its input arrives)
    and the output layer L are always groups of their own.
    """
    L = len(kinds)
    runs: list[tuple[int, int]] = []
    s = first
    for l in range(first + 1, stop + 1):
        boundary = l == stop or l == first + 1 or l == L or kinds[l - 1].fuse_key() != kinds[s - 1].fuse_key()
        if boundary:
            runs.append((s, l))
            s = l
    return runs


def _dense_from_module(m: nn.Module, is_output: bool) -> tuple[Dense, dict[str, Tensor]] | None:
    """nn.Linear, or nn.Sequential(nn.Linear, activation), as a Dense layer (None if it is neither)."""
    mods = list(m) if isinstance(m, nn.Sequential) else [m]
    if not mods or not isinstance(mods[0], nn.Linear) or len(mods) > 2 or mods[0].bias is None:
        return None
    lin = mods[0]
    act: Activation | None = None
    if len(mods) == 2:
        try:
            act = activation_from_module(mods[1])
        except ValueError:
            return None
    if is_output and act is not None and act.name == "identity":
        act = None
    if not is_output and act is None:
        act = Activation("identity")
    if is_output and act is not None:
        return None
    return Dense(lin.in_features, lin.out_features, act), {"weight": lin.weight, "bias": lin.bias}


def _residual_from_module(m: nn.Module, is_output: bool) -> tuple[Residual, dict[str, Tensor]] | None:
    if not isinstance(m, ResidualLinear):
        return None
    kind = Residual(m.in_features, m.out_features, m.activation, m.scale, m.skip, m.bias is not None)
    params = {"weight": m.weight} if m.bias is None else {"weight": m.weight, "bias": m.bias}
    return kind, params


_FROM_MODULE = (_residual_from_module, _dense_from_module)  # fastest kind first


def kind_from_module(m: nn.Module, index: int, is_output: bool) -> tuple[LayerKind, dict[str, Tensor]]:
    """The fastest kind that expresses module ``m`` as PC layer ``index``, and its parameters in
    the kind's public layout; ValueError naming the module if no kind does."""
    for from_module in _FROM_MODULE:
        got = from_module(m, is_output)
        if got is not None:
            return got
    what = "the output layer" if is_output else f"layer {index}"
    raise ValueError(
        f"{what} ({type(m).__name__}: {m}) has no PC layer kind: supported are nn.Linear with a bias, "
        "nn.Sequential(nn.Linear, activation) (no activation on the output layer) and pcdist.ResidualLinear "
        "(pcdist.mupc_layers)")
