"""Layer kinds: every kind of PC layer the engine fuses, one file each.

* ``dense`` (``Dense``, alias ``LayerSpec``): Linear + elementwise activation, the fused
  MLP path with its native CPU kernel (pcdist/engine/layers/dense.py);
* ``residual`` (``Residual``): μPC's scaled residual layers, the path that trains
  100+ layer networks (pcdist/engine/layers/residual.py);
* ``conv`` (``Conv``): Conv1d / Conv2d + activation + optional max / average pooling on
  [C, (H,) W] nodes (pcdist/engine/layers/conv.py);
* ``module`` (``ModuleKind``): any other nn.Module, K identical modules vmapped, VJPs by
  autograd, traced once into aten graphs (pcdist/engine/layers/module.py, graph.py);
* ``prior.py``: the prior of a free bottom node h_0, bound as a "layer 0" group.

``base.py`` defines the interface a kind implements; ``group_layers`` stacks runs of
equal layers into groups; ``kind_from_module`` picks the fastest kind for a torch module.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor, nn

from ..activations import Activation, activation_from_module, stock
from .base import Binding, BoundGroup, LayerGroup, LayerKind, seeded_generator
from .conv import Conv, ConvGroup
from .dense import Dense, DenseGroup
from .module import AnyModule, ModuleGroup, ModuleKind
from .residual import Residual, ResidualGroup, ResidualLinear, mupc_layers, mupc_specs

LayerSpec = Dense  # the name of the dense kind before there were other kinds

__all__ = ["AnyModule", "Binding", "LayerKind", "LayerGroup", "BoundGroup", "Conv", "ModuleGroup", "ModuleKind",
           "ConvGroup", "Dense", "DenseGroup", "LayerSpec", "Residual", "ResidualGroup",
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


def _activation_of(m: nn.Module | None) -> Activation | None:
    """The Activation of an elementwise activation module (None for None, or a module that is not one)."""
    if m is None:
        return None
    try:
        return activation_from_module(m)
    except ValueError:
        return None


def _dense_from_module(m: nn.Module, in_shape, is_output: bool):
    """[nn.Flatten,] nn.Linear [, activation] as a Dense layer (None if the module is not that)."""
    mods = list(m) if isinstance(m, nn.Sequential) else [m]
    flat = bool(mods) and stock(mods[0], nn.Flatten)
    if flat:
        if (mods[0].start_dim, mods[0].end_dim) not in ((1, -1),):
            return None
        mods = mods[1:]
    if not mods or not stock(mods[0], nn.Linear) or len(mods) > 2:
        return None
    lin = mods[0]
    act = _activation_of(mods[1]) if len(mods) == 2 else None
    if len(mods) == 2 and act is None:
        return None
    if is_output and act is not None and act.name == "identity":
        act = None
    if not is_output and act is None:
        act = Activation("identity")
    if is_output and act is not None:
        return None
    shape = None
    if in_shape is not None and len(in_shape) > 1:
        if not flat:
            return None  # an image node into a Linear needs the nn.Flatten that says so
        shape = tuple(in_shape)
    params = {"weight": lin.weight} if lin.bias is None else {"weight": lin.weight, "bias": lin.bias}
    return Dense(lin.in_features, lin.out_features, act, bias=lin.bias is not None, input_shape=shape), params


def _conv_from_module(m: nn.Module, in_shape, is_output: bool):
    """nn.Conv1d/2d [, activation] [, MaxPool / AvgPool] (zero padding) as a Conv layer."""
    mods = list(m) if isinstance(m, nn.Sequential) else [m]
    if not mods or not stock(mods[0], (nn.Conv1d, nn.Conv2d)) or len(mods) > 3 or in_shape is None or is_output:
        return None  # an output convolution (images at h_L: a conv decoder) is the module kind's
    conv, rest = mods[0], mods[1:]
    n = 1 if isinstance(conv, nn.Conv1d) else 2
    if conv.padding_mode != "zeros" or len(in_shape) != n + 1:
        return None
    act = Activation("identity")
    if rest and _activation_of(rest[0]) is not None:
        act, rest = _activation_of(rest[0]), rest[1:]
    pool = None
    if rest:
        p = rest[0]
        kinds = {1: (nn.MaxPool1d, nn.AvgPool1d), 2: (nn.MaxPool2d, nn.AvgPool2d)}[n]
        if len(rest) > 1 or not stock(p, kinds) or getattr(p, "ceil_mode", False) \
                or getattr(p, "dilation", 1) not in (1, (1,) * n) or getattr(p, "count_include_pad", True) is False \
                or getattr(p, "divisor_override", None) is not None or getattr(p, "return_indices", False):
            return None
        tup = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v,) * n  # noqa: E731
        pool = ("max" if isinstance(p, kinds[0]) else "avg", tup(p.kernel_size),
                tup(p.stride if p.stride is not None else p.kernel_size), tup(p.padding))
    padding = conv.padding
    if isinstance(padding, str):  # "valid" or "same" (odd effective kernels: symmetric padding)
        if padding == "valid":
            padding = (0,) * n
        elif all((d * (k - 1)) % 2 == 0 for k, d in zip(conv.kernel_size, conv.dilation)):
            padding = tuple(d * (k - 1) // 2 for k, d in zip(conv.kernel_size, conv.dilation))
        else:
            return None
    kind = Conv(conv.in_channels, conv.out_channels, tuple(in_shape[1:]), tuple(conv.kernel_size), act,
                tuple(conv.stride), tuple(padding), tuple(conv.dilation), conv.groups, conv.bias is not None,
                *(pool or (None, (), (), ())))
    params = {"weight": conv.weight} if conv.bias is None else {"weight": conv.weight, "bias": conv.bias}
    return kind, params


def _residual_from_module(m: nn.Module, in_shape, is_output: bool):
    if not isinstance(m, ResidualLinear):
        return None
    kind = Residual(m.in_features, m.out_features, m.activation, m.scale, m.skip, m.bias is not None)
    params = {"weight": m.weight} if m.bias is None else {"weight": m.weight, "bias": m.bias}
    return kind, params


def _module_from_module(m: nn.Module, in_shape, is_output: bool, index: int = 0):
    """Any other module: the generic kind (needs the input node's shape; a vector's, for a module that starts
    with an nn.Linear, is its ``in_features``)."""
    inner = m.module if isinstance(m, AnyModule) else m
    first = list(inner)[0] if isinstance(inner, nn.Sequential) and len(inner) else inner
    if in_shape is None:
        if not isinstance(first, nn.Linear):
            return None
        in_shape = (first.in_features,)
    if isinstance(first, nn.Linear) and len(in_shape) > 1:
        return None  # an image node into a Linear: the error asks for the nn.Flatten
    kind = ModuleKind.of(inner, tuple(in_shape), index)
    return kind, dict(inner.named_parameters())


_FAST = (_residual_from_module, _conv_from_module, _dense_from_module)  # fastest first; then the module kind


def kind_from_module(m: nn.Module, index: int, is_output: bool,
                     in_shape: tuple[int, ...] | None = None) -> tuple[LayerKind, dict[str, Tensor]]:
    """The fastest kind that expresses module ``m`` as PC layer ``index`` on an input node of shape
    ``in_shape`` (needed for convolutions), and its parameters in the kind's public layout;
    ValueError naming the module if no kind does."""
    if isinstance(m, AnyModule):  # the user asks for the generic kind
        if in_shape is None:
            raise ValueError(f"layer {index} (AnyModule) is the first layer: give input_shape")
        return _module_from_module(m, in_shape, is_output, index)
    for from_module in _FAST:
        got = from_module(m, in_shape, is_output)
        if got is not None:
            return got
    got = _module_from_module(m, in_shape, is_output, index)
    if got is not None:
        return got
    what = "the output layer" if is_output else f"layer {index}"
    first = list(m)[0] if isinstance(m, nn.Sequential) and len(m) else m
    if isinstance(first, nn.Linear) and in_shape is not None and len(in_shape) > 1:
        raise ValueError(f"{what} ({type(m).__name__}: {m}) reads the node of shape {list(in_shape)} with an "
                         "nn.Linear: put nn.Flatten() before it")
    if isinstance(first, (nn.Conv1d, nn.Conv2d)) and in_shape is None:
        raise ValueError(f"{what} ({type(m).__name__}: {m}) is a convolution on an input of unknown shape: give "
                         f"input_shape=(channels, {'length' if isinstance(first, nn.Conv1d) else 'height, width'}) "
                         f"(one sample's, without the batch)")
    if in_shape is None and index == 1 and not isinstance(first, (nn.Linear, nn.Flatten)):
        raise ValueError(f"{what} ({type(m).__name__}: {m}) is the first layer and the shape of its input is unknown: "
                         f"give input_shape=(...) (one sample's, without the batch)")
    raise ValueError(
        f"{what} ({type(m).__name__}: {m}) has no PC layer kind: supported are nn.Linear "
        "([nn.Flatten,] nn.Linear [, activation]; no activation on the output layer), nn.Conv1d/2d [+ activation] "
        "[+ max/avg pooling] (zero padding; give input_shape) and pcdist.ResidualLinear (pcdist.mupc_layers)")
