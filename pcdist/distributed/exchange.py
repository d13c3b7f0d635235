"""The layer axis's point-to-point traffic: the pipelined feed-forward init and the one boundary
exchange per inference step.

Rank r of the layer axis owns the contiguous layers [a_r, b_r) and keeps a replica of its
upstream neighbour's last node h_{a_r - 1}. Per inference step it trades two tensors of the
boundary node's shape with each neighbour, in ONE exchange:

    downstream   send e_{b_r - 1} (the error of its last node) to r + 1
    upstream     send -P_{a_r} (its first layer's back-projection) to r - 1

and receives their counterparts; both ranks then apply the same update to the shared node.
The exchange is posted once the boundary layers are computed, the interior layers compute
while the messages fly, and only the value update waits. On NCCL the exchange is one
``batch_isend_irecv`` over the Stage's preallocated views; on gloo the receives are posted
a step ahead (see ``update_values``). A rank with no neighbours exchanges nothing.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from ..engine.capture import on_host
from ..engine.exchange import Local
from ..engine.stage import Stage
from ..errors import PeerError

__all__ = ["LayerExchange", "first_line"]


def first_line(e: BaseException) -> str:
    """The backend's error without the C++ frames that gloo and NCCL append (kept in ``__cause__``)."""
    return str(e).strip().split("\n")[0]


_FAILED_KEY = "pcdist/failed/{}"
_store_gone = _store_asked = False


def diagnostic_store():
    """The rendezvous store, for what a failure's line says; None once it is gone. A call to a store whose host died
    logs the backend's C++ frames (dozens of lines on every survivor) before it raises: its host is first asked with
    a plain connection, and a store that failed once (``store_gone``) is not asked again."""
    if _store_gone:
        return None
    try:
        store = inner = dist.distributed_c10d._get_default_store()
    except Exception:  # no process group (any more)
        return None
    while hasattr(inner, "underlying_store"):  # (pcdist's prefix per restart, torch's own)
        inner = inner.underlying_store
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    if host and port:
        global _store_asked
        if not _store_asked:  # the first time, after a failure: a host killed as the failure came may still be
            _store_asked = True  # closing its sockets (its listening one accepts, then the store's reply is a reset)
            time.sleep(0.5)
        try:
            socket.create_connection((host, port), timeout=1).close()
        except OSError:
            store_gone()
            return None
    return store


def store_gone() -> None:
    """A call to the store failed: its host is gone, and with it the store (torchrun's agent, or rank 0); it is not
    asked again (``diagnostic_store``, ``store_is_gone``)."""
    global _store_gone
    _store_gone = True


def store_is_gone() -> bool:
    return _store_gone


def report_failure(message: str) -> None:
    """Leave in the rendezvous store why this rank stops (a file missing on its side, a diverged energy), so that a
    peer whose exchange or collective fails for it names the rank and the cause in its own one line."""
    store = diagnostic_store()
    try:
        if store is not None:
            store.set(_FAILED_KEY.format(dist.get_rank()), message.split("\n")[0])
    except Exception:  # diagnostics only
        store_gone()


def failures(ranks, store=None) -> dict[int, str]:
    """{rank: why it stopped} of the ``ranks`` that left a reason (``report_failure``); {} where none did or the store
    is gone."""
    store = store or diagnostic_store()
    if store is None:
        return {}
    try:
        keys = {r: _FAILED_KEY.format(r) for r in ranks}
        return {r: store.get(k).decode(errors="replace") for r, k in keys.items() if store.check([k])}
    except Exception:  # diagnostics only
        store_gone()
        return {}


def stopped(peers, store=None) -> str:
    """Why ``peers`` stopped, as one clause ("rank 1 stopped: ..."), from what they left (``report_failure``); where
    none of them left a reason but another rank did (the diverged slice whose layer neighbour's loss ended this
    rank's data peer), that rank's, said as the cause; "" where no rank left one."""
    said, how = failures(peers, store), "stopped"
    if not said:
        try:
            said, how = failures([r for r in range(dist.get_world_size()) if r not in peers], store), \
                "stopped, and the peers here with it"
        except Exception:  # diagnostics only
            return ""
    return "; ".join(f"rank {r} {how}: {why}" for r, why in said.items())


def _names(peers: tuple[int, ...]) -> str:
    return " and ".join(f"rank {r}" for r in peers)


def _why(peers: tuple[int, ...]) -> str:
    said = stopped(list(peers))
    if said:
        return said
    return f"{'is' if len(peers) == 1 else 'are'} {_names(peers)} alive?"


def _wait(reqs) -> float:
    """Wait for (work, peers, what, timeout) tuples (``peers``: the ranks the work exchanges with); returns the
    seconds spent blocked.

    A failure names this rank and its peers, and why a peer stopped where it left word (``report_failure``).
    """
    t0 = time.perf_counter()
    for work, peers, what, timeout in reqs:
        try:
            work.wait(timeout)
        except Exception as e:  # gloo/NCCL raise RuntimeError or DistBackendError
            me = dist.get_rank()
            raise PeerError(
                f"rank {me}: {what} with {_names(peers)} failed or timed out after {timeout.total_seconds():g}s "
                f"({_why(peers)}): {first_line(e)}"
            ) from e
    return time.perf_counter() - t0


def works_of_batch(works: list, peers: list[tuple[int, str]], what: str, timeout) -> list:
    """``_wait``'s (work, peers, what, timeout) for the works of one ``batch_isend_irecv`` of the ops ``peers``
    describes ((rank, what) each): one work per op (gloo), or one for the whole batch (NCCL coalesces it: then
    the batch's every peer is named)."""
    if len(works) == len(peers):
        return [(w, (peer,), desc, timeout) for w, (peer, desc) in zip(works, peers)]
    ranks = tuple(dict.fromkeys(r for r, _ in peers))
    return [(w, ranks, what, timeout) for w in works]



