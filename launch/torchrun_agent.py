"""torchrun's agent (`python -m torch.distributed.run`), leaving the stop signals to the launch script around it.

    python launch/torchrun_agent.py [--noop] INT,TERM --standalone --nproc_per_node=2 train.py ...

torchrun's agent handles SIGTERM and SIGINT itself: it passes them on to its workers, kills them 30 s later and
ends with a traceback, and an agent killed by one takes its workers down before they checkpoint. launch/local.sh
and launch/slurm_node.sh pass the stop signals to the workers themselves, so the agent must leave them alone: the
signals named keep the disposition they have when it starts, whatever torch's agent code sets (torch >= 2.9 can
be told so by PET_SIGNALS_TO_HANDLE; before 2.9 it sets its handlers regardless). With --noop they get a handler
that does nothing first, so that the workers it starts get the default dispositions (a handler is reset when a
process starts another program; an ignored signal stays ignored): launch/local.sh's. Without it an ignored
signal stays ignored in the workers too, until train.py's training loop catches it: launch/slurm_node.sh's, so
that a worker still starting up is not killed by a stop signal it is sent.
"""

import runpy
import signal
import sys


def main(argv: list[str]) -> None:
    noop = argv[:1] == ["--noop"]
    names, *torchrun_args = argv[1:] if noop else argv
    pinned = {getattr(signal, f"SIG{name}") for name in names.split(",")}
    setter = signal.signal
    for sig in pinned if noop else ():
        setter(sig, lambda *_: None)
    signal.signal = lambda sig, handler: signal.getsignal(sig) if sig in pinned else setter(sig, handler)
    sys.argv = ["torchrun", *torchrun_args]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
