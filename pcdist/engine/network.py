"""Predictive-coding networks stored as groups of stacked, equal layers of any kind.

Layer l (1-based, global) maps value node l-1 to the prediction of node l; layer L is
the output layer. Each layer is described by a kind (pcdist.layers: ``Dense``, ``Residual``,
``Conv``, ``ModuleKind``); consecutive equal layers form one group whose parameters are
stacked [K, ...] tensors, so every phase of the K layers is one batched kernel. The network
also fixes its energy: the output energy, each layer's precision pi_l and the prior of a
free bottom node h_0 (pcdist/engine/layers/prior.py).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import OrderedDict
from typing import Sequence

import torch
from torch import Tensor, nn

from .activations import ELEMENTWISE_MODULES, SUPPORTED_MODULES, Activation, activation_from_module, get_activation
from .energies import check_energy
from .layers import Dense, LayerGroup, LayerKind, group_layers, kind_from_module, seeded_generator
from .layers.prior import Prior, PriorGroup

__all__ = ["PCNetwork", "group_layers", "mlp_specs", "legacy_signature", "split_sequential", "precisions", "module_structure"]


def precisions(precision, num_layers: int) -> tuple[float, ...] | None:
    """The precisions pi_1 .. pi_L of a network: None (all 1), one number for every hidden layer
    (the output layer's stays 1) or one per layer; None again when every one is 1."""
    if precision is None:
        return None
    if isinstance(precision, (int, float)) and not isinstance(precision, bool):
        values = [float(precision)] * (num_layers - 1) + [1.0]
    else:
        values = [float(v) for v in precision]
        if len(values) != num_layers:
            raise ValueError(f"precision needs one value per layer ({num_layers}) or one number for the hidden "
                             f"layers, got {len(values)} values")
    bad = [v for v in values if not (math.isfinite(v) and v >= 0)]
    if bad:
        raise ValueError(f"precisions must be finite numbers >= 0, got {bad[0]!r}")
    return None if all(v == 1.0 for v in values) else tuple(values)


def mlp_specs(dims: Sequence[int], activation: str | Activation = "tanh", init: str = "default") -> list[Dense]:
    """Dense layers of an MLP with widths ``dims`` (input, hidden..., output); no activation on the output."""
    if len(dims) < 2 or any(isinstance(d, bool) or int(d) != d or int(d) < 1 for d in dims):
        raise ValueError(f"model dims must be at least two positive integer widths, got {list(dims)}")
    act = activation if isinstance(activation, Activation) else get_activation(activation)
    L = len(dims) - 1
    return [Dense(int(dims[l]), int(dims[l + 1]), act if l < L - 1 else None, init=init) for l in range(L)]


def legacy_signature(model) -> list[dict] | None:
    """The layer signatures of a checkpoint written before layer kinds ([dims, activation names]
    of an MLP), or None if ``model`` is not in that form."""
    if not (isinstance(model, (list, tuple)) and len(model) == 2 and all(isinstance(m, (list, tuple)) for m in model)):
        return None
    dims, acts = model
    if len(dims) != len(acts) + 1:
        return None
    return [{"kind": "dense", "in": dims[l], "out": dims[l + 1], "activation": acts[l]} for l in range(len(acts))]


class PCNetwork(nn.Module):
    """A predictive-coding network; owns the layers [first, stop) of ``specs`` (layer kinds).

    A single process owns all layers. Each rank of a layer-parallel run owns one
    contiguous slice, and allocates only that slice's parameters.

    ``energy``: the output energy ("se", "ce", "bce", "zero" or a callable ``energy(u, target) -> [B]``,
    pcdist/engine/energies.py). ``precision``: the layers' precisions pi_l (``precisions``).
    ``prior``: the ``Prior`` of h_0 when it is free (default: precision 1, mean zero); a learned
    mean is a parameter of the slice that owns layer 1 (group 0).
    """

    def __init__(
        self,
        specs: Sequence[LayerKind],
        energy: str = "se",
        layers: tuple[int, int] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init: bool = True,
        seed: int | None = None,
        precision=None,
        prior: Prior | None = None,
    ):
        super().__init__()
        if not specs:
            raise ValueError("a PCNetwork needs at least one layer")
        self.specs = tuple(specs)
        L = len(self.specs)
        for l, s in enumerate(self.specs, start=1):
            if not isinstance(s, LayerKind):
                raise TypeError(f"layer {l}: expected a layer kind (pcdist.layers.Dense, Residual, ...), got {s!r}")
            s.check(l, l == L)
        for l, (s, nxt) in enumerate(zip(self.specs, self.specs[1:]), start=1):
            if s.out_shape != nxt.in_shape:
                what = "features" if len(s.out_shape) == 1 else "shape"
                a, b = (s.out_shape[0], nxt.in_shape[0]) if len(s.out_shape) == len(nxt.in_shape) == 1 else \
                    (list(s.out_shape), list(nxt.in_shape))
                raise ValueError(f"layer {l} outputs {a} {what} but layer {l + 1} expects {b}")
        self.energy = check_energy(energy)
        self.precision = precisions(precision, L)
        self.prior = prior if prior is not None else Prior()
        if not isinstance(self.prior, Prior):
            raise TypeError(f"prior must be a pcdist Prior, got {self.prior!r}")
        first, stop = layers if layers is not None else (1, L + 1)
        if not 1 <= first < stop <= L + 1:
            raise ValueError(f"layer slice [{first}, {stop}) is not within layers 1..{L}")
        self.first, self.stop = first, stop
        self.groups = nn.ModuleList(self.specs[s - 1].make_group(s, t - s, dtype=dtype, device=device)
                                    for s, t in group_layers(self.specs, first, stop))
        if self.prior.mean == "learned" and first == 1:
            self.groups.insert(0, PriorGroup(self.prior, self.node_shapes[0], dtype=dtype, device=device))
        self.__dict__["_templates"] = {}  # layer -> (the user's module, {public name: its parameter name})
        self.structure: dict[int, dict] = {}  # layer -> module_structure of the user's module (to_layers' nesting)
        if init:
            self.reset_parameters(seed)

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_dims(cls, dims: Sequence[int], activation: str | Activation = "tanh", energy: str = "se",
                  init: str = "default", **kw) -> "PCNetwork":
        """An MLP with widths ``dims`` (input, hidden..., output), nn.Linear's default init
        (``init="orthogonal"``: orthogonal weights, zero biases).

        Keywords go to the constructor: ``layers=(a, b)`` for a slice, ``seed``, ``dtype``, ``device``.
        """
        return cls(mlp_specs(dims, activation, init), energy=energy, **kw)

    @classmethod
    def from_layers(cls, layers: Sequence[nn.Module], energy: str = "se", input_shape: Sequence[int] | None = None,
                    layers_owned: tuple[int, int] | None = None, **kw) -> "PCNetwork":
        """A PCNetwork with a copy of the weights of ``layers``, one torch module per PC layer.

        Module l maps value node l-1 to the prediction of node l; the last one is the output
        layer. Each module gets the fastest kind that expresses it (``pcdist.layers.kind_from_module``):
        [nn.Flatten,] nn.Linear [+ activation] -> dense, nn.Conv1d/2d [+ activation] [+ pooling] -> conv,
        pcdist.ResidualLinear -> residual. ``input_shape`` is the input node's shape without the batch
        (needed when the first layer is a convolution, e.g. (1, 8, 8)). ``layers_owned=(a, b)`` keeps
        only layers a..b-1 (a layer slice). ``precision`` and ``prior`` go to the constructor.
        """
        mods = list(layers)
        if not mods:
            raise ValueError("from_layers needs at least one module")
        picked, shape = [], None if input_shape is None else tuple(int(d) for d in input_shape)
        for l, m in enumerate(mods, start=1):
            kind, params = kind_from_module(m, l, l == len(mods), shape)
            picked.append((kind, params))  # shapes that do not chain are named by the constructor
            shape = tuple(kind.out_shape)
        p = next(iter(picked[0][1].values()))
        net = cls([k for k, _ in picked], energy=energy, layers=layers_owned, dtype=p.dtype, device=p.device,
                  init=False, **kw)
        state = {f"layers.{l}.{name}": t for l, (_, params) in enumerate(picked, start=1) for name, t in params.items()}
        if net.groups and net.groups[0].first == 0:  # a learned prior mean starts at its init (zero)
            state.update({f"layers.0.{name}": t.detach() for name, t in net.groups[0].public_params(0).items()})
        net.load_layer_state_dict(state)
        for l, (m, (_, params)) in enumerate(zip(mods, picked), start=1):  # to_layers gives these modules back
            names = {id(t): n for n, t in m.named_parameters()}
            net._templates[l] = (copy.deepcopy(m), {pub: names[id(t)] for pub, t in params.items()})
            net.structure[l] = module_structure(m)
        return net

    @classmethod
    def from_sequential(cls, seq: nn.Sequential, energy: str = "se", layers: tuple[int, int] | None = None,
                        input_shape: Sequence[int] | None = None, **kw) -> "PCNetwork":
        """A PCNetwork with a copy of the weights of an nn.Sequential (or of a slice of it).

        A value node goes after each nn.Linear / nn.Conv1d / nn.Conv2d with the activation and the
        pooling that follow it; an nn.Flatten goes with the nn.Linear after it. ``input_shape`` as in
        ``from_layers`` (a network that starts with a convolution needs it). Anything else cannot be
        placed where a value node would go: build such networks with ``from_layers``.
        """
        blocks = split_sequential(seq)
        net = cls.from_layers(blocks, energy=energy, input_shape=input_shape, layers_owned=layers, **kw)
        names = {id(t): n for n, t in seq.named_parameters()}
        where = {(l, pub): names[id(b.get_parameter(name))]
                 for l, b in enumerate(blocks, start=1) for pub, name in net._templates[l][1].items()}
        net.__dict__["_sequential"] = (copy.deepcopy(seq), where)  # to_sequential gives this Sequential back
        return net

    def reset_parameters(self, seed: int | None = None) -> None:
        """Each kind's init (dense: nn.Linear's default; residual: N(0, 1)), layer by layer.

        With a ``seed``, layer l draws from its own generator seeded by (seed, l), so
        the weights do not depend on how the layers are split over ranks.
        """
        for g in self.groups:
            for k, l in enumerate(g.layers):
                g.reset_layer(k, seeded_generator(seed, l))

    # -- structure ----------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.specs)

    @property
    def node_shapes(self) -> list[tuple[int, ...]]:
        """Shape of each value node h_0 .. h_L (without the batch)."""
        return [self.specs[0].in_shape] + [s.out_shape for s in self.specs]

    @property
    def dims(self) -> list[int]:
        """Widths of the value nodes h_0 .. h_L (their sizes, for nodes that are not vectors)."""
        return [int(torch.Size(s).numel()) for s in self.node_shapes]

    @property
    def owns_all(self) -> bool:
        return self.first == 1 and self.stop == self.num_layers + 1

    def prior_group(self) -> PriorGroup:
        """The prior of h_0 as group 0: the network's own (a learned mean), or a constant one."""
        if self.groups and isinstance(self.groups[0], PriorGroup):
            return self.groups[0]
        p = next(self.parameters())
        return PriorGroup(self.prior, self.node_shapes[0], dtype=p.dtype, device=p.device)

    def signature(self) -> list[dict]:
        """What fixes the parameters' shapes and meaning, layer by layer (checkpoints compare it)."""
        return [s.signature() for s in self.specs]

    def _locate(self, l: int) -> tuple[LayerGroup, int]:
        for g in self.groups:
            if g.first <= l < g.first + g.K:
                return g, l - g.first
        raise IndexError(f"layer {l} is not owned here (owned: {self.first}..{self.stop - 1})")

    def layer_params(self, l: int) -> dict[str, Tensor]:
        """Writable views of global layer l's parameters in their public layout (nn.Linear's for
        dense and residual layers: ``weight`` [out, in], ``bias`` [out])."""
        g, k = self._locate(l)
        return g.public_params(k)

    def layer_weight(self, l: int) -> Tensor:
        """W_l^T [in, out] of global dense or residual layer l, a view into its group's stacked weight."""
        g, k = self._locate(l)
        return g.weight[k]

    def layer_bias(self, l: int) -> Tensor:
        """b_l [out] of global layer l, a view into its group's stacked bias."""
        g, k = self._locate(l)
        return g.bias[k]

    def layer_state_dict(self) -> dict[str, Tensor]:
        """The owned layers' parameters keyed by global layer index, in their public layout:
        ``layers.{l}.weight`` [out, in] and ``layers.{l}.bias`` [out] for dense layers."""
        return {f"layers.{l}.{name}": t.detach().clone()
                for g in self.groups for k, l in enumerate(g.layers) for name, t in g.public_params(k).items()}

    def load_layer_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load the owned layers from a (possibly larger) dict keyed by global layer index."""
        with torch.no_grad():
            for g in self.groups:
                for k, l in enumerate(g.layers):
                    for name, dst in g.public_params(k).items():
                        key = f"layers.{l}.{name}"
                        if key not in state:
                            raise KeyError(f"missing {key!r} in the layer state (owned layers {self.first}..{self.stop - 1})")
                        if tuple(state[key].shape) != tuple(dst.shape):
                            raise ValueError(f"{key}: shape {list(state[key].shape)} does not match the model's {list(dst.shape)}")
                        dst.copy_(state[key])

    # -- evaluation ---------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        """One feed-forward pass through the owned layers; on the full network, the logits u_L.

        The first layer takes what ``trainer.step`` takes, as the training service feeds it:
        images for a vector input are flattened, floats are cast to the weights' dtype; integer
        inputs are refused (scale them to floats as in training, e.g. uint8 / 255)."""
        if self.first == 1:
            x = self._as_input(x)
        for g in self.groups:
            x = g(x)
        return x

    def _as_input(self, x: Tensor) -> Tensor:
        """x as the first layer's input node [B, *in_shape] in the weights' dtype, or a ValueError."""
        shape = tuple(self.node_shapes[0])
        p = next(self.parameters(), None)
        if not torch.is_tensor(x):
            raise TypeError(f"the network takes a tensor [batch, {', '.join(map(str, shape))}], got {type(x).__name__}")
        if not (x.is_floating_point() or x.is_complex()):
            raise ValueError(f"the network takes float inputs, got {x.dtype}: scale them as in training "
                             "(uint8 images: x / 255, or pcdist.load(...).preprocess(x))")
        if tuple(x.shape[1:]) != shape:
            if x.ndim >= 2 and len(shape) == 1 and x[0].numel() == shape[0]:
                x = x.flatten(1)  # images into a vector input, flattened as the service does
            else:
                raise ValueError(f"the network takes inputs [batch, {', '.join(map(str, shape))}], got "
                                 f"{list(x.shape)}")
        if p is not None and x.dtype != p.dtype:
            x = x.to(p.dtype)
        return x

    def to_layers(self) -> nn.ModuleList:
        """The current weights as plain torch modules, one per PC layer: the modules given to
        ``from_layers`` (same classes, nesting and ``state_dict`` keys), else each kind's own
        (nested as ``structure`` records, e.g. for a network loaded from a run)."""
        if not self.owns_all:
            raise RuntimeError("to_layers needs all layers; this network owns a slice")
        out = []
        for g in self.groups:
            if g.first == 0:  # the prior of h_0: not a layer
                continue
            for k, l in enumerate(g.layers):
                if l in self._templates:
                    out.append(self._from_template(g, k, l))
                else:
                    out.append(apply_structure(g.to_module(k), self.structure.get(l)))
        return nn.ModuleList(out)

    def _from_template(self, g, k: int, l: int) -> nn.Module:
        template, names = self._templates[l]
        m = copy.deepcopy(template)
        p = next(g.parameters())
        m.to(device=p.device, dtype=p.dtype)
        with torch.no_grad():
            for pub, t in g.public_params(k).items():
                m.get_parameter(names[pub]).copy_(t)
        return m

    def to_sequential(self) -> nn.Sequential:
        """The current weights as a plain nn.Sequential: the one given to ``from_sequential`` (same
        classes, nesting and ``state_dict`` keys), else ``to_layers()`` spliced into one flat
        Sequential (Linear, act, ..., Linear for an MLP; ``nn.Sequential(*net.to_layers())`` keeps
        each layer's own nesting)."""
        if "_sequential" in self.__dict__ and self.owns_all:
            seq, where = self.__dict__["_sequential"]
            seq = copy.deepcopy(seq)
            p = next(self.parameters())
            seq.to(device=p.device, dtype=p.dtype)
            with torch.no_grad():
                for g in self.groups:
                    for k, l in enumerate(g.layers if g.first > 0 else ()):  # the prior of h_0 is not a layer
                        for pub, t in g.public_params(k).items():
                            seq.get_parameter(where[l, pub]).copy_(t)
            return seq
        mods: list[nn.Module] = []
        for m in self.to_layers():
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


def split_sequential(seq: nn.Sequential) -> list[nn.Sequential]:
    """The modules of ``seq`` (nested Sequentials flattened) as one nn.Sequential per PC layer:
    [nn.Flatten,] (nn.Linear | nn.Conv1d | nn.Conv2d) [, activation] [, pooling]. The modules are
    shared, not copied. A module that fits nowhere is named in a ValueError."""
    mods = [m for m in seq.modules() if not isinstance(m, nn.Sequential)]
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
            raise ValueError(f"module {i} ({type(m).__name__}) comes before the first nn.Linear or nn.Conv; {hint}")
        else:
            cur = blocks[-1]
            layer = cur[1] if isinstance(cur[0], nn.Flatten) else cur[0]
            has_act = any(_is_activation(x) or isinstance(x, ELEMENTWISE_MODULES) for x in cur
                          if x is not layer and not isinstance(x, nn.Flatten))
            has_pool = any(isinstance(x, _POOLS) for x in cur)
            if (_is_activation(m) or isinstance(m, ELEMENTWISE_MODULES)) and not has_act and not has_pool:
                cur.append(m)
            elif isinstance(m, (nn.Softmax, nn.LogSoftmax)) and i == len(mods) - 1:
                raise ValueError(f"module {i} ({type(m).__name__}) after the output layer: leave it out; energy='ce' "
                                 f"applies the softmax to the output layer's u_L = a_L (the logits) itself")
            elif isinstance(m, _POOLS) and isinstance(layer, (nn.Conv1d, nn.Conv2d)) and not has_pool:
                cur.append(m)
            elif _is_activation(m):
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
    acts = [type(x).__name__ for x in last if isinstance(x, ELEMENTWISE_MODULES)]
    acts += [activation_from_module(x).name for x in last if _is_activation(x)]
    if acts and acts[0] != "identity":
        raise ValueError(f"the output layer must not be followed by an activation (found {acts[0]}); "
                         "the output energy acts on u_L = a_L")
    unfused = [f"{type(x).__name__} (module {mods.index(x)})" for b in blocks for x in b
               if isinstance(x, ELEMENTWISE_MODULES)]
    if unfused:
        warnings.warn(f"from_sequential: {', '.join(unfused)} {'is' if len(unfused) == 1 else 'are'} not among the "
                      f"fused activations ({SUPPORTED_MODULES}); such a layer runs through the module kind "
                      f"(autograd's VJPs, slower than a fused activation)", stacklevel=3)
    return [nn.Sequential(*b) for b in blocks]


def _is_activation(m: nn.Module) -> bool:
    try:
        activation_from_module(m)
        return True
    except ValueError:
        return False
