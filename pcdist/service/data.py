"""Datasets as in-memory tensors, from bundled data, a teacher network or the standard files.

* ``digits``: scikit-learn's bundled 8x8 digits (no download), a fixed stratified split;
  images [1, 8, 8].
* ``synthetic``: inputs N(0, 1) labelled by a random tanh teacher network of the model's shape.
* ``signals``: generated 1-D signals [1, 64] of ten classes (pcdist/service/signals.py: a motif at a
  random position in noise; 4000 training, 1000 validation samples).
* ``mnist`` / ``fashion_mnist``: the four standard IDX files (gzipped or not) in ``root``;
  images [1, 28, 28].
* ``cifar10``: the standard python batches (``data_batch_1..5``, ``test_batch``) in ``root``
  or ``root/cifar-10-batches-py``, read by an unpickler that only builds numpy arrays;
  images [3, 32, 32]. ``cifar100``: its python files (``train``, ``test``) in ``root`` or
  ``root/cifar-100-python``, the 100 fine labels.
* ``arrays``: your own data (``load_arrays``): an ``.npz`` with ``x_train``, ``y_train``,
  ``x_val``, ``y_val`` (into memory), or a folder of those four ``.npy`` files
  (memory-mapped, streamed by DataLoader workers: ``StreamedData``).

In memory, a ``Dataset`` holds inputs [N, *sample_shape] (flat features [N, F], signals [N, C, L]
or images [N, C, H, W], kept shaped) and integer labels [N]. ``StreamedData`` wraps map-style torch
Datasets (items ``(x, label)``) that need not fit in memory; pcdist.service.loader reads them.

A missing or malformed file raises DataError naming the path and the expected format.
"""

from __future__ import annotations

import gzip
import io
import math
import operator
import pickle
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import DataError

__all__ = ["Dataset", "StreamedData", "DataError", "load_dataset", "load_arrays", "load_digits", "one_hot", "read_idx",
           "check_files", "FILES", "augment", "normalized", "normalization_stats"]

ARRAYS = ("x_train", "y_train", "x_val", "y_val")


@dataclass
class Dataset:
    """Training and validation data in memory: inputs [N, *sample_shape] (float), labels [N] (int64);
    the fields are named as the arrays of an ``.npz`` (x_train, y_train, x_val, y_val)."""

    x_train: Tensor  # [N, features] or [N, C, H, W], float32 (float64 kept)
    y_train: Tensor  # [N], int64 class ids
    x_val: Tensor
    y_val: Tensor
    num_classes: int

    @property
    def labels_train(self) -> Tensor:
        """``y_train`` (the field's name before it followed the .npz arrays)."""
        return self.y_train

    @property
    def labels_val(self) -> Tensor:
        """``y_val`` (the field's name before it followed the .npz arrays)."""
        return self.y_val

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def num_features(self) -> int:
        return math.prod(self.sample_shape)

    def __len__(self) -> int:
        """Training samples."""
        return len(self.x_train)

    def flat(self) -> "Dataset":
        """The same data with every sample flattened to [features] (a view where the inputs are contiguous)."""
        return Dataset(self.x_train.flatten(1), self.y_train, self.x_val.flatten(1), self.y_val, self.num_classes)


