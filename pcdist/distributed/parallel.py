"""Where a rank sits in the (data, layer) mesh, and the collectives between ranks.

Rank r of the layer axis owns the contiguous layers [a_r, b_r) (balanced by each layer
kind's FLOPs) and trades boundary tensors with its two neighbours once per inference step
(pcdist/distributed/exchange.py). The data axis splits the batch; weight gradients are all-reduced
over it only, one bucket per fused group, overlapped with the next group's gradient GEMMs
(pcdist/distributed/buckets.py). Energies and metrics are reduced to one logging rank when logged. A
single process is the case with no neighbours and no data peers: every exchange is empty.

The PC maths lives in ``engine.Stage``; this module only places the rank and moves tensors.
"""

from __future__ import annotations

import os
import pickle
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .buckets import GradBuckets
from ..engine.capture import on_host
from ..engine.stage import Stage
from ..errors import ConfigError, PeerError
from .exchange import LayerExchange, diagnostic_store, first_line, stopped, store_gone, store_is_gone
from ..engine.layers import LayerKind
from .partition import check_layer_ranks, layer_costs, partition_layers
from .rendezvous import join_process_group, warn_if_restarts_unsafe

__all__ = ["ParallelDims", "Parallel", "PeerError", "collective", "init_distributed", "leave_process_group",
           "backend_for"]


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
        if num_layers is not None:
            check_layer_ranks(self.layer, num_layers)


