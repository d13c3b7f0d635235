"""pcdist: predictive-coding networks with every layer working at once.

On one device, same-shape layers are fused into batched kernels; across ranks,
each rank owns a contiguous slice of layers and trades boundary tensors with its
neighbours (see the README).

The package has three parts: ``pcdist.engine`` (the single-device PC engine),
``pcdist.distributed`` (the mesh and the boundary exchange) and ``pcdist.service``
(config, command line, runs, checkpoints, data, metrics).
"""

import sys as _sys

from .distributed.parallel import Parallel, ParallelDims, init_distributed
from .engine import deeppcr, layers
from .engine.activations import ACTIVATIONS, Activation, get_activation
from .engine.energies import ENERGIES
from .engine.fuse import FusedModules, fuse
from .engine.layers import AnyModule, Conv, Dense, LayerKind, LayerSpec, ModuleKind, Residual, ResidualLinear, mupc_layers, mupc_specs
from .engine.layers.prior import Prior
from .engine.schedules import top_down
from .engine.network import PCNetwork, mlp_specs
from .engine.trainer import ALGORITHMS, PCTrainer, warmup_cosine
from .errors import ConfigError
from .service import data
from .service.config import compose
from .service.run import Preempted, train

# pcdist.layers, pcdist.data and pcdist.deeppcr stay importable by their short names.
for _name, _module in (("layers", layers), ("data", data), ("deeppcr", deeppcr)):
    _sys.modules[f"{__name__}.{_name}"] = _module

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "ALGORITHMS",
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