@dataclass
class StreamedData:
    """Data that need not fit in memory: map-style ``torch.utils.data.Dataset``s whose items are
    ``(x, label)`` (x a tensor or array of one sample's shape, label an int), read in batches by a
    DataLoader with worker processes (``data.num_workers``) and pinned memory on CUDA.

    pcdist builds the loader itself, so that every rank takes its shard of the same global
    batch; pass datasets, not a DataLoader. A dataset may define ``__getitems__(indices)``
    returning ``(x [b, ...], labels [b])`` to read a batch at once.
    """

    train: torch.utils.data.Dataset
    val: torch.utils.data.Dataset
    num_classes: int
    sample_shape: tuple[int, ...] | None = None
    """One sample's shape; None: taken from ``train[0]``."""

    def __post_init__(self):
        for split in ("train", "val"):
            d = getattr(self, split)
            if isinstance(d, torch.utils.data.DataLoader):
                raise DataError(f"StreamedData({split}=...) got a DataLoader: pass its .dataset; pcdist builds the "
                                f"loader so that every rank takes its shard of the same global batch")
            if isinstance(d, torch.utils.data.IterableDataset) or not hasattr(d, "__getitem__") \
                    or not hasattr(d, "__len__"):
                raise DataError(f"StreamedData({split}=...) needs a map-style dataset (__len__ and __getitem__): every "
                                f"rank reads its shard of each global batch by index; got {type(d).__name__}")
            if len(d) == 0:
                raise DataError(f"StreamedData {split} dataset is empty")
        self.num_classes = count(self.num_classes, "StreamedData num_classes")
        if self.sample_shape is None:
            x, _ = sample_pair(self.train[0], "StreamedData train sample 0")
            self.sample_shape = tuple(torch.as_tensor(np.asarray(x) if not isinstance(x, Tensor) else x).shape)
        self.sample_shape = tuple(int(s) for s in self.sample_shape)

    @property
    def num_features(self) -> int:
        return math.prod(self.sample_shape)

    def __len__(self) -> int:
        """Training samples."""
        return len(self.train)


def one_hot(labels: Tensor, num_classes: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """[B] integer labels -> [B, num_classes] one-hot rows."""
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{int(labels.min())}, {int(labels.max())}]")
    return torch.nn.functional.one_hot(labels.long(), num_classes).to(dtype)


def load_digits(val_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 images, 10 classes), pixels scaled to [0, 1], with a
    fixed stratified split: images [N, 1, 8, 8] as every reader keeps them (``load_dataset("digits")``
    is the same); ``.flat()`` gives [N, 64]. The file is read and split without importing scikit-learn
    (its import costs each process more than a second); the split is sklearn's ``train_test_split(...,
    stratify=labels, random_state=seed)``, index for index (tests/test_data_arrays.py)."""
    table = _digits_table()
    pixels, labels = table[:, :-1], table[:, -1].astype(int)
    train, val = stratified_split(labels, val_fraction, seed)
    images = lambda a: torch.as_tensor(a / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)  # noqa: E731
    return Dataset(images(pixels[train]), torch.as_tensor(labels[train]), images(pixels[val]),
                   torch.as_tensor(labels[val]), num_classes=10)


def _digits_table() -> np.ndarray:
    """[1797, 65] rows of 64 pixels (0..16) and the label, from scikit-learn's installed digits.csv.gz."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the digits data set comes with scikit-learn: pip install scikit-learn")
    path = Path(next(iter(spec.submodule_search_locations)), "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        return np.loadtxt(f, delimiter=",")


def stratified_split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) indices: scikit-learn's StratifiedShuffleSplit (one split, ``test_size=val_fraction``,
    ``random_state=seed``) step for step, so every class keeps its share and the numbers equal sklearn's."""
    n = len(labels)
    n_val = math.ceil(val_fraction * n)
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    by_class = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)
    n_train_of = _approximate_mode(counts, n - n_val, rng)
    n_val_of = _approximate_mode(counts - n_train_of, n_val, rng)
    train, val = [], []
    for members, k_train, k_val in zip(by_class, n_train_of, n_val_of):
        members = members.take(rng.permutation(len(members)), mode="clip")
        train.extend(members[:k_train])
        val.extend(members[k_train:k_train + k_val])
    # (as integer indices also where a side is empty: val_fraction=0.9999 leaves no training sample)
    return rng.permutation(train).astype(np.int64), rng.permutation(val).astype(np.int64)


