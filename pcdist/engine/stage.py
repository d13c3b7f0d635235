"""Fused phases of predictive-coding inference for one contiguous slice of layers, any layer kind.

A ``Stage`` holds the value nodes of the layers [first, stop) of a PCNetwork for one
batch size (pcdist/engine/nodes.py: runs of equal-shape nodes in one tensor, so a group's inputs
and outputs are two shifted views) and runs the phases of the PC schedule over every
group of stacked equal layers, each group bound by its kind (pcdist.layers):

    feedforward    h_l <- u_l for the hidden nodes, layer by layer (a chain); a free h_0
                   starts at its prior's mean, a free h_L at u_L
    errors         e = pi (h - u) and each layer's error signal
    backproject    v_{l-1} <- beta * v_{l-1} - P_l,  P_l = -dE_l/dh_{l-1}
    update_values  v += e (unless v is e already);  h -= x_lr * v  (pcdist/engine/values.py)
    weight_grads   dF/dtheta of every layer into .grad

With momentum mu the value optimizer is v <- g + mu v, h <- h - x_lr v, reset every
batch (g_l = pi_l e_l - P_{l+1} is the per-sample gradient of the energy).

The end nodes are clamped or free per Stage (``free_bottom``, ``free_top``): a free h_0 is
updated like a hidden node, its own error the prior's e_0 = pi_0 (h_0 - m_0) (the prior is
bound as a "layer 0" group, pcdist/engine/layers/prior.py) and its back-projection layer 1's;
a free h_L follows its output energy's gradient pi_L dE_out/dh_L. Precisions pi_l are one
tensor per Stage (``precision``), read by every group's error pass, so a schedule may change
them between inference steps.

For pc without momentum the weights and predictions stay fixed until the value step, so
the step is fused into the phases: each group's error pass also takes h_out -= x_lr * e,
and the back-projection adds x_lr * P straight into h (for dense layers: the GEMM itself),
with no v at all (see ``Stage.errors``).

The stage never touches torch.distributed: a neighbour's boundary tensors are exchanged
through ``recv_input`` / ``send_node`` (feed-forward) and ``send_error`` / ``recv_error`` /
``send_backproj`` / ``recv_backproj`` (inference), which a layer-parallel driver
(pcdist/distributed/exchange.py) fills and reads between the phases. A single process owns every layer,
so it has no boundary at all.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .energies import OutputEnergy
from .layers import Binding, BoundGroup
from .layers.conv import channels_last_nodes
from .arguments import INITS, NEAR_EQUILIBRIUM, check
from .network import PCNetwork
from .nodes import ValueNodes
from .values import ValueOptimizer, ValueRule

__all__ = ["Stage", "INITS", "energy_dtype"]


class Stage:
    """Preallocated value nodes and the fused PC phases of a PCNetwork's layer slice.

    ``static_weights``: the weights stay fixed through a batch's inference (pc), so kinds may
    keep weight-derived copies per weight change (dense and residual layers: a row-major
    w^T for the back-projection GEMM, which reads it 20-30% faster than the transposed view).
    ``free_bottom`` / ``free_top``: h_0 / h_L are free (inferred) instead of clamped.
    ``dynamic_precision``: keep a precision per layer even when the network's are all 1 (a
    schedule will change them); otherwise only networks with precisions pay for them.
    """

    def __init__(self, net: PCNetwork, batch_size: int, x_momentum: float | ValueRule = 0.0, init: str = "ff",
                 static_weights: bool = False, free_bottom: bool = False, free_top: bool = False,
                 dynamic_precision: bool = False, dtype: torch.dtype | None = None):
        check("init", init)
        self.net, self.B, self.init = net, batch_size, init
        self.free_bottom, self.free_top = free_bottom, free_top
        p = next(net.parameters())
        dtype = dtype or p.dtype  # the nodes' (float32 under precision="bf16", whose products are bfloat16)
        L, first, stop = net.num_layers, net.first, net.stop
        rule = x_momentum if isinstance(x_momentum, ValueRule) else ValueRule("sgd", float(x_momentum))
        # v and e are one tensor unless heavy-ball momentum keeps v, or a kind's back-projection reads e.
        separate = rule.plain and rule.momentum != 0.0 or any(g.reads_errors for g in net.groups)
        lowp = next((q.dtype for q in net.parameters() if q.dtype in (torch.bfloat16, torch.float16)), None)
        self.nodes = ValueNodes(net.node_shapes, first, stop, batch_size, separate, free_bottom, free_top,
                                channels_last_nodes(net.specs, first, stop, dtype, p.device, lowp), dtype=dtype,
                                device=p.device)
        # pi_first .. pi_{stop-1}; None when all are 1 and no schedule changes them (no extra pass).
        pis = net.precision or (1.0,) * L
        self.precision = torch.tensor(pis[first - 1 : stop - 1], dtype=dtype, device=p.device) \
            if net.precision is not None or dynamic_precision else None
        groups = list(net.groups)
        if free_bottom and first == 1 and not (groups and groups[0].first == 0):
            groups.insert(0, net.prior_group(dtype))  # a fixed prior: a constant group of this Stage's own
        self.groups: list[BoundGroup] = []
        self.idle: dict[int, Tensor] = {}  # the parameters this stage does not train, by id: no gradient, no update
        for g in groups:
            if g.first == 0 and not free_bottom:  # a learned prior's group, idle while h_0 is clamped
                self.idle.update((id(q), q) for q in g.parameters())
                continue
            self.groups.append(self._bind(g, static_weights, free_top))
        self.output = self.groups[-1] if stop == L + 1 else None
        nd = self.nodes
        self.recv_input, self.send_node = nd.recv_input, nd.send_node
        self.has_replica, self.recv_error, self.send_backproj = nd.has_replica, nd.recv_error, nd.send_backproj
        self.send_error, self.recv_backproj = nd.send_error, nd.recv_backproj
        self.values = ValueOptimizer(nd, rule, not separate)
        self.energy_index = 0 if self.groups[0].first == 0 else first  # global index of layer_energies()[0]
        # What a step's core writes for the host to read at log points, and the precision schedule's rows.
        self.energy_log = torch.zeros(sum(g.K for g in self.groups), dtype=energy_dtype(dtype), device=p.device)
        self.precision_rows: dict[int, Tensor] = {}
        self.noise: dict = {}  # (tau, global batch, x_lr) -> its ValueNoise (pcdist/engine/values.py)
        self.noise_buffers: dict = {}  # global batch -> the buffer every ValueNoise of that batch draws into
        # The lowest layer whose weight gradient this step can be nonzero: pc from the feed-forward init (no noise,
        # the target clamped) moves the error one layer per evaluation, so below layer L - T x stages the exact
        # gradient is zero and the computed one round-off of recomputed predictions, which Adam would scale up
        # to full steps. Set by each relax (0: every layer learns); weight_grads zeroes the rows below it.
        self.front = 0

    def _bind(self, g, static_weights: bool, free_top: bool) -> BoundGroup:
        net, L = self.net, self.net.num_layers
        h_in, v_in, _ = self.nodes.views(g.first - 1, g.K) if g.first > 0 else (None, None, None)
        h_out, _, e_out = self.nodes.views(g.first, g.K)
        prec = None
        if self.precision is not None and g.first > 0:
            prec = self.precision[g.first - net.first : g.first - net.first + g.K]
        is_output = g.first + g.K - 1 == L
        energy = OutputEnergy(net.energy, prec) if is_output else None
        if is_output and free_top:
            energy.check_free_top()
        gr = g.bind(h_in, h_out, e_out, Binding(self.B, static_weights, self.init, g.first > 1 or self.free_bottom,
                                                energy, is_output and free_top, prec))
        gr.v_in = v_in  # where the group's back-projection accumulates (the value gradient)
        gr.params = list(g.parameters())
        return gr

    def drop_idle_grads(self) -> None:
        """No gradient on the parameters this stage does not train (``idle``), as the eager update leaves them."""
        for p in self.idle.values():
            p.grad = None

    def node(self, n: int) -> Tensor:
        """The value node h_n [B, *shape] (a view)."""
        return self.nodes.node(n)

    # -- phases -------------------------------------------------------------------
    def begin(self, x: Tensor | None, y: Tensor | None) -> None:
        """Start a batch: clamp the input (first slice) and the target (last slice), where clamped; its inference
        starts with ``restart``."""
        if x is not None and not (self.free_bottom and self.net.first == 1):
            self.recv_input.copy_(x)
        if y is not None and self.output is not None and not self.free_top:
            self.output.h_out[0].copy_(y)

    def restart(self) -> None:
        """Start the inference of the batch ``begin`` copied in: every prediction and weight-derived copy stale (or
        refreshed), the value step's count at 0. Each inference routine starts with it (a step's core, ``infer``'s,
        the energy trace, the diagnostics), so that a core run again eagerly after its capture failed starts afresh
        and each batch pays for it once."""
        self.weights_changed()
        self.values.reset()

    def feedforward(self, rows: slice | None = None) -> None:
        """h_l <- u_l for every hidden node of the slice, layer by layer (a chain).

        ``rows`` restricts the pass to a micro-batch (the pipelined init of a layer slice).
        With ``init="deeppcr"`` a group of K > 1 hidden layers is solved as one chain by
        Newton + parallel cyclic reduction (pcdist/engine/deeppcr.py) instead of K dependent steps.
        ``init="newton"``, ``"newton_cr"`` or ``"backward"`` then move the hidden nodes near the
        equilibrium of inference (pcdist/engine/equilibrium.py).
        """
        for gr in self.groups:
            gr.feedforward(rows, self.init)
        if rows is None and self.init in NEAR_EQUILIBRIUM:
            from .equilibrium import near_equilibrium
            near_equilibrium(self, self.init)

    def errors(self, groups: list[BoundGroup] | None = None, need_all_deltas: bool = False,
               step_lr: float | None = None) -> None:
        """Predictions (where stale), errors e and error signals of the groups (default all).

        Layer 1's signal under a clamped h_0 only feeds its weight gradient, so it is skipped
        unless ``need_all_deltas``. A free h_L's gradient goes into its value gradient.

        ``step_lr`` (pc without momentum: the weights and every prediction stay fixed
        until the value step) fuses the value step into this phase and the next: each
        group's pass also takes h_out -= step_lr * e, and ``backproject`` adds
        step_lr * P straight into h. A node is the input of the next group, so its
        step is taken here only once that group has read it (groups run last first);
        otherwise it waits for ``update_values``.
        """
        vo = self.values
        fused = vo.begin_step(step_lr)
        for gr in reversed(self.groups if groups is None else groups):
            if gr is self.output:
                gr.errors(True, None)
                if self.free_top:
                    gr.energy.value_grad(gr.u[0], gr.h_out[0], gr.d[0], gr.e_out[0])
                    if fused:
                        gr.h_out.add_(gr.e_out, alpha=-step_lr)
            else:
                i = self.groups.index(gr)
                last = i == len(self.groups) - 1
                now = fused and (last or self.groups[i + 1] in vo.done)
                # The node sent downstream steps in update_values, exactly as its replica there.
                gr.errors(need_all_deltas or gr.free_input, step_lr if now else None,
                          hold_last=last and self.send_error is not None)
                if fused and not now:
                    vo.deferred.append(gr)
            vo.done.append(gr)

    def backproject(self, groups: list[BoundGroup] | None = None) -> None:
        """v_in <- beta * v_in - P for the groups (default all) whose input node is free.

        The first group of a slice that starts past layer 1 writes ``send_backproj``
        instead: its input node is the upstream neighbour's (replicated here).
        """
        beta, step_lr = self.values.beta, self.values.step_lr
        for gr in self.groups if groups is None else groups:
            if not gr.free_input:
                continue
            if gr is self.groups[0] and self.has_replica:  # the slice's first layer is a group of its own
                gr.backproject(self.send_backproj.unsqueeze(0), beta=0.0, alpha=-1.0)
            elif step_lr is not None:  # fused value step: h += x_lr * P
                gr.backproject(gr.h_in, beta=1.0, alpha=step_lr)
            else:
                gr.backproject(gr.v_in, beta=beta, alpha=-1.0)

    def update_values(self, x_lr: float) -> None:
        """The value step on every free node this slice updates (``ValueOptimizer.update``); then
        every prediction that reads a moved node is stale."""
        self.values.update(x_lr, self.send_error is not None, self.free_top and self.output is not None)
        for gr in self.groups:
            if gr.free_input:
                gr.cached = False

    def weight_grads(self, groups: list[BoundGroup] | None = None, scale: float | None = None) -> None:
        """Write dF/dtheta of the groups' layers (default all) into .grad.

        F is the batch mean of E (``scale`` -1/B); ``scale=-1`` gives batch sums instead.
        """
        scale = -1.0 / self.B if scale is None else scale
        for gr in self.groups if groups is None else groups:
            for p in gr.params:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
            gr.weight_grads(scale)
            below = min(gr.K, self.front - gr.first)
            for p in gr.params if below > 0 else ():  # [K, ...] stacks: the rows of the layers below the front
                p.grad[:below].zero_()

    def weights_changed(self) -> None:
        """Mark every prediction (and weight-derived copy) stale after an optimizer step and at a new batch."""
        for gr in self.groups:
            gr.weights_changed()

    def layer_energies(self) -> Tensor:
        """Batch-mean energy of each owned group's layers, from the last ``errors``: the global layers
        ``energy_index`` .. stop - 1, where index 0 is the prior of a free h_0."""
        return torch.cat([gr.energies().to(self.energy_log.dtype) for gr in self.groups]) / self.B


def energy_dtype(dtype: torch.dtype) -> torch.dtype:
    """Energies are summed in float32 at least (a network built in bfloat16: float32 sums)."""
    return torch.promote_types(dtype, torch.float32)
