"""Conversions between a PCNetwork and plain torch modules.

``from_layers`` (one module per PC layer, each given the fastest layer kind that expresses it),
``from_sequential`` (an nn.Sequential split where value nodes go, ``split_sequential``) and their
inverses ``to_layers`` / ``to_sequential``, which give back the user's own modules (same classes,
nesting and ``state_dict`` keys) with the current weights. ``module_structure`` records a module's
nesting as plain data (run directories keep it) and ``apply_structure`` restores it. The
``PCNetwork`` classmethods and methods of the same names are thin wrappers over these.
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from typing import Sequence

import torch
from torch import nn

from .activations import ELEMENTWISE_MODULES, FUSED_MODULES, SUPPORTED_MODULES, activation_from_module
from .layers import kind_from_module

__all__ = ["from_layers", "from_sequential", "to_layers", "to_sequential", "split_sequential", "module_structure",
           "apply_structure"]


def from_layers(cls, layers: Sequence[nn.Module], energy: str = "se", input_shape: Sequence[int] | None = None,
                layers_owned: tuple[int, int] | None = None, **kw):
    """``cls.from_layers`` (PCNetwork.from_layers): a network of class ``cls`` with a copy of the weights of
    ``layers``, one torch module per PC layer, which ``to_layers`` gives back. ``device`` and ``dtype`` in
    ``kw`` move the network there (default: where the modules' weights are)."""
    device, dtype = kw.pop("device", None), kw.pop("dtype", None)
    mods = list(layers)
    if not mods:
        raise ValueError("from_layers needs at least one module")
    tail = list(mods[-1])[-1] if isinstance(mods[-1], nn.Sequential) and len(mods[-1]) else mods[-1]
    if energy == "ce" and isinstance(tail, (nn.Softmax, nn.LogSoftmax)):
        raise ValueError(f"the output layer ends with {type(tail).__name__}: leave it out; energy='ce' applies the "
                         f"softmax to the output layer's u_L (the logits) itself")
    owner: dict[int, tuple[int, str]] = {}  # each parameter's first layer (a module passed twice ties weights)
    for l, m in enumerate(mods, start=1):
        for name, t in m.named_parameters():
            if id(t) in owner and owner[id(t)][0] != l:
                raise ValueError(f"layers {owner[id(t)][0]} and {l} share the parameter {owner[id(t)][1]!r} (one "
                                 f"module given twice?): each PC layer trains weights of its own, so they would be "
                                 f"untied silently; give each layer its own module (copy.deepcopy)")
            owner.setdefault(id(t), (l, name))
    picked, shape = [], None if input_shape is None else tuple(int(d) for d in input_shape)
    for l, m in enumerate(mods, start=1):
        kind, params = kind_from_module(m, l, l == len(mods), shape)
        if l == 1 and shape is not None and tuple(kind.in_shape) != shape:
            raise ValueError(f"input_shape={list(shape)}, but layer 1 ({type(m).__name__}) takes inputs of shape "
                             f"{list(kind.in_shape)}")
        picked.append((kind, params))  # shapes that do not chain are named by the constructor
        shape = tuple(kind.out_shape)
    p = next((t for _, params in picked for t in params.values()), None)  # a first layer may have none (a pooling)
    for what, given, of in (("dtype", dtype, lambda t: t.dtype), ("device", device, lambda t: t.device)):
        found = {}  # (a network has one of each: the others were cast or moved to the first layer's, silently)
        for l, (_, params) in enumerate(picked, start=1):
            for t in params.values():
                found.setdefault(of(t) if t.is_floating_point() or what == "device" else None, l)
        found.pop(None, None)
        if given is None and len(found) > 1:
            said = ", ".join(f"{str(k).replace('torch.', '')} (layer {l})" for k, l in found.items())
            raise ValueError(f"the layers' parameters have several {what}s: {said}; a network has one: pass "
                             f"{what}= to from_layers, or convert the modules first")
    net = cls([k for k, _ in picked], energy=energy, layers=layers_owned,
              dtype=p.dtype if p is not None else torch.get_default_dtype(), device=p.device if p is not None else None,
              init=False, **kw)
    state = {f"layers.{l}.{name}": t for l, (_, params) in enumerate(picked, start=1) for name, t in params.items()}
    if net.groups and net.groups[0].first == 0:  # a learned prior mean starts at its init (zero)
        state.update({f"layers.0.{name}": t.detach() for name, t in net.groups[0].public_params(0).items()})
    net.load_layer_state_dict(state)
    _carry_frozen(net, picked)
    for g in net.groups:  # a module layer's own buffers (the parameters are in state)
        if getattr(g.kind, "kind", None) == "module":
            for k, l in enumerate(g.layers):
                g.load_buffers(k, mods[l - 1])
    for l, (m, (_, params)) in enumerate(zip(mods, picked), start=1):  # to_layers gives these modules back
        names = {id(t): n for n, t in m.named_parameters()}
        net._templates[l] = (copy.deepcopy(m), {pub: names[id(t)] for pub, t in params.items()})
        net.structure[l] = module_structure(m)
    return net if device is None and dtype is None else net.to(device=device, dtype=dtype)


def _carry_frozen(net, picked) -> None:
    """The user's frozen parameters (``requires_grad_(False)``) frozen in the network: the stacked parameter of a
    group of layers is frozen where every one of its layers' is, and a group whose layers disagree is refused."""
    stacked: dict[int, tuple[torch.Tensor, list]] = {}
    for g in net.groups:
        for k, l in enumerate(g.layers):
            if l == 0:  # the prior of h_0: not one of the user's layers
                continue
            for name, view in g.public_params(k).items():
                root = view if view._base is None else view._base
                stacked.setdefault(id(root), (root, []))[1].append((l, not picked[l - 1][1][name].requires_grad))
    for root, flags in stacked.values():
        frozen = {f for _, f in flags}
        if frozen == {True}:
            root.requires_grad_(False)
        elif len(frozen) > 1:
            raise ValueError(f"layers {[l for l, f in flags if f]} are frozen (requires_grad=False) and layers "
                             f"{[l for l, f in flags if not f]} not, but they share one stacked parameter (layers of "
                             f"one shape are fused): freeze all of them or none")


def from_sequential(cls, seq: nn.Sequential, energy: str = "se", layers: tuple[int, int] | None = None,
                    input_shape: Sequence[int] | None = None, **kw):
    """``cls.from_sequential`` (PCNetwork.from_sequential): ``from_layers`` on the blocks of
    ``split_sequential(seq)``, remembering ``seq`` for ``to_sequential``."""
    blocks = split_sequential(seq, stacklevel=4)
    net = cls.from_layers(blocks, energy=energy, input_shape=input_shape, layers_owned=layers, **kw)
    names = {id(t): n for n, t in seq.named_parameters()}
    where = {(l, pub): names[id(b.get_parameter(name))]
             for l, b in enumerate(blocks, start=1) for pub, name in net._templates[l][1].items()}
    net.__dict__["_sequential"] = (copy.deepcopy(seq), where)  # to_sequential gives this Sequential back
    return net


def to_layers(net) -> nn.ModuleList:
    """``net.to_layers()``: the current weights as plain torch modules, one per PC layer."""
    if not net.owns_all:
        raise RuntimeError("to_layers needs all layers; this network owns a slice")
    out = []
    for g in net.groups:
        if g.first == 0:  # the prior of h_0: not a layer
            continue
        for k, l in enumerate(g.layers):
            if l in net._templates:
                out.append(_from_template(net, g, k, l))
            else:
                out.append(apply_structure(g.to_module(k), net.structure.get(l)))
    return nn.ModuleList(out)


def _from_template(net, g, k: int, l: int) -> nn.Module:
    template, names = net._templates[l]
    m = copy.deepcopy(template)
    p = next(g.parameters(), None)  # a layer of no parameters (nn.Tanh(), a pooling) as the network holds it
    p = p if p is not None else next(net.parameters(), None)
    if p is not None:
        m.to(device=p.device, dtype=p.dtype)
    with torch.no_grad():
        for pub, t in g.public_params(k).items():
            m.get_parameter(names[pub]).copy_(t)
        for name, t in g.public_buffers(k).items():  # a module layer's buffers, as the network holds them
            m.get_buffer(name).copy_(t)
    return m


def to_sequential(net) -> nn.Sequential:
    """``net.to_sequential()``: the current weights as a plain nn.Sequential."""
    if "_sequential" in net.__dict__ and net.owns_all:
        seq, where = net.__dict__["_sequential"]
        seq = copy.deepcopy(seq)
        p = next(net.parameters())
        seq.to(device=p.device, dtype=p.dtype)
        with torch.no_grad():
            for g in net.groups:
                for k, l in enumerate(g.layers if g.first > 0 else ()):  # the prior of h_0 is not a layer
                    for pub, t in g.public_params(k).items():
                        seq.get_parameter(where[l, pub]).copy_(t)
        return seq
    mods: list[nn.Module] = []
    for m in net.to_layers():
        mods.extend(m if isinstance(m, nn.Sequential) else [m])
    return nn.Sequential(*mods)


def module_structure(m: nn.Module) -> dict:
    """How a module nests its parts, as plain data (run directories record it): ``{"wrap": "bare"}``
    or ``{"wrap": "sequential", "names": [child names]}``."""
    if isinstance(m, nn.Sequential):
        return {"wrap": "sequential", "names": [n for n, _ in m.named_children()]}
    return {"wrap": "bare"}


def apply_structure(m: nn.Module, structure: dict | None) -> nn.Module:
    """A kind's own module ``m`` nested as ``structure`` (``module_structure``) says; an identity
    activation the user did not write is dropped."""
    if not structure:
        return m
    parts = list(m) if isinstance(m, nn.Sequential) else [m]
    want = 1 if structure["wrap"] == "bare" else len(structure["names"])
    while len(parts) > want and isinstance(parts[-1], nn.Identity):
        parts.pop()
    if len(parts) != want:
        return m
    if structure["wrap"] == "bare":
        return parts[0]
    return nn.Sequential(OrderedDict(zip(structure["names"], parts)))


_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d)