def _approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """Per-class shares of ``draws`` (sklearn.utils.extmath._approximate_mode): the floors of the exact
    shares, then one more to the largest remainders, ties broken by ``rng``."""
    exact = counts / counts.sum() * draws
    floored = np.floor(exact)
    need = int(draws - floored.sum())
    remainder = exact - floored
    for value in np.sort(np.unique(remainder))[::-1]:
        if need <= 0:
            break
        (tied,) = np.where(remainder == value)
        add = min(len(tied), need)
        floored[rng.choice(tied, size=add, replace=False)] += 1
        need -= add
    return floored.astype(int)


def synthetic(dims: list[int], n_train: int, n_val: int, seed: int) -> Dataset:
    """Inputs N(0, 1) labelled by argmax of a random tanh teacher MLP with widths ``dims``."""
    if dims[-1] < 2:  # (one class: every label 0, the ce energy 0, an accuracy of 1.0 reported)
        raise DataError(f"data=synthetic labels by argmax over model.dims[-1]={dims[-1]} classes: a classifier needs "
                        f"at least 2")
    g = torch.Generator().manual_seed(seed + 12345)
    x = torch.randn(n_train + n_val, dims[0], generator=g)
    h = x
    for i in range(len(dims) - 1):
        w = torch.randn(dims[i], dims[i + 1], generator=g) * (2.0 / dims[i]) ** 0.5
        h = h @ w
        if i < len(dims) - 2:
            h = torch.tanh(h)
    labels = h.argmax(1)
    return Dataset(x[:n_train], labels[:n_train], x[n_train:], labels[n_train:], dims[-1])


def _open(path: Path) -> bytes:
    for p in (path, path.with_name(path.name + ".gz")):
        if p.is_file():
            raw = p.read_bytes()
            try:
                return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
            except (OSError, EOFError, zlib.error) as e:
                raise DataError(f"{p}: not a complete gzip file ({e}; an interrupted download?)") from None
    raise DataError(f"missing file {path} (or {path}.gz)")


def read_idx(path: Path, magic: int) -> np.ndarray:
    """An IDX file (MNIST's format: big-endian magic, dims, uint8 data), gzipped or not."""
    raw = _open(path)
    ndim = {2049: 1, 2051: 3}[magic]
    header = 4 + 4 * ndim
    if len(raw) < header or struct.unpack(">I", raw[:4])[0] != magic:
        found = struct.unpack(">I", raw[:4])[0] if len(raw) >= 4 else None
        raise DataError(f"{path}: not an IDX file with magic {magic} (found {found}); expected the standard "
                        f"MNIST format (idx{ndim}-ubyte)")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    n = int(np.prod(shape))
    if len(raw) - header != n:
        raise DataError(f"{path}: header says {shape} ({n} bytes) but {len(raw) - header} bytes follow (truncated?)")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _mnist(root: Path) -> Dataset:
    parts = []
    for split in ("train", "t10k"):
        images = read_idx(root / f"{split}-images-idx3-ubyte", 2051)
        labels = read_idx(root / f"{split}-labels-idx1-ubyte", 2049)
        if len(images) != len(labels):
            raise DataError(f"{root}: {split} has {len(images)} images but {len(labels)} labels")
        parts += [torch.from_numpy(images[:, None].astype(np.float32) / 255.0),  # [N, 1, 28, 28]
                  torch.from_numpy(labels.astype(np.int64))]
    return Dataset(*parts, num_classes=10)


class _NumpyOnly(pickle.Unpickler):
    """Unpickles dicts, lists, bytes and numpy arrays only: never arbitrary objects."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


def _cifar_file(path: Path, what: str, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(images [N, 3, 32, 32] uint8, labels [N]) of one CIFAR python file (a pickled dict)."""
    if not path.is_file():
        raise DataError(f"missing file {path}; expected the {what} python files")
    try:
        d = _NumpyOnly(io.BytesIO(path.read_bytes()), encoding="bytes").load()
        data, labels = np.asarray(d[b"data"], dtype=np.uint8), np.asarray(d[label_key], dtype=np.int64)
    except Exception as e:
        raise DataError(f"{path}: not a {what} python file (a pickled dict with b'data' [N, 3072] uint8 "
                        f"and {label_key!r}): {e}") from e
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise DataError(f"{path}: b'data' has shape {data.shape} and {len(labels)} labels; expected [N, 3072] and N")
    return data.reshape(-1, 3, 32, 32), labels


