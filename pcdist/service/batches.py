"""The batch order of a run: every step's global batch, drawn from (seed, epoch) (``batch_indices``); this
rank's share of it on the device (``shard``, ``step_batches``) and of the validation set (``val_chunks``)."""

from __future__ import annotations

import functools

import torch

from ..distributed.parallel import Parallel
from .config import Config
from .data import augment, one_hot
from .loader import Streamed, val_split


def batch_indices(n: int, B: int, step: int, seed: int) -> torch.Tensor:
    """The global batch of ``step``: epoch-wise permutations seeded by (seed, epoch), last partial batch dropped."""
    per_epoch = n // B
    epoch, i = divmod(step, per_epoch)
    return _permutation(n, (seed * 7919 + epoch) % 2**64)[i * B : (i + 1) * B]  # (the seeds torch takes)


@functools.lru_cache(maxsize=2)
def _permutation(n: int, seed: int) -> torch.Tensor:
    """One epoch's order, drawn once per epoch (randperm of 60000 takes ~1-2 ms: a step of a small model)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def step_batches(c: Config, ds, par: Parallel, start: int, end: int, device, dtype):
    """This rank's (x, y) of every step start..end-1 (``data.augment``: crops and flips drawn from
    (seed, step) for the whole global batch, so every split of it draws alike)."""
    B, seed = c.trainer.batch_size, c.trainer.seed
    if isinstance(ds, Streamed):
        steps = ds.train(start, end)
    else:
        steps = (shard(c, ds, par, batch_indices(len(ds.x_train), B, step, seed), device, dtype)
                 for step in range(start, end))
    rows = torch.tensor_split(torch.arange(B), par.data_size)[par.data_rank]
    images_here = par.is_first if c.pc.mode == "supervised" else par.is_last  # (the data sit on h_L otherwise)
    try:
        for step, (x, y) in enumerate(steps, start):
            if c.data.augment and images_here:
                x = augment(x, torch.Generator().manual_seed((seed * 104_729 + step) % 2**64), rows, B)
            yield x, y
    finally:
        steps.close()  # closed early: a streamed loader stops its workers now


def shard(c: Config, ds, par: Parallel, idx: torch.Tensor, device, dtype):
    """This data rank's share of a global batch, on the device, labels one-hot."""
    idx = torch.tensor_split(idx, par.data_size)[par.data_rank]
    return to_device(ds.x_train[idx], device, dtype), to_device(one_hot(ds.y_train[idx], ds.num_classes, dtype),
                                                                 device, dtype)


def to_device(t: torch.Tensor, device: torch.device, dtype) -> torch.Tensor:
    """A host batch on the device: on a GPU through pinned memory without waiting (the step queued before it
    keeps running), elsewhere a plain conversion."""
    if torch.device(device).type != "cuda":
        return t.to(device=device, dtype=dtype)
    return t.to(dtype).pin_memory().to(device, non_blocking=True)


def val_chunks(ds, par: Parallel, device, dtype):
    """This data rank's share of the validation set: (x on the device, labels) chunks."""
    if isinstance(ds, Streamed):
        yield from ds.val_chunks()
        return
    for chunk in val_split(len(ds.x_val), par.data_size, par.data_rank, 1024):
        yield ds.x_val[chunk].to(device=device, dtype=dtype), ds.y_val[chunk]
