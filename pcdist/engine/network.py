"""Predictive-coding networks stored as groups of stacked, equal layers of any kind.

Layer l (1-based, global) maps value node l-1 to the prediction of node l; layer L is
the output layer. Each layer is described by a kind (pcdist.layers: ``Dense``, ``Residual``,
``Conv``, ``ModuleKind``); consecutive equal layers form one group whose parameters are
stacked [K, ...] tensors, so every phase of the K layers is one batched kernel. The network
also fixes its energy: the output energy, each layer's precision pi_l and the prior of a
free bottom node h_0 (pcdist/engine/layers/prior.py). The conversions to and from plain
torch modules (``from_layers``, ``from_sequential``, ``to_layers``, ``to_sequential``) live in
pcdist/engine/convert.py.
"""

from __future__ import annotations

import inspect
import math
from typing import Sequence

import torch
from torch import Tensor, nn

from . import convert
from .activations import Activation, get_activation
from .convert import module_structure, split_sequential
from .energies import check_energy
from .layers import Dense, LayerGroup, LayerKind, group_layers, seeded_generator
from .layers.prior import Prior, PriorGroup
from ..errors import did_you_mean

__all__ = ["PCNetwork", "group_layers", "mlp_specs", "legacy_signature", "split_sequential", "precisions",
           "module_structure", "check_specs", "network_input"]


