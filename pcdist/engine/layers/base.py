"""The layer-kind interface: what the engine needs to know about one kind of PC layer.

Shape letters: K layers in a group, B batch, I / O the input / output node shape
(a width for dense and residual layers).

A PC layer maps value node l-1 to the prediction u_l of node l. The engine sees it
through three objects:

* ``LayerKind`` (a frozen dataclass) describes ONE global layer: its node shapes, a
  fuse key (consecutive layers with equal keys stack into one group of K), its FLOPs
  per sample and inference step (for the FLOP-balanced partition) and its signature
  (what a checkpoint records). It builds the parameter group.
* ``LayerGroup`` (an nn.Module) holds the stacked parameters of K consecutive equal
  layers ([K, ...] tensors, so the optimizer sees few large tensors) and their
  parameter init, public per-layer layout (checkpoints, ``to_layers``) and the plain
  feed-forward chain used for evaluation.
* ``BoundGroup`` is a group bound to a Stage's preallocated value nodes for one batch
  size (and one ``Binding``: which end nodes are free, the precisions, the output energy):
  the phases of the PC schedule as a few batched kernels.

The phases (per group, all K layers at once):

    predict       u = layer(h_in)                                   (stale only after h or W moved)
    errors        e = pi (h_out - u) and the layer's error signal (pi: the layer's precision, 1
                  unless given); optionally the value step's own-error term h_out -= lr * e
                  (pc without momentum, see Stage.errors)
    backproject   target <- beta * target + alpha * P,   P = -dE_l/dh_{l-1} per sample
    weight_grads  dF/dtheta into .grad (F the batch mean of E; ``scale`` = -1/B)
    energies      batch-sum energy of each layer (hidden: 1/2 pi ||h_out - u||^2; output: pi E_out)

Everything a phase needs is local to a layer and its two nodes, so the layer-parallel
schedule (pcdist/distributed/exchange.py) is the same for every kind.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from .. import gemm
from ..arguments import whole
from ..energies import OutputEnergy

__all__ = ["LayerKind", "LayerGroup", "BoundGroup", "Binding", "TransposedWeight", "accumulate", "low",
           "seeded_generator", "DerivedWeight", "f32_products", "product_into", "accumulate_product"]

_aten = torch.ops.aten


def seeded_generator(seed: int | None, layer: int) -> torch.Generator | None:
    """Layer ``layer``'s own generator for a network ``seed`` (None: the global RNG), so a layer's
    initial weights do not depend on how the layers are split over ranks."""
    if seed is not None and not whole(seed):
        raise ValueError(f"seed must be None or an integer, got {seed!r}")
    # (mod 2**64: the seed torch takes, for any integer; it took -2**63 .. 2**64 - 1, and maps a negative one so too)
    return None if seed is None else torch.Generator().manual_seed((int(seed) * 1_000_003 + layer) % 2**64)


@dataclass(frozen=True)
class LayerKind:
    """One global PC layer, value node l-1 -> prediction of node l (subclasses are frozen dataclasses)."""

    kind: ClassVar[str] = "?"

    @property
    def in_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def out_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def fuse_key(self):
        """Consecutive layers with equal keys stack into one group (default: the description itself)."""
        return self

    def flops(self, index: int) -> int:
        """FLOPs per sample of one inference step of global layer ``index`` (1-based)."""
        raise NotImplementedError

    def signature(self) -> dict:
        """What a checkpoint records of this layer: the fields that fix its parameters' shapes and meaning."""
        return {"kind": self.kind, **asdict(self)}

    def check(self, index: int, is_output: bool) -> None:
        """Raise ValueError if this layer cannot stand at ``index`` (e.g. an output with an activation)."""

    def make_group(self, first: int, K: int, dtype=None, device=None) -> "LayerGroup":
        raise NotImplementedError


