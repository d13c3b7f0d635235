"""``model.json``: what a run directory records to rebuild its network and its inputs without the data.

Written by the training service beside ``config.yaml`` (``record_model``, pcdist/service/models.py), read by
``pcdist.load`` (pcdist/service/load.py). Plain JSON, nothing unpickled:

    {"format": 1,
     "energy": "ce",
     "layers": [{"kind": "dense", "fields": {"in_features": 64, ..., "activation": {"name": "gelu", ...}}},
                {"kind": "module", "signature": {...}, "class": "mypkg.blocks.Block"}, ...],
     "structure": {"1": {"wrap": "bare"}, ...},        # how the user's modules nested their parts
     "factory": "mypkg.models:make_layers",           # or null: an importable function that builds the layers
     "inputs": {"sample_shape": [1, 8, 8], "flatten": true, "dtype": "float32", "num_classes": 10,
                "normalize": {"mean": [...], "std": [...]} or null}}

The dense, residual and conv kinds are rebuilt from their fields alone. A ``module`` layer (any
other nn.Module) is code, not data: it is rebuilt by calling ``factory`` (recorded when
``pcdist.train(cfg, layers=...)`` got an importable function; called only when the caller opts in,
``pcdist.load(run_dir, trust_code=True)``), or from modules the caller passes
(``pcdist.load(run_dir, layers=...)``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

from ..engine.activations import Activation, get_activation
from ..engine.layers import Conv, Dense, LayerKind, Residual
from .metrics import replace_file

__all__ = ["FILE", "describe_kind", "kind_from_description", "kind_from_signature", "write_model_file",
           "read_model_file", "Inputs"]

FILE = "model.json"
FORMAT = 1
_KINDS = {"dense": Dense, "residual": Residual, "conv": Conv}


def _plain(v: Any) -> Any:
    if isinstance(v, Activation):
        return {"activation": dataclasses.asdict(v)}
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def _unplain(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"activation"}:
        return Activation(**v["activation"])
    if isinstance(v, list):
        return tuple(_unplain(x) for x in v)
    return v


def describe_kind(kind: LayerKind) -> dict:
    """One layer as plain data: every field of the dense, residual and conv kinds; the signature and
    class of a module layer."""
    if kind.kind in _KINDS:
        return {"kind": kind.kind, "fields": {f.name: _plain(getattr(kind, f.name)) for f in dataclasses.fields(kind)}}
    template = getattr(kind, "template", None)
    cls = type(template)
    return {"kind": kind.kind, "signature": kind.signature(), "class": f"{cls.__module__}.{cls.__qualname__}"}


def kind_from_description(d: dict) -> LayerKind | None:
    """The layer kind ``describe_kind`` wrote (None for a module layer: it needs its module)."""
    cls = _KINDS.get(d.get("kind"))
    if cls is None:
        return None
    return cls(**{k: _unplain(v) for k, v in d["fields"].items()})


def kind_from_signature(sig: dict) -> LayerKind | None:
    """A layer kind from a checkpoint's signature alone (runs written before model.json; activations
    with their default parameters). None for a module layer."""
    act = None if sig.get("activation") is None else get_activation(sig["activation"])
    kind = sig.get("kind")
    if kind == "dense":
        shape = sig.get("in_shape")
        return Dense(sig["in"], sig["out"], act, bias=sig.get("bias", True),
                     input_shape=None if shape is None else tuple(shape))
    if kind == "residual":
        return Residual(sig["in"], sig["out"], act, sig["scale"], sig["skip"], sig["bias"])
    if kind == "conv":
        t = lambda k: tuple(sig[k])  # noqa: E731
        return Conv(sig["in"][0], sig["out"][0], tuple(sig["in"][1:]), t("kernel_size"), act, t("stride"),
                    t("padding"), t("dilation"), sig["groups"], sig["bias"], sig["pool"], t("pool_kernel"),
                    t("pool_stride"), t("pool_padding"))
    return None


@dataclasses.dataclass
class Inputs:
    """How the run fed its inputs: sample shape as loaded, flattened or not, the dtype, the
    standardisation (per-channel mean and std of the training set) where ``data.normalize`` was on."""

    sample_shape: tuple[int, ...]
    flatten: bool
    dtype: str = "float32"
    num_classes: int | None = None
    mean: torch.Tensor | None = None
    std: torch.Tensor | None = None

    def node_shape(self) -> tuple[int, ...]:
        """The input node's shape: the sample's, or its size where flattened."""
        return (math.prod(self.sample_shape),) if self.flatten else tuple(self.sample_shape)

    def to_json(self) -> dict:
        norm = None if self.mean is None else {"mean": self.mean.tolist(), "std": self.std.tolist()}
        return {"sample_shape": list(self.sample_shape), "flatten": self.flatten, "dtype": self.dtype,
                "num_classes": self.num_classes, "normalize": norm}

    @classmethod
    def from_json(cls, d: dict) -> "Inputs":
        norm = d.get("normalize")
        if d.get("dtype", "float32") not in ("float32", "float64"):  # a name, never looked up in torch unchecked
            raise ValueError(f"model.json: inputs dtype {d.get('dtype')!r} is not float32 or float64")
        dtype = getattr(torch, d.get("dtype", "float32"))
        shape, classes = d["sample_shape"], d.get("num_classes")
        if not (isinstance(shape, list) and shape and all(type(n) is int and n > 0 for n in shape)):
            raise ValueError(f"model.json: inputs sample_shape {shape!r} is not a list of sizes")
        if classes is not None and not (type(classes) is int and classes > 0):
            raise ValueError(f"model.json: inputs num_classes {classes!r} is not a number of classes")
        mean = std = None
        if norm is not None:
            mean, std = torch.tensor(norm["mean"], dtype=dtype), torch.tensor(norm["std"], dtype=dtype)
            torch.broadcast_shapes(mean.shape, std.shape, tuple(shape))  # (a ValueError where they do not fit)
            if not (torch.isfinite(mean).all() and torch.isfinite(std).all() and (std > 0).all()):
                raise ValueError("model.json: the input normalisation holds a std that is not > 0, or a value that "
                                 "is not finite")
            std = torch.where(std <= 1e-8, 1.0, std)  # a run of before: its floor on a constant channel (data.py)
        return cls(tuple(shape), bool(d["flatten"]), d.get("dtype", "float32"), classes, mean, std)


def write_model_file(run_dir: str | Path, specs, energy: str, structure: dict[int, dict], inputs: Inputs,
                     factory: str | None = None) -> Path:
    """run_dir/model.json (written to a temporary name, then renamed)."""
    body = {"format": FORMAT, "energy": energy, "layers": [describe_kind(s) for s in specs],
            "structure": {str(l): v for l, v in structure.items()}, "factory": factory, "inputs": inputs.to_json()}
    return replace_file(Path(run_dir) / FILE, json.dumps(body, indent=1))


def read_model_file(run_dir: str | Path) -> dict | None:
    """run_dir/model.json as a dict, or None where the run predates it."""
    path = Path(run_dir) / FILE
    return json.loads(path.read_text()) if path.is_file() else None
