"""Stopping on a signal: SIGTERM, SIGUSR1 and SIGINT (Ctrl-C) are caught so that the step in progress finishes
and checkpoints (``catch_stop_signals``); every rank agrees on the stop in a vote that never holds a rank up
(``StopVote``); the run then raises ``Preempted``."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.parallel import collective
from ..errors import stop_status


class Preempted(BaseException):
    """SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) arrived: the run checkpointed and stopped; rerunning resumes it.
    ``signal``: the one every rank agreed on (SIGINT: the user's Ctrl-C; else the launcher's pre-emption).

    A request to stop, as KeyboardInterrupt and SystemExit are, not an error: ``except Exception`` in a caller's
    loop over runs does not catch it and start the next run. A Ctrl-C raises ``Interrupted``, a KeyboardInterrupt
    too (``except KeyboardInterrupt`` catches it, and a notebook shows it as one)."""

    def __init__(self, message: str, signal_number: int = signal.SIGTERM):
        super().__init__(message)
        self.signal = signal_number

    @staticmethod
    def of(message: str, signal_number: int) -> "Preempted":
        return (Interrupted if signal_number == signal.SIGINT else Preempted)(message, signal_number)


class Interrupted(Preempted, KeyboardInterrupt):
    """The user's Ctrl-C (SIGINT) stopped the run after a checkpoint: a ``Preempted`` and a ``KeyboardInterrupt``."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def catch_stop_signals() -> tuple[dict, dict]:
    """Record SIGTERM / SIGUSR1 / SIGINT instead of dying, so the current step can finish and checkpoint; a
    second stop signal that is a Ctrl-C exits at once. Returns the record and the signals' previous handlers
    (``restore_signals``). Also those the process started ignoring: launch/slurm_node.sh starts torchrun's agent,
    and so its workers, ignoring SIGTERM and SIGUSR1 until their training catches them."""
    got: dict = {"signal": 0}
    before: dict = {}
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            before[sig] = signal.getsignal(sig)
            signal.signal(sig, functools.partial(_on_stop_signal, got))
    return got, before


def _on_stop_signal(got: dict, signum: int, frame) -> None:
    """Remember the first stop signal; a Ctrl-C after it stops the process at once, saying whether the stop's
    checkpoint was written (``got["saved"]``: its step) and how to resume (``got["resume"]``), where a run set
    them."""
    if signum == signal.SIGINT and got["signal"]:
        where = f"after the checkpoint of step {got['saved']}" if got.get("saved") else \
            "before the checkpoint of this step (the run directory keeps its newest checkpoint)"
        line = f"second Ctrl-C: stopped at once, {where}{'; to resume: ' + got['resume'] if got.get('resume') else ''}"
        print(line, file=sys.stderr, flush=True)
        if got.get("record"):  # (train.log: the run's record)
            got["record"](line)
        os._exit(stop_status(ctrl_c=True))
    got["signal"] = got["signal"] or signum


def restore_signals(before: dict) -> None:
    """Give the stop signals back their handlers from before training (in a script: KeyboardInterrupt for Ctrl-C,
    and SIGTERM / SIGUSR1 end the process again)."""
    if threading.current_thread() is threading.main_thread():
        for sig, handler in before.items():
            if handler is not None:  # (one installed outside Python: left as training left it)
                signal.signal(sig, handler)


def stop_message(signum: int, done: int, path: Path, resume: str) -> str:
    """How the run stopped, its checkpoint, and how to resume it (``resume``: the command, resume.resume_command)."""
    how = "by Ctrl-C (SIGINT)" if signum == signal.SIGINT else "by a signal"
    return f"stopped {how} after step {done}; checkpoint {path}; to resume: {resume}"


class StopVote:
    """Which stop signal any rank got, agreed by all (0: none): each step posts this rank's signal number in
    a MAX all-reduce (``async_op``) and reads the vote posted one step earlier, long complete by then, so
    the vote never holds a rank up (a blocking all-reduce per step would line the ranks up at every step).
    Every rank reads the same votes in the same steps, so all stop after the same step, at most two steps
    after the signal, and agree on which signal it was (the largest number: a pre-emption over a Ctrl-C).
    The vote is a host tensor over a gloo group (on GPUs too), so reading it never waits for the device; a
    vote that does not complete within ``timeout`` (parallel.timeout_s) names the ranks, as the other
    collectives do."""

    def __init__(self, distributed: bool, device: torch.device, timeout: timedelta | None = None):
        self.distributed, self.timeout = distributed, timeout
        self.group = dist.new_group(backend="gloo", timeout=timeout) if distributed and device.type == "cuda" \
            else None
        self._posted: tuple | None = None

    def __call__(self, signum: int) -> int:
        """The vote posted at the previous call (0 at the first); posts ``signum`` for the next."""
        stop = self.finish()
        if not self.distributed:
            self._posted = (None, signum)
            return stop
        t = torch.tensor([float(signum)])
        with collective("the stop-signal all-reduce"):
            self._posted = (dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True), t)
        return stop

    def finish(self) -> int:
        """Wait for the vote in flight (if any) and return it."""
        if self._posted is None:
            return 0
        work, t = self._posted
        self._posted = None
        if work is None:
            return int(t)
        with collective("the stop-signal all-reduce"):
            work.wait(self.timeout) if self.timeout is not None else work.wait()
        return int(t.item())