class LayerGroup(nn.Module):
    """K consecutive equal layers with stacked parameters; global layers first .. first + K - 1.

    ``reads_errors``: the group's back-projection reads its layers' errors e themselves (not
    only a signal of its own), so a Stage must keep the errors apart from the value
    gradients it accumulates.
    """

    reads_errors: ClassVar[bool] = False
    lowp_params: ClassVar[tuple[str, ...]] = ()
    """The parameters a trainer with precision="bf16" keeps in bfloat16 for the products (the matmul and
    convolution weights); the rest stay in the master weights' dtype (pcdist/engine/precision.py)."""

    def __init__(self, kind: LayerKind, first: int, K: int):
        super().__init__()
        self.kind, self.first, self.K = kind, first, K

    @property
    def layers(self) -> range:
        return range(self.first, self.first + self.K)

    def public_params(self, k: int) -> dict[str, Tensor]:
        """Writable views of layer k's parameters in their public layout (e.g. nn.Linear's
        ``weight`` [out, in]): what checkpoints, ``to_layers`` and ``from_layers`` exchange."""
        raise NotImplementedError

    def public_buffers(self, k: int) -> dict[str, Tensor]:
        """Writable views of layer k's buffers (a module layer's BatchNorm statistics, say), saved beside its
        parameters; none for pcdist's own kinds."""
        return {}

    def reset_layer(self, k: int, generator: torch.Generator | None) -> None:
        """Initialise layer k from ``generator`` (None: the global RNG)."""
        raise NotImplementedError

    def to_module(self, k: int) -> nn.Module:
        """Layer k as a plain torch module with a copy of its weights (forward = its prediction)."""
        raise NotImplementedError

    def forward(self, h: Tensor) -> Tensor:
        """Feed-forward through the K layers in order (a chain: sequential by nature)."""
        raise NotImplementedError

    def layer(self, k: int, h: Tensor) -> Tensor:
        """Layer k's prediction of a batch h [B, *I] (differentiable, for torch.func: the inits near
        equilibrium, pcdist/engine/equilibrium.py)."""
        raise NotImplementedError(f"{type(self).__name__} has no per-layer prediction")

    def bind(self, h_in: Tensor, h_out: Tensor, e_out: Tensor, b: "Binding") -> "BoundGroup":
        """The group's phases over a Stage's views: ``h_in`` [K, B, *I] and ``h_out`` / ``e_out``
        [K, B, *O] (for the output layer h_out holds the top node: the clamped target, or a free
        node); ``b`` says how (see ``Binding``)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"layers {self.first}..{self.first + self.K - 1}: {self.K} x ({self.kind})"


@dataclass(frozen=True)
class Binding:
    """How a group is bound to a Stage for one batch size.

    ``static_weights``: the weights stay fixed through a batch's inference (pc), so weight-derived
    copies may be cached per weight change. ``init``: the value-node init ("ff", "deeppcr").
    ``free_input``: the group's input node is free (a hidden node, or a free h_0), so its
    back-projection is needed and its prediction moves with every value step; False only for
    layer 1 under a clamped h_0. ``energy``: the output group's energy (None for hidden groups);
    ``free_output``: the output group's top node h_L is free (the feed-forward sets it; it then
    follows its energy's gradient). ``prec``: the K layers' precisions [K] (a view of the Stage's,
    which a schedule may change between steps), None when every precision is 1.
    """

    batch_size: int
    static_weights: bool = False
    init: str = "ff"
    free_input: bool = True
    energy: OutputEnergy | None = None
    free_output: bool = False
    prec: Tensor | None = None


class BoundGroup:
    """A LayerGroup's phases over preallocated buffers (see the module docstring).

    Attributes the Stage reads: ``g`` (the LayerGroup), ``K``, ``first``, ``h_in``, ``h_out``,
    ``e_out``, ``is_output``, ``free_input`` and ``cached`` (u is current for the present inputs and
    weights); an output group also keeps ``u``, ``d`` (its signal) and ``energy``.
    """

    def __init__(self, g: LayerGroup, h_in: Tensor, h_out: Tensor, e_out: Tensor, b: Binding):
        self.g, self.K, self.first = g, g.K, g.first
        self.h_in, self.h_out, self.e_out = h_in, h_out, e_out
        self.energy, self.is_output = b.energy, b.energy is not None
        self.free_input, self.free_output, self.prec = b.free_input, b.free_output, b.prec
        self.cached = False

    def feedforward(self, rows: slice | None, init: str) -> None:
        """u for the K layers as a chain from h_in[0] (restricted to ``rows``), then h_out <- u
        (hidden groups); leaves the group cached."""
        raise NotImplementedError

    def predict(self) -> None:
        raise NotImplementedError

    def errors(self, with_signal: bool, step_lr: float | None, hold_last: bool = False) -> None:
        """e = h_out - u (hidden) or the output's error signal, predicting first if stale.

        ``with_signal``: the signal that feeds the back-projection is wanted (global layer 1
        needs its signal only for the weight gradient). ``step_lr``: also take h_out -= step_lr * e
        (on all nodes but the last with ``hold_last``)."""
        raise NotImplementedError

    def backproject(self, target: Tensor, beta: float, alpha: float) -> None:
        """target [K, B, *I] <- beta * target + alpha * P with P = -dE_l/dh_{l-1} (beta 0 ignores
        the old contents)."""
        raise NotImplementedError

    def weight_grads(self, scale: float) -> None:
        """Write scale * (-dE/dtheta summed over the batch) into the group's .grad (which exist)."""
        raise NotImplementedError

    def energies(self) -> Tensor:
        """Batch-sum energy of each of the K layers [K], from the last ``errors``: 1/2 pi ||h - u||^2 =
        1/2 ||e||^2 / pi (0 where pi is 0); the output group's from its prediction ``u``, top node
        ``h_out`` and signal ``d`` (a kind that can be the output layer keeps those three)."""
        if self.is_output:
            return self.energy.value(self.u[0], self.h_out[0], self.d[0]).reshape(1)
        e = self.e_out.flatten(1)
        sq = 0.5 * torch.linalg.vector_norm(e if e.dtype.itemsize >= 4 else e.float(), dim=1).square()
        if self.prec is None:
            return sq
        return torch.where(self.prec > 0, sq / self.prec.clamp_min(torch.finfo(sq.dtype).tiny), 0.0)

    def weigh(self, e: Tensor) -> Tensor:
        """e *= pi per layer, in place (nothing without precisions): the torch-ops error pass's weighting."""
        if self.prec is None:
            return e
        return e.mul_(self.prec.view(-1, *[1] * (e.dim() - 1)))

    def weights_changed(self) -> None:
        """The weights moved (optimizer step) or a new batch began."""
        self.cached = False


