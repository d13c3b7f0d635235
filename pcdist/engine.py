"""Fused phases of predictive-coding inference for one contiguous slice of layers.

Shape letters: K layers in a group, B batch, I input width, O output width,
N value nodes in a block.

A ``Stage`` holds the value nodes of the layers [first, stop) of a PCNetwork for
one batch size, stored as *node blocks*: runs of consecutive nodes of equal width
in one tensor h_NBO. The inputs of a group's K layers are then the view
h_NBO[i:i+K] and their outputs h_NBO[i+1:i+K+1], with no copy, and every phase of
a group is one batched kernel:

    predict    a = baddbmm(b, h_in, w_KIO);  u = f(a)
    error      e = h_out - u;  d = e * f'(a)          (d = -dE/da; output: y - u or y - softmax(u))
    update     v_in = beta * v_in - d @ w_KOI          (back-projection, fused into the GEMM)
               v += e (momentum only);  h -= x_lr * v   (one pass per node block)
    weights    dF/dw_KIO = -(1/B) h_in^T @ d;  dF/db = -(1/B) sum_B d

On CPUs the elementwise work between the GEMMs is one pass per group (pcdist.native):
a = bmm(h_in, w) and then b, f, e, f' in a single kernel (u is never stored), instead
of a bias copy and three torch ops. For pc without momentum the weights and predictions stay fixed until
the value step, so its step splits into h_out -= x_lr * e, taken in that same pass, and
h_in += x_lr * d @ w_KOI, taken by the back-projection GEMM itself (see
``Stage.errors``): no separate update pass and no v at all.

The back-projection multiplies by the transposed weights. A GEMM that reads its second
operand transposed is 20-30% slower on CPUs (MKL) than one that reads it row-major, so
with ``transposed_weights=True`` (the trainer's choice for pc, where the weights stay
fixed for the T steps of a batch) each group keeps a row-major copy w_KOI, refreshed
once after every weight change; iPC changes the weights every step and reads the
transposed view instead.

The stage never touches torch.distributed: a neighbour's boundary tensors are
exchanged through ``recv_input`` / ``send_node`` (feed-forward) and ``send_error`` /
``recv_error`` / ``send_backproj`` / ``recv_backproj`` (inference), which a
layer-parallel driver fills and reads between the phases. A single process owns
every layer, so it has no boundary at all.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import native
from .energies import output_energy, output_signal
from .network import LayerGroup, PCNetwork

__all__ = ["Stage"]


def _scale(v: Tensor, beta: float) -> Tensor:
    """v *= beta in place; beta 0 clears v (as a GEMM with beta 0 ignores its old contents)."""
    if beta == 0.0:
        return v.zero_()
    return v if beta == 1.0 else v.mul_(beta)


class _Block:
    """Value nodes [lo, lo + N) of one width, with momentum v and errors e."""

    def __init__(self, lo: int, N: int, B: int, width: int, separate_errors: bool, **kw):
        self.lo, self.N = lo, N
        self.h_NBO = torch.zeros(N, B, width, **kw)
        self.v_NBO = torch.zeros(N, B, width, **kw)
        # Without momentum v is the gradient itself: the errors are written straight into it.
        self.e_NBO = torch.zeros(N, B, width, **kw) if separate_errors else self.v_NBO


class _Group:
    """Views and scratch buffers of one LayerGroup inside a Stage.

    Parameter views are taken once: optimizers update parameters in place, and the
    trainer rebuilds its Stage if a parameter's storage is replaced.
    """

    def __init__(self, g: LayerGroup, blk_in: _Block, blk_out: _Block, B: int, transposed_weights: bool):
        s, K = g.first, g.K
        self.g, self.K, self.act = g, K, g.spec.activation
        i, o = s - 1 - blk_in.lo, s - blk_out.lo
        self.h_in = blk_in.h_NBO[i : i + K]
        self.v_in = blk_in.v_NBO[i : i + K]
        self.h_out = blk_out.h_NBO[o : o + K]
        self.e_out = blk_out.e_NBO[o : o + K]
        self.w_KIO = g.weight
        # w^T for the back-projection: a row-major copy (refreshed by ``weights_t``) or a view.
        self._w_KOI = g.weight.transpose(1, 2)
        if transposed_weights:
            self._w_KOI = torch.empty_like(self._w_KOI, memory_format=torch.contiguous_format)
        self._w_KOI_stale = transposed_weights
        self.b_K1O = g.bias.unsqueeze(1)
        kw = dict(dtype=g.weight.dtype, device=g.weight.device)
        self.a = torch.empty(K, B, g.spec.out_features, **kw)
        # u overwrites a unless f'(a) must be read from a itself (gelu).
        self.u = self.a if self.act is None or not self.act.needs_input else torch.empty_like(self.a)
        self.d = torch.empty_like(self.a)
        self.layers = [(g.bias[k], g.weight[k], self.a[k], self.u[k]) for k in range(K)]  # for the chain
        self.cached = False  # u = f(a) is current for the present inputs and weights
        # f, the error, f' and the value step in one pass (CPU); None: separate torch ops.
        # It reads a (u itself, except for gelu, whose f' needs its input) and, unless fresh, u.
        self.kernel = native.Kernel(self.act, self.a, self.h_out, self.e_out, self.d, g.bias, u=self.u) \
            if native.usable(self.act, self.a) and self.e_out.is_contiguous() else None

    def predict(self, activate: bool = True) -> None:
        """a = b + h_in @ w; u = f(a): one kernel each for all K layers. ``activate=False``
        leaves a = h_in @ w, for the fused kernel to add b and apply f."""
        if activate:
            torch.baddbmm(self.b_K1O, self.h_in, self.w_KIO, out=self.a)
            if self.act is not None:
                self.act.forward(self.a, out=self.u)
            self.cached = True
        else:
            torch.bmm(self.h_in, self.w_KIO, out=self.a)

    def errors(self, with_d: bool, step_lr: float | None, hold_last: bool = False) -> None:
        """e = h_out - u and d = e * f'(a) (if ``with_d``) of a hidden group, predicting first if
        stale; with ``step_lr`` also the value step's own-error term h_out -= step_lr * e
        (``hold_last``: on all nodes but the last), and e is then left unwritten where the
        kernel takes that step (only the held node's e is read, as the boundary message)."""
        stepped = self.K - 1 if hold_last else self.K
        if self.kernel is not None:
            # The kernel does not store u: only layer 1 (clamped input) reuses it, for the whole batch.
            fresh = not self.cached and self.g.first > 1
            if fresh:
                self.predict(activate=False)
            elif not self.cached:
                self.predict()
            self.kernel.run(fresh, with_d, step_lr, stepped)
            return
        if not self.cached:
            self.predict()
        torch.sub(self.h_out, self.u, out=self.e_out)
        if with_d:
            self.act.grad(self.e_out, self.a, self.u, out=self.d)
        if step_lr is not None:
            self.h_out[:stepped].add_(self.e_out[:stepped], alpha=-step_lr)

    @property
    def w_KOI(self) -> Tensor:
        """w^T [K, O, I] for the back-projection, current with the weights."""
        if self._w_KOI_stale:
            self._w_KOI.copy_(self.w_KIO.transpose(1, 2))
            self._w_KOI_stale = False
        return self._w_KOI

    def weights_changed(self) -> None:
        self.cached = False
        if self._w_KOI.data_ptr() != self.w_KIO.data_ptr():  # a copy, not the view
            self._w_KOI_stale = True


class Stage:
    """Preallocated value nodes and the fused PC phases of a PCNetwork's layer slice."""

    def __init__(self, net: PCNetwork, batch_size: int, x_momentum: float = 0.0, init: str = "ff",
                 transposed_weights: bool = False):
        if init not in ("ff", "deeppcr"):
            raise ValueError(f"unknown value-node init {init!r}; allowed: 'ff' (feed-forward), 'deeppcr'")
        self.net, self.B, self.mu, self.init = net, batch_size, float(x_momentum), init
        p = net.groups[0].weight
        kw = dict(dtype=p.dtype, device=p.device)
        L, first, stop = net.num_layers, net.first, net.stop
        widths = net.dims
        self.blocks: list[_Block] = []
        n = first - 1
        while n < stop:  # nodes first-1 .. stop-1, in runs of equal width
            m = n
            while m + 1 < stop and widths[m + 1] == widths[n]:
                m += 1
            self.blocks.append(_Block(n, m - n + 1, batch_size, widths[n], self.mu != 0.0, **kw))
            n = m + 1
        self.groups = [
            _Group(g, self._block_of(g.first - 1), self._block_of(g.first), batch_size, transposed_weights)
            for g in net.groups
        ]
        self.output = self.groups[-1] if stop == L + 1 else None
        # Squared-error output: d_L = y - b_L - h W_L is one GEMM on the precomputed y - b_L.
        se_out = self.output is not None and net.energy == "se"
        self._y_minus_b = torch.empty_like(self.output.a) if se_out else None
        # Owned hidden nodes: first .. min(stop - 1, L - 1); one contiguous slot range per block.
        hi_node = min(stop - 1, L - 1)
        self._hidden = []
        for blk in self.blocks:
            lo, hi = max(blk.lo, first), min(blk.lo + blk.N - 1, hi_node)
            if lo <= hi:
                sl = slice(lo - blk.lo, hi - blk.lo + 1)
                self._hidden.append((blk.h_NBO[sl], blk.v_NBO[sl], blk.e_NBO[sl]))
        # Boundary tensors of a layer slice (unused when the slice is the whole network). The
        # upstream neighbour's last node h_{first-1} is replicated here (node slot 0): both ranks
        # apply the same update to it from the same two messages per step, its error e
        # (downstream) and its back-projection (upstream), so neither waits for the other's update.
        blk0, blkN = self.blocks[0], self.blocks[-1]
        self.recv_input = blk0.h_NBO[0]  # h_{first-1}: x, or the replica of the upstream neighbour's last node
        self.send_node = blkN.h_NBO[-1] if self.output is None else None  # h_{stop-1}, for the feed-forward
        self.has_replica = first > 1
        self.recv_error = blk0.e_NBO[0] if self.has_replica else None  # e_{first-1} from upstream
        self.send_backproj = torch.zeros_like(blk0.h_NBO[0]) if self.has_replica else None  # -W_first^T d_first
        self.send_error = blkN.e_NBO[-1] if self.output is None else None  # e_{stop-1}, for downstream
        self.recv_backproj = torch.zeros_like(blkN.h_NBO[-1]) if self.output is None else None
        self._step = 0
        # This step's fused value step (see ``errors``): its x_lr, the groups done, those deferred.
        self._step_lr, self._done, self._deferred = None, [], []

    def _block_of(self, node: int) -> _Block:
        return next(b for b in self.blocks if b.lo <= node < b.lo + b.N)

    def node(self, n: int) -> Tensor:
        """The value node h_n [B, width] (a view)."""
        blk = self._block_of(n)
        return blk.h_NBO[n - blk.lo]

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
            act = gr.act
            h = gr.h_in[0] if rows is None else gr.h_in[0][rows]
            if self.init == "deeppcr" and gr.K > 1 and gr is not self.output:
                self._chain_deeppcr(gr, h, rows)
                continue
            for b, w, a, u in gr.layers:
                if rows is not None:
                    a, u = a[rows], u[rows]
                torch.addmm(b, h, w, out=a)
                h = a if act is None else act.forward(a, out=u)
            if gr is not self.output:
                if rows is None:
                    gr.h_out.copy_(gr.u)
                else:
                    gr.h_out[:, rows].copy_(gr.u[:, rows])
            gr.cached = True

    def _chain_deeppcr(self, gr: _Group, h_BI: Tensor, rows: slice | None) -> None:
        """The group's K chained predictions solved at once; a and u then follow from one GEMM."""
        from .deeppcr import solve

        states = solve((gr.w_KIO, gr.g.bias, gr.act), h_BI).states  # [K + 1, B, O]
        sel = slice(None) if rows is None else rows
        gr.h_out[:, sel].copy_(states[1:])
        a = gr.a[:, sel]
        torch.baddbmm(gr.b_K1O, gr.h_in[:, sel], gr.w_KIO, out=a)
        gr.act.forward(a, out=gr.u[:, sel])
        gr.cached = True

    def errors(self, groups: list[_Group] | None = None, need_all_deltas: bool = False,
               step_lr: float | None = None) -> None:
        """Predictions (where stale), errors e and signals d = e * f'(a) of the groups (default all).

        The first global layer's d only feeds its weight gradient, so it is skipped
        unless ``need_all_deltas``.

        ``step_lr`` (pc without momentum: the weights and every prediction stay fixed
        until the value step) fuses the value step into this phase and the next: each
        group's pass also takes h_out -= step_lr * e, and ``backproject`` adds
        step_lr * d @ w^T straight into h. A node is the input of the next group, so its
        step is taken here only once that group has read it (groups run last first);
        otherwise it waits for ``update_values``.
        """
        fused = step_lr is not None and self.mu == 0.0
        self._step_lr = step_lr if fused else None
        for gr in reversed(self.groups if groups is None else groups):
            if gr is self.output:
                if self._y_minus_b is not None:
                    torch.baddbmm(self._y_minus_b, gr.h_in, gr.w_KIO, alpha=-1.0, out=gr.d)
                else:
                    if not gr.cached:
                        gr.predict()
                    output_signal(self.net.energy, gr.u[0], gr.h_out[0], gr.d[0])
            else:
                i = self.groups.index(gr)
                last = i == len(self.groups) - 1
                now = fused and (last or self.groups[i + 1] in self._done)
                # The node sent downstream steps in update_values, exactly as its replica there.
                gr.errors(need_all_deltas or gr.g.first > 1, step_lr if now else None,
                          hold_last=last and self.send_error is not None)
                if fused and not now:
                    self._deferred.append(gr)
            self._done.append(gr)

    @property
    def _beta(self) -> float:
        """Weight of the old v in the back-projection GEMM.

        Every hidden node receives exactly one back-projection (from the layer above
        it), so beta applies the momentum exactly once: 1 without momentum (v holds
        e), mu with momentum, 0 on the first step of a batch.
        """
        return 1.0 if self.mu == 0.0 else (self.mu if self._step > 0 else 0.0)

    def backproject(self, groups: list[_Group] | None = None) -> None:
        """v_in <- beta * v_in - d @ W for the groups (default all) whose input node is free.

        The first group of a slice that starts past layer 1 writes ``send_backproj``
        instead: its input node is the upstream neighbour's (replicated here).
        """
        beta = self._beta
        for gr in self.groups if groups is None else groups:
            if gr.g.first == 1:
                continue
            if gr is self.groups[0]:  # has_replica: the slice's first layer is a group of its own
                self.send_backproj.unsqueeze(0).baddbmm_(gr.d, gr.w_KOI, beta=0.0, alpha=-1.0)
            elif self._step_lr is not None:  # fused value step: h += x_lr * d @ w^T
                gr.h_in.baddbmm_(gr.d, gr.w_KOI, alpha=self._step_lr)
            else:
                gr.v_in.baddbmm_(gr.d, gr.w_KOI, beta=beta, alpha=-1.0)

    def update_values(self, x_lr: float) -> None:
        """v += e (momentum only); h -= x_lr * v on the owned hidden nodes and the replica.

        A layer slice first folds in the boundary messages (which must have arrived):
        v_{stop-1} gets the downstream back-projection ``recv_backproj``, and the replica
        h_{first-1} takes the update its owner takes, from ``recv_error`` and ``send_backproj``,
        in the same floating-point order.
        """
        beta = self._beta
        fused = self._step_lr is not None  # errors and backproject took the rest of the step
        if fused:
            for gr in self._deferred:
                gr.h_out.add_(gr.e_out, alpha=-x_lr)
            if self.send_error is not None:  # the boundary node, stepped as its replica downstream is
                blkN = self.blocks[-1]
                blkN.h_NBO[-1].add_(blkN.e_NBO[-1], alpha=-x_lr).add_(self.recv_backproj, alpha=-x_lr)
        else:
            if self.recv_backproj is not None:
                _scale(self.blocks[-1].v_NBO[-1], beta).add_(self.recv_backproj)
            for h, v, e in self._hidden:
                if self.mu != 0.0:  # else v is e already
                    v.add_(e)
                h.add_(v, alpha=-x_lr)
        if self.has_replica:
            blk0 = self.blocks[0]
            h, v, e = blk0.h_NBO[0], blk0.v_NBO[0], blk0.e_NBO[0]
            if fused:
                h.add_(e, alpha=-x_lr).add_(self.send_backproj, alpha=-x_lr)
            else:
                _scale(v, beta).add_(self.send_backproj)
                if self.mu != 0.0:
                    v.add_(e)
                h.add_(v, alpha=-x_lr)
        for gr in self.groups:
            if gr.g.first > 1:
                gr.cached = False
        self._step += 1
        self._step_lr, self._done, self._deferred = None, [], []

    def weight_grads(self, groups: list[_Group] | None = None, scale: float | None = None) -> None:
        """Write dF/dw and dF/db of the groups' layers (default all) into .grad.

        F is the batch mean of E (``scale`` -1/B); ``scale=-1`` gives batch sums instead.
        """
        scale = -1.0 / self.B if scale is None else scale
        for gr in self.groups if groups is None else groups:
            w, b = gr.g.weight, gr.g.bias
            if w.grad is None:
                w.grad = torch.empty_like(w)
            if b.grad is None:
                b.grad = torch.empty_like(b)
            w.grad.baddbmm_(gr.h_in.transpose(1, 2), gr.d, beta=0.0, alpha=scale)
            torch.sum(gr.d, dim=1, out=b.grad).mul_(scale)

    def weights_changed(self) -> None:
        """Mark every prediction (and transposed weight copy) stale after an optimizer step and
        at a new batch."""
        for gr in self.groups:
            gr.weights_changed()
        if self._y_minus_b is not None:
            torch.sub(self.output.h_out, self.output.b_K1O, out=self._y_minus_b)

    def layer_energies(self) -> Tensor:
        """Batch-mean energy of each owned layer [L_owned], from the last ``errors``."""
        parts = []
        for gr in self.groups:
            if gr is self.output:
                parts.append(output_energy(self.net.energy, gr.u[0], gr.h_out[0], gr.d[0]).reshape(1))
            else:
                parts.append(0.5 * torch.linalg.vector_norm(gr.e_out.flatten(1), dim=1).square())
        return torch.cat(parts) / self.B
