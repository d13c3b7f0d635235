"""pcdist: predictive-coding networks with every layer working at once.

On one device, same-shape layers are fused into batched kernels; across ranks,
each rank owns a contiguous slice of layers and trades boundary tensors with its
neighbours (see the README and docs/).

The package has three parts: ``pcdist.engine`` (the single-device PC engine),
``pcdist.distributed`` (the mesh and the boundary exchange) and ``pcdist.service``
(config, command line, runs, checkpoints, data, metrics).
"""

import os as _os
import sys as _sys

if _sys.argv[:1] == ["-m"] and not getattr(_sys.flags, "safe_path", False) and _sys.path:
    # `python -m pcdist` put the current folder first on sys.path (not under -P), and nothing else is imported
    # yet: take it off, so that a module lying there (a yaml.py or torch.py in a run folder one was sent) is never
    # imported in place of a dependency. With --trust-code it goes last: the run's own code may live there, as the
    # user says, but it still never stands in for an installed package.
    _here = _sys.path.pop(0)
    if "--trust-code" in _sys.argv:
        _sys.path.append(_here)

if "torch" not in _sys.modules:  # OpenMP reads its wait policy once, when torch loads it
    # Threads that sleep while they wait, instead of spinning: on a machine where other processes hold cores,
    # spinning threads made CPU runs 6-13x slower (docs/service.md, "Threads on CPU"). ACTIVE: spin (dedicated cores).
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _interrupted_while_starting(signum, frame):
    """Ctrl-C while the command line imports torch and pcdist (a second or two, before anything runs or is
    written): one line and status 130, as a Ctrl-C later in the run, not a traceback of the imports. It ends the
    process at once: an exception raised here can be swallowed (torch's C++ clears any error of its numpy import,
    which left numpy half-imported and the run going on, to fail later or not at all)."""
    print("interrupted (Ctrl-C) while starting: nothing was run", file=_sys.stderr, flush=True)
    _sys.stdout.flush()
    from .errors import stop_status

    _os._exit(stop_status(ctrl_c=True))


if (_sys.argv[:1] == ["-m"] or _os.path.basename(_sys.argv[0]) == "pcdist-train"
        or getattr(_sys.modules.get("__main__"), "PCDIST_COMMAND_LINE", False)):  # the command line (train.py)
    import signal as _signal  # (pcdist.service.cli.main gives Ctrl-C back its KeyboardInterrupt)

    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:  # (not where it is ignored)
        _signal.signal(_signal.SIGINT, _interrupted_while_starting)

import importlib as _importlib  # noqa: E402 - after the handler above
import importlib.abc as _abc  # noqa: E402

_API = {
    ".distributed.parallel": ("Parallel", "ParallelDims", "init_distributed"),
    ".engine.diagnostics": ("diagnose",),
    ".engine.activations": ("ACTIVATIONS", "Activation", "get_activation"),
    ".engine.energies": ("ENERGIES",),
    ".engine.fuse": ("FusedModules", "fuse"),
    ".engine.layers": ("AnyModule", "Conv", "Dense", "LayerKind", "LayerSpec", "ModuleKind", "Residual",
                       "ResidualLinear", "mupc_layers", "mupc_specs"),
    ".engine.layers.prior": ("Prior",),
    ".engine.schedules": ("top_down",),
    ".engine.network": ("PCNetwork", "mlp_specs"),
    ".engine.trainer": ("ALGORITHMS", "PCTrainer", "warmup_cosine"),
    ".engine.values": ("ValueRule",),
    ".errors": ("ConfigError",),
    ".service.config": ("compose",),
    ".service.backprop": ("BackpropTrainer",),
    ".service.compare": ("compare",),
    ".service.evaluate": ("evaluate", "predict"),
    ".service.export": ("export",),
    ".service.load": ("Run", "RunError", "load"),
    ".service.run": ("Interrupted", "Preempted", "Result", "train"),
}
"""pcdist's API: where each name lives. ``import pcdist`` imports none of it (no torch: the command line checks
its arguments and answers ``--help`` in ~0.5 s); the first name used imports it all, as one import would."""

_SHORT = {f"{__name__}.layers": ".engine.layers", f"{__name__}.data": ".service.data",
          f"{__name__}.deeppcr": ".engine.deeppcr"}
"""pcdist.layers, pcdist.data and pcdist.deeppcr: importable by their short names."""


def _load() -> None:
    """Import the whole API into the package (once)."""
    import gc

    # Importing torch and pcdist makes ~300k objects (modules, functions, classes: no garbage), and the garbage
    # collector would pass over them again and again as they are made: off while they import, then as it was.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for module, names in _API.items():
            loaded = _importlib.import_module(module, __name__)
            globals().update({n: getattr(loaded, n) for n in names})
        for short, module in _SHORT.items():
            globals()[short.rpartition(".")[2]] = _importlib.import_module(module, __name__)
    finally:
        if collecting:
            gc.enable()


def __getattr__(name: str):
    if name in __all__:
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _ShortNames(_abc.MetaPathFinder, _abc.Loader):
    """``import pcdist.layers`` (and .data, .deeppcr): the module of the long name, under the short one too."""

    def find_spec(self, fullname, path, target=None):
        from importlib.util import spec_from_loader

        return spec_from_loader(fullname, self) if fullname in _SHORT else None

    def create_module(self, spec):
        return None  # a placeholder, replaced by exec_module

    def exec_module(self, module):
        _sys.modules[module.__name__] = _importlib.import_module(_SHORT[module.__name__], __name__)


_sys.meta_path.append(_ShortNames())

__version__ = "0.1.0"

__all__ = sorted([n for names in _API.values() for n in names] + [s.rpartition(".")[2] for s in _SHORT])