def lowp(a: Tensor, w: Tensor) -> Tensor:
    """a @ w with a cast to w's narrower dtype (bfloat16 weights under precision="bf16"), the product in that
    dtype: for an op that takes it in float32 as it reads it (an add into float32, a copy), one pass less."""
    return torch.matmul(a.to(w.dtype), w)


def low(a: Tensor, w: Tensor, dtype: torch.dtype) -> Tensor:
    """``lowp``'s product in ``dtype``."""
    return lowp(a, w).to(dtype)


_F32_PRODUCTS: dict[torch.device, bool] = {}


def f32_products(like: Tensor) -> bool:
    """True if bfloat16 batched products can be written in float32 by the GEMM itself on ``like``'s device
    (cuBLAS's float32 output of bfloat16 operands, torch's ``out_dtype``, CUDA only): one pass less per product
    than a bfloat16 product copied or added into the float32 nodes, and no rounding of the product to bfloat16.
    Probed once per device on a small in-place product against float32 arithmetic; a torch without it, a CPU, or
    one that disagrees keeps the bfloat16 products (``lowp``)."""
    dev = like.device
    if dev.type != "cuda":
        return False
    if dev not in _F32_PRODUCTS:
        ok = False
        try:
            g = torch.Generator(device=dev).manual_seed(0)
            a, w = (torch.randn(2, 8, 16, generator=g, device=dev).bfloat16(),
                    torch.randn(2, 16, 24, generator=g, device=dev).bfloat16())
            c, p = torch.randn(2, 8, 24, generator=g, device=dev), torch.full((2, 8, 24), math.nan, device=dev)
            prod = torch.bmm(a.float(), w.float())
            want = 0.5 * c + 0.25 * prod
            _aten.baddbmm.dtype_out(c, a, w, torch.float32, beta=0.5, alpha=0.25, out=c)
            _aten.baddbmm.dtype_out(p, a, w, torch.float32, beta=0.0, alpha=0.25, out=p)  # beta 0: p not read
            ok = bool(torch.allclose(c, want, rtol=1e-4, atol=1e-4)
                      and torch.allclose(p, 0.25 * prod, rtol=1e-4, atol=1e-4))
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            pass
        _F32_PRODUCTS[dev] = ok
    return _F32_PRODUCTS[dev]


