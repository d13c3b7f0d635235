"""The user's own model in the training service: ``pcdist.train(cfg, layers=...)``.

``layers`` is one torch module per PC layer (module l maps value node l-1 to the prediction of
node l; ``PCNetwork.from_layers`` picks each one's kind), an nn.Sequential (split where value
nodes go, ``PCNetwork.from_sequential``), or a function that returns either. A function that
can be imported by name (a module-level function of an importable module, not ``__main__``) is
recorded as ``"package.module:function"`` in the run's model.json, so ``pcdist.load(run_dir,
trust_code=True)`` can call it again and give back the exact modules (never without that opt-in);
otherwise the dense, residual and conv layers are rebuilt from their recorded fields and nesting,
and generic module layers need ``pcdist.load(run_dir, layers=...)``.

Every rank of a torchrun launch builds the same modules; their weights are the initial weights,
so build them deterministically (seed first) when the layers are split over ranks.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..engine.convert import module_structure, split_sequential
from ..engine.network import PCNetwork
from ..errors import ConfigError

__all__ = ["UserLayers", "factory_path", "call_factory"]


def factory_path(fn: Callable) -> str | None:
    """``"package.module:function"`` if ``fn`` can be imported by that name in another process, else None."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        return None
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{name}" if obj is fn else None


def call_factory(path: str):
    """Import ``"package.module:function"`` and call it (a ConfigError naming it where that fails)."""
    module, _, name = path.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"the run's layers come from {path}, which cannot be imported here ({e}); put its package "
                          f"on the path or pass the modules: pcdist.load(run_dir, layers=...)") from e
    return obj()


@dataclass
class UserLayers:
    """The user's modules, one per PC layer, where they came from, and a Sequential they were split from."""

    modules: list[nn.Module]
    factory: str | None = None
    sequential: nn.Sequential | None = None

    @classmethod
    def of(cls, layers) -> "UserLayers":
        factory = None
        if isinstance(layers, str):
            factory, layers = layers, call_factory(layers)
        elif callable(layers) and not isinstance(layers, nn.Module):
            factory, layers = factory_path(layers), layers()
        if isinstance(layers, nn.Sequential):
            return cls(split_sequential(layers), factory, layers)
        if isinstance(layers, (list, tuple, nn.ModuleList)) and layers and all(isinstance(m, nn.Module)
                                                                                for m in layers):
            return cls(list(layers), factory)
        raise ConfigError(f"pcdist.train(cfg, layers=...) takes torch modules, one per PC layer (a list, an "
                          f"nn.ModuleList or an nn.Sequential), or a function returning them; got "
                          f"{type(layers).__name__}")

    def flattens(self, sample_shape: tuple[int, ...]) -> bool:
        """Image samples are flattened for a first layer that starts with an nn.Linear."""
        if len(sample_shape) == 1:
            return False
        first = self.modules[0]
        while isinstance(first, nn.Sequential) and len(first):
            first = first[0]
        return isinstance(first, nn.Linear)

    def _build(self, energy: str, owned, node_shape, **kw) -> PCNetwork:
        # the data's node shape where a first layer needs one (images); a vector's is checked against the mode's
        # end nodes by the caller (ServiceTrainer._model_specs), in its words
        node_shape = tuple(node_shape) if node_shape is not None and len(node_shape) > 1 else None
        try:
            if self.sequential is not None:
                return PCNetwork.from_sequential(self.sequential, energy=energy, layers=owned, input_shape=node_shape,
                                                 **kw)
            return PCNetwork.from_layers(self.modules, energy=energy, input_shape=node_shape, layers_owned=owned, **kw)
        except ValueError as e:
            raise ConfigError(f"pcdist.train(cfg, layers=...): {e}") from e

    def specs(self, node_shape: tuple[int, ...]) -> list:
        """The layer kinds of the modules on an input node of ``node_shape``."""
        return list(self._build("se", None, node_shape).specs)

    def network(self, energy: str, owned, node_shape, dtype, device, **kw) -> PCNetwork:
        """The PCNetwork of layers ``owned`` = (first, stop) with the modules' weights (``kw``: its precisions
        and prior, as PCNetwork takes them)."""
        net = self._build(energy, tuple(owned), node_shape, **kw)
        return net.to(dtype=dtype, device=device)

    def structure(self) -> dict[int, dict]:
        return {l: module_structure(m) for l, m in enumerate(self.modules, start=1)}

    def unbuildable(self, specs) -> list[int]:
        """Layers that only code rebuilds (generic module layers), where no factory was recorded."""
        return [] if self.factory else [l for l, s in enumerate(specs, start=1) if s.kind not in
                                        ("dense", "residual", "conv")]
