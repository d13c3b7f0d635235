"""Numeric precision of a trainer's step: fp32, tf32 or bf16.

    fp32   float32 everywhere; on GPUs the matmuls and convolutions in IEEE float32 (TF32 off)
    tf32   float32 value nodes and weights, the matmuls and convolutions of float32 tensors in TF32
           on GPUs that have it (Ampere and later; a CPU has no TF32 and computes in float32)
    bf16   the matmuls and convolutions of dense, μPC and conv layers on bfloat16 operands (float32
           accumulation inside), their weights kept in bfloat16 for them; value nodes, errors,
           predictions, biases and energies in float32; float32 master weights and optimizer state

Value nodes stay float32 because PC's value step is small: x_lr e is a fraction of a percent of h in a
deep network, below bfloat16's resolution of h (2^-8), so bfloat16 nodes stop moving (measured: the
64-layer μPC lost 4 points with bfloat16 nodes; docs/gpu.md). bf16 runs the phases on a *compute copy*
of the network whose layers' ``lowp_params`` (their weights) are bfloat16 and whose other parameters are
the master's own: every step starts from the master weights cast into it, the weight gradients of the
bfloat16 products are cast into the master weights' .grad, the optimizer steps the master weights, and
the copy is refreshed. The module kind (any nn.Module) computes in float32. Checkpoints and ``pcdist.load``
hold only the float32 master network (the service's tests by inference run in the run's precision).

The TF32 switches are process-wide (torch.backends): a trainer sets its own at each step (``MixedPrecision.apply``),
so trainers of other precisions can share a process; the service puts the ones it found back when a run ends.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch

__all__ = ["PRECISIONS", "MixedPrecision", "set_tf32", "tf32_state", "restore_tf32", "tf32_convolutions", "cpu_float32",
           "cpu_is_ieee"]

PRECISIONS = ("fp32", "tf32", "bf16")


def set_tf32(on: bool) -> None:
    """TF32 for float32 matmuls and convolutions on CUDA devices, on or off (process-wide). Through the settings
    that keep torch's older and newer TF32 switches agreeing (torch >= 2.9 has both: a write to one kind alone makes
    every later read of the other raise, torch.compile's included)."""
    torch.set_float32_matmul_precision("high" if on else "highest")
    torch.backends.cudnn.allow_tf32 = on
    if not on:  # torch >= 2.9 stores that as "none", which inherits a backend-wide or global "tf32" a caller set
        for name in ("cudnn.conv", "cudnn.rnn"):
            if getattr(_switch(name), "fp32_precision", None) == "tf32":
                _switch(name).fp32_precision = "ieee"


_BACKENDS = ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")
"""The float32 precision switches of torch >= 2.9, one per backend and operation (``torch.backends.<name>``)."""


def _switch(name: str):
    """``torch.backends.<name>`` ("" the global one, "cudnn" a backend's, "cudnn.conv" an operation's)."""
    obj = torch.backends
    for part in filter(None, name.split(".")):
        obj = getattr(obj, part, None)
    return obj


_NEWER = ("", "cudnn", "mkldnn", *_BACKENDS)
"""Every float32 precision switch of torch >= 2.9 (``fp32_precision``), those that inherit first."""


def _newer() -> list[str]:
    return [n for n in _NEWER if hasattr(_switch(n), "fp32_precision")]


def tf32_state() -> dict:
    """The float32 precision switches now, for ``restore_tf32``: torch's older three, each where it can be read (a
    caller who wrote only the newer per-backend switches makes the older unreadable), and every newer one."""
    older = {}
    for name, read in (("cuda", lambda: torch.backends.cuda.matmul.allow_tf32),
                       ("matmul", torch.get_float32_matmul_precision),
                       ("cudnn", lambda: torch.backends.cudnn.allow_tf32)):
        try:
            older[name] = read()
        except RuntimeError:
            pass
    return {"older": older, "newer": {n: _switch(n).fp32_precision for n in _newer()}}


def restore_tf32(state: tuple[str, bool] | dict | None) -> None:
    """Put back the switches ``tf32_state`` returned (or a tuple: the older two): the older ones that were
    readable, then every newer one, so that each reads as it did, and what could not be read still cannot."""
    if state is None:
        return
    if not isinstance(state, dict):
        state = {"older": {"matmul": state[0], "cudnn": state[1]}, "newer": {}}
    older = state["older"]
    if "cuda" in older:  # (first: the matmul precision below writes it too, agreeing with the rest)
        torch.backends.cuda.matmul.allow_tf32 = older["cuda"]
    if "matmul" in older:
        torch.set_float32_matmul_precision(older["matmul"])
    if "cudnn" in older:
        torch.backends.cudnn.allow_tf32 = older["cudnn"]
    for n, value in state["newer"].items():
        _switch(n).fp32_precision = value


def cpu_is_ieee() -> bool:
    """True if float32 matmuls and convolutions on CPUs run in IEEE float32 (torch's default; a process-wide
    ``set_float32_matmul_precision("medium")`` or oneDNN's ``fp32_precision = "bf16"`` computes them in bfloat16,
    2e-3 off)."""
    cpu = [n for n in ("mkldnn.matmul", "mkldnn.conv") if hasattr(_switch(n), "fp32_precision")]
    if cpu:  # (a "none" inherits oneDNN's backend-wide switch, which inherits the global one)
        return all(_effective(n) in ("ieee", "none") for n in cpu) and _legacy_highest()
    return _legacy_highest()


