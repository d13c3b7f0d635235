"""The module kind's calls: a module group's forward and its VJP, traced once into aten graphs.

A ``Call`` splits ``fn(*args) -> u`` into ``forward(*args) -> (u, saved)`` and
``vjp(saved, d)``, the gradients of <d, u> by the tensors of ``args[grad_of]``: the module
kind's linearisation (pcdist/engine/layers/module.py) is a forward whose ``saved`` waits for the
back-projection.

``trace`` records, once per bound group, with AOTAutograd (``functorch.compile.aot_function``),
the aten ops that torch.func's ``vmap`` and ``functional_call`` and autograd issue: a forward
graph that also returns what the backward keeps, and a backward graph. pcdist then calls the
two graphs directly (no Python module code, no batching rules, no autograd engine at run time),
after three rewrites that change no number beyond round-off. A forward + VJP of a 31-layer
Linear(128, 128) + tanh group at batch 64 took 1.7-2.3 ms eager and 0.96-1.2 ms traced
(2 cores, five alternating runs). The rewrites:

* **a batched matmul and the broadcast add after it become one ``baddbmm``**: that is how vmap
  lowers nn.Linear's bias (bmm, then a [K, 1, O] add: one more pass over the output); the
  dense kind's predict is the same single call;
* **a transposed batched matmul is computed in the layout it is read in**
  (transpose(bmm(a, b)) -> bmm(b^T, a^T)): Linear's weight gradient [K, O, I], written into
  .grad without a strided copy;
* **tanh on CPU (float32 / float64) runs pcdist's vectorised kernel** (pcdist/engine/native.py, the
  dense kind's): torch's CPU tanh goes through MKL's VML, measured at 336 us for a
  [31, 64, 128] block on the benchmark machine (an AMD EPYC) against 63 us for the kernel
  and 55 us for torch's own sigmoid.

``trace`` checks the graphs against the eager call on a random probe (output and VJP) and
falls back to the eager call (``EagerCall``: autograd at every call) where tracing fails
(data-dependent control flow, an op AOTAutograd cannot functionalise) or the two disagree.
``PCDIST_TRACE=0`` turns tracing off.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Callable

import torch
from torch import Tensor, fx

from .. import native
from ..arguments import env_choice
from ..activations import Activation

__all__ = ["Call", "EagerCall", "GraphCall", "trace", "rewrite"]

aten = torch.ops.aten


def native_tanh(x: Tensor) -> Tensor:
    """tanh by pcdist's CPU kernel (a new contiguous tensor)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    lib = native.library()
    fn = lib.pcd_res_act_f64 if x.dtype == torch.float64 else lib.pcd_res_act_f32
    fn(native.ACT_CODES["tanh"], 0, torch.get_num_threads(), 0.0, 0.0, ctypes.c_void_p(x.data_ptr()),
       ctypes.c_void_p(out.data_ptr()), None, None, None, None, x.numel(), 0.0, 0.0, 0.0)
    return out


def _val(n) -> Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, Tensor) else None


def _fold_bias(g: fx.Graph, add: fx.Node) -> bool:
    """add(bias, bmm(x, w)) (bmm possibly behind a view to its own shape) -> baddbmm(bias, x, w)."""
    if add.kwargs or len(add.args) != 2:
        return False
    out = _val(add)
    for mm, bias in (add.args, add.args[::-1]):
        mm, view = _peel_bmm(mm)
        if mm is None or not isinstance(bias, fx.Node) or bias in (mm, view):
            continue
        v_mm, v_b = _val(mm), _val(bias)
        if out is None or v_mm is None or v_b is None or tuple(v_mm.shape) != tuple(out.shape) \
                or v_b.dtype != out.dtype or v_mm.dtype != out.dtype or v_b.dim() > 3:
            continue
        with g.inserting_before(add):
            fused = g.call_function(aten.baddbmm.default, (bias, *mm.args))
        _substitute(g, add, fused, view, mm)
        return True
    return False


