"""Tiny dataset files in the exact standard formats (MNIST IDX, CIFAR-10 python batches, CIFAR-100 files)."""

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np


def write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    magic = 2051 if array.ndim == 3 else 2049
    raw = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        raw = gzip.compress(raw)
    path.write_bytes(raw)


def make_mnist(root: Path, n_train: int = 64, n_val: int = 32, gz: bool = True, seed: int = 0) -> Path:
    """The four IDX files of an MNIST-format dataset with random 28x28 images and labels 0..9."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("t10k", n_val)):
        write_idx(root / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)), gz)
        write_idx(root / f"{split}-labels-idx1-ubyte", rng.integers(0, 10, (n,)), gz)
    return root


def make_cifar10(root: Path, per_batch: int = 16, seed: int = 0) -> Path:
    """cifar-10-batches-py/ with data_batch_1..5 and test_batch: pickled dicts of uint8 [N, 3072] + labels."""
    rng = np.random.default_rng(seed)
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, per_batch).tolist(), b"batch_label": name.encode()}
        (d / name).write_bytes(pickle.dumps(batch, protocol=2))
    return root


def make_cifar100(root: Path, n_train: int = 48, n_val: int = 16, seed: int = 0) -> Path:
    """cifar-100-python/ with train and test: pickled dicts of uint8 [N, 3072], fine and coarse labels."""
    rng = np.random.default_rng(seed)
    d = root / "cifar-100-python"
    d.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("test", n_val)):
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"fine_labels": rng.integers(0, 100, n).tolist(), b"coarse_labels": rng.integers(0, 20, n).tolist(),
                 b"filenames": [b"x.png"] * n}
        (d / name).write_bytes(pickle.dumps(batch, protocol=2))
    return root
