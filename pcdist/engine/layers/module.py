"""The ``module`` kind: any nn.Module between two value nodes, u_l = module(h_{l-1}).

Shape letters: K layers in a group, B batch.

Predictions by calling the module (``torch.func.functional_call`` with this layer's
parameters); the back-projection P = (du/dh_in)^T d and the weight gradients by autograd,
where d = -dE/du is the layer's error signal (its error e for a hidden layer). K identical
modules (same structure and parameter shapes) stack their parameters with
``torch.func.stack_module_state`` and run as one ``vmap``-ed call; a module that vmap cannot
run (data-dependent control flow, in-place tricks) runs layer by layer instead, with the same
numbers.

These calls are traced once per bound group into aten graphs (pcdist/engine/layers/graph.py: the
forward, its VJP by the input, its VJP by the weights, and one layer for the feed-forward
chain) and then run without the module's Python, vmap or the autograd engine; a module that
cannot be traced keeps the eager calls. Each prediction keeps what the back-projection
needs (a linearisation); the weight gradients are taken only where they are used (the
evaluation before a weight update). Modules with running statistics or randomness would
change at every inference step: a BatchNorm in training mode or a Dropout with p > 0 in
training mode is refused with a message (``.eval()`` fixes both: BatchNorm then uses its
running statistics as constants, Dropout is the identity).
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.func import functional_call, stack_module_state, vmap

from .base import Binding, BoundGroup, LayerGroup, LayerKind, accumulate
from .graph import Call, trace

__all__ = ["ModuleKind", "ModuleGroup", "AnyModule", "check_module"]


class AnyModule(nn.Module):
    """Marks a module to be trained as a generic PC layer (the ``module`` kind) even where a faster
    kind exists; forward is the module's own."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, h: Tensor) -> Tensor:
        return self.module(h)


def check_module(m: nn.Module, index: int) -> None:
    """Refuse what would drift silently: running statistics and randomness in training mode (by type here; any
    other by its probe calls, ``ModuleKind.of``), a module compiled by torch.compile."""
    for name, sub in m.named_modules():
        what = f"layer {index} ({type(m).__name__}{'.' + name if name else ''}: {type(sub).__name__})"
        if hasattr(sub, "_orig_mod") and type(sub).__name__ == "OptimizedModule":
            raise ValueError(f"{what} is compiled by torch.compile, whose backward cannot serve PC's repeated "
                             f"gradients; give the module itself (on a GPU pcdist captures the whole step)")
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.training:
            raise ValueError(f"{what} is in training mode: its batch statistics (and running averages) would change "
                             "at every inference step. Call .eval() on it (its running statistics become constants) "
                             "or leave it out")
        if isinstance(sub, nn.modules.batchnorm._NormBase) and sub.training and sub.track_running_stats:
            raise ValueError(f"{what} is in training mode with track_running_stats: its running averages would "
                             "change at every inference step (and so its eval-mode output). Call .eval() on it or "
                             "leave it out")
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.training and sub.p > 0:
            raise ValueError(f"{what} draws a new mask at every inference step, so the energy PC minimises would "
                             "change under it; call .eval() on it (the identity) or leave it out")


def _structure(m: nn.Module) -> str:
    """What makes two modules stackable: their repr and every parameter's and buffer's name, shape, dtype."""
    parts = [repr(m)]
    parts += [f"p {n} {tuple(p.shape)} {p.dtype}" for n, p in m.named_parameters()]
    parts += [f"b {n} {tuple(b.shape)} {b.dtype}" for n, b in m.named_buffers()]
    return "\n".join(parts)


def _attributes(m: nn.Module) -> str:
    """The settings of ``m`` and its submodules that a repr may not show (a ``self.c = 5.0``, a ``self.f =
    torch.sin``, a plain tensor of the user's): modules that differ in one do not stack, whatever their repr (a
    stacked group runs its first layer's)."""
    return "\n".join(f"{name} {k}={_token(v)}" for name, sub in m.named_modules()
                     for k, v in sorted(vars(sub).items()) if not k.startswith("_"))


