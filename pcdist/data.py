"""Datasets as in-memory tensors. The default needs no download: scikit-learn's digits."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["load_digits", "one_hot"]


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
