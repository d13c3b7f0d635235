"""Where a rank sits in the (data, layer) mesh, and its point-to-point boundary exchange.

Rank r of the layer axis owns the contiguous layers [a_r, b_r) (balanced by FLOPs)
and keeps a replica of its upstream neighbour's last node h_{a_r - 1}. Per inference
step it trades two tensors of shape [B, width] with each neighbour, in ONE exchange:

    downstream   send e_{b_r - 1} (the error of its last node) to r + 1
    upstream     send -W_{a_r}^T d_{a_r} (its first layer's back-projection) to r - 1

and receives their counterparts; both ranks then apply the same update to the shared
node. The exchange is posted once the boundary layers are computed, the interior
layers compute while the messages fly, and only the value update waits. On NCCL the
exchange is one ``batch_isend_irecv`` over the Stage's preallocated views; on gloo
the receives are posted a step ahead (see ``update_values``). The feed-forward init
is pipelined over micro-batches. The data axis splits the batch; weight gradients
are all-reduced over it only, one bucket per fused group, overlapped with the next
group's gradient GEMMs. A single process is the case with no neighbours and no data
peers: every exchange is empty.

The PC maths lives in ``engine.Stage``; this module only moves its boundary tensors.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .engine import Stage
from .errors import ConfigError
from .network import LayerSpec
from .partition import layer_flops, partition_layers
from .rendezvous import join_process_group, warn_if_restarts_unsafe

__all__ = ["ParallelDims", "Parallel", "PeerError", "collective", "init_distributed", "backend_for"]


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh axes: ``data`` x ``layer`` must equal the world size."""

    data: int = 1
    layer: int = 1

    def validate(self, world_size: int, num_layers: int | None = None) -> None:
        """Raise ConfigError (a ValueError) naming every factor if the mesh cannot be built."""
        for name, v in (("parallel.data", self.data), ("parallel.layer", self.layer)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if self.data * self.layer != world_size:
            raise ConfigError(
                f"mesh parallel.data={self.data} x parallel.layer={self.layer} = {self.data * self.layer} ranks, "
                f"but the world size is {world_size}; choose factors whose product is {world_size}"
            )
        if num_layers is not None and self.layer > num_layers:
            raise ConfigError(
                f"parallel.layer={self.layer} ranks but the model has only {num_layers} layers; "
                f"use parallel.layer <= {num_layers}"
            )


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo for everything else."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(device: torch.device | str | None = None, timeout_s: float = 300.0) -> torch.device:
    """Join the process group torchrun describes (env:// rendezvous); returns this rank's device.

    On GPUs every rank binds ``cuda:LOCAL_RANK`` and the NCCL group is created
    eagerly; on CPUs the backend is gloo. A peer that stops answering raises after
    ``timeout_s`` instead of hanging. Started without torchrun (no RANK and
    WORLD_SIZE in the environment), the process forms a group of one, so the same
    script also runs as ``python script.py``.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kw = {"device_id": device} if device.type == "cuda" else {}
    if dist.is_initialized():
        warn_if_restarts_unsafe()
    elif "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:  # not launched by torchrun
        dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s), store=dist.HashStore(),
                                rank=0, world_size=1, **kw)
    else:  # each torchrun attempt on its own keys of the store, so restarts work (pcdist/rendezvous.py)
        join_process_group(backend_for(device), timedelta(seconds=timeout_s), **kw)
    return device


class PeerError(RuntimeError):
    """A point-to-point exchange or a collective with other ranks failed or timed out."""


@contextmanager
def collective(what: str, group=None):
    """Run a collective; a failure (a peer died or stopped answering within the process-group
    timeout) becomes a PeerError naming this rank, the ranks of the group and, from the
    progress each rank records in the rendezvous store, the members that fell behind."""
    try:
        yield
    except PeerError:
        raise
    except Exception as e:  # gloo/NCCL raise RuntimeError or DistBackendError
        me = dist.get_rank()
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        raise PeerError(f"rank {me}: {what} over ranks {ranks} failed or timed out{_who_fell_behind(ranks)}: {e}") from e


_STEPS_KEY = "pcdist/steps_begun/{}"


def _mark_progress(steps: int) -> None:
    """Record in the rendezvous store how many training steps this rank has begun (one small
    write per step) so that a failed collective can name the member that fell behind."""
    try:
        dist.distributed_c10d._get_default_store().set(_STEPS_KEY.format(dist.get_rank()), str(steps))
    except Exception:  # diagnostics only: a dead store shows up in the next exchange anyway
        pass


def _who_fell_behind(ranks: list[int]) -> str:
    """Which ranks of a failed collective began fewer training steps than this one (from the
    store, read within 5 s; empty when the store is gone with the rank that hosted it)."""
    me = dist.get_rank()
    try:
        store = dist.distributed_c10d._get_default_store()
        old = store.timeout
        store.set_timeout(timedelta(seconds=5))
        try:
            keys = {r: _STEPS_KEY.format(r) for r in ranks}
            begun = {r: int(store.get(k)) if store.check([k]) else 0 for r, k in keys.items()}
        finally:
            store.set_timeout(old)
    except Exception:
        return ""
    behind = [r for r in ranks if begun[r] < begun[me]]
    if not behind:
        return f" (every rank of the group began training step {begun[me]}; one of them died or stopped answering in it)"
    return (f" (rank {me} began training step {begun[me]}, but "
            + ", ".join(f"rank {r} only step {begun[r]}" for r in behind) + ": it died or stopped answering)")


def _wait(reqs) -> float:
    """Wait for (work, peer, what, timeout) tuples; returns the seconds spent blocked.

    A failure names both ranks.
    """
    t0 = time.perf_counter()
    for work, peer, what, timeout in reqs:
        try:
            work.wait(timeout)
        except Exception as e:  # gloo/NCCL raise RuntimeError or DistBackendError
            me = dist.get_rank()
            raise PeerError(
                f"rank {me}: {what} with rank {peer} failed or timed out after {timeout.total_seconds():g}s "
                f"(is rank {peer} alive?): {e}"
            ) from e
    return time.perf_counter() - t0


class Parallel:
    """This rank's layer slice, its neighbours on the layer axis and its data-axis group.

    ``Parallel.single(num_layers)`` is the single-process case (no peers at all);
    ``Parallel.from_mesh(dims, specs)`` builds the (data, layer) DeviceMesh of a
    torch.distributed job.
    """

    def __init__(self, layers: tuple[int, int], num_layers: int, prev: int | None = None, next: int | None = None,
                 data_group=None, data_size: int = 1, layer_rank: int = 0, layer_size: int = 1,
                 logging_rank: int | None = None, micro_batches: int = 1, data_rank: int = 0,
                 timeout_s: float = 300.0, prepost: bool = False):
        self.layers, self.num_layers = layers, num_layers
        self.prev, self.next = prev, next
        self.data_group, self.data_size = data_group, data_size
        self.layer_rank, self.layer_size = layer_rank, layer_size
        self.data_rank = data_rank
        self.timeout = timedelta(seconds=timeout_s)
        self.logging_rank = logging_rank  # global rank that gathers stats; None: no gathering needed
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"parallel.micro_batches must be an integer >= 1, got {micro_batches!r}")
        self.micro_batches = micro_batches
        self._buckets: list[Tensor] = []  # per-group gradient buckets (data axis only)
        self._bucket_key = None
        self._reducing: list = []  # their all-reduces in flight
        self._pending: list = []  # the boundary exchange in flight (posted by errors)
        # gloo only: the next step's receives, posted as soon as this step's are consumed.
        self.prepost = prepost
        self._recvs: list = []
        self.comm_seconds = 0.0  # time blocked on boundary messages (benchmarks read it)
        self.steps_begun = 0  # recorded in the store for error messages (``collective``)

    @classmethod
    def single(cls, num_layers: int) -> "Parallel":
        return cls((1, num_layers + 1), num_layers)

    @classmethod
    def from_mesh(cls, dims: ParallelDims, specs: Sequence[LayerSpec], device: torch.device | str = "cpu",
                  micro_batches: int = 1, timeout_s: float = 300.0) -> "Parallel":
        """Build the (data, layer) mesh over the initialised process group and place this rank."""
        from torch.distributed.device_mesh import init_device_mesh

        dims.validate(dist.get_world_size(), len(specs))
        mesh = init_device_mesh(torch.device(device).type, (dims.data, dims.layer), mesh_dim_names=("data", "layer"))
        lr, P = mesh.get_local_rank("layer"), dims.layer
        layer_group = mesh.get_group("layer")
        # Every rank of the group joins one collective first: NCCL then has its
        # communicator before the first point-to-point batch.
        dev = torch.device(device)
        dist.barrier(group=layer_group, **({"device_ids": [dev.index or 0]} if dev.type == "cuda" else {}))
        peer = lambda r: dist.get_global_rank(layer_group, r)  # noqa: E731
        slices = partition_layers([layer_flops(s, l) for l, s in enumerate(specs, start=1)], P)
        # Stats are gathered on the rank that sees the output energy: last layer slice, data rank 0.
        logging = int(mesh.mesh[0, P - 1])
        return cls(slices[lr], len(specs), prev=peer(lr - 1) if lr > 0 else None,
                   next=peer(lr + 1) if lr < P - 1 else None,
                   data_group=mesh.get_group("data") if dims.data > 1 else None, data_size=dims.data,
                   layer_rank=lr, layer_size=P, logging_rank=logging, micro_batches=micro_batches,
                   data_rank=mesh.get_local_rank("data"), timeout_s=timeout_s, prepost=dev.type != "cuda")

    @property
    def is_first(self) -> bool:
        return self.prev is None

    @property
    def is_last(self) -> bool:
        return self.next is None

    @property
    def is_logging(self) -> bool:
        return self.logging_rank is None or dist.get_rank() == self.logging_rank

    # -- point to point -----------------------------------------------------------
    def _p2p(self, send: Tensor | None, to: int | None, recv: Tensor | None, frm: int | None, what: str,
             *more) -> list:
        """Post one batch of isend/irecv; returns (work, peer, what, timeout) for ``_wait``.

        ``more`` repeats (send, to, recv, frm) for further peers in the same batch.
        """
        ops, peers = [], []
        quads = [(send, to, recv, frm), *(more[i : i + 4] for i in range(0, len(more), 4))]
        for send, to, recv, frm in quads:
            if to is not None:
                ops.append(dist.P2POp(dist.isend, send, to))
                peers.append((to, f"{what} send"))
            if frm is not None:
                ops.append(dist.P2POp(dist.irecv, recv, frm))
                peers.append((frm, f"{what} receive"))
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        return [(w, peer, desc, self.timeout) for w, (peer, desc) in zip(works, peers)]

    def feedforward(self, st: Stage) -> None:
        """The feed-forward init, pipelined over micro-batches across the layer slices."""
        self.steps_begun += 1
        if self.data_group is not None or self.prev is not None or self.next is not None:
            _mark_progress(self.steps_begun)
        if self.prev is None and self.next is None:
            st.feedforward()
            return
        M = min(self.micro_batches, st.B)
        bounds = [st.B * m // M for m in range(M + 1)]
        sends = []
        for lo, hi in zip(bounds, bounds[1:]):
            rows = slice(lo, hi)
            self.comm_seconds += _wait(self._p2p(None, None, st.recv_input[rows], self.prev, "feed-forward"))
            st.feedforward(rows)
            if self.next is not None:
                sends += self._p2p(st.send_node[rows], self.next, None, None, "feed-forward")
        self.comm_seconds += _wait(sends)

    def errors(self, st: Stage, need_all_deltas: bool = False, exchange: bool = True,
               step_lr: float | None = None) -> None:
        """Errors of every group, and the step's one boundary exchange posted as early as possible.

        The boundary quantities come first: the first layer's error and back-projection
        (for the upstream neighbour) and the last node's error (for the downstream one).
        Then one batch_isend_irecv sends both and receives their counterparts, and the
        interior groups compute while the messages fly; ``update_values`` waits for them.
        Every input of this phase is local (the upstream node is replicated), so nothing
        here waits. ``exchange=False`` (an evaluation after the last update) sends nothing.
        ``step_lr``: fuse the value step into the passes (see ``Stage.errors``).
        """
        if not exchange or (self.prev is None and self.next is None):
            st.errors(None, need_all_deltas, step_lr)
            return
        first, last = st.groups[0], st.groups[-1]
        st.errors([first], need_all_deltas, step_lr)
        if self.prev is not None:
            st.backproject([first])
        if last is not first:
            st.errors([last], need_all_deltas, step_lr)
        if self._recvs:  # the receives were posted at the end of the last step
            self._pending = self._recvs + self._p2p(st.send_error, self.next, None, None, "boundary exchange",
                                                    st.send_backproj, self.prev, None, None)
            self._recvs = []
        else:
            self._pending = self._p2p(st.send_error, self.next, st.recv_backproj, self.next, "boundary exchange",
                                      st.send_backproj, self.prev, st.recv_error, self.prev)
        st.errors(st.groups[1:-1], need_all_deltas, step_lr)

    def backproject(self, st: Stage) -> None:
        """Back-projections of the groups ``errors`` has not done (all but a replica-fed first layer)."""
        st.backproject(st.groups[1:] if self.prev is not None else None)

    def update_values(self, st: Stage, x_lr: float, more: bool = False) -> None:
        """Wait for the boundary messages, then the value step (owned nodes and the replica).

        ``more``: another exchange follows in this batch. On gloo its receives are then
        posted right away: gloo sends only once the receiver has posted (a rendezvous
        run by its transport threads), so a receive posted a step ahead lets the peer's
        send go out inline when it is posted, instead of waiting for both transport
        threads to get a core that the compute threads hold. NCCL matches sends and
        receives by order within one batch and keeps the single batch_isend_irecv.
        """
        if self._pending:
            self.comm_seconds += _wait(self._pending)
        self._pending = []
        st.update_values(x_lr)
        if more and self.prepost and (self.prev is not None or self.next is not None):
            self._recvs = self._p2p(None, None, st.recv_backproj, self.next, "boundary exchange",
                                    None, None, st.recv_error, self.prev)

    def predict(self, net, x: Tensor) -> Tensor | None:
        """Feed-forward prediction through every slice; the logits on the last slice, None elsewhere."""
        if self.prev is None and self.next is None:
            return net(x)
        h = x
        if self.prev is not None:
            h = torch.empty(x.shape[0], net.dims[net.first - 1], dtype=x.dtype, device=x.device)
            self.comm_seconds += _wait(self._p2p(None, None, h, self.prev, "prediction"))
        out = net(h).contiguous()
        if self.next is not None:
            self.comm_seconds += _wait(self._p2p(out, self.next, None, None, "prediction"))
            return None
        return out

    def any_rank(self, flag: bool, device: torch.device | str = "cpu") -> bool:
        """True on every rank if ``flag`` is true on any rank (one tiny all-reduce; none in one process)."""
        if self.logging_rank is None:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        with collective("the stop-signal all-reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def sum_to_logging(self, values: list[float], device: torch.device | str = "cpu") -> list[float] | None:
        """Sum per-rank values over the whole world onto the logging rank (None elsewhere)."""
        vec = torch.tensor(values, dtype=torch.float64, device=device)
        if self.logging_rank is None:
            return vec.tolist()
        with collective("the metrics reduce"):
            dist.reduce(vec, dst=self.logging_rank)
        return vec.tolist() if self.is_logging else None

    # -- data axis ----------------------------------------------------------------
    def weight_grads(self, st: Stage) -> None:
        """dF/dw of every owned layer into .grad; with a data axis, also its all-reduce, overlapped.

        Each fused group's gradients form one bucket. The group's batch-sum gradients
        are written straight into its bucket, whose all-reduce over the data axis then
        starts while the next group's gradient GEMMs run; ``reduce_grads`` waits and
        divides by the global batch (so unequal local batches weigh in by their size).
        The last group's bucket carries the local batch size.
        """
        if self.data_group is None:
            st.weight_grads()
            return
        buckets = self._grad_buckets(st)
        # Largest bucket first: its all-reduce is the longest and gets the most overlap.
        for i in sorted(range(len(buckets)), key=lambda i: -buckets[i].numel()):
            st.weight_grads([st.groups[i]], scale=-1.0)
            if i == len(buckets) - 1:
                buckets[i][-1] = st.B
            self._reducing.append(dist.all_reduce(buckets[i], group=self.data_group, async_op=True))

    def _grad_buckets(self, st: Stage) -> list[Tensor]:
        """One flat gradient buffer per group (plus a batch-count slot in the last); the
        parameters' .grad become views into them, so nothing is copied in or out."""
        # Rebuilt when a parameter or its .grad was replaced (e.g. by optimizer.zero_grad()).
        def key():
            return tuple(t.data_ptr() if t is not None else 0
                         for gr in st.groups for t in (gr.g.weight, gr.g.bias, gr.g.weight.grad, gr.g.bias.grad))

        if self._bucket_key != key():
            self._buckets = []
            for i, gr in enumerate(st.groups):
                w, b = gr.g.weight, gr.g.bias
                flat = torch.zeros(w.numel() + b.numel() + (i == len(st.groups) - 1), dtype=w.dtype, device=w.device)
                w.grad = flat[: w.numel()].view_as(w)
                b.grad = flat[w.numel() : w.numel() + b.numel()].view_as(b)
                self._buckets.append(flat)
            self._bucket_key = key()
        return self._buckets

    def reduce_grads(self) -> None:
        """Finish the data-axis gradient all-reduces: wait, then divide the sums by the global batch."""
        if not self._reducing:
            return
        t0 = time.perf_counter()
        with collective("the data-axis gradient all-reduce", self.data_group):
            for work in self._reducing:
                work.wait(self.timeout)
        self._reducing = []
        self.comm_seconds += time.perf_counter() - t0
        count = self._buckets[-1][-1].clone()
        for flat in self._buckets:
            flat.div_(count)

    def gather_layer_energies(self, local: Tensor, local_batch: int) -> Tensor | None:
        """Per-layer batch-mean energies of the whole network on the logging rank (None elsewhere)."""
        if self.logging_rank is None:
            return local
        vec = torch.zeros(self.num_layers + 1, dtype=torch.float64, device=local.device)
        a, b = self.layers
        vec[a - 1 : b - 1] = local.to(torch.float64) * local_batch
        if self.layer_rank == 0:
            vec[-1] = local_batch
        with collective("the energy reduce"):
            dist.reduce(vec, dst=self.logging_rank)
        return vec[:-1] / vec[-1] if self.is_logging else None
