"""The step as CUDA graphs: captured once per stage, replayed every step (docs/gpu.md).

On a GPU a small or medium PC step is bound by host work: every dispatched op costs several
microseconds of Python and dispatch, a replayed kernel about two. So the trainer splits a step:

* bookkeeping, once per stage (batch size, free ends): buffers, the exchange, the schedules' tables;
* the core: the device work of one step. It never reads a device value on the host, allocates
  nothing after warm-up and branches only on Python values fixed for the stage.

``Runner`` runs the core of each stage: with ``compile="none"`` eagerly; with ``"graph"`` it runs the
first call eagerly (it builds what the stage keeps: traced layers, optimizer state), the second under
``HostReads`` (a device read on the host would break a capture: the stage then stays eager, with one
line naming why), then on a CUDA device warms it up on a side stream and captures it as a ``Program``,
replayed from then on. On a CPU the same core runs eagerly.

A ``Program`` is the core captured as CUDA graphs between host calls: a layer-parallel rank's
boundary exchanges (``on_host``) run on the host between the replayed segments of its compute, in
the order they were recorded. ``HostReads`` counts the ops a step dispatches and every device value
read on the host (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``, D2H copies): the GPU cost model
a CPU can measure.
"""

from __future__ import annotations

import warnings
from collections import Counter, OrderedDict
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["COMPILE", "HostReads", "Program", "Runner", "on_host", "compile_mode", "host_work"]

COMPILE = ("auto", "none", "graph")
WARMUP = 2  # calls after the first before a stage is captured: the checked one, then one on the capture stream
# (lazy init there: optimizer state, cuBLAS)
MAX_PROGRAMS = 16
"""Captured cores a Runner keeps (each holds its graphs and their memory pool): past it, the least recently
replayed one is dropped, its memory given back, and captured again at once if it comes back (a sweep over many
T at test time, say)."""
CHURN = 4
"""Calls in a row of one stage's core (what runs and its Stage), each with constants it has not seen (an x_lr
changed at every step, say), after which the runner says once that it runs eagerly while they change, and keeps
no count for those that went by."""

_recording: "Program | None" = None
_host_work = 0  # > 0 inside host_work()


@contextmanager
def host_work():
    """Host work that reads or writes device values on purpose, never inside a captured core: the learning rates of
    a step copied in before it runs, a CPU optimizer's own scalar read (a CPU runs eagerly). ``HostReads`` counts
    its ops but no read."""
    global _host_work
    _host_work += 1
    try:
        yield
    finally:
        _host_work -= 1


def on_host(fn: Callable[[], None]) -> None:
    """Run ``fn`` (host work of the core: a boundary exchange, a collective) now, or, while a step is being
    captured, at this point of every replay, between the segments captured before and after it."""
    if _recording is None:
        fn()
    else:
        _recording.host(fn)


def compile_mode(mode: str, device: torch.device) -> str:
    """"none" or "graph" for ``mode`` on ``device`` ("auto": graph on CUDA devices, none elsewhere)."""
    if mode not in COMPILE:
        raise ValueError(f"unknown compile mode {mode!r}; allowed: {', '.join(COMPILE)}")
    if mode == "auto":
        return "graph" if device.type == "cuda" else "none"
    return mode


# -- counting what a step dispatches and reads --------------------------------------------------------
_VIEWS = {"view", "_unsafe_view", "as_strided", "unsqueeze", "squeeze", "transpose", "t", "permute", "select",
          "slice", "expand", "alias", "detach", "unbind", "split", "split_with_sizes", "chunk", "narrow",
          "flatten", "reshape", "unflatten", "diagonal", "view_as", "movedim", "_reshape_alias", "lift_fresh"}
_READ_OPS = {"_local_scalar_dense", "item", "is_nonzero", "equal"}
_SHAPE_OPS = {"nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
              "unique_dim_consecutive", "argwhere", "bincount"}