def _substitute(g: fx.Graph, old: fx.Node, new: fx.Node, *dead: fx.Node | None) -> None:
    """new takes old's place (and its metadata); old and the nodes only it used go."""
    new.meta = dict(old.meta)
    old.replace_all_uses_with(new)
    for n in (old, *dead):
        if n is not None:
            g.erase_node(n)


def _peel_bmm(n) -> tuple[fx.Node | None, fx.Node | None]:
    """(bmm, view) if n is a bmm, or a view of one to its own shape, used only here; else (None, None)."""
    view = None
    if isinstance(n, fx.Node) and n.target is aten.view.default and isinstance(n.args[0], fx.Node):
        view, n = n, n.args[0]
    if not isinstance(n, fx.Node) or n.target is not aten.bmm.default or len(n.users) != 1 \
            or (view is not None and (len(view.users) != 1 or _val(view) is None or _val(n) is None
                                      or tuple(_val(view).shape) != tuple(_val(n).shape))):
        return None, None
    return n, view


def _transposed_product(g: fx.Graph, t: fx.Node) -> bool:
    """transpose(bmm(a, b), 1, 2) -> bmm(b^T, a^T): the product in the layout it is read in (a weight
    gradient [K, O, I] written as nn.Linear stores it), not a strided copy later."""
    if t.kwargs or len(t.args) != 3 or sorted(a % 3 for a in t.args[1:]) != [1, 2]:
        return False
    mm, view = _peel_bmm(t.args[0])
    if mm is None:
        return False
    a, b = mm.args
    with g.inserting_before(t):
        bt = g.call_function(aten.transpose.int, (b, 1, 2))
        at = g.call_function(aten.transpose.int, (a, 1, 2))
        fused = g.call_function(aten.bmm.default, (bt, at))
    _substitute(g, t, fused, view, mm)
    return True


def rewrite(gm: fx.GraphModule, native_tanh_ok: bool) -> fx.GraphModule:
    """The three rewrites (see the module docstring), plus x * 1 -> x (vmap's lowering of the bias)."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target is aten.mul.Scalar and n.args[1] == 1 and not n.kwargs and _val(n) is not None \
                and _val(n.args[0]) is not None and _val(n).dtype == _val(n.args[0]).dtype:
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
    for n in list(g.nodes):
        if n.op == "call_function" and n.target is aten.add.Tensor:
            _fold_bias(g, n)
        elif n.op == "call_function" and n.target is aten.transpose.int:
            _transposed_product(g, n)
    if native_tanh_ok:
        for n in g.nodes:
            v = _val(n)
            if n.op == "call_function" and n.target is aten.tanh.default and v is not None \
                    and v.device.type == "cpu" and v.dtype in (torch.float32, torch.float64) \
                    and _val(n.args[0]) is not None and _val(n.args[0]).dtype == v.dtype:
                n.target = native_tanh
    g.lint()
    gm.recompile()
    return gm


def _leaves(a) -> list[Tensor]:
    return list(a.values()) if isinstance(a, dict) else [a]


def _tensors(args: tuple) -> list[Tensor]:
    """The tensors of ``args`` (tensors and dicts of tensors) in order."""
    return [t for a in args for t in _leaves(a)]


def _flatten(args: tuple) -> tuple[list[Tensor], Callable[[list[Tensor]], tuple]]:
    """The tensors of ``args`` in order, and how to rebuild args from them."""
    flat = _tensors(args)
    spec = [list(a) if isinstance(a, dict) else None for a in args]

    def rebuild(tensors: list[Tensor]) -> tuple:
        out, i = [], 0
        for keys in spec:
            n = 1 if keys is None else len(keys)
            out.append(tensors[i] if keys is None else dict(zip(keys, tensors[i:i + n])))
            i += n
        return tuple(out)

    return flat, rebuild


def _span(args: tuple, grad_of: int) -> slice:
    """Where ``args[grad_of]``'s tensors sit in the flattened arguments."""
    start = sum(len(_leaves(a)) for a in args[:grad_of])
    return slice(start, start + len(_leaves(args[grad_of])))


