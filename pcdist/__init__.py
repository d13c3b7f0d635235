"""pcdist: predictive-coding networks with every layer working at once.

On one device, same-shape layers are fused into batched kernels; across ranks,
each rank owns a contiguous slice of layers and trades boundary tensors with its
neighbours (see the README).
"""

from . import deeppcr
from .activations import ACTIVATIONS, Activation, get_activation
from .config import compose
from .energies import ENERGIES
from .errors import ConfigError
from .fuse import FusedModules, fuse
from .layers import AnyModule, Conv, Dense, LayerKind, LayerSpec, ModuleKind, Residual, ResidualLinear, mupc_layers, mupc_specs
from .network import PCNetwork, mlp_specs
from .parallel import Parallel, ParallelDims, init_distributed
from .run import Preempted, train
from .trainer import ALGORITHMS, PCTrainer, warmup_cosine

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
    "Residual",
    "ResidualLinear",
    "fuse",
    "deeppcr",
    "get_activation",
    "init_distributed",
    "mlp_specs",
    "mupc_layers",
    "mupc_specs",
    "train",
    "warmup_cosine",
]