"""Ops whose output's size depends on the values: the host waits for them (``h[h > 0]`` indexes with a mask)."""
_READ_METHODS = {"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "__format__",
                 "__repr__"}


def _name(op) -> str:
    return op._schema.name.split("::")[-1]


_FACTORIES = {"arange", "tensor", "zeros", "ones", "empty", "full", "eye", "linspace", "rand", "randn", "randint"}


def _bool_index(name: str, args) -> bool:
    """Indexing with a boolean mask (``h[h > 0]``, ``h[mask] = 0``): its positions are read on the host."""
    return name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1 and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))


def _on_device(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)


def _mixes_host_arrays(args) -> bool:
    """A device op handed a host array (an index tensor made on the host, say): a blocking copy per call, which a
    capture refuses. Host scalars (0-d) are fine: they pass as values."""
    flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(t, torch.Tensor)]
    return any(t.device.type != "cpu" for t in flat) and any(t.device.type == "cpu" and t.ndim for t in flat)


def _from_host(name: str, args, kwargs) -> bool:
    """A host array copied to the device (``t.to("cuda")``, ``d.copy_(host)``): on a GPU, what a capture refuses
    (pageable memory) or replays from the host memory of the capture, stale (pinned)."""
    if name == "_to_copy":
        return isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu" and \
            kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "cpu"
    return name == "copy_" and _on_device(args[:1]) and isinstance(args[1], torch.Tensor) and \
        args[1].device.type == "cpu"