class Call:
    """``fn(*args) -> u`` split into forward and VJP (see the module docstring)."""

    def forward(self, *args) -> tuple[Tensor, tuple]:
        """u (outside autograd) and what ``vjp`` needs."""
        raise NotImplementedError

    def vjp(self, saved: tuple, d: Tensor) -> list[Tensor]:
        """d^T du / dt for each tensor t of the differentiated argument, at the forward's point."""
        raise NotImplementedError


class EagerCall(Call):
    """The call itself, differentiated by autograd at every call."""

    def __init__(self, fn: Callable, grad_of: int | None):
        self.fn, self.grad_of = fn, grad_of

    def forward(self, *args) -> tuple[Tensor, tuple]:
        if self.grad_of is None:
            with torch.no_grad():
                return self.fn(*args), ()
        a = self.grad_of
        wrt = args[a]
        wrt = {k: t.detach().requires_grad_() for k, t in wrt.items()} if isinstance(wrt, dict) \
            else wrt.detach().requires_grad_()
        with torch.enable_grad():
            u = self.fn(*args[:a], wrt, *args[a + 1:])
        return u.detach(), (u, _leaves(wrt))

    def vjp(self, saved: tuple, d: Tensor) -> list[Tensor]:
        u, wrt = saved
        if not wrt:
            return []
        return list(torch.autograd.grad(u, wrt, d, retain_graph=True, allow_unused=True, materialize_grads=True))


