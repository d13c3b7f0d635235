"""The value nodes of a layer slice, preallocated for one batch size.

Shape letters: N nodes in a block, B batch, S a node's shape (a width for MLPs).

Nodes first-1 .. stop-1 of a slice of layers [first, stop) are stored as *node blocks*:
runs of consecutive nodes of equal shape in one tensor h_NBS. The inputs of a group's K
layers are then the view h_NBS[i:i+K] and their outputs h_NBS[i+1:i+K+1], with no copy.
Beside h each block holds the value gradient (or momentum) v and the errors e; without
momentum, and when no layer's back-projection reads the errors, v and e are one tensor
(the errors are written straight into the gradient they start).

An image node read by a 2-D convolution may be stored channels-last (``channels_last``, pcdist/engine/layers/conv.py
``channels_last_nodes``): a block whose every node is one is allocated [N, B, H, W, C] and viewed as [N, B, C, H, W],
so each node h_n [B, C, H, W] is a channels-last (NHWC) tensor, the layout GPUs' tensor-core convolutions read.

A layer slice's boundary tensors are views into (or buffers beside) these blocks: the
upstream neighbour's last node h_{first-1} is replicated in slot 0 (both ranks apply the
same update to it from the same two messages per step), ``send_node`` / ``send_error``
are the slice's last node and its error, ``recv_*`` receive their counterparts.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["NodeBlock", "ValueNodes", "stacked_zeros", "is_channels_last"]


def stacked_zeros(shape: tuple[int, ...], channels_last: bool = False, **kw) -> Tensor:
    """Zeros of ``shape`` [..., C, H, W]; ``channels_last``: stored [..., H, W, C], so that every [C, H, W] image
    of it (and every [B, C, H, W] batch) is channels-last."""
    if not channels_last:
        return torch.zeros(shape, **kw)
    *lead, C, H, W = shape
    n = len(lead)
    return torch.zeros(*lead, H, W, C, **kw).permute(*range(n), n + 2, n, n + 1)


def is_channels_last(t: Tensor) -> bool:
    """True if t [..., C, H, W] is stored densely as [..., H, W, C] (and is not also plain row-major: a tensor with
    one channel, or 1 x 1 images, is both, and is taken as row-major)."""
    if t.dim() < 3 or t.is_contiguous():
        return False
    n = t.dim()
    return t.permute(*range(n - 3), n - 2, n - 1, n - 3).is_contiguous()


class NodeBlock:
    """Value nodes [lo, lo + N) of one shape, with value gradients v and errors e (channels-last images where
    ``channels_last``)."""

    def __init__(self, lo: int, N: int, B: int, shape: tuple[int, ...], separate_errors: bool,
                 channels_last: bool = False, **kw):
        self.lo, self.N = lo, N
        self.h = stacked_zeros((N, B, *shape), channels_last, **kw)
        self.v = stacked_zeros((N, B, *shape), channels_last, **kw)
        self.e = stacked_zeros((N, B, *shape), channels_last, **kw) if separate_errors else self.v


class ValueNodes:
    """Nodes first-1 .. stop-1 of a slice of a network with node shapes ``shapes`` (h_0 .. h_L).

    ``channels_last``: the nodes to store channels-last (a block is, if all its nodes are in it).
    ``free``: the nodes this slice updates, (index of the first, h, v, e) per run of one block: the
    owned hidden nodes, h_0 if ``free_bottom`` (on the first slice) and h_L if ``free_top`` (on the
    last); the replica of the upstream neighbour's node is not among them.
    """

    def __init__(self, shapes: list[tuple[int, ...]], first: int, stop: int, B: int, separate_errors: bool,
                 free_bottom: bool = False, free_top: bool = False, channels_last: frozenset[int] = frozenset(),
                 **kw):
        L = len(shapes) - 1
        self.blocks: list[NodeBlock] = []
        n = first - 1
        while n < stop:  # runs of equal shape
            m = n
            while m + 1 < stop and shapes[m + 1] == shapes[n]:
                m += 1
            cl = all(i in channels_last for i in range(n, m + 1))
            self.blocks.append(NodeBlock(n, m - n + 1, B, tuple(shapes[n]), separate_errors, cl, **kw))
            n = m + 1
        # Free nodes: (0 or) first .. min(stop - 1, L - 1 (or L)); one contiguous slot range per block.
        lo_node = 0 if free_bottom and first == 1 else first
        hi_node = min(stop - 1, L if free_top else L - 1)
        self.free: list[tuple[int, Tensor, Tensor, Tensor]] = []
        for blk in self.blocks:
            lo, hi = max(blk.lo, lo_node), min(blk.lo + blk.N - 1, hi_node)
            if lo <= hi:
                sl = slice(lo - blk.lo, hi - blk.lo + 1)
                self.free.append((lo, blk.h[sl], blk.v[sl], blk.e[sl]))
        first_blk, last_blk = self.blocks[0], self.blocks[-1]
        is_last = stop == L + 1
        self.has_replica = first > 1
        self.recv_input = first_blk.h[0]  # h_{first-1}: x, or the replica of the upstream neighbour's last node
        self.send_node = None if is_last else last_blk.h[-1]  # h_{stop-1}, for the feed-forward
        self.recv_error = first_blk.e[0] if self.has_replica else None  # e_{first-1} from upstream
        self.send_backproj = torch.zeros_like(first_blk.h[0]) if self.has_replica else None  # -P_first
        self.send_error = None if is_last else last_blk.e[-1]  # e_{stop-1}, for downstream
        self.recv_backproj = None if is_last else torch.zeros_like(last_blk.h[-1])

    def block_of(self, node: int) -> NodeBlock:
        return next(b for b in self.blocks if b.lo <= node < b.lo + b.N)

    def views(self, node: int, K: int) -> tuple[Tensor, Tensor, Tensor]:
        """(h, v, e) of the K consecutive nodes from ``node`` (all in one block)."""
        blk = self.block_of(node)
        i = node - blk.lo
        return blk.h[i : i + K], blk.v[i : i + K], blk.e[i : i + K]

    def node(self, n: int) -> Tensor:
        """The value node h_n [B, *shape] (a view)."""
        blk = self.block_of(n)
        return blk.h[n - blk.lo]
