"""Streamed data on each rank: a DataLoader with worker processes reads every step's batch ahead of training.

In-memory data (``pcdist.data.Dataset``) is indexed directly (``pcdist.service.batches.shard``). For
``StreamedData`` (an ``arrays`` folder, or torch Datasets passed to ``pcdist.train``) each
rank runs a DataLoader whose batch sampler yields this data rank's shard of the same global
batch of every step (``GlobalBatchSampler``: the order ``pcdist.service.batches.batch_indices`` defines
for all ranks), so layer-parallel ranks agree on the batch exactly as with in-memory data.
Workers (``data.num_workers``) load ``data.prefetch_factor`` batches ahead each, into pinned
memory on CUDA, copied to the GPU without blocking: the GPU does not wait on the loader.

Only the first layer slice reads inputs and the last reads labels; a slice in between needs
neither (the engine takes only the batch size from them), so it reads nothing.
"""

from __future__ import annotations

import signal
from typing import Callable, Iterator

import torch
from torch import Tensor

from .data import DataError, NpyArrays, StreamedData, as_float, class_id, sample_pair

__all__ = ["GlobalBatchSampler", "Streamed"]


class GlobalBatchSampler(torch.utils.data.Sampler):
    """For steps start..end-1: this data rank's part of the global batch ``batch_of(step)`` (a tensor of indices)."""

    def __init__(self, batch_of: Callable[[int], Tensor], start: int, end: int, data_size: int, data_rank: int):
        self.batch_of, self.start, self.end = batch_of, start, end
        self.data_size, self.data_rank = data_size, data_rank

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start, self.end):
            yield torch.tensor_split(self.batch_of(step), self.data_size)[self.data_rank].tolist()

    def __len__(self) -> int:
        return max(0, self.end - self.start)


class _Checked(torch.utils.data.Dataset):
    """Batches of a dataset as (x [b, *sample_shape] float, labels [b] int64), checked: the sample shape,
    finite inputs, labels in [0, num_classes). Runs in the worker processes."""

    def __init__(self, dataset, split: str, num_classes: int, sample_shape: tuple[int, ...]):
        self.dataset, self.num_classes, self.sample_shape = dataset, num_classes, sample_shape
        inner = getattr(dataset, "inner", dataset)  # data.signal=true wraps the arrays (a channel added)
        self.what = f"{inner.where}: x_{split}" if isinstance(inner, NpyArrays) else f"StreamedData {split}"

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        got = self.dataset.__getitems__(indices) if hasattr(self.dataset, "__getitems__") else None
        if got is None or isinstance(got, list):  # one (x, label) per index (torch's Subset returns a list)
            items = got if got is not None else [self.dataset[i] for i in indices]
            pairs = [sample_pair(item, f"{self.what} sample {i}") for i, item in zip(indices, items)]
            xs = [as_float(x) for x, _ in pairs]
            for i, x in zip(indices, xs):  # named here: torch.stack would refuse them naming no sample
                if tuple(x.shape) != self.sample_shape:
                    raise DataError(f"{self.what} sample {i} has shape {tuple(x.shape)}, expected "
                                    f"{self.sample_shape} (the first training sample's)")
            x = torch.stack(xs)
            labels = torch.tensor([class_id(y, f"{self.what} sample {i}") for i, (_, y) in zip(indices, pairs)])
        else:  # a batch at once: (x [b, ...], labels [b])
            x, labels = sample_pair(got, f"{self.what} samples {indices[0]}..")
            x, labels = as_float(x), torch.as_tensor(labels)
            if tuple(labels.shape) != (len(indices),) or len(x) != len(indices) or labels.is_floating_point() \
                    or labels.dtype == torch.bool:
                raise DataError(f"{self.what} samples {indices[0]}..: __getitems__ gave {len(x)} inputs and labels "
                                f"of shape {list(labels.shape)} ({labels.dtype}) for {len(indices)} indices; expected "
                                f"[{len(indices)}] integer class ids")
        if tuple(x.shape[1:]) != self.sample_shape:
            raise DataError(f"{self.what}: samples {indices[0]}.. have shape {tuple(x.shape[1:])}, expected "
                            f"{self.sample_shape} (the first training sample's)")
        bad = ~torch.isfinite(x).flatten(1).all(1)
        if bad.any():
            raise DataError(f"{self.what} sample {indices[int(bad.nonzero()[0, 0])]} holds NaN or Inf")
        out = (labels < 0) | (labels >= self.num_classes)
        if out.any():
            k = int(out.nonzero()[0, 0])
            raise DataError(f"{self.what} sample {indices[k]} has label {int(labels[k])}, outside "
                            f"[0, {self.num_classes})")
        return x, labels.long()


def _calm_worker(_: int) -> None:
    """A DataLoader worker ignores the stop signals (SIGTERM, SIGUSR1). Sent to a whole process group (``timeout``,
    ``kill -- -PGID``, torchrun's agent, a SLURM step), one killed it, and torch's SIGCHLD handler then raised in
    the training process mid-step: no pre-emption checkpoint, tracebacks in place of a peer's one line. The
    training process stops its workers itself (and they end with it if it dies)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def _batch(b):
    return b


def _one_line(e: DataError) -> DataError:
    """A worker's DataError arrives wrapped in its traceback: keep the original one-line message."""
    last = str(e).strip().splitlines()[-1]
    return DataError(last.split("DataError: ", 1)[-1])


