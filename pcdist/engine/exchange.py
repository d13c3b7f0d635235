"""The exchange the engine needs between its phases, and its single-process default.

A Stage (pcdist/engine/stage.py) holds one layer slice's value nodes and computes its phases; it
never talks to another process. The trainer drives the phases through an *exchange*: the object
that knows where this slice sits among its peers and moves the boundary tensors between them.
``Local`` is the exchange of one process owning every layer: no boundary, no peers, every
gather is the local value. The layer-parallel exchange (``pcdist.distributed.Parallel``)
implements the same methods with point-to-point sends and collectives; the engine never
imports it, so the PC maths stays plain and parallelism is applied from outside.

What an exchange provides (attributes and methods the engine reads):

    layers, num_layers           this slice [first, stop) and the network's L
    is_first, is_last            whether the slice holds h_0 / h_L
    is_logging, logging_rank     the rank that gets gathered results (None: no gathering)
    data_size, data_rank         the data axis
    comm_seconds                 seconds blocked on messages (benchmarks read it)
    begin_step()                 a training step begins (host work, before its core: counted for error lines)
    feedforward(st)              the init (pipelined over slices)
    errors(st, ...), backproject(st), update_values(st, x_lr, more)   one inference step's phases
    weight_grads(st), reduce_grads()                                   gradients (+ data-axis reduce)
    all_sum(t)                   a device tensor summed over every rank (a skipped update's vote)
    gather_layer_energies(...), gather_nodes(...), gather_batch(t), predict(net, x),
    sum_to_logging(values), sum_over_data(tensors), recv_from_next(buf), send_to_prev(t)

Every host call an exchange makes inside a step's core (a send, a wait, a collective) goes through
``pcdist.engine.capture.on_host``, so a step captured as CUDA graphs replays it between segments.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Local"]


class Local:
    """The exchange of a single process that owns all ``num_layers`` layers."""

    prev = next = None
    logging_rank = None
    data_size, data_rank, layer_rank, layer_size = 1, 0, 0, 1

    def __init__(self, num_layers: int):
        self.layers, self.num_layers = (1, num_layers + 1), num_layers
        self.comm_seconds = 0.0

    @property
    def is_first(self) -> bool:
        return self.prev is None

    @property
    def is_last(self) -> bool:
        return self.next is None

    @property
    def is_logging(self) -> bool:
        return True

    # -- the phases -------------------------------------------------------------------
    def begin_step(self) -> None:
        """A training step begins (nothing to record in one process)."""

    def feedforward(self, st) -> None:
        st.feedforward()

    def errors(self, st, need_all_deltas: bool = False, exchange: bool = True, step_lr: float | None = None) -> None:
        st.errors(None, need_all_deltas, step_lr)

    def backproject(self, st) -> None:
        st.backproject()

    def update_values(self, st, x_lr: float, more: bool = False) -> None:
        st.update_values(x_lr)

    def weight_grads(self, st) -> None:
        st.weight_grads()

    def reduce_grads(self) -> None:
        pass

    def all_sum(self, t: Tensor, what: str = "the skipped-update all-reduce") -> Tensor:
        """``t`` summed over every rank, in place, on the device (a skipped update's vote, the adaptive solver's
        error norm); ``what``: the collective in words."""
        return t

    # -- results ------------------------------------------------------------------------
    def gather_layer_energies(self, local: Tensor, local_batch: int, first_index: int | None = None) -> Tensor | None:
        """The network's batch-mean energies [..., L + 1] from this slice's [..., n] (entry 0: the prior of a free
        h_0, 0 when clamped; entry l: layer l); ``local`` holds global entries from ``first_index`` on."""
        lo = self.layers[0] if first_index is None else first_index
        full = local.new_zeros(*local.shape[:-1], self.num_layers + 1)
        full[..., lo : lo + local.shape[-1]] = local
        return full

    def gather_nodes(self, own: dict[int, Tensor], num_layers: int) -> list[Tensor] | None:
        return [own[n] for n in range(num_layers + 1)]

    def gather_batch(self, t: Tensor | None) -> Tensor | None:
        return t

    def predict(self, net, x: Tensor) -> Tensor | None:
        return net(x)

    def sum_to_logging(self, values: list[float], device=None) -> list[float] | None:
        return torch.tensor(values, dtype=torch.float64).tolist()

    def sum_over_data(self, tensors: list[Tensor]) -> None:
        pass

    def recv_from_next(self, buf: Tensor) -> Tensor:
        return buf

    def send_to_prev(self, t: Tensor) -> None:
        pass
