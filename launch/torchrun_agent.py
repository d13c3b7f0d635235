"""torchrun's agent (`python -m torch.distributed.run`), leaving the stop signals to the launch script around it.

    python launch/torchrun_agent.py [--noop INT] TERM --standalone --nproc_per_node=2 train.py ...

torchrun's agent handles SIGTERM and SIGINT itself: it passes them on to its workers, kills them 30 s later and
ends with a traceback, and an agent killed by one takes its workers down before they checkpoint. launch/local.sh
and launch/slurm_node.sh pass the stop signals to the workers themselves, so the agent must leave them alone: the
signals named keep the disposition they have when it starts, whatever torch's agent code sets (torch >= 2.9 can
be told so by PET_SIGNALS_TO_HANDLE; before 2.9 it sets its handlers regardless). Those named after --noop get a
handler that does nothing first, so that the workers it starts get the default disposition (a handler is reset
when a process starts another program; an ignored signal stays ignored): launch/local.sh's Ctrl-C, which a
background job starts ignoring. The others keep theirs: one ignored stays ignored in the workers too, until
train.py's training loop catches it, so that a worker still starting up is not killed by a stop signal it is
sent (launch/slurm_node.sh's USR1 and TERM, launch/local.sh's TERM).
"""

import runpy
import signal
import sys


def main(argv: list[str]) -> None:
    noop_names, argv = (argv[1], argv[2:]) if argv[:1] == ["--noop"] else ("", argv)
    names, *torchrun_args = argv
    noop = {getattr(signal, f"SIG{name}") for name in noop_names.split(",") if name}
    pinned = noop | {getattr(signal, f"SIG{name}") for name in names.split(",")}
    setter = signal.signal
    for sig in noop:
        setter(sig, lambda *_: None)
    signal.signal = lambda sig, handler: signal.getsignal(sig) if sig in pinned else setter(sig, handler)
    sys.argv = ["torchrun", *torchrun_args]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
