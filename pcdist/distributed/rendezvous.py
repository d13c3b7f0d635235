"""Joining the process group so that torchrun can restart it: one key space per attempt.

torchrun (torch >= 2.5) hands its workers the agent's own TCPStore
(``TORCHELASTIC_USE_AGENT_STORE=True``), and that store outlives them. torch's
``init_process_group`` writes a group's bootstrap keys (gloo's addresses, NCCL's unique
id, barrier counters) under the same names in every attempt, so a restarted group reads
the dead group's entries: "Gloo connectFullMesh failed ... Connection refused"
(pytorch/pytorch#135712). ``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt on
several nodes: each agent counts only its own workers' failures, and a restart for a
peer node's failure is not counted (``SimpleElasticAgent._invoke_run``), so counts differ.

So every attempt agrees on a generation through the store itself. Each process takes a
ticket, a number no other process ever gets (an atomic add). Rank 0's ticket is the
generation; rank 0 writes it under the key ``welcome/<ticket>`` of every ticket issued
near its own (an attempt's tickets are consecutive: the previous attempt's processes
are stopped before the next ones start) until every other rank has confirmed it. A rank
waits for the key named by its own ticket, which nobody can have written in an earlier
attempt. The group's keys then live under ``pcdist/gen-<generation>/``.
"""

from __future__ import annotations

import os
import time
import warnings
from datetime import timedelta

import torch.distributed as dist

from ..errors import PeerError

__all__ = ["join_process_group", "attempt_store", "warn_if_restarts_unsafe"]

_TICKETS = "pcdist/tickets"


def join_process_group(backend: str, timeout: timedelta, group_timeout: timedelta | None = None, **kw) -> None:
    """``init_process_group`` from torchrun's environment (env://), on this attempt's own keys; ``group_timeout``:
    the group's own (NCCL's watchdog), default ``timeout``."""
    try:
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    except dist.DistStoreError as e:  # rank 0's own store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) waits for them all
        raise PeerError(f"rank {os.environ.get('RANK', '?')}: the ranks did not all reach the rendezvous within "
                        f"{timeout.total_seconds():g}s ({str(e).splitlines()[0]}); are they running?") from e
    store.set_timeout(timeout)
    dist.init_process_group(backend, store=attempt_store(store, rank, world, timeout), rank=rank, world_size=world,
                            timeout=group_timeout or timeout, **kw)


def attempt_store(store: dist.Store, rank: int, world: int, timeout: timedelta) -> dist.PrefixStore:
    """``store`` seen through a prefix that only the ranks of this attempt share (see the module docstring)."""
    ticket = store.add(_TICKETS, 1)
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        gen, joined, answered = ticket, f"pcdist/gen-{ticket}/joined", max(0, ticket - world)
        while store.add(joined, 0) < world - 1:  # the tickets of this attempt lie within world - 1 of ours
            issued = min(store.add(_TICKETS, 0), ticket + world - 1)
            for t in range(answered + 1, issued + 1):
                store.set(f"pcdist/welcome/{t}", str(gen))
            answered = max(answered, issued)
            if time.monotonic() > deadline:
                raise PeerError(f"rank 0: only {store.add(joined, 0)} of the other {world - 1} ranks joined the "
                                f"process group within {timeout.total_seconds():g}s; are they running?")
            time.sleep(0.01)
    else:
        key = f"pcdist/welcome/{ticket}"
        try:
            store.wait([key], timeout)
        except Exception as e:  # DistStoreError on timeout
            raise PeerError(f"rank {rank}: no word from rank 0 within {timeout.total_seconds():g}s while "
                            f"forming the process group; is rank 0 running? ({e})") from e
        gen = int(store.get(key))
        store.add(f"pcdist/gen-{gen}/joined", 1)
    return dist.PrefixStore(f"pcdist/gen-{gen}/", store)


def warn_if_restarts_unsafe() -> None:
    """Rank 0 warns when a process group that pcdist did not create (``init_process_group``
    called by the script itself) runs under torchrun restarts on the agent's shared store."""
    env = os.environ
    if (env.get("RANK", "0") == "0" and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0
            and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        warnings.warn("the process group was created outside pcdist on torchrun's shared store: restarted workers "
                      "would read the dead group's addresses (pytorch/pytorch#135712); call "
                      "pcdist.init_distributed() instead of init_process_group, or export "
                      "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun", RuntimeWarning, stacklevel=3)
