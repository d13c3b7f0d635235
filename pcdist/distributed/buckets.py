"""The data axis's weight-gradient all-reduce: one flat bucket per fused group, overlapped.

Each fused group's gradients form one bucket: the parameters' .grad are views into it,
so nothing is copied in or out. The group's batch-SUM gradients are written straight
into its bucket, whose all-reduce over the data axis then starts (``async_op=True``)
while the next group's gradient GEMMs run; ``average`` divides by the global batch once
every reduce has finished (so unequal local batches weigh in by their size). The last
group's bucket carries the local batch size in one extra slot.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from torch import Tensor

from ..engine.capture import on_host

__all__ = ["GradBuckets"]


class GradBuckets:
    """The gradient buckets of one Stage's groups and their all-reduces in flight."""

    def __init__(self, group, guard: Callable[[], ContextManager]):
        self.group = group
        self.guard = guard  # turns a failed post (a backend may refuse a peer it has seen die) into a PeerError
        self._buckets: list[Tensor] = []
        self._key = None
        self._reducing: list = []

    def start(self, st) -> None:
        """Write every group's batch-sum gradients into its bucket and start its all-reduce,
        largest bucket first (its all-reduce is the longest and gets the most overlap)."""
        buckets = self._buckets_for(st)
        for i in sorted(range(len(buckets)), key=lambda i: -sum(b.numel() for b in buckets[i])):
            if not buckets[i]:  # a group without parameters (a fixed prior of a free h_0)
                continue
            st.weight_grads([st.groups[i]], scale=-1.0)
            if i == len(buckets) - 1:
                self._count.fill_(st.B)
            for b in buckets[i]:
                on_host(lambda b=b: self._post(b))

    def _post(self, bucket: Tensor) -> None:
        with self.guard():
            self._reducing.append(dist.all_reduce(bucket, group=self.group, async_op=True))

    def _buckets_for(self, st) -> list[list[Tensor]]:
        """Per group, one flat buffer per dtype of its parameters (bf16 keeps its weights in bfloat16, the rest in
        float32), rebuilt when a parameter or its .grad was replaced (e.g. by optimizer.zero_grad()); the batch
        count is one extra slot of the last group's widest buffer (bfloat16 counts exactly only to 256: a float32
        buffer of its own where that group has no other)."""
        def key():
            return tuple(t.data_ptr() if t is not None else 0
                         for gr in st.groups for p in gr.g.parameters() for t in (p, p.grad))

        if self._key != key():
            self._buckets = []
            for i, gr in enumerate(st.groups):
                by_dtype: dict[torch.dtype, list] = {}
                for p in gr.g.parameters():
                    by_dtype.setdefault(p.dtype, []).append(p)
                last = i == len(st.groups) - 1
                wide = max(by_dtype, key=lambda d: torch.finfo(d).bits - (d == torch.bfloat16), default=None)
                if last and (wide is None or torch.finfo(wide).bits < 32):
                    like = next(p for gr in st.groups for p in gr.g.parameters())
                    by_dtype[torch.float32], wide = [], torch.float32  # (the count's own)
                    self._count_device = like.device
                flats = []
                for dtype, params in by_dtype.items():
                    extra = last and dtype == wide
                    device = params[0].device if params else self._count_device
                    flat = torch.zeros(sum(p.numel() for p in params) + extra, dtype=dtype, device=device)
                    at = 0
                    for p in params:
                        p.grad = flat[at : at + p.numel()].view_as(p)
                        at += p.numel()
                    if extra:
                        self._count = flat[-1]
                    flats.append(flat)
                self._buckets.append(flats)
            self._key = key()
        return self._buckets

    def wait(self, timeout: timedelta) -> None:
        """Wait for the all-reduces in flight (a dead peer raises within ``timeout``)."""
        reducing, self._reducing = self._reducing, []
        for work in reducing:
            work.wait(timeout)

    def average(self) -> None:
        """Divide the summed gradients by the global batch (after ``wait``)."""
        count = self._count.clone()
        for flats in self._buckets:
            for flat in flats:
                flat.div_(count)
