"""A process that trains starts without importing torch's compiler (``torch._dynamo``) it never uses.

torch.optim marks its optimizers' methods for torch.compile: ``add_param_group``, ``zero_grad``,
``state_dict`` and ``load_state_dict`` are wrapped so that a compiled caller skips them
(``torch._disable_dynamo``), and ``step`` calls ``torch._dynamo.graph_break()`` around its body
(``_use_grad_for_differentiable``). Both wrappers import ``torch._dynamo`` on their first call, compiling or
not: 1.3 CPU-s (sympy, the tracer, triton's runtime) in every process that builds an optimizer, about a
third of a training process's start (a 1-step ``train.py`` run: 3.75 -> 2.95 CPU-s), paid by every rank of
every launch and every command that trains.

``defer_dynamo`` (called by ``pcdist/engine/__init__.py``, before anything of pcdist uses torch) makes those
wrappers import it only where it is already imported. That changes nothing a program can see: nothing can be
compiling, so nothing can be skipped or broken, until ``torch._dynamo`` is imported (``torch.compile`` imports
it), and from then on the wrappers do exactly what torch's do, by calling them. Where torch's wrappers are not
the ones this expects (another torch version), it leaves them as they are.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
import torch.optim.optimizer as _optimizer

_DYNAMO = "torch._dynamo"


def _probe() -> None:
    pass


def _lazy_disable(wrapper) -> None:
    """torch._disable_dynamo's wrapper looks up ``fn.__dynamo_disable`` (the compiler's skipping wrapper,
    made on the first call) before importing anything: give it one that makes the real one only once the
    compiler is imported."""
    fn = wrapper.__wrapped__
    if getattr(fn, "__dynamo_disable", None) is not None:
        return

    def disable_when_loaded(*args, **kwargs):
        if _DYNAMO not in sys.modules:
            return fn(*args, **kwargs)
        import torch._dynamo

        # as torch's own wrapper makes it: wrapping=False where this torch has it (2.8 and later)
        kw = {"wrapping": False} if "wrapping" in inspect.signature(torch._dynamo.disable).parameters else {}
        real = torch._dynamo.disable(fn, True, **kw)
        fn.__dynamo_disable = real  # as torch's wrapper caches it
        return real(*args, **kwargs)

    fn.__dynamo_disable = disable_when_loaded


def _lazy_step(use_grad):
    """``step`` as torch's ``_use_grad_for_differentiable`` runs it (grad mode = the optimizer's
    ``differentiable``), without its graph breaks until the compiler is imported; then torch's own."""
    func = use_grad.__wrapped__

    @functools.wraps(func)
    def step(*args, **kwargs):
        if _DYNAMO in sys.modules:
            return use_grad(*args, **kwargs)
        with torch.set_grad_enabled(args[0].defaults["differentiable"]):
            return func(*args, **kwargs)

    return step


def defer_dynamo() -> None:
    """Make torch.optim's optimizers import ``torch._dynamo`` only once something else has (see the module)."""
    if _DYNAMO in sys.modules:
        return  # paid already
    disable_code = torch._disable_dynamo(_probe).__code__
    use_grad_code = _optimizer._use_grad_for_differentiable(_probe).__code__
    classes = {_optimizer.Optimizer} | {c for c in vars(torch.optim).values()
                                        if isinstance(c, type) and issubclass(c, _optimizer.Optimizer)}
    for cls in classes:
        for name, f in list(vars(cls).items()):
            code = getattr(f, "__code__", None)
            if code is disable_code and hasattr(f, "__wrapped__"):
                _lazy_disable(f)
            elif code is use_grad_code and hasattr(f, "__wrapped__") and not getattr(f, "hooked", False):
                setattr(cls, name, _lazy_step(f))
