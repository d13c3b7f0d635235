"""Datasets as in-memory tensors, from bundled data, a teacher network or the standard files.

* ``digits``: scikit-learn's bundled 8x8 digits (no download), a fixed stratified split.
* ``synthetic``: inputs N(0, 1) labelled by a random tanh teacher network of the model's shape.
* ``mnist`` / ``fashion_mnist``: the four standard IDX files (gzipped or not) in ``root``.
* ``cifar10``: the standard python batches (``data_batch_1..5``, ``test_batch``) in ``root``
  or ``root/cifar-10-batches-py``, read by an unpickler that only builds numpy arrays.

A missing or malformed file raises DataError naming the path and the expected format.
"""

from __future__ import annotations

import gzip
import io
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["Dataset", "DataError", "load_dataset", "load_digits", "one_hot", "read_idx", "check_files", "FILES"]


class DataError(ValueError):
    """A dataset file is missing or not in the expected format."""


@dataclass
class Dataset:
    x_train: Tensor  # [N, features], float32
    labels_train: Tensor  # [N], int64
    x_val: Tensor
    labels_val: Tensor
    num_classes: int

    @property
    def num_features(self) -> int:
        return self.x_train.shape[1]


def one_hot(labels: Tensor, num_classes: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """[B] integer labels -> [B, num_classes] one-hot rows."""
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{int(labels.min())}, {int(labels.max())}]")
    return torch.nn.functional.one_hot(labels.long(), num_classes).to(dtype)


def load_digits(val_fraction: float = 0.2, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's bundled 8x8 digits (1797 images, 10 classes), pixels scaled to [0, 1].

    Returns (x_train, labels_train, x_val, labels_val) with a fixed stratified split.
    """
    from sklearn.datasets import load_digits as _load
    from sklearn.model_selection import train_test_split

    d = _load()
    x_tr, x_va, y_tr, y_va = train_test_split(
        d.data / 16.0, d.target, test_size=val_fraction, random_state=seed, stratify=d.target
    )
    f = lambda a: torch.as_tensor(a, dtype=torch.float32)  # noqa: E731
    return f(x_tr), torch.as_tensor(y_tr), f(x_va), torch.as_tensor(y_va)


def synthetic(dims: list[int], n_train: int, n_val: int, seed: int) -> Dataset:
    """Inputs N(0, 1) labelled by argmax of a random tanh teacher MLP with widths ``dims``."""
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
            return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
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
        parts += [torch.from_numpy(images.reshape(len(images), -1).astype(np.float32) / 255.0),
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


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise DataError(f"missing file {path}; expected the CIFAR-10 python batches (cifar-10-batches-py)")
    try:
        d = _NumpyOnly(io.BytesIO(path.read_bytes()), encoding="bytes").load()
        data, labels = np.asarray(d[b"data"], dtype=np.uint8), np.asarray(d[b"labels"], dtype=np.int64)
    except Exception as e:
        raise DataError(f"{path}: not a CIFAR-10 python batch (a pickled dict with b'data' [N, 3072] uint8 "
                        f"and b'labels'): {e}") from e
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise DataError(f"{path}: b'data' has shape {data.shape} and {len(labels)} labels; expected [N, 3072] and N")
    return data, labels


def _cifar10(root: Path) -> Dataset:
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    train = [_cifar_batch(root / f"data_batch_{i}") for i in range(1, 6)]
    xv, yv = _cifar_batch(root / "test_batch")
    xt = np.concatenate([b[0] for b in train])
    yt = np.concatenate([b[1] for b in train])
    f = lambda a: torch.from_numpy(a.astype(np.float32) / 255.0)  # noqa: E731
    return Dataset(f(xt), torch.from_numpy(yt), f(xv), torch.from_numpy(yv), num_classes=10)


_IDX = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
FILES = {"mnist": _IDX, "fashion_mnist": _IDX, "cifar10": [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]}


def check_files(name: str, root: str | None) -> None:
    """DataError (one line: the files expected, that nothing is downloaded, where to put them)
    unless ``root`` holds every standard file of dataset ``name``."""
    if name not in FILES:
        return
    r = Path(root).expanduser() if root is not None else None
    if r is not None and name == "cifar10" and (r / "cifar-10-batches-py").is_dir():
        r = r / "cifar-10-batches-py"
    if r is None or not r.is_dir():
        missing = FILES[name]
        where = "data.root is not set" if r is None else f"data.root={root} is not a directory"
    else:
        missing = [f for f in FILES[name] if not (r / f).is_file() and not (r / f"{f}.gz").is_file()]
        where = f"{r} lacks {len(missing)} of the {len(FILES[name])} files"
    if missing:
        kind = "the CIFAR-10 python batches" if name == "cifar10" else "the standard IDX files, plain or .gz,"
        raise DataError(f"data={name}: {where}; expected {kind} {', '.join(missing)}. pcdist downloads nothing: "
                        f"put them there, or set data.root=/path/to/{name} (or PCDIST_DATA=/path, the folder "
                        f"holding {name}/)")


def load_dataset(name: str, root: str | None = None, dims: list[int] | None = None, seed: int = 0,
                 val_fraction: float = 0.2, synthetic_train: int = 2048, synthetic_val: int = 512) -> Dataset:
    """The dataset ``name`` (see the module docstring); checks the labels against num_classes."""
    if name == "digits":
        ds = Dataset(*load_digits(val_fraction, seed=0), num_classes=10)
    elif name == "synthetic":
        if dims is None:
            raise ValueError("data=synthetic needs the model dims (its teacher has the model's shape)")
        ds = synthetic(list(dims), synthetic_train, synthetic_val, seed)
    elif name in FILES:
        check_files(name, root)
        r = Path(root).expanduser()
        ds = _cifar10(r) if name == "cifar10" else _mnist(r)
    else:
        raise ValueError(f"unknown dataset {name!r}; allowed: digits, synthetic, mnist, fashion_mnist, cifar10")
    for split, labels in (("train", ds.labels_train), ("val", ds.labels_val)):
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= ds.num_classes):
            raise DataError(f"{name} {split} labels span [{int(labels.min())}, {int(labels.max())}], "
                            f"outside [0, {ds.num_classes})")
    return ds
