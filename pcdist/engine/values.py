"""The value optimizer of a Stage: SGD with momentum on the free value nodes, and value noise.

Shape letters: N nodes of a block, B batch, S a node's shape.

Per inference step, with g the per-sample energy gradient of a free node (its own error
pi e plus the back-projection of the layer above: g = pi e - P), the value step is

    v <- g + mu v;   h <- h - x_lr v                       (v reset every batch)
    h <- h + sqrt(2 x_lr tau) xi,   xi ~ N(0, 1)           (value noise, MCPC; ``add_noise``)

The back-projections accumulate into v during ``Stage.backproject`` with the weight ``beta``
on the old v (every free node but h_L gets exactly one back-projection, so momentum is
applied there exactly once; a free h_L, which none projects into, is scaled here). Without
momentum and with the errors written straight into v (``aliased``), v is g already.

For pc without momentum the Stage fuses the step into its passes (``begin_step``): each
group's error pass takes h -= x_lr e, the back-projection adds x_lr P into h, and only the
steps that had to wait (a node read by a group that ran later: ``deferred``) and the slice's
boundary nodes are left to ``update``.

A layer slice's boundary: v of its last node gets the downstream back-projection
``recv_backproj``, and the replica of the upstream neighbour's last node takes the update its
owner takes, from ``recv_error`` and ``send_backproj``, in the same floating-point order.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from .nodes import ValueNodes

__all__ = ["ValueOptimizer", "noise_seed", "scale_", "value_noise"]


def noise_seed(seed: int, call: int, t: int, node: int) -> int:
    """The seed of node ``node``'s value noise at inference step ``t`` of training step (or infer call)
    ``call``: xi = randn(global batch, *shape) from a generator seeded with it, so every rank that
    holds the node, whatever the layer or data split, draws the same numbers."""
    return (seed * 0x9E3779B1 + call * 0x85EBCA77 + t * 0xC2B2AE3D + node * 0x27D4EB2F) % 2**63


def scale_(v: Tensor, beta: float) -> Tensor:
    """v *= beta in place; beta 0 clears v (as a GEMM with beta 0 ignores its old contents)."""
    if beta == 0.0:
        return v.zero_()
    return v if beta == 1.0 else v.mul_(beta)


class ValueOptimizer:
    """The value step over a Stage's nodes: momentum ``mu``; ``aliased``: v and e are one tensor."""

    def __init__(self, nodes: ValueNodes, mu: float, aliased: bool):
        self.nodes, self.mu, self.aliased = nodes, mu, aliased
        self.reset()

    def reset(self) -> None:
        """A new batch: momentum starts again from zero."""
        self.step = 0
        self.step_lr, self.done, self.deferred = None, [], []

    def begin_step(self, step_lr: float | None) -> bool:
        """Start an error pass; True if the value step is fused into it (pc without momentum)."""
        self.step_lr = step_lr if step_lr is not None and self.mu == 0.0 else None
        return self.step_lr is not None

    @property
    def beta(self) -> float:
        """Weight of the old v in the back-projection: 1 when v holds e (no momentum), mu with
        momentum, 0 on the first step of a batch."""
        return 1.0 if self.aliased else (self.mu if self.step > 0 else 0.0)

    def update(self, x_lr: float, boundary: bool, top: bool) -> None:
        """v += e (unless v is e); h -= x_lr * v on the free nodes (``boundary``: this slice sends its last
        node downstream; ``top``: it holds a free h_L) and on the replica (see the module docstring)."""
        nd, beta, blocks = self.nodes, self.beta, self.nodes.blocks
        if self.step_lr is not None:  # errors and backproject took the rest of the step
            for gr in self.deferred:
                gr.h_out.add_(gr.e_out, alpha=-x_lr)
            if boundary:  # the boundary node, stepped as its replica downstream is
                blocks[-1].h[-1].add_(blocks[-1].e[-1], alpha=-x_lr).add_(nd.recv_backproj, alpha=-x_lr)
        else:
            if nd.recv_backproj is not None:
                scale_(blocks[-1].v[-1], beta).add_(nd.recv_backproj)
            if top and not self.aliased:  # no layer projects into h_L: its momentum is applied here
                scale_(blocks[-1].v[-1], beta)
            for _, h, v, e in nd.free:
                if not self.aliased:
                    v.add_(e)
                h.add_(v, alpha=-x_lr)
        if nd.has_replica:
            h, v, e = blocks[0].h[0], blocks[0].v[0], blocks[0].e[0]
            if self.step_lr is not None:
                h.add_(e, alpha=-x_lr).add_(nd.send_backproj, alpha=-x_lr)
            else:
                scale_(v, beta).add_(nd.send_backproj)
                if not self.aliased:
                    v.add_(e)
                h.add_(v, alpha=-x_lr)
        self.step += 1
        self.step_lr, self.done, self.deferred = None, [], []

    def add_noise(self, std: float, draw: Callable[[int, tuple[int, ...]], Tensor]) -> None:
        """h += std * xi on every node this slice updates, the replica included; ``draw(n, shape)``
        gives node n's noise [B, *shape] (the same on every rank that holds node n)."""
        nd = self.nodes
        for lo, h, _, _ in nd.free:
            for i in range(h.shape[0]):
                h[i].add_(draw(lo + i, tuple(h.shape[2:])), alpha=std)
        if nd.has_replica:
            h = nd.blocks[0].h[0]
            h.add_(draw(nd.blocks[0].lo, tuple(h.shape[1:])), alpha=std)


def value_noise(st, par, x_lr: float, tau: float, seed: int, call: int, global_batch: int | None):
    """The value noise of one training step or infer call ``call`` on a Stage: ``add(t)`` puts
    sqrt(2 x_lr tau) xi on every node this rank updates at inference step t, xi of node n drawn from
    ``noise_seed(seed, call, t, n)`` for the global batch and cut to this data rank's rows (``par``: the
    rank's Parallel); None when tau is 0."""
    if not tau:
        return None
    B = st.B
    total = B if par.data_size == 1 else global_batch
    if total is None:
        raise ValueError("value noise on a data axis needs the global batch size: pass global_batch=")
    rows = torch.tensor_split(torch.arange(total), par.data_size)[par.data_rank]
    if len(rows) != B:
        raise ValueError(f"global_batch={total} over {par.data_size} data ranks gives this rank {len(rows)} rows, "
                         f"but its batch has {B}")
    lo, std, like = int(rows[0]) if len(rows) else 0, math.sqrt(2.0 * x_lr * tau), st.node(st.net.stop - 1)

    def add(t: int) -> None:
        def draw(n: int, shape: tuple[int, ...]) -> Tensor:
            gen = torch.Generator(device=like.device).manual_seed(noise_seed(seed, call, t, n))
            return torch.randn(total, *shape, generator=gen, dtype=like.dtype, device=like.device)[lo : lo + B]

        st.values.add_noise(std, draw)

    return add