def split_sequential(seq: nn.Sequential, stacklevel: int = 3) -> list[nn.Sequential]:
    """The modules of ``seq`` (nested Sequentials flattened) as one nn.Sequential per PC layer:
    [nn.Flatten,] (nn.Linear | nn.Conv1d | nn.Conv2d) [, activation] [, pooling]. The modules are
    shared, not copied. A module that fits nowhere is named in a ValueError. ``stacklevel``: the
    warning's about unfused activations (3: the caller of the function that calls this one)."""
    mods = list(_leaves(seq))
    seen: dict[int, int] = {}
    for i, m in enumerate(mods):  # (seq.modules() yields a module used twice once: it was left out silently)
        if id(m) in seen and next(m.parameters(), None) is not None:
            raise ValueError(f"module {i} ({type(m).__name__}) is module {seen[id(m)]} again: its weights would "
                             f"serve two PC layers, which each train weights of their own; give each place a module "
                             f"of its own (copy.deepcopy)")
        seen.setdefault(id(m), i)
    blocks: list[list[nn.Module]] = []
    flatten: tuple[int, nn.Flatten] | None = None
    hint = ("from_sequential puts a value node after each nn.Linear / nn.Conv with its activation and pooling; "
            "for other blocks give one module per PC layer to PCNetwork.from_layers")
    for i, m in enumerate(mods):
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            blocks.append([m] if flatten is None else [flatten[1], m])
            flatten = None
        elif isinstance(m, nn.Flatten):
            if flatten is not None:
                raise ValueError(f"module {i} (Flatten) follows another nn.Flatten")
            flatten = (i, m)
        elif flatten is not None:
            raise ValueError(f"module {i} ({type(m).__name__}) follows the nn.Flatten at module {flatten[0]}: "
                             f"a Flatten goes right before an nn.Linear; {hint}")
        elif not blocks:
            raise ValueError(f"module {i} ({type(m).__name__}) comes before the first nn.Linear, nn.Conv1d or "
                             f"nn.Conv2d; {hint}")
        else:
            cur = blocks[-1]
            layer = cur[1] if isinstance(cur[0], nn.Flatten) else cur[0]
            has_act = any(_elementwise(x) for x in cur if x is not layer and not isinstance(x, nn.Flatten))
            has_pool = any(isinstance(x, _POOLS) for x in cur)
            if _elementwise(m) and not has_act and not has_pool:
                cur.append(m)
            elif isinstance(m, (nn.Softmax, nn.LogSoftmax)) and i == len(mods) - 1:
                raise ValueError(f"module {i} ({type(m).__name__}) after the output layer: leave it out; energy='ce' "
                                 f"applies the softmax to the output layer's u_L = a_L (the logits) itself")
            elif isinstance(m, _POOLS) and isinstance(layer, (nn.Conv1d, nn.Conv2d)) and not has_pool:
                cur.append(m)
            elif _elementwise(m) and has_pool:
                raise ValueError(f"module {i} ({type(m).__name__}) after the pooling: a conv PC layer is convolution, "
                                 f"activation, then pooling; put the activation before the pooling (with max pooling "
                                 f"and a non-decreasing activation such as ReLU it is the same function)")
            elif _elementwise(m):
                raise ValueError(f"module {i} ({type(m).__name__}): two activations in a row cannot be placed "
                                 f"where a value node would go; {hint}")
            else:
                raise ValueError(f"module {i} ({type(m).__name__}) cannot be placed where a value node would go; "
                                 f"{hint}")
    if flatten is not None:
        raise ValueError(f"module {flatten[0]} (Flatten) is not followed by an nn.Linear")
    if not blocks:
        raise ValueError("the Sequential has no nn.Linear or nn.Conv layer")
    last = blocks[-1]
    acts = [activation_from_module(x).name if _is_activation(x) else type(x).__name__ for x in last
            if _elementwise(x)]
    if acts and acts[0] != "identity":
        raise ValueError(f"the output layer must not be followed by an activation (found {acts[0]}); "
                         "the output energy acts on u_L = a_L")
    unfused = [f"{type(x).__name__} (module {mods.index(x)})" for b in blocks for x in b
               if _elementwise(x) and not _is_activation(x)]
    if unfused:
        warnings.warn(f"from_sequential: {', '.join(unfused)} {'is' if len(unfused) == 1 else 'are'} not among the "
                      f"fused activations ({SUPPORTED_MODULES}); such a layer runs through the module kind "
                      f"(autograd's VJPs, slower than a fused activation)", stacklevel=stacklevel)
    return [nn.Sequential(*b) for b in blocks]


def _leaves(seq: nn.Sequential):
    """The modules of ``seq`` in order, nested Sequentials flattened, a module used twice at each of its places."""
    for m in seq._modules.values():
        if isinstance(m, nn.Sequential):
            yield from _leaves(m)
        elif m is not None:
            yield m


def _elementwise(m: nn.Module) -> bool:
    """An activation: fused (``_is_activation``), one of torch's other elementwise modules, or a fused one's class
    computing its own forward (a subclass, a hook: the module kind runs it)."""
    return _is_activation(m) or isinstance(m, ELEMENTWISE_MODULES + FUSED_MODULES)


def _is_activation(m: nn.Module) -> bool:
    try:
        activation_from_module(m)
        return True
    except ValueError:
        return False
