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
    _os._exit(130)


if (_sys.argv[:1] == ["-m"] or _os.path.basename(_sys.argv[0]) == "pcdist-train"
        or getattr(_sys.modules.get("__main__"), "PCDIST_COMMAND_LINE", False)):  # the command line (train.py)
    import signal as _signal  # (pcdist.service.cli.main gives Ctrl-C back its KeyboardInterrupt)

    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:  # (not where it is ignored)
        _signal.signal(_signal.SIGINT, _interrupted_while_starting)

import gc as _gc  # noqa: E402 - after the handler above

# Importing torch and pcdist makes ~300k objects (modules, functions, classes: no garbage), and the garbage
# collector would pass over them again and again as they are made: off while they import, then as it was.
_collecting = _gc.isenabled()
_gc.disable()
try:
    from .engine.startup import defer_dynamo

    defer_dynamo()  # torch.optim imports torch._dynamo (1.3 CPU-s) only once something compiles
    from .distributed.parallel import Parallel, ParallelDims, init_distributed
    from .engine import deeppcr, layers
    from .engine.diagnostics import diagnose
    from .engine.activations import ACTIVATIONS, Activation, get_activation
    from .engine.energies import ENERGIES
    from .engine.fuse import FusedModules, fuse
    from .engine.layers import (AnyModule, Conv, Dense, LayerKind, LayerSpec, ModuleKind, Residual, ResidualLinear,
                                mupc_layers, mupc_specs)
    from .engine.layers.prior import Prior
    from .engine.schedules import top_down
    from .engine.network import PCNetwork, mlp_specs
    from .engine.trainer import ALGORITHMS, PCTrainer, warmup_cosine
    from .engine.values import ValueRule
    from .errors import ConfigError
    from .service import data
    from .service.config import compose
    from .service.backprop import BackpropTrainer
    from .service.compare import compare
    from .service.evaluate import evaluate, predict
    from .service.export import export
    from .service.load import Run, RunError, load
    from .service.run import Preempted, Result, train
finally:
    if _collecting:
        _gc.enable()

# pcdist.layers, pcdist.data and pcdist.deeppcr stay importable by their short names.
for _name, _module in (("layers", layers), ("data", data), ("deeppcr", deeppcr)):
    _sys.modules[f"{__name__}.{_name}"] = _module

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "ALGORITHMS",
    "BackpropTrainer",
    "compare",
    "diagnose",
    "evaluate",
    "export",
    "load",
    "predict",
    "Result",
    "Run",
    "ValueRule",
    "RunError",
    "ENERGIES",
    "Activation",
    "AnyModule",
    "Conv",
    "ConfigError",
    "Dense",
    "compose",
    "FusedModules",
    "LayerKind",
    "LayerSpec",
    "ModuleKind",
    "Parallel",
    "ParallelDims",
    "PCNetwork",
    "PCTrainer",
    "Preempted",
    "Prior",
    "Residual",
    "ResidualLinear",
    "fuse",
    "data",
    "deeppcr",
    "get_activation",
    "init_distributed",
    "layers",
    "mlp_specs",
    "mupc_layers",
    "mupc_specs",
    "top_down",
    "train",
    "warmup_cosine",
]