def _shut_down(it) -> None:
    """Stop a DataLoader iterator's worker processes at once (torch's own shutdown, which its finalizer calls)."""
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def val_split(n: int, data_size: int, data_rank: int, size: int) -> list[Tensor]:
    """Data rank ``data_rank``'s share of ``n`` validation rows in chunks of about ``size`` (at most one row
    more): as many chunks on every data rank, whose shares differ by a row at most, since each chunk's inference
    may hold collectives of every rank (the adaptive solver's error norm): 2049 rows on two ranks cut at 1024 gave
    one two chunks and the other one, and the ranks waited on each other."""
    rows = torch.tensor_split(torch.arange(n), data_size)[data_rank]
    return list(torch.tensor_split(rows, max(1, -(-(n // data_size) // size))))


class Streamed:
    """This rank's reader of StreamedData: the batches of steps start..end-1 and the validation chunks,
    as (x on the device, one-hot y) and (x, labels); x flat [b, features], as vector models take it,
    or with ``flatten=False`` shaped [b, *sample_shape] (conv models). ``data_at_top``: the data sit at
    h_L and the labels at h_0 (the generative and unsupervised modes), so the last layer slice reads x
    and the first the labels; otherwise the first reads x and the last the labels."""

    def __init__(self, data: StreamedData, batch_of: Callable[[int], Tensor], par, batch_size: int,
                 num_workers: int, prefetch_factor: int, device: torch.device, dtype: torch.dtype,
                 flatten: bool = True, data_at_top: bool = False):
        self.data, self.batch_of, self.par, self.batch_size = data, batch_of, par, batch_size
        self.num_classes = data.num_classes
        self.device, self.dtype, self.flatten = device, dtype, flatten
        self.x_here = par.is_last if data_at_top else par.is_first
        self.labels_here = par.is_first if data_at_top else par.is_last
        self.reads = par.is_first or par.is_last
        self.options = dict(num_workers=num_workers, collate_fn=_batch, pin_memory=device.type == "cuda")
        if num_workers > 0:
            self.options.update(prefetch_factor=prefetch_factor, worker_init_fn=_calm_worker)
        self.train_set = _Checked(data.train, "train", data.num_classes, data.sample_shape)
        self.val_set = _Checked(data.val, "val", data.num_classes, data.sample_shape)
        self._val_loader = None

    @property
    def num_features(self) -> int:
        return self.data.num_features

    def _on_device(self, x: Tensor | None, labels: Tensor | None, n: int) -> tuple[Tensor, Tensor | None]:
        """x on the device, flattened unless the model takes it shaped (a placeholder of the right
        shape where this slice takes no inputs)."""
        shape = (self.num_features,) if self.flatten else tuple(self.data.sample_shape)
        if x is None or not self.x_here:
            x = torch.zeros((), dtype=self.dtype, device=self.device).expand(n, *shape)
        else:
            x = x.to(device=self.device, dtype=self.dtype, non_blocking=True)
            x = x.flatten(1) if self.flatten else x
        return x, labels

    def _y(self, labels: Tensor | None, n: int) -> Tensor:
        if labels is None or not self.labels_here:
            return torch.zeros((), dtype=self.dtype, device=self.device).expand(n, self.data.num_classes)
        labels = labels.to(self.device, non_blocking=True)  # checked in the worker: no range check (no sync) here
        return torch.nn.functional.one_hot(labels, self.data.num_classes).to(self.dtype)

    def _local_size(self) -> int:
        return len(torch.tensor_split(torch.empty(self.batch_size), self.par.data_size)[self.par.data_rank])

    def train(self, start: int, end: int) -> Iterator[tuple[Tensor, Tensor]]:
        """(x, y) of every step start..end-1, in order, loaded ahead by the workers."""
        if not self.reads:
            n = self._local_size()
            for _ in range(start, end):
                yield self._on_device(None, None, n)[0], self._y(None, n)
            return
        sampler = GlobalBatchSampler(self.batch_of, start, end, self.par.data_size, self.par.data_rank)
        loader = torch.utils.data.DataLoader(self.train_set, batch_sampler=sampler, **self.options)
        it = iter(loader)
        try:
            while True:
                try:
                    x, labels = next(it)
                except StopIteration:
                    return
                except DataError as e:
                    raise _one_line(e) from None
                x, labels = self._on_device(x, labels, len(labels))
                yield x, self._y(labels, len(labels))
        finally:  # stopped early (a pre-emption, a bad sample, the caller closed us): the workers stop now
            _shut_down(it)

    def batch(self, step: int) -> tuple[Tensor, Tensor]:
        """The (x, y) of one step, read here without workers."""
        idx = torch.tensor_split(self.batch_of(step), self.par.data_size)[self.par.data_rank].tolist()
        x, labels = self.train_set.__getitems__(idx)
        x, labels = self._on_device(x, labels, len(idx))
        return x, self._y(labels, len(idx))

    def close(self) -> None:
        """Stop the validation loader's worker processes (kept between evaluations) now: left to the garbage
        collector, they would outlive the run, and collecting them later stalls for seconds per worker."""
        if self._val_loader is not None:
            _shut_down(self._val_loader._iterator)
        self._val_loader = None

    def val_chunks(self) -> Iterator[tuple[Tensor, Tensor]]:
        """This data rank's share of the validation set as (x on the device, labels on the CPU) chunks."""
        chunks = [c.tolist() for c in val_split(len(self.data.val), self.par.data_size, self.par.data_rank,
                                                    self.batch_size)]
        if not self.reads:
            for c in chunks:
                yield self._on_device(None, None, len(c))[0], torch.zeros(len(c), dtype=torch.long)
            return
        if self._val_loader is None:  # built once; its workers stay for every evaluation
            self._val_loader = torch.utils.data.DataLoader(
                self.val_set, batch_sampler=chunks, persistent_workers=self.options["num_workers"] > 0,
                **self.options)
        try:
            for x, labels in self._val_loader:
                yield self._on_device(x, labels, len(labels))
        except DataError as e:
            raise _one_line(e) from None