def _check_slices_train(slices: list[tuple[int, int]], specs, P: int) -> None:
    """Each layer slice holds a parameter to train (a rank of parameter-free layers only, nn.Tanh() as a PC layer,
    would have an optimizer over nothing): ConfigError naming the slice."""
    for first, stop in slices:
        kinds = specs[first - 1:stop - 1]
        if all(isinstance(s, LayerKind) and getattr(s, "num_params", 1) == 0 for s in kinds):
            held = ", ".join(str(s) for s in kinds)
            raise ConfigError(f"parallel.layer={P}: a layer rank would hold layers {first}..{stop - 1} "
                              f"({held}), which have no parameters to train; use fewer layer ranks, or give those "
                              f"layers to a neighbour's module")


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo for everything else."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(device: torch.device | str | None = None, timeout_s: float = 300.0,
                     backend: str | None = None) -> torch.device:
    """Join the process group torchrun describes (env:// rendezvous); returns this rank's device.

    On GPUs every rank binds ``cuda:LOCAL_RANK`` and the NCCL group is created
    eagerly; on CPUs the backend is gloo. A peer that stops answering raises after
    ``timeout_s`` instead of hanging. Started without torchrun (no RANK and
    WORLD_SIZE in the environment), the process forms a group of one, so the same
    script also runs as ``python script.py``. ``backend``: "nccl" or "gloo" instead of the device's
    (gloo on GPUs: collectives only, for debugging; it cannot send GPU tensors between layer slices).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend or backend_for(device)
    kw = {"device_id": device} if device.type == "cuda" and backend == "nccl" else {}
    # NCCL's watchdog tears the process down when an op outlives the group's timeout: it must outlast the host's own
    # waits (timeout_s), which name the peer that stopped answering, and say why
    group = timedelta(seconds=2 * timeout_s + 60 if backend == "nccl" else timeout_s)
    if dist.is_initialized():
        warn_if_restarts_unsafe()
    elif "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:  # not launched by torchrun
        dist.init_process_group(backend, timeout=group, store=dist.HashStore(), rank=0, world_size=1, **kw)
    else:  # each torchrun attempt on its own keys of the store, so restarts work (pcdist/distributed/rendezvous.py)
        join_process_group(backend, timedelta(seconds=timeout_s), group, **kw)
    return device


def leave_process_group(failed: bool) -> None:
    """End this process's group: after a failure an NCCL group is aborted (its destroy would wait for the ops a
    lost peer never matches), otherwise destroyed."""
    if failed and dist.get_backend() == "nccl":
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - NCCL's watchdog may have aborted it already: the process ends anyway
            pass
    else:
        dist.destroy_process_group()


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
        raise PeerError(f"rank {me}: {what} over ranks {ranks} failed or timed out{_who_fell_behind(ranks)}: "
                        f"{first_line(e)}") from e


def barrier(what: str, group=None, device: torch.device | None = None) -> None:
    """Every rank of ``group`` (default: the world) arrives, within the host's own wait (the rendezvous store's
    timeout: ``parallel.timeout_s``). A stalled peer raises inside ``collective()``, naming the ranks, on NCCL as
    on gloo: a blocking NCCL barrier would wait for the watchdog's abort, in NCCL's words. ``device``: the CUDA
    device an NCCL barrier runs on."""
    kw = {"device_ids": [device.index or 0]} if device is not None and device.type == "cuda" else {}
    with collective(what, group):
        dist.barrier(group=group, async_op=True, **kw).wait(dist.distributed_c10d._get_default_store().timeout)


_STEPS_KEY = "pcdist/steps_begun/{}"


def _mark_progress(steps: int) -> None:
    """Record in the rendezvous store how many training steps this rank has begun (one small
    write per step) so that a failed collective can name the member that fell behind."""
    if store_is_gone():
        return
    try:
        dist.distributed_c10d._get_default_store().set(_STEPS_KEY.format(dist.get_rank()), str(steps))
    except Exception:  # diagnostics only: a dead store shows up in the next exchange anyway; its host (torchrun's
        store_gone()  # agent, killed) stays gone, so no more writes (each logged C++ frames on every step)


def _who_fell_behind(ranks: list[int]) -> str:
    """Which ranks of a failed collective stopped and why (``report_failure``), or else began fewer training steps
    than this one (from the store, read within 5 s; empty when the store is gone with the rank that hosted it)."""
    me = dist.get_rank()
    store = diagnostic_store()
    if store is None:
        return ""
    try:
        old = store.timeout
        store.set_timeout(timedelta(seconds=5))
        try:
            keys = {r: _STEPS_KEY.format(r) for r in ranks}
            begun = {r: int(store.get(k)) if store.check([k]) else 0 for r, k in keys.items()}
            failed = stopped(ranks, store)
        finally:
            store.set_timeout(old)
    except Exception:
        store_gone()
        return ""
    if failed:
        return f" ({failed})"
    behind = [r for r in ranks if begun[r] < begun[me]]
    if not behind:
        return (f" (every rank of the group had begun {begun[me]} training steps in this launch; "
                "one of them died or stopped answering in the last)")
    return (f" (rank {me} had begun {begun[me]} training steps in this launch, but "
            + ", ".join(f"rank {r} only {begun[r]}" for r in behind) + ": it died or stopped answering)")


class Parallel(LayerExchange):
    """This rank's layer slice, its neighbours on the layer axis (the point-to-point schedule of
    ``pcdist.distributed.exchange.LayerExchange``) and its data-axis group.

    ``Parallel.single(num_layers)`` is the single-process case (no peers at all);
    ``Parallel.from_mesh(dims, specs)`` builds the (data, layer) DeviceMesh of a
    torch.distributed job.
    """

    def __init__(self, layers: tuple[int, int], num_layers: int, prev: int | None = None, next: int | None = None,
                 data_group=None, data_size: int = 1, layer_rank: int = 0, layer_size: int = 1,
                 logging_rank: int | None = None, micro_batches: int = 1, data_rank: int = 0,
                 timeout_s: float = 300.0, prepost: bool = False):
        super().__init__(prev, next, micro_batches, timeout_s, prepost, num_layers)
        self.layers = layers
        self.data_group, self.data_size = data_group, data_size
        self.layer_rank, self.layer_size = layer_rank, layer_size
        self.data_rank = data_rank
        self.logging_rank = logging_rank  # global rank that gathers stats; None: no gathering needed
        self._grads = None  # data axis only
        if data_group is not None:
            self._grads = GradBuckets(data_group, lambda: collective("the data-axis gradient all-reduce", data_group))
        self.steps_begun = 0  # recorded in the store for error messages (``collective``)

    @classmethod
    def single(cls, num_layers: int) -> "Parallel":
        return cls((1, num_layers + 1), num_layers)

    @classmethod
    def from_mesh(cls, dims: ParallelDims, specs: Sequence[LayerKind] | Sequence[int],
                  device: torch.device | str = "cpu", micro_batches: int = 1, timeout_s: float = 300.0,
                  free_bottom: bool = False, learned_prior: bool = False) -> "Parallel":
        """Build the (data, layer) mesh over the initialised process group and place this rank.

        ``specs``: the network's layer kinds, or any per-layer costs (the partition balances
        their sums over the layer ranks; see ``pcdist.distributed.partition.layer_costs``, and ``free_bottom``
        there: an inferred h_0). ``learned_prior``: the first layer slice holds the learned mean of a free h_0's prior
        (a parameter to train, whatever its layers hold).
        """
        from torch.distributed.device_mesh import init_device_mesh

        dims.validate(dist.get_world_size(), len(specs))
        mesh = init_device_mesh(torch.device(device).type, (dims.data, dims.layer), mesh_dim_names=("data", "layer"))
        lr, P = mesh.get_local_rank("layer"), dims.layer
        layer_group = mesh.get_group("layer")
        # Every rank of the group joins one collective first: NCCL then has its
        # communicator before the first point-to-point batch.
        dev = torch.device(device)
        barrier("the layer group's first barrier (every rank starting)", layer_group, dev)
        peer = lambda r: dist.get_global_rank(layer_group, r)  # noqa: E731
        costs = layer_costs(specs, free_bottom) if all(isinstance(s, LayerKind) for s in specs) else \
            [int(c) for c in specs]
        slices = partition_layers(costs, P)
        _check_slices_train(slices[1:] if learned_prior else slices, specs, P)  # (every rank sees every slice: all
        # refuse alike, before any exchange; the first slice trains its learned prior's mean, whatever it holds)
        # Stats are gathered on the rank that sees the output energy: last layer slice, data rank 0.
        logging = int(mesh.mesh[0, P - 1])
        return cls(slices[lr], len(specs), prev=peer(lr - 1) if lr > 0 else None,
                   next=peer(lr + 1) if lr < P - 1 else None,
                   data_group=mesh.get_group("data") if dims.data > 1 else None, data_size=dims.data,
                   layer_rank=lr, layer_size=P, logging_rank=logging, micro_batches=micro_batches,
                   data_rank=mesh.get_local_rank("data"), timeout_s=timeout_s, prepost=dev.type != "cuda")

    @property
    def is_logging(self) -> bool:
        return self.logging_rank is None or dist.get_rank() == self.logging_rank

    def begin_step(self) -> None:
        """A training step begins (the trainer's host work, replayed step or not; not an inference, a validation
        chunk or a diagnosis, which ranks may run in other numbers): recorded in the store so that a failed
        collective can name who fell behind."""
        self.steps_begun += 1
        if self.data_group is not None or not self.alone:
            _mark_progress(self.steps_begun)

    # -- collectives ----------------------------------------------------------------
    def all_sum(self, t: Tensor, what: str = "the skipped-update all-reduce") -> Tensor:
        """``t`` summed over every rank, in place (one tiny all-reduce; none in one process); ``what``: the
        collective in words, for the line a lost peer gives."""
        if self.logging_rank is not None:
            on_host(lambda: self._sum(t, what))
        return t

    def _sum(self, t: Tensor, what: str) -> None:
        with collective(what):  # waited for within parallel.timeout_s, as every collective is (NCCL's too)
            self._timed(dist.all_reduce(t, async_op=True))

    def _timed(self, work) -> None:
        """Wait for a collective posted with async_op=True within ``parallel.timeout_s``, so that a stalled peer
        raises inside ``collective()`` (which names the ranks): NCCL's blocking calls return once queued, and a
        stall surfaced at the next host read, or as the watchdog's abort (gloo's raise either way)."""
        work.wait(self.timeout)

    def _gather_object(self, obj, what: str) -> list | None:
        """Every rank's ``obj`` on the logging rank, in rank order (None elsewhere): ``dist.gather_object`` with
        each wait within ``parallel.timeout_s`` (its sizes, then its bytes), so that a stalled peer is a PeerError
        naming ``what`` under NCCL too, whose blocking gather would wait for the watchdog."""
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
        with collective(what):
            self._timed(dist.all_gather(sizes, size, async_op=True))
            longest = int(torch.cat(sizes).max())
            padded = torch.zeros(longest, dtype=torch.uint8, device=device)
            padded[:data.numel()] = data
            parts = [torch.empty_like(padded) for _ in sizes] if self.is_logging else None
            self._timed(dist.gather(padded, parts, dst=self.logging_rank, async_op=True))
        if not self.is_logging:
            return None
        return [pickle.loads(p[:int(n.item())].cpu().numpy().tobytes()) for p, n in zip(parts, sizes)]

    def sum_to_logging(self, values: list[float], device: torch.device | str = "cpu") -> list[float] | None:
        """Sum per-rank values over the whole world onto the logging rank (None elsewhere)."""
        vec = torch.tensor(values, dtype=torch.float64, device=device)
        if self.logging_rank is None:
            return vec.tolist()
        with collective("the metrics reduce"):
            self._timed(dist.reduce(vec, dst=self.logging_rank, async_op=True))
        return vec.tolist() if self.is_logging else None

    # -- data axis ----------------------------------------------------------------
    def weight_grads(self, st: Stage) -> None:
        """dF/dtheta of every owned layer into .grad; with a data axis, also its all-reduce,
        one bucket per fused group, overlapped with the next groups' gradients (pcdist/distributed/buckets.py)."""
        if self._grads is None:
            st.weight_grads()
        else:
            self._grads.start(st)

    def reduce_grads(self) -> None:
        """Finish the data-axis gradient all-reduces: wait, then divide the sums by the global batch."""
        if self._grads is None:
            return
        on_host(self._wait_grads)
        self._grads.average()

    def _wait_grads(self) -> None:
        t0 = time.perf_counter()
        with collective("the data-axis gradient all-reduce", self.data_group):
            self._grads.wait(self.timeout)
        self.comm_seconds += time.perf_counter() - t0

    def sum_over_data(self, tensors: list[Tensor]) -> None:
        """Sum each tensor over the data axis, in place (nothing without a data axis)."""
        if self.data_group is None:
            return
        with collective("the data-axis sum", self.data_group):
            for work in [dist.all_reduce(t, group=self.data_group, async_op=True) for t in tensors]:
                self._timed(work)

    def gather_layer_energies(self, local: Tensor, local_batch: int, first_index: int | None = None) -> Tensor | None:
        """The whole network's batch-mean energies [..., L + 1] on the logging rank (None elsewhere): entry 0
        the prior of a free h_0 (0 when clamped), entry l layer l. ``local`` [..., n] holds this rank's
        entries from global index ``first_index`` on (default: its first layer)."""
        if self.logging_rank is None:
            return super().gather_layer_energies(local, local_batch, first_index)
        lo = self.layers[0] if first_index is None else first_index
        vec = torch.zeros(*local.shape[:-1], self.num_layers + 2, dtype=torch.float64, device=local.device)
        vec[..., lo : lo + local.shape[-1]] = local.to(torch.float64) * local_batch
        if self.layer_rank == 0:
            vec[..., -1] = local_batch
        with collective("the energy reduce"):
            self._timed(dist.reduce(vec, dst=self.logging_rank, async_op=True))
        return vec[..., :-1] / vec[..., -1:] if self.is_logging else None

    def gather_nodes(self, own: dict[int, Tensor], num_layers: int) -> list[Tensor] | None:
        """Value nodes h_0 .. h_L of the whole batch on the logging rank (None elsewhere), from every
        rank's own {node: [B_local, ...]} (data shards joined in data-rank order)."""
        if self.logging_rank is None:
            return [own[n] for n in range(num_layers + 1)]
        parts = self._gather_object(({n: t.cpu() for n, t in own.items()}, self.data_rank), "the value-node gather")
        if not self.is_logging:
            return None
        device = next(iter(own.values())).device
        out = []
        for n in range(num_layers + 1):
            shards = sorted((rank, nodes[n]) for nodes, rank in parts if n in nodes)
            out.append(torch.cat([t for _, t in shards]).to(device))
        return out

    def gather_batch(self, t: Tensor | None) -> Tensor | None:
        """Rows held by some ranks (``t``; None on the others) joined over the data axis in data-rank order,
        on the logging rank (None elsewhere): e.g. predictions the last layer slice of each data replica made."""
        if self.logging_rank is None:
            return t
        parts = self._gather_object(None if t is None else (self.data_rank, t.cpu()), "the batch gather")
        if not self.is_logging:
            return None
        shards = sorted((p for p in parts if p is not None), key=lambda p: p[0])
        return torch.cat([t for _, t in shards]).to(t.device if t is not None else "cpu") if shards else None