class _Ops(TorchDispatchMode):
    """Counts every aten op; a scalar read or a copy into host memory of a device tensor is a host read."""

    def __init__(self, owner: "HostReads"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        o, name = self.owner, _name(func)
        o.ops += 1
        o.views += name in _VIEWS
        o.by_op[name] += 1
        if _host_work:
            return func(*args, **kwargs)
        sized = name in _SHAPE_OPS or (name == "repeat_interleave" and kwargs.get("output_size") is None)
        if (name in _READ_OPS or sized or _bool_index(name, args)) and (o.strict or _on_device(args)):
            o.read(f"aten.{name}" + ("" if name in _READ_OPS else " (its output's size depends on the values)"
                                     if sized else " with a boolean mask (its positions are read)"))
        elif name == "_to_copy" and _on_device(args[:1]) and str(kwargs.get("device", "")).startswith("cpu"):
            o.read("a copy to the host")
        elif name == "copy_" and args[0].device.type == "cpu" and _on_device(args[1:2]):
            o.read("a copy to the host")
        elif not o.strict and _from_host(name, args, kwargs):
            o.read("a copy from the host (a graph would replay it from the host memory of the capture)")
        elif name != "copy_" and _mixes_host_arrays(args):
            o.read(f"a host tensor handed to aten.{name} with device tensors")
        return func(*args, **kwargs)


class _Methods(TorchFunctionMode):
    """A tensor method that reads values on the host (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``, ...)."""

    def __init__(self, owner: "HostReads"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _host_work:
            return func(*args, **kwargs)
        on_device = _on_device(args[:1])
        if (name in _READ_METHODS and (self.owner.strict or on_device)) or (name == "to" and on_device
                                                                            and _to_host(args, kwargs)):
            self.owner.read(f"Tensor.{name}")
        elif (self.owner.strict and name in _FACTORIES and func is getattr(torch, name, None)
              and kwargs.get("device") is None and "out" not in kwargs):  # on a GPU: a host tensor
            self.owner.read(f"torch.{name} with no device= (a host tensor)", ours_only=True)
        return func(*args, **kwargs)


def _to_host(args, kwargs) -> bool:
    return any(isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu"
               for a in (*args[1:], kwargs.get("device")))


class HostReads:
    """Counts, while active, the aten ops dispatched (``ops``; ``views`` of them launch no kernel) and every
    read of a tensor's value on the host (``reads``: where it happened).

    ``strict``: treat every tensor as a device tensor (on a CPU, a read of any tensor would be a
    device read on a GPU), so a CPU run finds the reads a GPU run would make: ``.item()``, ``bool(t)``,
    ``float(t)``, ``.tolist()``, ``.numpy()``, ``.cpu()``, an op whose output's size depends on the values
    (``nonzero``, ``unique``, indexing with a boolean mask), and a tensor made with no ``device=`` (``torch.arange(n)``:
    on a GPU a host tensor, copied to the device, blocking, where it is used). (A ``.to(device)`` cannot tell the host
    from the device on a CPU; on a GPU every copy into host memory, and every host array handed to a device op, is
    found where it is dispatched, and so is every copy of a host array to the device.)"""

    def __init__(self, strict: bool = True):
        self.strict = strict
        self.ops = self.views = 0
        self.by_op: Counter = Counter()
        self.reads: list[str] = []
        self._modes = (_Methods(self), _Ops(self))

    def read(self, what: str, ours_only: bool = False) -> None:
        """Record a host read: what, where (the innermost frame outside torch's machinery) and from which
        line of pcdist; ``ours_only``: only where that frame is pcdist's (not the caller's own batch, say)."""
        import traceback

        frames = [f for f in traceback.extract_stack() if f.filename != __file__
                  and "/torch/utils/" not in f.filename and "/torch/overrides" not in f.filename
                  and "/torch/_tensor" not in f.filename and "/torch/_compile" not in f.filename
                  and "/torch/_dynamo" not in f.filename]
        ours = [f for f in frames if "/pcdist/" in f.filename]
        if ours_only and not (frames and ours and ours[-1] is frames[-1]):
            return
        here = lambda f: f"{f.filename.split('/pcdist/')[-1].split('site-packages/')[-1]}:{f.lineno} ({f.name})"  # noqa: E731
        where = f" in {here(frames[-1])}" if frames else ""
        if ours and frames and ours[-1] is not frames[-1]:
            where += f", from {here(ours[-1])}"
        self.reads.append(what + where)

    @property
    def kernels(self) -> int:
        """Ops that launch work on a device (every op but views)."""
        return self.ops - self.views

    def __enter__(self) -> "HostReads":
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)


# -- capture and replay -------------------------------------------------------------------------------
class Program:
    """A function captured as CUDA graphs between host calls (``on_host``), replayed in the recorded order.

    ``generators``: the CUDA generators the function draws from (value noise), registered with every
    graph so that each replay draws from their state at that time, as an eager call would."""

    def __init__(self, device: torch.device, stream, pool, generators=()):
        self.device, self.stream, self.pool, self.generators = device, stream, pool, tuple(generators)
        self.parts: list = []
        self.grads: list = []  # (tensor, its .grad when captured): what the graphs write by address (keep_grads)
        self._open = None

    def capture(self, fn: Callable[[], None]) -> None:
        global _recording
        _recording = self
        try:
            with torch.cuda.stream(self.stream):  # a failed capture is ended here too: on the stream it began on
                try:  # (CUDA refuses another; the capture would stay open, and the stream with it)
                    self._begin()
                    fn()
                    self._end()
                except BaseException:
                    self._abandon()
                    raise
        finally:
            _recording = None

    def _abandon(self) -> None:
        """End the capture a failure left open (on the capture stream, current)."""
        g, self._open = self._open, None
        if g is None:
            return
        try:
            g.capture_end()
        except Exception:  # the capture had failed: its generators may be left capturing
            self._release()

    def keep_grads(self, holders) -> None:
        """Keep the ``.grad`` of each of ``holders`` (the parameters a step trains), which the graphs read and write
        by address: a replay puts back any that was replaced or dropped since (a parameter frozen then unfrozen,
        whose .grad the step set to None; ``zero_grad()``), which would otherwise be written after it was freed."""
        self.grads = [(p, p.grad) for p in holders if p.grad is not None]

    def _release(self) -> None:
        """After a capture whose end failed: one empty capture over the same generators, which ends their capture
        (an end that fails leaves them capturing, where every later eager draw from them would fail)."""
        g = torch.cuda.CUDAGraph()
        for gen in self.generators:
            g.register_generator_state(gen)
        with torch.cuda.stream(self.stream), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            g.capture_end()

    def _begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        if self.generators and not hasattr(g, "register_generator_state"):
            raise RuntimeError("this PyTorch cannot register a generator with a CUDA graph (value noise needs it)")
        for gen in self.generators:
            g.register_generator_state(gen)
        g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self._open = g

    def _end(self) -> None:
        g, self._open = self._open, None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            g.capture_end()
        self.parts.append(g)

    def host(self, fn: Callable[[], None]) -> None:
        self._end()
        self.parts.append(fn)
        self._begin()

    def replay(self) -> None:
        for p, g in self.grads:
            if p.grad is not g:
                p.grad = g
        for p in self.parts:
            if isinstance(p, torch.cuda.CUDAGraph):
                p.replay()
            else:
                p()


class Runner:
    """Runs the core of each stage (``key``, a tuple: what runs, its Stage, then what the core's constants
    are): eagerly (``mode="none"``), or checked, warmed up, captured and replayed (``"graph"``; see the module
    docstring), keeping at most ``MAX_PROGRAMS`` captures. ``say``: where the one-line notes go.

    ``prepare()``: a context manager that every call run in Python on a CUDA device runs inside (the first calls,
    the capture, an eager fallback; not a replay): the optimizer made capturable while it steps there (a
    non-fused Adam's step reads its tensor learning rate on the host otherwise). ``trained()``: the parameters whose
    ``.grad`` a captured step writes (``Program.keep_grads``)."""

    def __init__(self, mode: str, device: torch.device, say: Callable[[str], None] = print,
                 generators=(), prepare: Callable[[], ContextManager] | None = None,
                 trained: Callable[[], Iterable[torch.Tensor]] = tuple):
        self.mode, self.device, self.say = mode, torch.device(device), say
        self.generators, self.prepare, self.trained = generators, prepare, trained
        self.calls: Counter = Counter()
        self.programs: OrderedDict = OrderedDict()  # key -> its Program, the least recently replayed first
        self.eager: dict = {}  # key -> why that stage runs eagerly
        self._latest: dict = {}  # (what runs, its Stage) -> the key of its last call
        self._new: Counter = Counter()  # (what runs, its Stage) -> its calls in a row with constants new to it
        self._said: set = set()  # (what runs, its Stage) said to change its constants at every call
        self._stream = None

    def __call__(self, key, fn: Callable[[], None]) -> None:
        if self.mode == "none":
            fn()
            return
        program = self.programs.get(key)
        if program is not None:
            self.programs.move_to_end(key)
            self._new[key[:2]] = 0
            program.replay()
            return
        with self.prepare() if self.device.type == "cuda" and self.prepare is not None else nullcontext():
            self._run(key, fn)

    def _run(self, key, fn: Callable[[], None]) -> None:
        if key in self.eager or key[:2] in self.eager:  # (a key, or its whole stage: ``fallback(key[:2], ...)``)
            fn()
            return
        n = self.calls[key]
        self._changes(key, n == 0)
        self.calls[key] += 1
        if n == 0:
            fn()  # the first call builds what the stage keeps (traced layers, optimizer state, schedule rows)
        elif n == 1:
            self._checked(key, fn)
        elif self.device.type != "cuda":
            fn()  # a CPU runs the same core eagerly
        elif n < 1 + WARMUP:
            self._side(fn)
        else:
            self._capture(key, fn)

    def _changes(self, key, new: bool) -> None:
        """Count a stage's calls in a row with constants new to it: at CHURN, say once that the stage runs eagerly
        while they change; from then on the counts of the keys that went by are dropped (else one per call)."""
        stage = key[:2]
        went, self._latest[stage] = self._latest.get(stage), key
        self._new[stage] = self._new[stage] + 1 if new else 0
        if self._new[stage] < CHURN:
            return
        if went is not None and went != key and went not in self.programs:
            self.calls.pop(went, None)
        if stage not in self._said:
            self._said.add(stage)
            self.say(f"compile=graph: {describe(key)} runs eagerly while what it is captured with (x_lr, T, the "
                     f"solver, value noise, the optimizer's settings, the frozen parameters) changes at every call: "
                     f"kept for {2 + WARMUP} calls, it is captured")

    def _checked(self, key, fn) -> None:
        with HostReads(strict=self.device.type == "cpu") as reads:
            fn()
        found = reads.reads
        if self.device.type != "cuda":  # an optimizer's own reads (its step count) go where prepare() makes it
            found = [r for r in found if " in torch/optim/" not in r]  # capturable, which it does on CUDA only
        if found:
            self.fallback(key, f"the step reads a device value on the host ({found[0]})")

    def _side(self, fn) -> None:
        cur = torch.cuda.current_stream(self.device)
        s = self._capture_stream()
        s.wait_stream(cur)
        with torch.cuda.stream(s):
            fn()
        cur.wait_stream(s)

    def _capture_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _capture(self, key, fn) -> None:
        if len(self.programs) >= MAX_PROGRAMS:  # before the capture, so that it can use the memory freed
            self._drop_programs([next(iter(self.programs))])  # its count kept: captured at once if it comes back
        cur = torch.cuda.current_stream(self.device)
        s = self._capture_stream()
        s.wait_stream(cur)
        program = Program(self.device, s, torch.cuda.graph_pool_handle(), self.generators)  # a pool per stage
        try:
            program.capture(fn)
        except Exception as e:  # not capturable after all: this stage stays eager
            torch.cuda.synchronize(self.device)
            self.fallback(key, "capturing it failed: "
                                f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")
            fn()
            return
        cur.wait_stream(s)
        if key[0] == "step":  # (inference writes no gradient)
            program.keep_grads(self.trained())
        self.programs[key] = program
        program.replay()

    def forget(self, stage) -> None:
        """Drop all the runner keeps for ``stage`` (its trainer let the stage go): its programs with their graphs
        and memory, its call counts and eager notes, none of which would be used again."""
        keys = [k for k in {*self.programs, *self.calls, *self.eager} if k[1] is stage]
        self._drop_programs([k for k in keys if k in self.programs])
        for k in keys:
            self.calls.pop(k, None), self.eager.pop(k, None)
        for k in [k for k in {*self._latest, *self._new, *self._said} if k[1] is stage]:
            self._latest.pop(k, None), self._new.pop(k, None), self._said.discard(k)

    def _drop_programs(self, keys) -> None:
        """Free captured programs: their graphs, and their memory pools given back to the device (a dropped
        pool's cached blocks serve no other allocation, and none at all while a capture runs, until released)."""
        if not keys:
            return
        torch.cuda.synchronize(self.device)  # no replay of theirs still running
        for k in keys:
            del self.programs[k]
        torch.cuda.empty_cache()

    def fallback(self, key, why: str) -> None:
        """Run ``key`` (or, given ``key[:2]``, every call of that stage) eagerly from now on, said in one line
        naming ``why``."""
        self.eager[key] = why
        self.say(f"compile=graph: {describe(key)} runs eagerly: {why}")


def describe(key) -> str:
    """A key in words: ("step", stage, ...) -> "the training step at batch size B"."""
    if isinstance(key, tuple) and key and key[0] in ("step", "infer"):
        what = "the training step" if key[0] == "step" else "inference"
        return f"{what} at batch size {getattr(key[1], 'B', key[1])}"
    return str(key)
