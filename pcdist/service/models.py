"""The models that ``model.name`` picks, in a registry (mlp, mupc, cnn, vgg, deconv, and yours), and the model
factory: the layer kinds of the configured model on the data's shapes (``model_specs``), the network of a layer
slice (``make_network``), and the run's model.json (``record_model``).

A ``Model`` is one small object per model: its layer kinds from the config and the shapes of the end nodes
(``specs``), its number of PC layers (``num_layers``), whether it reads samples flattened or as images / signals
channels-first (``images``), the pc.modes it trains in, its own config and data checks, and the teacher widths
of data=synthetic. ``register_model(MyModel())`` adds one by its ``name``: ``model.name=my`` then takes it in
``pcdist.train``, ``python train.py`` and ``python -m pcdist evaluate``. Nothing outside this module switches on
a model's name.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..engine.layers import mupc_specs
from ..engine.models import cnn_specs, deconv_specs, vgg_specs
from ..engine.modes import MODES
from ..engine.network import PCNetwork, mlp_specs
from ..errors import ConfigError
from .config import GROUPS, PYTHON_MODEL, Config, ModelConfig, network_options
from .data import DataError, Dataset, NpyArrays
from .modelfile import Inputs, write_model_file
from .userlayers import UserLayers

__all__ = ["Model", "MODELS", "register_model", "model_of", "check_model_keys", "modes_allowed", "end_shapes",
           "model_specs", "make_network", "record_model"]


class Model:
    """A model that ``model.name`` picks (see the module docstring); subclasses set ``name`` and override
    ``specs`` and ``num_layers`` (and the rest where the defaults, those of a vector model, do not fit)."""

    name = "?"
    images = False
    """Its data nodes stay images [C, H, W] (or signals [C, L]) as loaded; False: it reads samples flattened."""
    refuse_channels_last = False
    """Refuse samples that look channels-last ([H, W, C], [L, C]) with the one line that says how to transpose them."""
    modes: tuple[str, ...] = MODES
    """The pc.modes it trains in."""
    wrong_mode = ""
    """Why it does not train in the other modes (the end of validate's one line)."""
    layers_key = "model.dims"
    """The config keys that set its number of layers (named when parallel.layer asks for more ranks)."""
    keys: tuple[str, ...] | None = None
    """The model.* keys it reads (its layers and its ``teacher``) besides model.name and model.energy (every
    model's): a key the user sets that it does not read is refused (``check_model_keys``) rather than ignored.
    None: not declared, none refused."""

    def specs(self, c: Config, bottom: tuple[int, ...], top: tuple[int, ...], classes: int) -> list:
        """The layer kinds, given the shapes of h_0 (``bottom``) and h_L (``top``) in pc.mode and the number of
        classes of the data (a ValueError where the shapes leave a layer nothing to work on)."""
        raise NotImplementedError

    def num_layers(self, m: ModelConfig) -> int:
        """Its number of PC layers (weight layers), the most ranks the layer axis can have."""
        raise NotImplementedError

    def check(self, m: ModelConfig) -> None:
        """Refuse values of its own model.* keys that no other key's range already refuses (validate calls it)."""

    def check_data(self, c: Config, ds, shape: str) -> None:
        """Refuse data whose shape does not fit its config (``shape``: the sample's shape as `` (C x H x W)``)."""

    def teacher(self, m: ModelConfig) -> list[int]:
        """The widths of data=synthetic's teacher network (input, hidden, classes)."""
        return [64, m.width, 10]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


MODELS: dict[str, Model] = {}
"""The models ``model.name`` picks, by name, in the order ``validate`` lists them."""


def register_model(model: Model, name: str | None = None) -> Model:
    """Add ``model`` to the registry under ``name`` (default its own); returns it."""
    if not isinstance(model, Model):
        raise TypeError(f"register_model takes a pcdist Model (subclass pcdist.service.models.Model), got {model!r}")
    MODELS[name or model.name] = model
    return model


class MLP(Model):
    """Linear + activation layers of widths model.dims (model.init: their weight init)."""

    name, keys = "mlp", ("dims", "activation", "init")

    def specs(self, c, bottom, top, classes):
        m = c.model
        return mlp_specs(m.dims, m.activation, m.init)

    def num_layers(self, m):
        return len(m.dims) - 1

    def check_data(self, c, ds, shape):
        if c.pc.mode == "supervised":
            _check_mlp_ends(c, ds, shape)
            return
        # the data sit at h_L, a label (generative) or a latent (unsupervised) at h_0
        bottom = ds.num_classes if c.pc.mode == "generative" else c.pc.latent_dim
        said = f"{ds.num_classes} classes" if c.pc.mode == "generative" else f"pc.latent_dim={c.pc.latent_dim}"
        for key, got, want, what in (("model.dims[0]", c.model.dims[0], bottom, f"h_0: {said}"),
                                     ("model.dims[-1]", c.model.dims[-1], ds.num_features,
                                      f"h_L: data {c.data.name}'s {ds.num_features} features{shape}")):
            if got != want:
                raise DataError(f"pc.mode={c.pc.mode} needs {key}={want} ({what}), but model.dims="
                                f"{list(c.model.dims)}")

    def teacher(self, m):
        return m.dims


class MuPC(Model):
    """A μPC residual network of model.depth layers of width model.width."""

    name, layers_key, keys = "mupc", "model.depth", ("width", "depth", "activation")

    def specs(self, c, bottom, top, classes):
        m = c.model
        return mupc_specs(math.prod(bottom), m.width, m.depth, math.prod(top), m.activation)

    def num_layers(self, m):
        return m.depth


class CNN(Model):
    """Conv layers of model.channels (Conv2d on images, Conv1d on signals), then the dense model.head."""

    name, images, refuse_channels_last, layers_key = "cnn", True, True, "model.channels and model.head"
    modes, wrong_mode = ("supervised",), "cnn and vgg are conv encoders: data in, label out"
    keys = ("channels", "kernel_size", "pool", "head", "stride", "padding", "activation")

    def specs(self, c, bottom, top, classes):
        m = c.model
        return cnn_specs(bottom, m.channels, m.kernel_size, m.pool, m.head, classes, m.activation, m.stride,
                         m.padding)

    def num_layers(self, m):
        return len(m.channels) + len(m.head) + 1

    def check(self, m):
        if len(m.pool) != len(m.channels):
            raise ConfigError(f"config model.channels={m.channels} has {len(m.channels)} conv layers but model.pool="
                              f"{m.pool} has {len(m.pool)} entries: one pooling (max, avg or none) per conv layer, "
                              f"e.g. model.pool=[{','.join(['max'] * len(m.channels))}]")
        for key, vals in (("model.stride", m.stride), ("model.padding", m.padding)):
            if vals and len(vals) != len(m.channels):
                raise ConfigError(f"config {key}={vals} has {len(vals)} entries but model.channels={m.channels} "
                                  f"has {len(m.channels)} conv layers: one per conv layer (or [] for the default)")


class VGG(Model):
    """PCX's VGG-5 / VGG-7 (model.variant) for 3 x 32 x 32 images."""

    name, images, refuse_channels_last, layers_key = "vgg", True, True, "model.variant"
    modes, wrong_mode = ("supervised",), "cnn and vgg are conv encoders: data in, label out"
    keys = ("variant", "activation")

    def specs(self, c, bottom, top, classes):
        return vgg_specs(c.model.variant, bottom, classes, c.model.activation)

    def num_layers(self, m):
        return {"vgg5": 5, "vgg7": 7}[m.variant]


class Deconv(Model):
    """A conv decoder for images at h_L: a dense layer, then upsampling + conv layers of model.channels."""

    name, images, layers_key = "deconv", True, "model.channels"
    modes, wrong_mode = ("generative", "unsupervised"), "deconv is a decoder: use pc.mode=generative or unsupervised"
    keys = ("channels", "kernel_size", "activation")

    def specs(self, c, bottom, top, classes):
        m = c.model
        return deconv_specs(math.prod(bottom), top, m.channels, m.kernel_size, m.activation)

    def num_layers(self, m):
        return len(m.channels) + 2


class Python(Model):
    """The layers passed to ``pcdist.train(cfg, layers=...)`` (model.name=python, model.depth of them): not in
    ``MODELS`` (no config picks it); the user's layers (pcdist/service/userlayers.py) say the rest."""

    name, layers_key, keys = PYTHON_MODEL, "model.variant", ()

    def specs(self, c, bottom, top, classes):
        m = c.model
        return mlp_specs(m.dims, m.activation, m.init)

    def num_layers(self, m):
        return m.depth


for _m in (MLP(), MuPC(), CNN(), VGG(), Deconv()):
    register_model(_m)

PYTHON = Python()


def model_of(c: Config) -> Model:
    """The configured model (model.name's)."""
    return PYTHON if c.model.name == PYTHON_MODEL else MODELS[c.model.name]


def check_model_keys(c: Config, passed: dict[str, str] | None) -> None:
    """Refuse a model.* key the user sets (``passed``: on the command line or in pcdist.train's cfg; a preset or
    group choice is not checked) that the configured model does not read, which would be ignored silently."""
    model = model_of(c)
    if model.keys is None:
        return
    reads = {"name", "energy", *model.keys}
    for key, override in (passed or {}).items():
        group, _, field = key.partition(".")
        if group != "model" or field in reads or override.split("=", 1)[0] in GROUPS:
            continue
        who = "the layers passed to pcdist.train(cfg, layers=...)" if model is PYTHON else f"model.name={model.name}"
        readers = [n for n, m in MODELS.items() if field in (m.keys or ())]
        fix = f"drop it or pick model={readers[0]}" if readers and model is not PYTHON else "drop it"
        raise ConfigError(f"{override}: {who} does not read model.{field} ({' and '.join(readers) or 'no model'} "
                          f"{'do' if len(readers) > 1 else 'does'}), so it would change nothing; {fix} ({who} reads "
                          f"{', '.join(f'model.{k}' for k in ('energy', *model.keys))})")


def modes_allowed(mode: str) -> str:
    """The models that train in pc.mode ``mode``, as ``a, b or c``."""
    names = [n for n, m in MODELS.items() if mode in m.modes]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def end_shapes(c: Config, sample_shape: tuple[int, ...], classes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of h_0 and h_L in pc.mode: (data, label) supervised, (label, data) generative,
    (latent, data) unsupervised; data flattened unless the model keeps images."""
    data = tuple(sample_shape) if model_of(c).images else (math.prod(sample_shape),)
    bottom = {"supervised": data, "generative": (classes,), "unsupervised": (c.pc.latent_dim,)}[c.pc.mode]
    return bottom, (data if c.pc.mode != "supervised" else (classes,))


def model_specs(c: Config, sample_shape: tuple[int, ...], classes: int) -> list:
    """The layer kinds of the configured model. mupc, cnn, vgg and deconv take the shapes of their end nodes
    from the data (a sample's ``sample_shape``, the number of ``classes``) and pc.mode."""
    try:
        return model_of(c).specs(c, *end_shapes(c, sample_shape, classes), classes)
    except ValueError as e:  # a layer the data's shape leaves nothing to (a conv on too small a sample)
        raise ConfigError(f"model.name={c.model.name} on data {c.data.name}'s samples of shape {list(sample_shape)}: "
                          f"{e}") from e


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


def _labels_at_hand(ds) -> list | None:
    """The training and validation labels where they are at hand without reading a sample: in memory, or the
    memory-mapped y_*.npy of an arrays folder; None for other streamed data."""
    if isinstance(ds, Dataset):
        return [ds.y_train, ds.y_val]
    splits = [getattr(getattr(ds, split, None), "inner", getattr(ds, split, None)) for split in ("train", "val")]
    return [split.y for split in splits] if all(isinstance(split, NpyArrays) for split in splits) else None


def _empty_class_0(ds) -> str:
    """A note for labels that start at 1 (in memory or in an arrays folder): the classes counted include an empty
    class 0."""
    labels = _labels_at_hand(ds)
    if labels is None or not len(labels[0]) or int(labels[0].min()) < 1:
        return ""
    low = min(int(y.min()) for y in labels if len(y))
    return (f" (no label is below {low}, so class{'es' * (low > 1)} 0{f'-{low - 1}' if low > 1 else ''} "
            f"{'are' if low > 1 else 'is'} empty: labels are class ids from 0; if yours start at {low}, subtract "
            f"{low}, y - {low})")
