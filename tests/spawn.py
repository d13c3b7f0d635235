"""Run a function on N real torch.distributed processes (gloo on CPU), with a deadline.

Each worker gets the caller's environment as it is at the call, torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port) and one intra-op thread. A
worker's exception comes back to the test as WorkerError with its traceback; a run past the
deadline is killed and reported, never left hanging.

The workers are forked from a forkserver that imported torch and pcdist once (per test process),
so that a worker costs its own work, not the second or two of CPU that importing torch costs
each fresh interpreter: each is still a process of its own, with its own process group.
"""

from __future__ import annotations

import os
import time
import traceback

import torch.multiprocessing as mp
from ports import free_port


__all__ = ["run", "free_port", "WorkerError"]


class WorkerError(RuntimeError):
    pass


PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "torch._dynamo", "pcdist",
           "pcdist.distributed.parallel", "pytest", "reference"]
"""What the forkserver imports before it forks the workers (the tests' modules import the rest). torch._dynamo:
every torch optimizer imports it when the first one is made (a second of CPU)."""


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts: the first run() of the process
    return ctx


def _entry(rank, world, port, env, fn, args, errq):
    os.environ.clear()  # the caller's environment now, not the forkserver's from when it started
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    try:
        fn(rank, world, *args)
    except BaseException as e:  # report, then fail the process
        errq.put((rank, type(e).__name__, str(e), traceback.format_exc()))
        raise SystemExit(1)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run(fn, world: int, *args, timeout: float = 120.0) -> None:
    """Run fn(rank, world, *args) on `world` processes; raise WorkerError on any failure."""
    ctx = _context()
    errq = ctx.SimpleQueue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world, port, env, fn, args, errq), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = []
    while not errq.empty():
        errors.append(errq.get())
    if errors:
        errors.sort()
        raise WorkerError("\n".join(f"rank {r}: {name}: {msg}\n{tb}" for r, name, msg, tb in errors))
    if alive:
        raise WorkerError(f"ranks {alive} still running after {timeout:.0f}s (killed)")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise WorkerError(f"workers exited abnormally: {bad}")
