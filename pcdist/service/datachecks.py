"""A run's data, loaded and checked against the model and the batch size before it trains: shapes, labels,
finite inputs, channels-last images, enough samples (``_check_data``); normalised and flattened as the model
reads them (``load_data``)."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..errors import ConfigError
from .config import ONE_READER, PYTHON_DATA, PYTHON_MODEL, Config, unread
from .data import DataError, Dataset, NpyArrays, StreamedData, load_dataset, normalization_stats, normalized, prepared
from .loader import Streamed
from .modelfile import Inputs
from .models import model_of, model_specs
from .userlayers import UserLayers


def load_data(c: Config, data: Dataset | StreamedData | None, user: UserLayers | None = None
               ) -> tuple[Dataset | StreamedData, Inputs, dict]:
    """This run's data: ``data`` if given, else data.name's; checked against the model and the batch size.

    Image models (cnn, vgg, deconv: ``Model.images``, pcdist/service/models.py) take images as they are
    ([N, C, H, W]); the vector models (mlp, mupc) take in-memory inputs flattened to [N, features] (a view),
    and streamed batches flattened as they arrive (pcdist.service.loader). ``data.normalize`` standardises
    in-memory inputs per channel.
    Returns the data, how its inputs were prepared (saved in the run's model.json) and its identity (what a
    checkpoint records of it: ``data_identity``).
    """
    if data is None:
        data = _dataset(c)
    elif not isinstance(data, (Dataset, StreamedData)):
        raise DataError(f"pcdist.train(cfg, data=...) takes a pcdist.data.Dataset (tensors in memory) or "
                        f"StreamedData (torch Datasets), got {type(data).__name__}")
    elif isinstance(data, Dataset):
        data = prepared(data)
    if c.data.num_classes is not None and c.data.num_classes != data.num_classes:  # (data from Python: its own)
        raise ConfigError(f"config data.num_classes={c.data.num_classes}, but the data passed to pcdist.train has "
                          f"num_classes={data.num_classes}: set it on the data (Dataset / StreamedData num_classes), "
                          f"or leave data.num_classes out")
    _check_data(c, data)
    # of the data as given (normalizing rounds by the machine's threads; synthetic labels are a teacher's argmax)
    identity = data_identity(data, labels=c.data.name != "synthetic")
    shape = tuple(data.sample_shape)
    flatten = _flattens(c, shape, user)
    inputs = Inputs(shape, flatten, c.trainer.dtype, data.num_classes)
    if c.data.normalize:
        if not isinstance(data, Dataset):
            raise ConfigError("config data.normalize=true standardises in-memory data; for streamed data "
                              "(an arrays folder, torch Datasets) normalise the arrays or the Dataset yourself")
        inputs.mean, inputs.std = normalization_stats(data)
        data = normalized(data, (inputs.mean, inputs.std), getattr(torch, c.trainer.dtype))
    _check_augment(c, data.sample_shape, flatten)
    return (data.flat() if flatten and isinstance(data, Dataset) else data), inputs, identity


def _dataset_args(c: Config) -> tuple:
    """``load_dataset``'s arguments for the configured data."""
    d = c.data
    teacher = model_of(c).teacher(c.model)  # data=synthetic's shape
    return (d.name, d.root, tuple(teacher), c.trainer.seed, d.val_fraction, d.synthetic_train, d.synthetic_val,
            d.path, d.num_classes, d.signal)


def _dataset(c: Config) -> Dataset | StreamedData:
    """The configured data set (data.name's)."""
    name, root, teacher, *rest = _dataset_args(c)
    return load_dataset(name, root, list(teacher), *rest)


def check_model_on_data(c: Config, loaded: dict | None = None) -> None:
    """The configured data against the configured model, as a run checks them before it trains (a sweep checks
    every job so before the first starts); ``loaded``: data sets already read, by their arguments."""
    loaded = {} if loaded is None else loaded
    args = _dataset_args(c)
    if args not in loaded:
        loaded[args] = _dataset(c)
    ds = loaded[args]
    _check_data(c, ds)
    model_specs(c, tuple(ds.sample_shape), ds.num_classes)


def _flattens(c: Config, sample_shape: tuple[int, ...], user: UserLayers | None) -> bool:
    """Whether the model reads flattened samples: the vector models (mlp, mupc: ``Model.images`` false), and the
    user's layers when the first one starts with an nn.Linear."""
    if user is not None:
        return user.flattens(sample_shape)
    return not model_of(c).images


