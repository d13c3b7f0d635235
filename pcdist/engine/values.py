"""The value optimizer of a Stage: SGD with momentum on the free value nodes, and value noise.

Shape letters: N nodes of a block, B batch, S a node's shape.

Per inference step, with g the per-sample energy gradient of a free node (its own error
pi e plus the back-projection of the layer above: g = pi e - P), the value step is

    v <- g + mu v;   h <- h - x_lr v                       (v reset every batch)
    h <- h + sqrt(2 x_lr tau) xi,   xi ~ N(0, 1)           (value noise, MCPC; ``ValueNoise``)

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

import torch
from torch import Tensor

from .nodes import ValueNodes

__all__ = ["ValueOptimizer", "ValueNoise", "noise_seed", "scale_", "stage_noise"]


def noise_seed(seed: int, call: int) -> int:
    """The seed of the value noise of training step (or infer call) ``call`` (see ``ValueNoise``)."""
    return (seed * 0x9E3779B1 + call * 0x85EBCA77 + 0x27D4EB2F) % 2**63


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


class ValueNoise:
    """MCPC's Langevin term on a Stage: h += std xi after the value step of every inference step, on every node
    this rank updates (the replica of the upstream node included), std = sqrt(2 x_lr tau).

    The draw is graph-safe and the same whatever the split: at the start of training step (or infer call)
    ``call`` a generator is seeded with ``noise_seed(seed, call)`` (``seed_call``, on the host); at each
    inference step one ``randn(n)`` draws the noise of the whole global batch of every node h_0 .. h_L, in
    that order, each node's block [global batch, *shape] (n = global batch x the sum of the node sizes).
    Node h_n's xi is its block, cut to this data rank's rows. Every rank draws the whole vector, so it does
    not matter which nodes or rows it owns; a captured step reads the generator's seed at each replay.
    """

    def __init__(self, st, par, std: float, global_batch: int | None, generator: torch.Generator):
        B = st.B
        total = B if par.data_size == 1 else global_batch
        if total is None:
            raise ValueError("value noise on a data axis needs the global batch size: pass global_batch=")
        rows = torch.tensor_split(torch.arange(total), par.data_size)[par.data_rank]
        if len(rows) != B:
            raise ValueError(f"global_batch={total} over {par.data_size} data ranks gives this rank {len(rows)} rows, "
                             f"but its batch has {B}")
        lo = int(rows[0]) if len(rows) else 0
        shapes = st.net.node_shapes
        offsets = [0]
        for shape in shapes:
            offsets.append(offsets[-1] + total * math.prod(shape))
        like = st.node(st.net.stop - 1)
        self.flat = torch.empty(offsets[-1], dtype=like.dtype, device=like.device)
        self.std, self.generator = std, generator

        def block(n: int, N: int) -> Tensor:  # xi of nodes n .. n + N - 1, this rank's rows
            xi = self.flat[offsets[n] : offsets[n + N]].view(N, total, *shapes[n])
            return xi[:, lo : lo + B]

        nd = st.values.nodes
        self.pairs = [(h, block(n, h.shape[0])) for n, h, _, _ in nd.free]
        if nd.has_replica:
            self.pairs.append((nd.blocks[0].h[:1], block(nd.blocks[0].lo, 1)))

    def seed_call(self, seed: int, call: int) -> None:
        """Seed this call's draws (host work, before the step's core runs)."""
        self.generator.manual_seed(noise_seed(seed, call))

    def __call__(self, t: int) -> None:
        """Inference step t's noise on every node this rank updates."""
        torch.randn(self.flat.shape, generator=self.generator, out=self.flat)
        for h, xi in self.pairs:
            h.add_(xi, alpha=self.std)


def stage_noise(st, par, x_lr: float, tau: float, global_batch: int | None, generator: torch.Generator,
                seed: int, call: int) -> ValueNoise | None:
    """The Stage's value noise at temperature ``tau`` (made once per stage and tau), seeded for ``call``;
    None without noise."""
    if not tau:
        return None
    key = (tau, global_batch)
    noise = st.noise.get(key)
    if noise is None:
        noise = st.noise[key] = ValueNoise(st, par, math.sqrt(2.0 * x_lr * tau), global_batch, generator)
    noise.seed_call(seed, call)
    return noise