def _effective(name: str) -> str:
    for n in (name, name.split(".")[0], ""):
        value = _switch(n).fp32_precision
        if value != "none":
            return value
    return "none"


def _legacy_highest() -> bool:
    try:
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:  # set through the newer switches alone: those rule
        return True


@contextlib.contextmanager
def cpu_float32():
    """While active, float32 matmuls and convolutions on CPUs in IEEE float32 (a trainer of any precision asks for no
    less); the process's switches as they were after. Through oneDNN's own switches where torch has them (torch's
    older matmul switch also writes CUDA's, and its put-back left oneDNN's at TF32 after a caller's
    ``cuda.matmul.allow_tf32 = True``); else through the older one."""
    cpu = [n for n in ("mkldnn.matmul", "mkldnn.conv") if hasattr(_switch(n), "fp32_precision")]
    if not cpu:
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)
        return
    before = {n: _switch(n).fp32_precision for n in cpu}
    for n in cpu:
        _switch(n).fp32_precision = "ieee"
    try:
        yield
    finally:
        for n, value in before.items():
            _switch(n).fp32_precision = value


def tf32_convolutions() -> bool:
    """True if cuDNN runs float32 convolutions in TF32 (torch's default; off under trainer.precision=fp32)."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        return conv.fp32_precision == "tf32"
    return bool(torch.backends.cudnn.allow_tf32)


class MixedPrecision:
    """The network a trainer computes with (``compute``) beside the one its optimizer steps (``master``)."""

    def __init__(self, name: str, master: torch.nn.Module):
        if name not in PRECISIONS:
            raise ValueError(f"unknown precision {name!r}; allowed: {', '.join(PRECISIONS)}")
        self.name, self.master = name, master
        p = next(master.parameters())
        self.cuda = p.device.type == "cuda"
        self.apply()
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.compute = master
        if name == "bf16":
            if p.dtype != torch.float32:
                raise ValueError(f"precision='bf16' keeps float32 master weights: build the network in float32, "
                                 f"got {p.dtype}")
            self.compute = copy.deepcopy(master)
            for (_, mod), (_, twin) in zip(master.named_modules(), self.compute.named_modules()):
                low = getattr(twin, "lowp_params", ())
                for name_, buffer in mod.named_buffers(recurse=False):  # the master's own (a BatchNorm's statistics,
                    twin._buffers[name_] = buffer  # loaded later, say)
                for name_, param in list(mod.named_parameters(recurse=False)):
                    if name_ in low:
                        twin_param = getattr(twin, name_)
                        twin_param.data = twin_param.data.to(torch.bfloat16)
                        self.pairs.append((param, twin_param))
                    else:  # the master's own parameter: its updates and gradients need no copy
                        setattr(twin, name_, param)
            if not self.pairs:  # (every layer of the module kind, say)
                warnings.warn("precision='bf16' changes nothing here: no layer has bfloat16 products (the module "
                              "kind computes in float32), so this network runs in float32", stacklevel=3)

    def apply(self) -> None:
        """This precision's TF32 switches (CUDA: each step sets them, before its core runs or is captured; a CPU
        has no TF32: ``engine_mode`` keeps its float32 matmuls IEEE while the trainer computes)."""
        if self.cuda:
            set_tf32(self.name == "tf32")

    def check(self) -> None:
        """A bf16 trainer's master network still float32 and where its compute copy is (a stage is rebuilt
        because the master's storage changed: ``net.double()``, ``net.to(...)`` after the trainer was made)."""
        if self.name != "bf16":
            return
        p = next(self.master.parameters())
        twin = next(iter(self.pairs), (p, p))[1]
        if p.dtype != torch.float32 or p.device != twin.device:
            raise ValueError(f"precision='bf16' keeps float32 master weights and a bfloat16 copy of them where they "
                             f"are: the network is now {p.dtype} on {p.device}, its copy on {twin.device}; make a "
                             f"new PCTrainer after moving or casting the network")

    @property
    def master_dtype(self) -> torch.dtype:
        """The master weights' dtype (now: a network moved with .double() after the trainer was built counts)."""
        return next(self.master.parameters()).dtype

    def begin(self) -> None:
        """Before a step (or an inference): this precision's switches, the compute copy current."""
        self.apply()
        self.weights()

    @torch.no_grad()
    def weights(self) -> None:
        """The master weights cast into the compute copy (nothing when they are one network)."""
        for m, c in self.pairs:
            c.copy_(m)

    @torch.no_grad()
    def grads(self, idle=frozenset()) -> None:
        """The compute copy's weight gradients cast into the master weights' .grad (none for ``idle``: the ids of
        copies the step does not train)."""
        for m, c in self.pairs:
            if id(c) in idle:
                m.grad = None
                continue
            if m.grad is None:
                m.grad = torch.empty_like(m)
            m.grad.copy_(c.grad)