def _token(v, within: frozenset = frozenset()) -> str:
    """``v`` as text that is equal for equal settings: plain values and dense tensors by content, containers by
    their items, anything else (a function, an object, a sparse tensor, a container that holds itself) by
    identity."""
    if isinstance(v, (bool, int, float, str, type(None))):
        return repr(v)
    if isinstance(v, Tensor) and v.layout == torch.strided:
        data = v.detach().cpu().reshape(-1)
        digest = hashlib.sha1(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
        return f"tensor{tuple(v.shape)}{v.dtype}:{digest}"
    if isinstance(v, (list, tuple, dict)) and id(v) not in within:
        inner = within | {id(v)}
        if isinstance(v, dict):
            return f"dict{{{', '.join(f'{_token(k, inner)}: {_token(x, inner)}' for k, x in v.items())}}}"
        return f"{type(v).__name__}[{', '.join(_token(x, inner) for x in v)}]"
    return f"{type(v).__name__}@{id(v):x}"


def _check_probe(m: nn.Module, index: int, inputs: tuple[Tensor, ...], seen: tuple[Tensor, Tensor] | None) -> None:
    """Refuse a module whose probe calls show what PC's inference loop cannot run: an input written in place (the
    value node it reads), or (``seen``: two calls on one node) another output at each call (randomness or a state
    its forward moves in training mode). (A buffer its forward writes, a record of its own, is written at every
    call: docs/layers.md.)"""
    what = f"layer {index} ({type(m).__name__})"
    if any(x._version != 0 for x in inputs):
        raise ValueError(f"{what} writes its input in place (an inplace=True activation first?), which is the value "
                         f"node it reads; make that operation out of place")
    if seen is not None and (seen[0].shape != seen[1].shape or
                             not torch.allclose(*seen, rtol=1e-4, atol=1e-5, equal_nan=True)):
        raise ValueError(f"{what} gives another output for the same input at each call (in training mode: an RReLU's "
                         f"or a noise layer's draws, spectral_norm's power iteration?): the energy PC minimises would "
                         f"change under it; call .eval() on it or leave it out")


@dataclass(frozen=True)
class ModuleKind(LayerKind):
    """A generic PC layer: ``template`` (its structure; the group holds the parameters) maps a node of
    ``input_shape`` to a prediction of ``output_shape``."""

    kind = "module"
    structure: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    template: nn.Module = field(compare=False, repr=False, hash=False)
    num_params: int = 0
    attributes: str = field(default="", repr=False)  # equal layers only stack (not in the signature: checkpoints)

    @classmethod
    def of(cls, m: nn.Module, in_shape: tuple[int, ...], index: int = 0) -> "ModuleKind":
        """The module kind of ``m`` on a node of shape ``in_shape`` (the output shape by one probe call)."""
        check_module(m, index)
        p = next(iter(m.parameters()), None)
        kw = dict(dtype=p.dtype if p is not None else torch.get_default_dtype(),
                  device=p.device if p is not None else "cpu")
        zeros = torch.zeros(2, *in_shape, **kw)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # (the global RNG stays untouched)
            try:
                if any(nn.parameter.is_lazy(t) for t in (*m.parameters(), *m.buffers())):
                    m(zeros.clone())  # a lazy module's first call makes its weights (on the user's module, as torch's)
                probe = copy.deepcopy(m)  # (the user's module stays as it is: a forward may write its buffers)
                out = probe(zeros)
            except (RuntimeError, ValueError, TypeError, IndexError) as e:  # a width that does not fit, mostly
                node, why = f"layer {index - 1}'s output" if index > 1 else "the input", str(e).strip()
                raise ValueError(f"layer {index} ({type(m).__name__}) fails on the node it is given, "
                                 f"[B, {', '.join(map(str, in_shape))}] ({node}): "
                                 f"{why.splitlines()[0] if why else type(e).__name__}") from e
            if not isinstance(out, Tensor) or out.shape[0] != 2:
                raise ValueError(f"layer {index} ({type(m).__name__}) must map a batch "
                                 f"[B, {', '.join(map(str, in_shape))}] to one tensor [B, ...]")
            x = torch.randn(2, *in_shape, generator=torch.Generator().manual_seed(0)).to(**kw)
            try:  # twice on one random node (zeros hide an RReLU's draws)
                seen = probe(x), probe(x.clone())
            except (RuntimeError, ValueError, TypeError, IndexError):  # (a node read as integers: an embedding's)
                seen = None
        _check_probe(m, index, (zeros, x), seen)
        return cls(_structure(m), tuple(in_shape), tuple(out.shape[1:]), copy.deepcopy(m),
                   sum(q.numel() for q in m.parameters()), _attributes(m))

    @property
    def in_shape(self) -> tuple[int, ...]:
        return self.input_shape

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.output_shape

    def __str__(self) -> str:
        return f"module {type(self.template).__name__} {list(self.input_shape)} -> {list(self.output_shape)}"

    def flops(self, index: int) -> int:
        """An estimate (the module is opaque): a multiply-add per parameter and sample for the prediction,
        as many for the back-projection (not on layer 1), and elementwise work on the output."""
        return (2 if index == 1 else 4) * self.num_params + 8 * math.prod(self.output_shape)

    def signature(self) -> dict:
        return {"kind": self.kind, "module": self.structure, "in": list(self.input_shape),
                "out": list(self.output_shape)}

    def make_group(self, first: int, K: int, dtype=None, device=None) -> "ModuleGroup":
        return ModuleGroup(self, first, K, dtype=dtype, device=device)


def _layer(stacked: dict[str, Tensor], k: int) -> dict[str, Tensor]:
    return {n: t[k] for n, t in stacked.items()}


def _mangle(name: str) -> str:
    return name.replace(".", "__")


class ModuleGroup(LayerGroup):
    """K identical modules: each parameter and buffer stacked to [K, ...] (``stack_module_state``)."""

    reads_errors = True  # the back-projection maps the errors themselves through the module's VJP

    def __init__(self, kind: ModuleKind, first: int, K: int, dtype=None, device=None):
        super().__init__(kind, first, K)
        copies = [copy.deepcopy(kind.template).to(dtype=dtype, device=device) for _ in range(K)]
        params, buffers = stack_module_state(copies)
        self.names = list(params)
        self.buffer_names = list(buffers)
        self.stacked = nn.ParameterDict({_mangle(n): nn.Parameter(p.detach().clone()) for n, p in params.items()})
        for n, b in buffers.items():
            self.register_buffer("buf__" + _mangle(n), b.clone())
        # The structure functional_call runs (every parameter and buffer it reads comes from the stacks);
        # kept out of the submodules so its own tensors are never trained, saved or all-reduced.
        self.__dict__["base"] = copies[0]

    def params(self) -> dict[str, Tensor]:
        return {n: self.stacked[_mangle(n)] for n in self.names}

    def detached_params(self) -> dict[str, Tensor]:
        """The stacked parameters outside autograd (inference differentiates by the inputs only)."""
        return {n: p.detach() for n, p in self.params().items()}

    def buffers_(self) -> dict[str, Tensor]:
        return {n: getattr(self, "buf__" + _mangle(n)) for n in self.buffer_names}

    def public_params(self, k: int) -> dict[str, Tensor]:
        return {n: self.stacked[_mangle(n)][k] for n in self.names}

    def reset_layer(self, k: int, generator: torch.Generator | None) -> None:
        """The module's own init (its reset_parameters), drawn from ``generator``'s seed."""
        fresh = copy.deepcopy(self.base)
        with torch.random.fork_rng(devices=[]):
            if generator is not None:
                torch.manual_seed(generator.initial_seed())
            for sub in fresh.modules():
                if hasattr(sub, "reset_parameters"):
                    sub.reset_parameters()
        with torch.no_grad():
            for n, p in fresh.named_parameters():
                self.stacked[_mangle(n)][k].copy_(p)

    def public_buffers(self, k: int) -> dict[str, Tensor]:
        return {n: getattr(self, "buf__" + _mangle(n))[k] for n in self.buffer_names}

    @torch.no_grad()
    def load_buffers(self, k: int, m: nn.Module) -> None:
        """Layer k's buffers (BatchNorm's running statistics, say) from the user's module ``m`` (the stacks start
        as the group's first module's)."""
        for n, b in m.named_buffers():
            if n in self.buffer_names:
                getattr(self, "buf__" + _mangle(n))[k].copy_(b)

    def to_module(self, k: int) -> nn.Module:
        m = copy.deepcopy(self.base)
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(self.stacked[_mangle(n)][k])
            for n, b in m.named_buffers():
                if n in self.buffer_names:
                    b.copy_(getattr(self, "buf__" + _mangle(n))[k])
        return m

    def call(self, k: int, h: Tensor, params: dict[str, Tensor] | None = None,
             buffers: dict[str, Tensor] | None = None) -> Tensor:
        """Layer k on a batch h [B, ...] (differentiable)."""
        p = {n: t[k] for n, t in (params or self.params()).items()}
        b = {n: t[k] for n, t in (self.buffers_() if buffers is None else buffers).items()}
        return functional_call(self.base, (p, b), (h,))

    def forward(self, h: Tensor) -> Tensor:
        for k in range(self.K):
            h = self.call(k, h)
        return h

    def layer(self, k: int, h: Tensor) -> Tensor:
        return self.call(k, h)

    def bind(self, h_in, h_out, e_out, b: Binding) -> "ModuleBound":
        return ModuleBound(self, h_in, h_out, e_out, b)


class ModuleBound(BoundGroup):
    """A ModuleGroup's phases: the K stacked modules as one vmapped call (or a loop where vmap cannot
    run them), traced once into aten graphs where that works (pcdist/engine/layers/graph.py)."""

    def __init__(self, g: ModuleGroup, h_in: Tensor, h_out: Tensor, e_out: Tensor, b: Binding):
        super().__init__(g, h_in, h_out, e_out, b)
        B = b.batch_size
        kw = dict(dtype=h_in.dtype, device=h_in.device)
        self._u = self.u = torch.empty(self.K, B, *g.kind.out_shape, **kw)  # u: this buffer or a call's output
        self.d = torch.empty_like(self.u) if self.is_output else e_out  # -dE/du
        self._vmapped = vmap(lambda p, b, h: functional_call(g.base, (p, b), (h,)))
        self.batched = self._vmap_works()
        # u and its VJP by the input, at every inference step; by the weights (traced on first use)
        self._by_input = trace(self._map, (g.detached_params(), g.buffers_(), h_in), 2)
        self._by_weight: Call | None = None
        self._one: Call | None = None  # one layer on the whole batch: the feed-forward chain (on first use)
        self._saved = None  # what the last linearisation keeps for the back-projection
        self._copy_input = None  # whether that shares h_in's memory (found on first use)

    def _vmap_works(self) -> bool:
        """vmap of the module over K, checked once on two samples against a call per layer."""
        g = self.g
        try:
            gen = torch.Generator(device=self.h_in.device).manual_seed(0)  # the global RNG stays untouched
            x = self.h_in[:, :2].detach().clone().normal_(generator=gen)
            with torch.no_grad():
                got = self._map(g.params(), g.buffers_(), x, batched=True)
                want = torch.stack([g.call(k, x[k]) for k in range(self.K)])
            return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))
        except Exception:
            return False

    def _map(self, params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor,
             batched: bool | None = None) -> Tensor:
        """u [K, B, ...] of the K layers on inputs x [K, B, ...], eagerly (what ``trace`` records)."""
        g = self.g
        if self.K == 1:  # nothing to batch: the module itself
            return g.call(0, x[0], params, buffers).unsqueeze(0)
        if batched if batched is not None else self.batched:
            return self._vmapped(params, buffers, x)
        return torch.stack([g.call(k, x[k], params, buffers) for k in range(self.K)])

    def _linearise(self) -> Tensor:
        """u at the present h_in, keeping what the back-projection differentiates.

        The fused value step moves h_in before the back-projection runs. The first call finds out
        whether what the linearisation keeps shares h_in's memory (Linear keeps only its weight
        and output; LayerNorm keeps its input); if so, every linearisation reads a copy of h_in.
        """
        g = self.g
        x = self.h_in.clone() if self._copy_input else self.h_in
        u, saved = self._by_input.forward(g.detached_params(), g.buffers_(), x)
        if self._copy_input is None:
            self._copy_input = _shares_memory(saved, self.h_in)
            if self._copy_input:
                return self._linearise()
        self._saved = saved
        return u

    def feedforward(self, rows: slice | None, init: str) -> None:
        g = self.g
        params, buffers = g.detached_params(), g.buffers_()
        if self.u is not self._u:  # the feed-forward writes into the group's own buffer (rows: keep the rest)
            if rows is not None:
                self._u.copy_(self.u)
            self.u = self._u
        if rows is None:
            h = self.h_in[0]
            if self._one is None:
                one = lambda p, b, h: functional_call(g.base, (p, b), (h,))  # noqa: E731
                self._one = trace(one, (_layer(params, 0), _layer(buffers, 0), h), None)
            for k in range(self.K):
                self.u[k] = h = self._one.forward(_layer(params, k), _layer(buffers, k), h)[0]
        else:
            h = self.h_in[0][rows]
            with torch.no_grad():
                for k in range(self.K):
                    self.u[k][rows] = h = g.call(k, h, params, buffers)
        if not self.is_output or self.free_output:
            sel = slice(None) if rows is None else rows
            self.h_out[:, sel].copy_(self.u[:, sel])
        self.cached = True
        self._saved = None

    def predict(self) -> None:
        if not self.free_input:  # a clamped input: no back-projection, so no linearisation
            self.u = self._by_input.forward(self.g.detached_params(), self.g.buffers_(), self.h_in)[0]
        else:
            self.u = self._linearise()  # the call's own output, not a copy (nothing else views self.u)
        self.cached = True

    def errors(self, with_signal: bool, step_lr: float | None, hold_last: bool = False) -> None:
        if not self.cached:
            self.predict()
        elif self._saved is None and self.free_input:  # u from the feed-forward init: linearise here,
            self._linearise()  # before the step moves h
        if self.is_output:
            self.energy.signal(self.u[0], self.h_out[0], self.d[0])
            return
        self.weigh(torch.sub(self.h_out, self.u, out=self.e_out))
        if step_lr is not None:
            stepped = self.K - 1 if hold_last else self.K
            self.h_out[:stepped].add_(self.e_out[:stepped], alpha=-step_lr)

    def backproject(self, target: Tensor, beta: float, alpha: float) -> None:
        (p,) = self._by_input.vjp(self._saved, self.d)
        accumulate(target, p, beta, alpha)

    def weight_grads(self, scale: float) -> None:
        g = self.g
        if not g.names:  # a module without parameters (an activation, a fixed map): nothing to learn
            return
        args = (g.detached_params(), g.buffers_(), self.h_in)
        if self._by_weight is None:
            self._by_weight = trace(self._map, args, 0)
        _, saved = self._by_weight.forward(*args)  # nothing moves h_in before the VJP below
        for p, grad in zip(g.params().values(), self._by_weight.vjp(saved, self.d)):
            torch.mul(grad, scale, out=p.grad)

    def weights_changed(self) -> None:
        self.cached = False
        self._saved = None


def _shares_memory(saved, t: Tensor) -> bool:
    """Whether any tensor in ``saved`` (nested tuples / lists) lives in t's memory."""
    if isinstance(saved, Tensor):
        return saved.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    return isinstance(saved, (tuple, list)) and any(_shares_memory(s, t) for s in saved)