class LayerExchange(Local):
    """The point-to-point schedule of one rank of the layer axis (``prev`` / ``next``: the global
    ranks of its neighbours, None at the ends).

    Every send, receive and wait runs through ``on_host``: a step captured as CUDA graphs replays
    them between its segments (pcdist/engine/capture.py). The state they share (``_pending``,
    ``_recvs``, ``_sends``) is read and written only inside those host calls."""

    def __init__(self, prev: int | None = None, next: int | None = None, micro_batches: int = 1,
                 timeout_s: float = 300.0, prepost: bool = False, num_layers: int = 1):
        super().__init__(num_layers)
        self.prev, self.next = prev, next
        self.timeout = timedelta(seconds=timeout_s)
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"parallel.micro_batches must be an integer >= 1, got {micro_batches!r}")
        self.micro_batches = micro_batches
        self._pending: list = []  # the boundary exchange in flight (posted by errors)
        self._sends: list = []  # the feed-forward's sends in flight
        # gloo only: the next step's receives, posted as soon as this step's are consumed.
        self.prepost = prepost
        self._recvs: list = []

    @property
    def alone(self) -> bool:
        """No neighbour on the layer axis: every exchange is empty."""
        return self.prev is None and self.next is None

    def _p2p(self, send: Tensor | None, to: int | None, recv: Tensor | None, frm: int | None, what: str,
             *more) -> list:
        """Post one batch of isend/irecv; returns (work, peers, what, timeout) for ``_wait`` (``works_of_batch``).

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
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as e:  # gloo refuses to post to a peer whose connection it already saw close
            ranks = _names(tuple(dict.fromkeys(r for r, _ in peers)))
            raise PeerError(f"rank {dist.get_rank()}: posting the {what} with {ranks} failed (is {ranks} alive?): "
                            f"{first_line(e)}") from e
        return works_of_batch(works, peers, what, self.timeout)

    def _wait(self, reqs) -> None:
        self.comm_seconds += _wait(reqs)

    def feedforward(self, st: Stage) -> None:
        """The feed-forward init, pipelined over micro-batches across the layer slices."""
        if self.alone:
            st.feedforward()
            return
        M = min(self.micro_batches, st.B)
        bounds = [st.B * m // M for m in range(M + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            rows = slice(lo, hi)
            if self.prev is not None:
                on_host(lambda rows=rows: self._wait(self._p2p(None, None, st.recv_input[rows], self.prev,
                                                               "feed-forward")))
            st.feedforward(rows)
            if self.next is not None:
                on_host(lambda rows=rows: self._sends.extend(self._p2p(st.send_node[rows], self.next, None, None,
                                                                       "feed-forward")))
        on_host(self._finish_sends)

    def _finish_sends(self) -> None:
        sends, self._sends = self._sends, []
        self._wait(sends)

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
        if not exchange or self.alone:
            st.errors(None, need_all_deltas, step_lr)
            return
        first, last = st.groups[0], st.groups[-1]
        st.errors([first], need_all_deltas, step_lr)
        if self.prev is not None:
            st.backproject([first])
        if last is not first:
            st.errors([last], need_all_deltas, step_lr)
        on_host(lambda: self._post(st))
        st.errors(st.groups[1:-1], need_all_deltas, step_lr)

    def _post(self, st: Stage) -> None:
        """Post the boundary exchange (its receives too, unless posted a step ahead)."""
        if self._recvs:  # the receives were posted at the end of the last step
            self._pending = self._recvs + self._p2p(st.send_error, self.next, None, None, "boundary exchange",
                                                    st.send_backproj, self.prev, None, None)
            self._recvs = []
        else:
            self._pending = self._p2p(st.send_error, self.next, st.recv_backproj, self.next, "boundary exchange",
                                      st.send_backproj, self.prev, st.recv_error, self.prev)

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
        if not self.alone:
            on_host(self._finish_exchange)
        st.update_values(x_lr)
        if more and self.prepost and not self.alone:
            on_host(lambda: self._prepost(st))

    def _finish_exchange(self) -> None:
        pending, self._pending = self._pending, []
        self._wait(pending)

    def _prepost(self, st: Stage) -> None:
        self._recvs = self._p2p(None, None, st.recv_backproj, self.next, "boundary exchange",
                                None, None, st.recv_error, self.prev)

    def recv_from_next(self, buf: Tensor) -> Tensor:
        """Receive ``buf`` from the downstream neighbour (a diagnostic's sequential backward; nothing
        without one)."""
        self._wait(self._p2p(None, None, buf, self.next, "backward"))
        return buf

    def send_to_prev(self, t: Tensor) -> None:
        """Send ``t`` to the upstream neighbour and wait (nothing without one)."""
        self._wait(self._p2p(t.contiguous(), self.prev, None, None, "backward"))

    def predict(self, net, x: Tensor) -> Tensor | None:
        """Feed-forward prediction through every slice; the logits on the last slice, None elsewhere."""
        if self.alone:
            return net(x)
        h = x
        if self.prev is not None:
            h = torch.empty(x.shape[0], *net.node_shapes[net.first - 1], dtype=x.dtype, device=x.device)
            self._wait(self._p2p(None, None, h, self.prev, "prediction"))
        out = net(h).contiguous()
        if self.next is not None:
            self._wait(self._p2p(out, self.next, None, None, "prediction"))
            return None
        return out