def precisions(precision, num_layers: int) -> tuple[float, ...] | None:
    """The precisions pi_1 .. pi_L of a network: None (all 1), one number for every hidden layer
    (the output layer's stays 1) or one per layer; None again when every one is 1."""
    if precision is None:
        return None
    if torch.is_tensor(precision) and precision.dim() == 0:
        precision = float(precision)
    if isinstance(precision, (int, float)) and not isinstance(precision, bool):
        values = [float(precision)] * (num_layers - 1) + [1.0]
    else:
        try:
            if isinstance(precision, (str, bytes)):
                raise TypeError
            values = [float(v) for v in precision]
        except (TypeError, ValueError):
            raise ValueError(f"precision must be a number (the hidden layers') or one number per layer, got "
                             f"{precision!r}") from None
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
        _check_dtype_device(dtype, device)
        self.specs = check_specs(specs)
        L = len(self.specs)
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
        _check_keywords(cls, "from_dims", kw)
        return cls(mlp_specs(dims, activation, init), energy=energy, **kw)

    @classmethod
    def from_layers(cls, layers: Sequence[nn.Module], energy: str = "se", input_shape: Sequence[int] | None = None,
                    layers_owned: tuple[int, int] | None = None, **kw) -> "PCNetwork":
        """A PCNetwork with a copy of the weights of ``layers``, one torch module per PC layer.

        Module l maps value node l-1 to the prediction of node l; the last one is the output
        layer. Each module gets the fastest kind that expresses it (``pcdist.engine.layers.kind_from_module``):
        [nn.Flatten,] nn.Linear [+ activation] -> dense, nn.Conv1d/2d [+ activation] [+ pooling] -> conv,
        pcdist.ResidualLinear -> residual. ``input_shape`` is the input node's shape without the batch
        (needed when the first layer is a convolution, e.g. (1, 8, 8)). ``layers_owned=(a, b)`` keeps
        only layers a..b-1 (a layer slice). ``precision`` and ``prior`` go to the constructor.
        """
        _check_keywords(cls, "from_layers", kw)
        return convert.from_layers(cls, layers, energy, input_shape, layers_owned, **kw)

    @classmethod
    def from_sequential(cls, seq: nn.Sequential, energy: str = "se", layers: tuple[int, int] | None = None,
                        input_shape: Sequence[int] | None = None, **kw) -> "PCNetwork":
        """A PCNetwork with a copy of the weights of an nn.Sequential (or of a slice of it).

        A value node goes after each nn.Linear / nn.Conv1d / nn.Conv2d with the activation and the
        pooling that follow it; an nn.Flatten goes with the nn.Linear after it. ``input_shape`` as in
        ``from_layers`` (a network that starts with a convolution needs it). Anything else cannot be
        placed where a value node would go: build such networks with ``from_layers``.
        """
        _check_keywords(cls, "from_sequential", kw)
        return convert.from_sequential(cls, seq, energy, layers, input_shape, **kw)

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

    def prior_group(self, dtype: torch.dtype | None = None) -> PriorGroup:
        """The prior of h_0 as group 0: the network's own (a learned mean), or a constant one (in ``dtype``,
        default the parameters')."""
        if self.groups and isinstance(self.groups[0], PriorGroup):
            return self.groups[0]
        p = next(self.parameters())
        return PriorGroup(self.prior, self.node_shapes[0], dtype=dtype or p.dtype, device=p.device)

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
        """The owned layers' parameters (and a module layer's buffers) keyed by global layer index, in their public
        layout: ``layers.{l}.weight`` [out, in] and ``layers.{l}.bias`` [out] for dense layers."""
        return {f"layers.{l}.{name}": t.detach().clone() for g in self.groups for k, l in enumerate(g.layers)
                for name, t in {**g.public_params(k), **g.public_buffers(k)}.items()}

    def load_layer_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load the owned layers from a (possibly larger) dict keyed by global layer index (buffers where the dict
        has them: checkpoints written before buffers were saved have none)."""
        with torch.no_grad():
            for g in self.groups:
                for k, l in enumerate(g.layers):
                    for name, dst in g.public_buffers(k).items():
                        if f"layers.{l}.{name}" in state:
                            dst.copy_(state[f"layers.{l}.{name}"])
                    for name, dst in g.public_params(k).items():
                        key = f"layers.{l}.{name}"
                        if key not in state:
                            raise KeyError(f"missing {key!r} in the layer state "
                                           f"(owned layers {self.first}..{self.stop - 1})")
                        if tuple(state[key].shape) != tuple(dst.shape):
                            raise ValueError(f"{key}: shape {list(state[key].shape)} does not match the model's "
                                             f"{list(dst.shape)}")
                        dst.copy_(state[key])

    # -- evaluation ---------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        """One feed-forward pass through the owned layers; on the full network, the logits u_L.

        The first layer takes its input node's shape, as ``trainer.step`` does, and also images for
        a vector input, flattened here (as the training service feeds them; ``step`` takes them
        flat); floats are cast to the weights' dtype; integer inputs are refused (scale them to
        floats as in training, e.g. uint8 / 255)."""
        if self.first == 1:
            x = network_input(self, x)
        for g in self.groups:
            x = g(x)
        return x

    def to_layers(self) -> nn.ModuleList:
        """The current weights as plain torch modules, one per PC layer: the modules given to
        ``from_layers`` (same classes, nesting and ``state_dict`` keys), else each kind's own
        (nested as ``structure`` records, e.g. for a network loaded from a run)."""
        return convert.to_layers(self)

    def to_sequential(self) -> nn.Sequential:
        """The current weights as a plain nn.Sequential: the one given to ``from_sequential`` (same
        classes, nesting and ``state_dict`` keys), else ``to_layers()`` spliced into one flat
        Sequential (Linear, act, ..., Linear for an MLP; ``nn.Sequential(*net.to_layers())`` keeps
        each layer's own nesting)."""
        return convert.to_sequential(self)


def check_specs(specs: Sequence[LayerKind]) -> tuple[LayerKind, ...]:
    """``specs`` as a tuple, after each kind's own check and a check that each layer's output shape is the
    next layer's input shape; a TypeError or ValueError naming the layer otherwise."""
    if not specs:
        raise ValueError("a PCNetwork needs at least one layer")
    specs = tuple(specs)
    L = len(specs)
    for l, s in enumerate(specs, start=1):
        if not isinstance(s, LayerKind):
            raise TypeError(f"layer {l}: expected a layer kind (pcdist.layers.Dense, Residual, ...), got {s!r}")
        s.check(l, l == L)
    for l, (s, nxt) in enumerate(zip(specs, specs[1:]), start=1):
        if s.out_shape != nxt.in_shape:
            what = "features" if len(s.out_shape) == 1 else "shape"
            a, b = (s.out_shape[0], nxt.in_shape[0]) if len(s.out_shape) == len(nxt.in_shape) == 1 else \
                (list(s.out_shape), list(nxt.in_shape))
            raise ValueError(f"layer {l} outputs {a} {what} but layer {l + 1} expects {b}")
    return specs


def network_input(net: PCNetwork, x: Tensor) -> Tensor:
    """x as the first layer's input node of ``net`` [B, *in_shape] in the weights' dtype, or a ValueError."""
    shape = tuple(net.node_shapes[0])
    p = next(net.parameters(), None)
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


def _check_dtype_device(dtype, device) -> None:
    """A floating-point dtype; a CUDA device only where torch sees one (not torch's bare AssertionError later)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch dtype (torch.float32, torch.float64), got {dtype}")
    if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}: this torch sees no CUDA device (a CPU build of torch, or no GPU "
                         f"visible: CUDA_VISIBLE_DEVICES, the driver); use device='cpu'")


def _check_keywords(cls, method: str, kw: dict) -> None:
    """The keywords ``method`` passes on to the constructor: one it does not take is named against ``method``
    (not against ``PCNetwork.__init__``, which the user did not call), with a near miss."""
    takes = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "specs", "energy")]
    for k in kw:
        if k not in takes:
            raise TypeError(f"{cls.__name__}.{method}() got an unexpected keyword argument {k!r}"
                            f"{did_you_mean(k, takes) or ' (it passes on ' + ', '.join(takes) + ')'}")
