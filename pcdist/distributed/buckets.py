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
        for i in sorted(range(len(buckets)), key=lambda i: -buckets[i].numel()):
            if buckets[i].numel() == 0:  # a group without parameters (a fixed prior of a free h_0)
                continue
            st.weight_grads([st.groups[i]], scale=-1.0)
            if i == len(buckets) - 1:
                buckets[i][-1] = st.B
            on_host(lambda b=buckets[i]: self._post(b))

    def _post(self, bucket: Tensor) -> None:
        with self.guard():
            self._reducing.append(dist.all_reduce(bucket, group=self.group, async_op=True))

    def _buckets_for(self, st) -> list[Tensor]:
        """One flat buffer per group (plus the batch-count slot in the last), rebuilt when a
        parameter or its .grad was replaced (e.g. by optimizer.zero_grad())."""
        def key():
            return tuple(t.data_ptr() if t is not None else 0
                         for gr in st.groups for p in gr.g.parameters() for t in (p, p.grad))

        if self._key != key():
            self._buckets = []
            like = next(p for gr in st.groups for p in gr.g.parameters())
            for i, gr in enumerate(st.groups):
                params = list(gr.g.parameters())
                n = sum(p.numel() for p in params)
                flat = torch.zeros(n + (i == len(st.groups) - 1), dtype=like.dtype, device=like.device)
                at = 0
                for p in params:
                    p.grad = flat[at : at + p.numel()].view_as(p)
                    at += p.numel()
                self._buckets.append(flat)
            self._key = key()
        return self._buckets

    def wait(self, timeout: timedelta) -> None:
        """Wait for the all-reduces in flight (a dead peer raises within ``timeout``)."""
        reducing, self._reducing = self._reducing, []
        for work in reducing:
            work.wait(timeout)

    def average(self) -> None:
        """Divide the summed gradients by the global batch (after ``wait``)."""
        count = self._buckets[-1][-1].clone()
        for flat in self._buckets:
            flat.div_(count)