def product_into(out: Tensor, a: Tensor, w: Tensor, f32: bool, bias: Tensor | None = None, scale: float = 1.0) -> None:
    """out = scale (a @ w (+ bias)) in out's dtype, the product on bfloat16 operands (a cast to w's dtype): by the
    Triton GEMM where it runs and is faster (it rounds a as it reads it: pcdist/engine/gemm.py ``low_product``),
    else written in float32 by cuBLAS where ``f32`` (``f32_products``), else a bfloat16 product copied or added
    in."""
    def fallback(bias_, out_):
        _product_into(out_, a, w, f32, bias_, scale)

    if not gemm.low_product(bias, a, w, 0.0 if bias is None else scale, scale, out, fallback):
        fallback(bias, out)


def _product_into(out: Tensor, a: Tensor, w: Tensor, f32: bool, bias: Tensor | None, scale: float) -> None:
    if f32:
        if bias is not None:
            out.copy_(bias.expand_as(out))
        if a.dim() == 2:  # one layer (the feed-forward chain): a batch of one
            out, a, w = out.unsqueeze(0), a.unsqueeze(0), w.unsqueeze(0)
        _aten.baddbmm.dtype_out(out, a.to(w.dtype), w, torch.float32, beta=0.0 if bias is None else scale,
                                alpha=scale, out=out)
        return
    p = lowp(a, w)
    out.copy_(p) if bias is None else torch.add(bias, p, out=out)
    if scale != 1.0:
        out.mul_(scale)


def accumulate_product(target: Tensor, a: Tensor, w: Tensor, beta: float, alpha: float, f32: bool) -> None:
    """``accumulate`` of the product a @ w on bfloat16 operands: target <- beta target + alpha (a @ w), by the Triton
    GEMM where it runs and is faster, else by cuBLAS itself where ``f32`` (``f32_products``)."""
    def fallback(_, out: Tensor) -> None:  # in place: out is the target
        if f32:
            _aten.baddbmm.dtype_out(out, a.to(w.dtype), w, torch.float32, beta=beta, alpha=alpha, out=out)
        else:
            accumulate(out, low(a, w, out.dtype), beta, alpha)

    if not gemm.low_product(target, a, w, beta, alpha, target, fallback):
        fallback(target, target)


def accumulate(target: Tensor, p: Tensor, beta: float, alpha: float) -> None:
    """target <- beta * target + alpha * p, in place (beta 0 ignores target's old contents, as a
    GEMM with beta 0 does): how a kind without a fused GEMM epilogue writes its back-projection."""
    if beta == 0.0:
        torch.mul(p, alpha, out=target)
    else:
        if beta != 1.0:
            target.mul_(beta)
        target.add_(p, alpha=alpha)


class DerivedWeight:
    """``view(w)`` of a weight w for a phase's kernel: with ``copy`` (weights fixed through a batch's inference: pc)
    a copy allocated by ``empty(view(w))`` (row-major by default), refreshed on first use after each weight change;
    otherwise the view itself."""

    def __init__(self, w: Tensor, view, copy: bool, empty=None):
        self.w, self.view = w, view
        self._t = view(w)
        if copy:
            self._t = empty(self._t) if empty else torch.empty_like(self._t, memory_format=torch.contiguous_format)
        self._stale = copy

    def get(self) -> Tensor:
        if self._stale:
            self._t.copy_(self.view(self.w))
            self._stale = False
        return self._t

    def invalidate(self) -> None:
        if self._t.data_ptr() != self.w.data_ptr():  # a copy, not the view
            self._stale = True


class TransposedWeight(DerivedWeight):
    """w^T [K, O, I] of a stacked w [K, I, O] for the back-projection GEMM.

    A GEMM that reads its second operand transposed is 20-30% slower on CPUs (MKL) than
    one that reads it row-major, so with ``copy=True`` (weights fixed through a batch's
    inference: pc) this keeps a row-major copy, refreshed on first use after each weight
    change; otherwise (iPC changes the weights every step) it is the transposed view.
    """

    def __init__(self, w_KIO: Tensor, copy: bool):
        super().__init__(w_KIO, lambda w: w.transpose(1, 2), copy)