def data_identity(ds: Dataset | StreamedData, labels: bool = True) -> dict:
    """What a checkpoint records of the data it was trained on, so that a resume on other data is seen (the same
    file rewritten, other files under the old path): the sizes, the sample shape, the classes and a digest of every
    label, where they are at hand without reading the samples (in memory, an arrays folder's y_*.npy, a torch
    Dataset's ``targets`` as torchvision's keep them, through ``Subset``s; ``labels`` False: none, for labels a
    computation makes, data=synthetic's). A sample's inputs mended (a NaN replaced) leave it as it was."""
    digest = hashlib.sha256()
    out = {"train": num_train(ds), "val": len(ds.val) if isinstance(ds, StreamedData) else len(ds.x_val),
           "sample_shape": [int(d) for d in ds.sample_shape], "num_classes": int(ds.num_classes)}
    for split in ("train", "val") if labels else ():
        if isinstance(ds, Dataset):
            ys = getattr(ds, f"y_{split}").cpu().numpy()
        else:
            inner = getattr(getattr(ds, split), "inner", getattr(ds, split))  # (data.signal=true wraps the arrays)
            ys = inner.y if isinstance(inner, NpyArrays) else _targets(inner)
        if ys is None:  # a torch Dataset without targets: its labels would mean reading every sample
            return out
        digest.update(np.asarray(ys, dtype=np.int64).tobytes())
    if not labels:
        return out
    out["labels"] = digest.hexdigest()[:16]
    return out


def _targets(d) -> np.ndarray | None:
    """A torch Dataset's labels where it keeps them as torchvision's datasets do (``targets``: a list, an array or
    a tensor of class indices, one per sample), through ``Subset``s (``random_split``'s); else None."""
    if isinstance(d, torch.utils.data.Subset):
        ys = _targets(d.dataset)
        return None if ys is None else ys[np.asarray(d.indices, dtype=np.int64)]
    ys = getattr(d, "targets", None)
    try:
        ys = np.asarray(ys.cpu() if isinstance(ys, torch.Tensor) else ys)
    except (TypeError, ValueError, RuntimeError):  # not an array of numbers
        return None
    return ys if ys.dtype.kind in "iu" and ys.shape == (len(d),) else None


def data_changes(meta: dict | None, identity: dict) -> str:
    """How ``identity`` differs from the data a checkpoint's ``meta`` records ("" where it does not, or where the
    checkpoint predates the record): "validation samples 360 -> 50; the labels differ"."""
    old = (meta or {}).get("data") or {}
    names = {"train": "training samples", "val": "validation samples", "sample_shape": "sample shape",
             "num_classes": "classes", "labels": "labels"}
    return "; ".join(f"{names[k]} {old[k]} -> {identity[k]}" if k != "labels" else "the labels differ"
                     for k in names if k in old and k in identity and old[k] != identity[k])


def check_same_data(run_dir, meta: dict | None, identity: dict) -> None:
    """Refuse to resume a run whose checkpoint was trained on other data than ``identity`` (its record says so;
    a checkpoint from before the record: not checked)."""
    changed = data_changes(meta, identity)
    if not changed:
        return
    raise DataError(f"cannot resume {run_dir}: its data changed since its checkpoint was trained ({changed}); a "
                    f"resume would train on other data and, by epochs, to another length; nothing was changed: "
                    f"restore the data, or train on the new data in a new run directory")


def num_train(ds: Dataset | StreamedData | Streamed) -> int:
    """Training samples."""
    return len(ds.data if isinstance(ds, Streamed) else ds)


def _channels_last(c: Config, sample_shape: tuple[int, ...]) -> str | None:
    """The one line for image or signal samples laid out channels-last ([H, W, C], [L, C]), which conv models
    read channels-first ([C, H, W], [C, L]); None if they do not look so."""
    shape = tuple(sample_shape)
    if len(shape) not in (2, 3) or not (shape[-1] <= 4 and shape[-1] < min(shape[:-1])):
        return None
    image = len(shape) == 3
    want = [shape[-1], *shape[:-1]]
    layout, axes = ("[H, W, C]", "0, 3, 1, 2") if image else ("[L, C]", "0, 2, 1")
    source = f"data {c.data.name}" + (f" ({c.data.path})" if c.data.path else "")
    as_given = f"{shape[0]} channels" + ("" if image else f" of length {shape[1]}")
    return (f"{source} has samples of shape {list(shape)}, channels-last {layout}, but model.name="
            f"{c.model.name} reads {'images [C, H, W]' if image else 'signals [C, L]'} channels-first; transpose "
            f"the arrays to [N, {', '.join(map(str, want))}]: x.transpose({axes}) (numpy) or x.permute({axes}) "
            f"(torch); if they are channels-first already ({as_given}), set data.layout=channels_first")