def _cifar(root: Path, name: str) -> Dataset:
    """CIFAR-10 (data_batch_1..5, test_batch) or CIFAR-100 (train, test; fine labels) as [N, 3, 32, 32]."""
    if name == "cifar10":
        folder, what, key, classes = "cifar-10-batches-py", "CIFAR-10", b"labels", 10
        train_files, val_file = [f"data_batch_{i}" for i in range(1, 6)], "test_batch"
    else:
        folder, what, key, classes = "cifar-100-python", "CIFAR-100", b"fine_labels", 100
        train_files, val_file = ["train"], "test"
    if (root / folder).is_dir():
        root = root / folder
    train = [_cifar_file(root / f, what, key) for f in train_files]
    xv, yv = _cifar_file(root / val_file, what, key)
    xt = np.concatenate([b[0] for b in train])
    yt = np.concatenate([b[1] for b in train])
    f = lambda a: torch.from_numpy(a.astype(np.float32) / 255.0)  # noqa: E731
    return Dataset(f(xt), torch.from_numpy(yt), f(xv), torch.from_numpy(yv), num_classes=classes)


def native(a: np.ndarray) -> np.ndarray:
    """``a`` in the machine's byte order (an array saved big-endian: '>f4'), which torch requires."""
    a = np.asarray(a)
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def as_float(x: np.ndarray | Tensor) -> Tensor:
    """Inputs as a float tensor: uint8 scaled to [0, 1], other integers and bool as they are, float64 kept."""
    t = torch.as_tensor(native(x)) if isinstance(x, np.ndarray) else torch.as_tensor(x)
    if t.dtype == torch.uint8:
        return t.to(torch.float32) / 255.0
    return t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)


def _check_arrays(where: str, a: dict, num_classes: int | None) -> int:
    """Shapes, dtypes and label ranges of x_train, y_train, x_val, y_val; returns the number of classes."""
    for split in ("train", "val"):
        x, y = a[f"x_{split}"], a[f"y_{split}"]
        if x.ndim < 2:
            raise DataError(f"{where}: x_{split} has shape {x.shape}; expected [N, features] or [N, C, H, W]")
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer) or x.dtype == bool):
            raise DataError(f"{where}: x_{split} has dtype {x.dtype}; expected float or integer inputs")
        if y.ndim != 1:
            fix = "a column: use y.ravel()" if y.ndim == 2 and y.shape[1] == 1 else "not one-hot: use y.argmax(1)"
            raise DataError(f"{where}: y_{split} has shape {y.shape}; expected [N] integer class ids ({fix})")
        if not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{where}: y_{split} has dtype {y.dtype}; expected integer class ids (y.astype(int))")
        if len(x) != len(y):
            raise DataError(f"{where}: x_{split} has {len(x)} samples but y_{split} has {len(y)} labels")
        if len(x) == 0:
            raise DataError(f"{where}: x_{split} has no samples")
    if (a["x_train"].dtype == np.uint8) != (a["x_val"].dtype == np.uint8):  # as_float scales uint8 only
        raise DataError(f"{where}: x_train is {a['x_train'].dtype} but x_val is {a['x_val'].dtype}: uint8 inputs are "
                        f"scaled to [0, 1] and others kept, so the two would differ in scale; save both alike")
    if a["x_train"].shape[1:] != a["x_val"].shape[1:]:
        raise DataError(f"{where}: x_train samples have shape {a['x_train'].shape[1:]} but x_val samples "
                        f"{a['x_val'].shape[1:]}")
    low = min(int(a["y_train"].min()), int(a["y_val"].min()))
    high = max(int(a["y_train"].max()), int(a["y_val"].max()))
    classes = num_classes if num_classes is not None else high + 1
    if low < 0 or high >= classes:
        given = f"data.num_classes={num_classes}" if num_classes is not None else "the largest label + 1"
        raise DataError(f"{where}: labels span [{low}, {high}], outside [0, {classes}) ({given})")
    return classes