class GraphCall(Call):
    """The forward and backward graphs AOTAutograd recorded, called directly.

    A graph is specialised to the layouts it was traced with: an argument laid out otherwise
    (the previous layer's output in the feed-forward chain, a contiguous d against a strided u)
    is copied into the traced layout first. An input the output does not depend on gets a zero
    gradient."""

    def __init__(self, fw: fx.GraphModule, bw: fx.GraphModule | None, span: slice | None):
        self.graphs = (fw, bw)
        self.fw, self.bw, self.span = fw.forward, bw.forward if bw is not None else None, span
        self._inputs = [_val(n) for n in _placeholders(fw)]
        self._strides = [None if v is None else v.stride() for v in self._inputs]
        tangent = _val(_placeholders(bw)[-1]) if bw is not None else None
        self._d_stride = None if tangent is None else tangent.stride()

    def forward(self, *args) -> tuple[Tensor, tuple]:
        flat = [_laid_out(t, st) for t, st in zip(_tensors(args), self._strides)]
        with torch.no_grad():
            out = self.fw(*flat)
        return out[0], tuple(out[1:])

    def vjp(self, saved: tuple, d: Tensor) -> list[Tensor]:
        with torch.no_grad():
            grads = self.bw(*saved, _laid_out(d, self._d_stride))[self.span]
        return [torch.zeros(v.shape, dtype=v.dtype, device=d.device) if g is None else g
                for g, v in zip(grads, self._inputs[self.span])]


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _outputs(gm: fx.GraphModule) -> tuple:
    (out,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _laid_out(t: Tensor, stride: tuple[int, ...] | None) -> Tensor:
    """t in the layout a graph was traced with (a copy where it differs)."""
    if stride is None or t.stride() == stride:
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


def _agree(pairs: list[tuple]) -> bool:
    """Each a equals its b but for round-off: max |a - b| within 1e-4 (float64: 1e-9; 16-bit: 1e-2)
    of max |b|, or of 1e-3 x the largest |b| of all pairs for a b near zero (a gradient that is
    zero in exact arithmetic comes out as round-off on both sides)."""
    if any(not isinstance(a, Tensor) or a.shape != b.shape or a.dtype != b.dtype for a, b in pairs):
        return False
    scale = [float(b.abs().max()) if b.numel() else 0.0 for _, b in pairs]
    floor = 1e-3 * max(scale, default=0.0)
    for (a, b), sc in zip(pairs, scale):
        tol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(b.dtype, 1e-2)
        if b.numel() and not float((a - b).abs().max()) <= tol * max(sc, floor):
            return False
    return True


def _plain(graphs: list[fx.GraphModule], n_inputs: int) -> bool:
    """The graphs have the layout GraphCall assumes: the forward returns u (then, with a backward,
    what the backward keeps: its inputs but the last, the tangent), the backward a gradient per
    input. Not so where AOTAutograd adds outputs: a module that writes a buffer or returns an alias
    it must regenerate."""
    fw, bw = graphs[0], graphs[1] if len(graphs) > 1 else None
    if len(_placeholders(fw)) != n_inputs:
        return False
    if bw is None:
        return len(_outputs(fw)) == 1
    ins = _placeholders(bw)
    return (len(_outputs(fw)) == len(ins) and ins[-1].name.startswith("tangents")
            and sum(n.name.startswith("tangents") for n in ins) == 1 and len(_outputs(bw)) == n_inputs)


def trace(fn: Callable, args: tuple, grad_of: int | None) -> Call:
    """``fn(*args)`` as a GraphCall, differentiable in ``args[grad_of]`` (None: forward only), where
    tracing works and agrees with the eager call on a probe; else an EagerCall. ``args``: the
    parameters (a dict of tensors), then tensors or dicts of tensors, the input batch last.
    Shape-specialised: call it with arguments shaped like ``args``."""
    eager = EagerCall(fn, grad_of)
    if env_choice("PCDIST_TRACE") == "0":
        return eager
    from functorch.compile import aot_function, make_boxed_func

    tanh_ok = native.usable(Activation("tanh"), args[-1])
    graphs: list[fx.GraphModule] = []

    def capture(gm: fx.GraphModule, _inputs) -> Callable:
        graphs.append(rewrite(gm, tanh_ok))
        return make_boxed_func(gm.forward)

    flat, rebuild = _flatten(args)
    span = None if grad_of is None else _span(args, grad_of)
    gen = torch.Generator(device=args[-1].device).manual_seed(0)  # the global RNG stays untouched
    # The probe: random parameters (args[0]) and input batch (args[-1]), so no zero-initialised
    # gate or uninitialised buffer hides a wrong graph; buffers as given (a running variance
    # must stay positive).
    drawn = set(range(*_span(args, 0).indices(len(flat)))) | {len(flat) - 1}
    probe = [torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=gen) if i in drawn else t
             for i, t in enumerate(flat)]
    try:
        with warnings.catch_warnings(), torch.enable_grad():
            warnings.simplefilter("ignore")
            recorded = aot_function(lambda *ts: fn(*rebuild(list(ts))), fw_compiler=capture, bw_compiler=capture)
            inputs = [t.clone().requires_grad_(span is not None and span.start <= i < span.stop)
                      for i, t in enumerate(probe)]
            u = recorded(*inputs)
            d = torch.randn(u.shape, dtype=u.dtype, device=u.device, generator=gen)
            if span is not None:
                torch.autograd.grad(u, inputs[span], d, allow_unused=True)
            if len(graphs) != (1 if span is None else 2) or not _plain(graphs, len(flat)):
                return eager
            call = GraphCall(graphs[0], graphs[1] if span is not None else None, span)
            got, saved = call.forward(*rebuild(probe))
            want, want_saved = eager.forward(*rebuild(probe))
            pairs = [(got, want)]
            if span is not None:
                pairs += zip(call.vjp(saved, d), eager.vjp(want_saved, d))
            ok = _agree(pairs)
    except Exception:  # noqa: BLE001 - anything tracing cannot take: the eager call stays
        return eager
    return call if ok else eager
