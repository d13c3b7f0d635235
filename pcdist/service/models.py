"""The model factory: the layer kinds of ``model.name`` on the data's shapes (``model_specs``), the network of a
layer slice (``make_network``), and the run's model.json (``record_model``)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..engine.layers import mupc_specs
from ..engine.models import cnn_specs, deconv_specs, vgg_specs
from ..engine.network import PCNetwork, mlp_specs
from ..errors import ConfigError
from .config import Config, network_options
from .data import DataError, Dataset
from .modelfile import Inputs, write_model_file
from .userlayers import UserLayers

IMAGE_MODELS = ("cnn", "vgg", "deconv")
"""Models whose data nodes stay images [C, H, W]; the others read samples flattened."""


def end_shapes(c: Config, sample_shape: tuple[int, ...], classes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of h_0 and h_L in pc.mode: (data, label) supervised, (label, data) generative,
    (latent, data) unsupervised; data flattened unless the model keeps images."""
    data = tuple(sample_shape) if c.model.name in IMAGE_MODELS else (math.prod(sample_shape),)
    bottom = {"supervised": data, "generative": (classes,), "unsupervised": (c.pc.latent_dim,)}[c.pc.mode]
    return bottom, (data if c.pc.mode != "supervised" else (classes,))


def model_specs(c: Config, sample_shape: tuple[int, ...], classes: int) -> list:
    """The layer kinds of the configured model. mupc, cnn, vgg and deconv take the shapes of their end nodes
    from the data (a sample's ``sample_shape``, the number of ``classes``) and pc.mode."""
    try:
        return _model_specs(c, sample_shape, classes)
    except ValueError as e:  # a layer the data's shape leaves nothing to (a conv on too small a sample)
        raise ConfigError(f"model.name={c.model.name} on data {c.data.name}'s samples of shape {list(sample_shape)}: "
                          f"{e}") from e


def _model_specs(c: Config, sample_shape: tuple[int, ...], classes: int) -> list:
    m = c.model
    bottom, top = end_shapes(c, sample_shape, classes)
    if m.name == "mupc":
        return mupc_specs(math.prod(bottom), m.width, m.depth, math.prod(top), m.activation)
    if m.name == "cnn":
        return cnn_specs(bottom, m.channels, m.kernel_size, m.pool, m.head, classes, m.activation, m.stride, m.padding)
    if m.name == "vgg":
        return vgg_specs(m.variant, bottom, classes, m.activation)
    if m.name == "deconv":
        return deconv_specs(math.prod(bottom), top, m.channels, m.kernel_size, m.activation)
    return mlp_specs(m.dims, m.activation, m.init)


def make_network(c: Config, specs: list, layers: tuple[int, int], dtype, device) -> PCNetwork:
    """The configured network's layer slice ``layers``: its output energy, precisions and the prior of h_0."""
    return PCNetwork(specs, energy=c.model.energy, layers=layers, seed=c.trainer.seed, dtype=dtype, device=device,
                     **network_options(c))


def record_model(c: Config, run_dir: Path, specs, net: PCNetwork, inputs: Inputs, user: UserLayers | None) -> None:
    """run_dir/model.json: the layers, their nesting and the input preparation, so that ``pcdist.load``
    rebuilds the network and its inputs without the data (pcdist/service/modelfile.py)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    structure = user.structure() if user is not None else {}
    write_model_file(run_dir, specs, c.model.energy, structure, inputs, user.factory if user is not None else None)
    if user is not None and user.unbuildable(specs):
        print(f"model.json: layers {user.unbuildable(specs)} are modules that only code can rebuild and no importable "
              f"function made them; pcdist.load({str(run_dir)!r}, layers=...) needs them (or pass "
              f"pcdist.train(cfg, layers=<an importable function>))", flush=True)


def _check_mlp_ends(c: Config, ds, shape: str) -> None:
    """model.dims against the data's input features and classes, both fixes said at once (with a note where the
    labels start at 1, which leaves class 0 empty)."""
    dims = list(c.model.dims)
    wrong = [f"{ds.num_features} input features{shape} but model.dims[0]={dims[0]}"] * (ds.num_features != dims[0])
    wrong += [f"{ds.num_classes} classes but model.dims[-1]={dims[-1]}"] * (ds.num_classes != dims[-1])
    if not wrong:
        return
    fixed = ",".join(map(str, [ds.num_features, *dims[1:-1], ds.num_classes]))
    raise DataError(f"data {c.data.name} has {' and '.join(wrong)}; set model.dims=[{fixed}]{_empty_class_0(ds)}")


def _empty_class_0(ds) -> str:
    """A note for labels that start at 1 (in-memory data): the classes counted include an empty class 0."""
    if not isinstance(ds, Dataset) or not len(ds.y_train) or int(ds.y_train.min()) < 1:
        return ""
    low = int(torch.cat([ds.y_train, ds.y_val]).min())
    return (f" (no label is below {low}, so class{'es' * (low > 1)} 0{f'-{low - 1}' if low > 1 else ''} "
            f"{'are' if low > 1 else 'is'} empty: labels are class ids from 0; if yours start at {low}, subtract "
            f"{low}, y - {low})")