def _check_finite(where: str, name: str, x: Tensor, offset: int = 0) -> None:
    if x.is_floating_point() and not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).flatten(1).any(1).nonzero()[0, 0]) + offset
        raise DataError(f"{where}: {name} sample {bad} holds NaN or Inf")


class NpyArrays(torch.utils.data.Dataset):
    """Samples of memory-mapped .npy arrays x [N, ...] and y [N]: read on demand, a batch at a time."""

    def __init__(self, where: str, split: str, x: np.ndarray, y: np.ndarray):
        self.where, self.split, self.x, self.y = where, split, x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return as_float(np.array(self.x[i])), int(self.y[i])

    def __getitems__(self, indices: list[int]):
        order = np.argsort(indices)  # ascending reads from the memory map, then back into batch order
        rows = np.asarray(indices)[order]
        x = np.empty((len(rows), *self.x.shape[1:]), dtype=self.x.dtype)
        x[order] = self.x[rows]
        return as_float(x), torch.from_numpy(np.asarray(self.y[indices], dtype=np.int64))


def load_arrays(path: str, num_classes: int | None = None, signal: bool = False) -> Dataset | StreamedData:
    """Your own data: an .npz with x_train, y_train, x_val, y_val (a Dataset in memory), or a folder
    of x_train.npy, y_train.npy, x_val.npy, y_val.npy (memory-mapped StreamedData).

    x: [N, features], [N, C, L] (1-D signals) or [N, C, H, W] (kept shaped), float or integer (uint8
    scaled to [0, 1]); ``signal``: x [N, L] are signals of one channel, read as [N, 1, L].
    y: integer class ids in [0, num_classes) (None: the largest label + 1). Missing arrays,
    mismatched shapes, bad labels and non-finite inputs raise DataError naming the file.
    """
    ds = _load_arrays(path, num_classes)
    if not signal:
        return ds
    if len(ds.sample_shape) != 1:
        raise DataError(f"data.signal=true reads x of shape [N, L] as one-channel signals, but data.path={path} holds "
                        f"samples of shape {list(ds.sample_shape)}; leave data.signal=false for [N, C, L] signals")
    if isinstance(ds, StreamedData):
        return StreamedData(_OneChannel(ds.train), _OneChannel(ds.val), ds.num_classes, (1, *ds.sample_shape))
    return Dataset(ds.x_train[:, None], ds.y_train, ds.x_val[:, None], ds.y_val, ds.num_classes)


