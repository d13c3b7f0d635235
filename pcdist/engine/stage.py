"""Fused phases of predictive-coding inference for one contiguous slice of layers, any layer kind.

A ``Stage`` holds the value nodes of the layers [first, stop) of a PCNetwork for one
batch size (pcdist.nodes: runs of equal-shape nodes in one tensor, so a group's inputs
and outputs are two shifted views) and runs the phases of the PC schedule over every
group of stacked equal layers, each group bound by its kind (pcdist.layers):

    feedforward    h_l <- u_l for the hidden nodes, layer by layer (a chain)
    errors         e = h - u and each layer's error signal
    backproject    v_{l-1} <- beta * v_{l-1} - P_l,  P_l = -dE_l/dh_{l-1}
    update_values  v += e (unless v is e already);  h -= x_lr * v
    weight_grads   dF/dtheta of every layer into .grad

With momentum mu the value optimizer is v <- g + mu v, h <- h - x_lr v, reset every
batch (g_l = e_l - P_{l+1} is the per-sample gradient of the energy).

For pc without momentum the weights and predictions stay fixed until the value step, so
the step is fused into the phases: each group's error pass also takes h_out -= x_lr * e,
and the back-projection adds x_lr * P straight into h (for dense layers: the GEMM itself),
with no v at all (see ``Stage.errors``).

The stage never touches torch.distributed: a neighbour's boundary tensors are exchanged
through ``recv_input`` / ``send_node`` (feed-forward) and ``send_error`` / ``recv_error`` /
``send_backproj`` / ``recv_backproj`` (inference), which a layer-parallel driver
(pcdist.parallel) fills and reads between the phases. A single process owns every layer,
so it has no boundary at all.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .layers import BoundGroup
from .network import PCNetwork
from .nodes import ValueNodes

__all__ = ["Stage", "INITS"]

INITS = ("ff", "deeppcr")


def _scale(v: Tensor, beta: float) -> Tensor:
    """v *= beta in place; beta 0 clears v (as a GEMM with beta 0 ignores its old contents)."""
    if beta == 0.0:
        return v.zero_()
    return v if beta == 1.0 else v.mul_(beta)


class Stage:
    """Preallocated value nodes and the fused PC phases of a PCNetwork's layer slice.

    ``static_weights``: the weights stay fixed through a batch's inference (pc), so kinds may
    keep weight-derived copies per weight change (dense and residual layers: a row-major
    w^T for the back-projection GEMM, which reads it 20-30% faster than the transposed view).
    """

    def __init__(self, net: PCNetwork, batch_size: int, x_momentum: float = 0.0, init: str = "ff",
                 static_weights: bool = False):
        if init not in INITS:
            raise ValueError(f"unknown value-node init {init!r}; allowed: 'ff' (feed-forward), 'deeppcr'")
        self.net, self.B, self.mu, self.init = net, batch_size, float(x_momentum), init
        p = next(net.parameters())
        L, first, stop = net.num_layers, net.first, net.stop
        # v and e are one tensor unless momentum keeps v, or a kind's back-projection reads e.
        separate = self.mu != 0.0 or any(g.reads_errors for g in net.groups)
        self._aliased = not separate
        self.nodes = ValueNodes(net.node_shapes, first, stop, batch_size, separate, dtype=p.dtype, device=p.device)
        self.groups: list[BoundGroup] = []
        for g in net.groups:
            h_in, v_in, _ = self.nodes.views(g.first - 1, g.K)
            h_out, _, e_out = self.nodes.views(g.first, g.K)
            energy = net.energy if g.first + g.K - 1 == L else None
            gr = g.bind(h_in, h_out, e_out, batch_size, static_weights, energy, init)
            gr.v_in = v_in  # where the group's back-projection accumulates (the value gradient)
            self.groups.append(gr)
        self.output = self.groups[-1] if stop == L + 1 else None
        nd = self.nodes
        self.recv_input, self.send_node = nd.recv_input, nd.send_node
        self.has_replica, self.recv_error, self.send_backproj = nd.has_replica, nd.recv_error, nd.send_backproj
        self.send_error, self.recv_backproj = nd.send_error, nd.recv_backproj
        self._step = 0
        # This step's fused value step (see ``errors``): its x_lr, the groups done, those deferred.
        self._step_lr, self._done, self._deferred = None, [], []

    def node(self, n: int) -> Tensor:
        """The value node h_n [B, *shape] (a view)."""
        return self.nodes.node(n)

    # -- phases -------------------------------------------------------------------
    def begin(self, x: Tensor | None, y: Tensor | None) -> None:
        """Start a batch: clamp the input (first slice) and the target (last slice)."""
        if x is not None:
            self.recv_input.copy_(x)
        if y is not None and self.output is not None:
            self.output.h_out[0].copy_(y)
        self.weights_changed()
        self._step = 0
        self._step_lr, self._done, self._deferred = None, [], []

    def feedforward(self, rows: slice | None = None) -> None:
        """h_l <- u_l for every hidden node of the slice, layer by layer (a chain).

        ``rows`` restricts the pass to a micro-batch (the pipelined init of a layer slice).
        With ``init="deeppcr"`` a group of K > 1 hidden layers is solved as one chain by
        Newton + parallel cyclic reduction (pcdist.deeppcr) instead of K dependent steps.
        """
        for gr in self.groups:
            gr.feedforward(rows, self.init)

    def errors(self, groups: list[BoundGroup] | None = None, need_all_deltas: bool = False,
               step_lr: float | None = None) -> None:
        """Predictions (where stale), errors e and error signals of the groups (default all).

        The first global layer's signal only feeds its weight gradient, so it is skipped
        unless ``need_all_deltas``.

        ``step_lr`` (pc without momentum: the weights and every prediction stay fixed
        until the value step) fuses the value step into this phase and the next: each
        group's pass also takes h_out -= step_lr * e, and ``backproject`` adds
        step_lr * P straight into h. A node is the input of the next group, so its
        step is taken here only once that group has read it (groups run last first);
        otherwise it waits for ``update_values``.
        """
        fused = step_lr is not None and self.mu == 0.0
        self._step_lr = step_lr if fused else None
        for gr in reversed(self.groups if groups is None else groups):
            if gr is self.output:
                gr.errors(True, None)
            else:
                i = self.groups.index(gr)
                last = i == len(self.groups) - 1
                now = fused and (last or self.groups[i + 1] in self._done)
                # The node sent downstream steps in update_values, exactly as its replica there.
                gr.errors(need_all_deltas or gr.first > 1, step_lr if now else None,
                          hold_last=last and self.send_error is not None)
                if fused and not now:
                    self._deferred.append(gr)
            self._done.append(gr)

    @property
    def _beta(self) -> float:
        """Weight of the old v in the back-projection.

        Every hidden node receives exactly one back-projection (from the layer above
        it), so beta applies the momentum exactly once: 1 when v holds e (no momentum),
        mu with momentum, 0 on the first step of a batch.
        """
        return 1.0 if self._aliased else (self.mu if self._step > 0 else 0.0)

    def backproject(self, groups: list[BoundGroup] | None = None) -> None:
        """v_in <- beta * v_in - P for the groups (default all) whose input node is free.

        The first group of a slice that starts past layer 1 writes ``send_backproj``
        instead: its input node is the upstream neighbour's (replicated here).
        """
        beta = self._beta
        for gr in self.groups if groups is None else groups:
            if gr.first == 1:
                continue
            if gr is self.groups[0]:  # has_replica: the slice's first layer is a group of its own
                gr.backproject(self.send_backproj.unsqueeze(0), beta=0.0, alpha=-1.0)
            elif self._step_lr is not None:  # fused value step: h += x_lr * P
                gr.backproject(gr.h_in, beta=1.0, alpha=self._step_lr)
            else:
                gr.backproject(gr.v_in, beta=beta, alpha=-1.0)

    def update_values(self, x_lr: float) -> None:
        """v += e (unless v is e); h -= x_lr * v on the owned hidden nodes and the replica.

        A layer slice first folds in the boundary messages (which must have arrived):
        v_{stop-1} gets the downstream back-projection ``recv_backproj``, and the replica
        h_{first-1} takes the update its owner takes, from ``recv_error`` and ``send_backproj``,
        in the same floating-point order.
        """
        beta = self._beta
        fused = self._step_lr is not None  # errors and backproject took the rest of the step
        blocks = self.nodes.blocks
        if fused:
            for gr in self._deferred:
                gr.h_out.add_(gr.e_out, alpha=-x_lr)
            if self.send_error is not None:  # the boundary node, stepped as its replica downstream is
                blocks[-1].h[-1].add_(blocks[-1].e[-1], alpha=-x_lr).add_(self.recv_backproj, alpha=-x_lr)
        else:
            if self.recv_backproj is not None:
                _scale(blocks[-1].v[-1], beta).add_(self.recv_backproj)
            for h, v, e in self.nodes.hidden:
                if not self._aliased:
                    v.add_(e)
                h.add_(v, alpha=-x_lr)
        if self.has_replica:
            h, v, e = blocks[0].h[0], blocks[0].v[0], blocks[0].e[0]
            if fused:
                h.add_(e, alpha=-x_lr).add_(self.send_backproj, alpha=-x_lr)
            else:
                _scale(v, beta).add_(self.send_backproj)
                if not self._aliased:
                    v.add_(e)
                h.add_(v, alpha=-x_lr)
        for gr in self.groups:
            if gr.first > 1:
                gr.cached = False
        self._step += 1
        self._step_lr, self._done, self._deferred = None, [], []

    def weight_grads(self, groups: list[BoundGroup] | None = None, scale: float | None = None) -> None:
        """Write dF/dtheta of the groups' layers (default all) into .grad.

        F is the batch mean of E (``scale`` -1/B); ``scale=-1`` gives batch sums instead.
        """
        scale = -1.0 / self.B if scale is None else scale
        for gr in self.groups if groups is None else groups:
            for p in gr.g.parameters():
                if p.grad is None:
                    p.grad = torch.empty_like(p)
            gr.weight_grads(scale)

    def weights_changed(self) -> None:
        """Mark every prediction (and weight-derived copy) stale after an optimizer step and at a new batch."""
        for gr in self.groups:
            gr.weights_changed()

    def layer_energies(self) -> Tensor:
        """Batch-mean energy of each owned layer [L_owned], from the last ``errors``."""
        return torch.cat([gr.energies() for gr in self.groups]) / self.B
