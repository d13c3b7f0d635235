"""The errors pcdist raises for the user's input, each named by what is wrong: a config key, a data file, a
checkpoint, a run directory, a peer rank.

They live here, apart from the code that raises them (and its torch), so that a command that only reads files
(``python -m pcdist compare``) or only checks a command line can catch them without importing torch. The
command line prints ConfigError, DataError, CheckpointError and RunError as one line and exits with status 2.
"""

import difflib
import errno


def stop_status(ctrl_c: bool) -> int:
    """The exit status of a process a signal stopped: 130 for a Ctrl-C, else 3 (pre-empted), or
    ``$PCDIST_PREEMPTED_STATUS`` where a launcher set it (launch/slurm.sbatch and launch/local.sh: 0, so that
    torchrun's agent neither restarts the stopped workers nor reports them as failed, with a traceback; the
    scripts say how it stopped). Anything but a number 0-255 means the default."""
    import os

    default = 130 if ctrl_c else 3
    value = os.environ.get("PCDIST_PREEMPTED_STATUS", str(default))
    return int(value) if value.isdigit() and int(value) < 256 else default


def did_you_mean(word: str, known) -> str:
    """``; did you mean trainer.max_steps?`` for a near miss among ``known``, else ``""`` (a dotted key matches
    by its last part first)."""
    known = list(known)
    same_name = [k for k in known if k.split(".")[-1] == word.split(".")[-1]]
    close = same_name or difflib.get_close_matches(word, known, n=1, cutoff=0.75)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def printable(text: str, keep: str = "") -> str:
    """``text`` with every character that is not printable (but those in ``keep``) written as Python escapes it
    (``\\x1b``): what a run folder holds (a file name, a link's target) is data, and a terminal must never
    receive its control sequences (a changed window title, an erased line, hidden text)."""
    return "".join(ch if ch.isprintable() or ch in keep else ascii(ch)[1:-1] for ch in str(text))


class ConfigError(ValueError):
    """A config key (or mesh factor) has a value that cannot work; the message names it. Raised before any process
    group or work exists (``pcdist.service.config``, ``ParallelDims``, ``pcdist.train``). A ValueError, so code
    that catches ValueError keeps working."""


class DataError(ValueError):
    """A dataset file is missing or not in the expected format (pcdist/service/data.py)."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (damaged, or from a different model; pcdist/service/checkpoint.py)."""


class RunError(ValueError):
    """A run directory cannot be read back as asked (the message names the problem; pcdist/service/load.py)."""


USER_ERRORS = (ConfigError, DataError, CheckpointError, RunError)
"""What the user's input (a setting, a file, a run directory) causes, not a bug: one line, status 2."""

DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EFBIG})
"""The errors of an OSError that a full or read-only disk (or a folder without permission) causes: one line."""


class PeerError(RuntimeError):
    """A point-to-point exchange or a collective with other ranks failed or timed out."""