class _OneChannel(torch.utils.data.Dataset):
    """Samples [L] of another dataset as one-channel signals [1, L]."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        x, y = self.inner[i]
        return x[None], y

    def __getitems__(self, indices: list[int]):
        x, y = self.inner.__getitems__(indices)
        return x[:, None], y


def _load_arrays(path: str, num_classes: int | None) -> Dataset | StreamedData:
    if path is None:
        raise DataError("data=arrays reads your arrays from data.path: set data.path=/path/to/data.npz "
                        "(x_train, y_train, x_val, y_val) or a folder of those four .npy files")
    p = Path(path).expanduser()
    where = f"data.path={path}"
    if p.is_dir():
        missing = [f"{k}.npy" for k in ARRAYS if not (p / f"{k}.npy").is_file()]
        if missing:
            raise DataError(f"{where}: missing {', '.join(missing)}; a folder needs x_train.npy, y_train.npy, "
                            f"x_val.npy, y_val.npy")
        a = {}
        for k in ARRAYS:
            try:
                a[k] = np.load(p / f"{k}.npy", mmap_mode="r", allow_pickle=False)
            except Exception as e:
                raise DataError(f"{where}: {k}.npy is not a .npy file of numbers (np.save of a numeric array "
                                f"writes one)") from e
            if not isinstance(a[k], np.ndarray):  # np.load gives an archive for an .npz by another name
                raise DataError(f"{where}: {k}.npy is an .npz archive, not a .npy file (np.save writes one)")
        classes = _check_arrays(where, a, num_classes)
        return StreamedData(NpyArrays(where, "train", a["x_train"], a["y_train"]),
                            NpyArrays(where, "val", a["x_val"], a["y_val"]), classes, a["x_train"].shape[1:])
    if not p.is_file():
        raise DataError(f"{where}: no such file or folder; expected an .npz with x_train, y_train, x_val, y_val or a "
                        f"folder of those four .npy files")
    try:
        npz = np.load(p, allow_pickle=False)
    except Exception as e:  # numpy's own text (pickles, allow_pickle) would mislead: the file is not an archive
        raise DataError(f"{where}: not an .npz archive (np.savez writes one); expected one with x_train, y_train, "
                        f"x_val, y_val") from e
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise DataError(f"{where}: a single array; expected an .npz (np.savez) with x_train, y_train, x_val, y_val")
    with npz:
        missing = [k for k in ARRAYS if k not in npz.files]
        if missing:
            raise DataError(f"{where}: no array {', '.join(missing)}; expected x_train, y_train, x_val, y_val "
                            f"(found {', '.join(npz.files) or 'none'})")
        try:
            a = {k: npz[k] for k in ARRAYS}
        except ValueError as e:  # an object array (np.savez of lists of other lengths, say): pickled, refused
            raise DataError(f"{where}: an array of Python objects ({e}); save numeric arrays (np.asarray(x, "
                            f"dtype=np.float32))") from None
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError) as e:  # a damaged copy
            raise DataError(f"{where}: damaged ({type(e).__name__}: {e}); copy or save the file again") from None
    return _in_memory(where, a, num_classes)


def _in_memory(where: str, a: dict, num_classes: int | None) -> Dataset:
    """The Dataset of the arrays ``a`` (x_train, y_train, x_val, y_val: numpy), checked (``_check_arrays``, finite
    inputs) and prepared (``as_float``; int64 labels)."""
    classes = _check_arrays(where, a, num_classes)
    x_train, x_val = as_float(a["x_train"]), as_float(a["x_val"])
    _check_finite(where, "x_train", x_train)
    _check_finite(where, "x_val", x_val)
    return Dataset(x_train, torch.from_numpy(a["y_train"].astype(np.int64)), x_val,
                   torch.from_numpy(a["y_val"].astype(np.int64)), classes)


def prepared(ds: Dataset, where: str = "pcdist.train(cfg, data=...)") -> Dataset:
    """A Dataset given from Python, checked and prepared as an .npz's arrays are (shapes, lengths, empty splits,
    label ids; uint8 scaled to [0, 1], other integers as floats: what predict and evaluate do)."""
    def array(t) -> np.ndarray:
        t = torch.as_tensor(t).detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()

    if not all(getattr(ds, k, None) is not None for k in ARRAYS):
        missing = [k for k in ARRAYS if getattr(ds, k, None) is None]
        raise DataError(f"{where}: a Dataset needs x_train, y_train, x_val and y_val (got none for "
                        f"{', '.join(missing)}; a validation split is needed: hold out part of the training set)")
    return _in_memory(where, {k: array(getattr(ds, k)) for k in ARRAYS}, count(ds.num_classes, f"{where} num_classes"))


def count(value, what: str) -> int:
    """A class count given as an int, a numpy integer or a 0-d integer tensor (``y.max() + 1``), as an int >= 1."""
    if isinstance(value, Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = int(value)
    try:
        n = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        n = None
    if n is None or n < 1:
        raise DataError(f"{what}={value!r}: expected an integer >= 1")
    return n


def class_id(label, what: str) -> int:
    """One sample's label as an int: an integer class id (a Python, numpy or 0-d tensor integer), else a DataError
    naming the sample (``what``): a float label would be truncated (2.9999998 -> class 2), one-hot has no id."""
    t = torch.as_tensor(np.asarray(label)) if not isinstance(label, Tensor) else label
    if t.numel() != 1:
        raise DataError(f"{what} has a label of shape {list(t.shape)}; expected an integer class id (one-hot: "
                        f"its argmax)")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise DataError(f"{what} has label {label!r} ({t.dtype}); expected an integer class id")
    return int(t.reshape(()))


def sample_pair(item, what: str):
    """A StreamedData item as (x, label), or a DataError naming the sample (``what``)."""
    if isinstance(item, (tuple, list)) and len(item) >= 2 and item[0] is not None:
        return item[0], item[1]
    got = (f"a {type(item).__name__} of {len(item)}" if isinstance(item, (tuple, list)) else
           f"a {type(item).__name__}")
    raise DataError(f"{what} is {got}; a StreamedData dataset returns (x, label) pairs, label an integer class id "
                    f"(unlabelled data, pc.mode=unsupervised: any label, e.g. 0, with num_classes=1)")


def normalization_stats(ds: Dataset) -> tuple[Tensor, Tensor]:
    """The training set's per-channel mean and standard deviation (the sample deviation, over n - 1), shaped to
    broadcast over one sample ([C, 1, 1] for images [N, C, H, W]; [F] for [N, F] inputs). A channel that does not
    vary in training (a border pixel of flattened images, 0 in every one) keeps std 1, as scikit-learn's
    StandardScaler does: a floor of 1e-8 multiplied the held-out values there by 1e8. A DataError below two
    training samples (no deviation to take)."""
    if len(ds.x_train) < 2:
        raise DataError(f"config data.normalize=true standardises by the training set's standard deviation, which "
                        f"needs 2 training samples or more; this data has {len(ds.x_train)}")
    dims = [0, *range(2, ds.x_train.dim())]
    mean = ds.x_train.mean(dims, keepdim=True)[0]
    std = ds.x_train.std(dims, keepdim=True)[0]
    # (a constant's deviation in floating point is its rounding: at most 1e-6 of the channel's own largest magnitude;
    # the whole set's would take a varying fraction beside a price of 5e5 for a constant)
    still = std <= torch.clamp(1e-6 * ds.x_train.abs().amax(dims, keepdim=True)[0].to(std.dtype), min=1e-8)
    return mean, torch.where(still, 1.0, std)


def normalized(ds: Dataset, stats: tuple[Tensor, Tensor] | None = None, dtype: torch.dtype | None = None) -> Dataset:
    """``ds`` with every input channel standardised by the training set's mean and standard deviation
    (channel = dim 1 of [N, C, ...] images; every feature of [N, F] inputs), or by ``stats``; ``dtype``: computed
    in it (the run's, as ``pcdist.load`` prepares inputs: float32 arithmetic cast to float64 was 5e-8 off)."""
    mean, std = stats if stats is not None else normalization_stats(ds)
    x_train, x_val = ds.x_train, ds.x_val
    if dtype is not None:
        x_train, x_val, mean, std = (t.to(dtype) for t in (x_train, x_val, mean, std))
    return Dataset((x_train - mean) / std, ds.y_train, (x_val - mean) / std, ds.y_val, ds.num_classes)


def augment(x: Tensor, generator: torch.Generator, rows: Tensor | None = None, global_batch: int | None = None,
            pad: int = 4) -> Tensor:
    """Random crops after ``pad`` pixels of zero padding and random horizontal flips of images
    [b, C, H, W] (PCX's CIFAR training augmentation). The draws are those of the whole global
    batch (``global_batch`` samples) from ``generator``; ``rows`` picks this shard's, so any
    split of the batch over data ranks draws alike."""
    if x.dim() != 4:
        raise DataError(f"data.augment needs images [B, C, H, W], got inputs of shape {list(x.shape)}")
    b, _, H, W = x.shape
    n = global_batch or b
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=generator)
    flips = torch.rand(n, generator=generator) < 0.5
    if rows is not None:
        offsets, flips = offsets[rows], flips[rows]
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    r = (offsets[:, 0, None] + torch.arange(H)).to(x.device)  # [b, H]
    c = (offsets[:, 1, None] + torch.arange(W)).to(x.device)  # [b, W]
    out = padded[torch.arange(b, device=x.device)[:, None, None], :, r[:, :, None], c[:, None, :]]  # [b, H, W, C]
    out = out.permute(0, 3, 1, 2)
    return torch.where(flips.to(x.device)[:, None, None, None], out.flip(-1), out).contiguous()