def signals_hint(c: Config, sample_shape: tuple[int, ...]) -> str | None:
    """The one line for samples [C, L] that an image model reads as signals (Conv1d over C channels) though they look
    like one-channel images [H, W] (C above the few channels signals have, at least half of L); None otherwise."""
    shape = tuple(sample_shape)
    if not (model_of(c).images and len(shape) == 2 and shape[0] > 4 and 2 * shape[0] >= shape[1]):
        return None
    h, w = shape
    return (f"note: data {c.data.name}'s samples [{h}, {w}] are read as 1-D signals of {h} channels and length {w} "
            f"(model.name={c.model.name} builds Conv1d layers on [C, L]); if they are one-channel images, give them "
            f"their channel: x[:, None], shape [N, 1, {h}, {w}]")


def unread_keys_note(c: Config, streamed: bool = False) -> str | None:
    """The one line for data and logger keys set off their defaults that this run does not read (data.val_fraction:
    digits; data.synthetic_*: synthetic; data.num_workers, data.prefetch_factor: streamed data, ``streamed``;
    logger.project and the other wandb keys: logger=wandb): said, not refused, as a run made so, or a sweep over
    data sets sharing them, must go on."""
    data = {k.split(".")[1]: (f"data={name}", lambda d, name=name: d.name == name)  # read by that data set alone
            for k, name in ONE_READER.items()}
    data["layout"] = ("your own data", lambda d: d.name in ("arrays", PYTHON_DATA))
    for k in ("num_workers", "prefetch_factor"):
        data[k] = ("streamed data: a folder of .npy files or a StreamedData", lambda d: streamed)
    logger = {k: ("logger=wandb", lambda lg: lg.name == "wandb") for k in ("project", "entity", "run_name")}
    said = [f"{section}.{k}={getattr(getattr(c, section), k)} (read by {readers[k][0]})"
            for section, readers in (("data", data), ("logger", logger))
            for k in unread(getattr(c, section), {k: reads for k, (_, reads) in readers.items()})]
    if not said:
        return None
    return f"note: this run (data={c.data.name}, logger={c.logger.name}) does not read {', '.join(said)}"


def _check_augment(c: Config, sample_shape, flatten: bool) -> None:
    """data.augment crops and flips images [C, H, W], for a model that reads them as images (the batches of a
    vector model are flat by then)."""
    if c.data.augment and len(sample_shape) != 3:
        raise ConfigError(f"config data.augment=true crops and flips images [C, H, W], but data {c.data.name}'s "
                          f"samples have shape {list(sample_shape)}")
    if c.data.augment and flatten:
        reader = "the first of layers=..." if c.model.name == PYTHON_MODEL else f"model.name={c.model.name}"
        raise ConfigError(f"config data.augment=true crops and flips images, but {reader} reads them flattened: "
                          f"augment for an image model (model=cnn, vgg), or leave it out")


def _check_data(c: Config, ds) -> None:
    shape = "" if len(getattr(ds, "sample_shape", ())) < 2 else f" ({' x '.join(map(str, ds.sample_shape))})"
    model = model_of(c)
    if model.refuse_channels_last and c.data.layout == "auto" and _channels_last(c, ds.sample_shape):
        raise DataError(_channels_last(c, ds.sample_shape))
    if model.images and len(ds.sample_shape) not in (2, 3):
        one = ""
        if len(ds.sample_shape) == 1:  # (data.signal is the arrays' key)
            one = (" (one-channel signals [N, L]: add data.signal=true)" if c.data.name == "arrays" else
                   f" (data={c.data.name} gives vectors: a conv model needs images, or signals: data=signals, or "
                   f"data=arrays with data.signal=true)")
        raise DataError(f"model.name={c.model.name} takes images [C, H, W] (or signals [C, L]), but data "
                        f"{c.data.name}'s samples have shape {list(ds.sample_shape)}{one}")
    model.check_data(c, ds, shape)
    if c.model.name != PYTHON_MODEL:  # (the user's layers: checked where they are built, load_data)
        _check_augment(c, ds.sample_shape, not model.images)
    if isinstance(ds, Dataset):  # streamed batches are checked as they are read (pcdist.service.loader)
        for name, x, labels in (("train", ds.x_train, ds.y_train), ("val", ds.x_val, ds.y_val)):
            if not torch.isfinite(x).all():
                raise DataError(f"data {c.data.name} {name} inputs contain NaN or Inf")
            if labels.is_floating_point() or (labels.numel() and (int(labels.min()) < 0
                                                                   or int(labels.max()) >= ds.num_classes)):
                raise DataError(f"data {c.data.name} {name} labels must be integer class ids in [0, {ds.num_classes})")
    if num_train(ds) < c.trainer.batch_size:
        raise DataError(f"data {c.data.name} has {num_train(ds)} training samples, fewer than "
                        f"trainer.batch_size={c.trainer.batch_size}")