_IDX = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
FILES = {"mnist": _IDX, "fashion_mnist": _IDX, "cifar10": [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"],
         "cifar100": ["train", "test"]}
_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


def check_files(name: str, root: str | None) -> None:
    """DataError (one line: the files expected, that nothing is downloaded, where to put them)
    unless ``root`` holds every standard file of dataset ``name``."""
    if name not in FILES:
        return
    r = Path(root).expanduser() if root is not None else None
    if r is not None and name in _FOLDERS and (r / _FOLDERS[name]).is_dir():
        r = r / _FOLDERS[name]
    if r is None or not r.is_dir():
        missing = FILES[name]
        where = "data.root is not set" if r is None else f"data.root={root} is not a directory"
    else:
        missing = [f for f in FILES[name] if not (r / f).is_file() and not (r / f"{f}.gz").is_file()]
        where = f"{r} lacks {len(missing)} of the {len(FILES[name])} files"
    if missing:
        kind = {"cifar10": "the CIFAR-10 python batches", "cifar100": "the CIFAR-100 python files"}.get(
            name, "the standard IDX files, plain or .gz,")
        raise DataError(f"data={name}: {where}; expected {kind} {', '.join(missing)}. pcdist downloads nothing: "
                        f"put them there, or set data.root=/path/to/{name} (or PCDIST_DATA=/path, the folder "
                        f"holding {name}/)")


def load_dataset(name: str, root: str | None = None, dims: list[int] | None = None, seed: int = 0,
                 val_fraction: float = 0.2, synthetic_train: int = 2048, synthetic_val: int = 512,
                 path: str | None = None, num_classes: int | None = None, signal: bool = False
                 ) -> Dataset | StreamedData:
    """The dataset ``name`` (see the module docstring); checks the labels against num_classes."""
    if name == "arrays":
        return load_arrays(path, num_classes, signal)
    if name == "signals":
        from .signals import make_signals

        a = make_signals()
        ds = Dataset(*(torch.from_numpy(a[k]) for k in ARRAYS), num_classes=10)
    elif name == "digits":
        ds = load_digits(val_fraction, seed=0)
    elif name == "synthetic":
        if dims is None:
            raise ValueError("data=synthetic needs the model dims (its teacher has the model's shape)")
        ds = synthetic(list(dims), synthetic_train, synthetic_val, seed)
    elif name in FILES:
        check_files(name, root)
        r = Path(root).expanduser()
        ds = _cifar(r, name) if name in _FOLDERS else _mnist(r)
    else:
        raise ValueError(f"unknown dataset {name!r}; allowed: digits, synthetic, mnist, fashion_mnist, cifar10, "
                         "cifar100, arrays")
    for split, labels in (("train", ds.y_train), ("val", ds.y_val)):
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= ds.num_classes):
            raise DataError(f"{name} {split} labels span [{int(labels.min())}, {int(labels.max())}], "
                            f"outside [0, {ds.num_classes})")
    return ds
