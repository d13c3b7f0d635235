"""The run directory: a new one per launch, resuming one (a visible choice), and the config of every attempt.

* A run that names no directory gets ``runs/<date>/<time>-<id>``, which no other launch
  uses (``new_run_dir``). Every rank of one torchrun launch, and every restart of it,
  must find the same directory without talking to each other, so under torchrun the
  first rank to start picks the name and records it in ``runs/.launches/<launch key>``;
  the others, and restarted workers, read it there.
* A directory that holds a checkpoint is resumed (``resume=auto``) from its newest valid one
  (a damaged newer one is skipped, and said so in one line; where every one is damaged, the run
  is refused); ``resume=never`` refuses to continue it, ``resume=require`` refuses to start
  fresh. A finished run is reported in one line and left untouched. A directory that holds a
  run's files but no checkpoint is refused, never appended to (a restart of the same torchrun
  launch excepted), and so is, for a sweep's job, a directory holding a run of other settings:
  a run directory is resumed only by the run that owns it.
* A resume continues the run with its own saved settings; only what the user passes now
  changes them (and the launch's own keys, ``LAUNCH_KEYS``: the mesh, ``trainer.stop_at``).
  Each change is refused, applied, or applied with a warning, per key (``ON_RESUME``), one
  line each; a refusal names the override to leave out. Nothing in the directory changes
  unless the run continues. The config of every attempt is kept as
  ``configs/attempt-<n>.yaml``, headed by its overrides (``config.yaml`` is the latest).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shlex
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import OmegaConf

from .checkpoint import newest_valid, read_meta, saved_config
from .metrics import read_metrics
from .config import (DATA_PATHS, ONE_READER, Config, absolute_path, command, flat, literal, load_config,
                     passed_settings, run_dir_override)
from ..errors import ConfigError, RunError, printable

__all__ = ["new_run_dir", "launch_run_dir", "next_run_dir", "Resume", "find_resume", "ON_RESUME", "SCHEDULE_KEYS",
           "LAUNCH_KEYS", "RUN_FILES", "run_files", "sweep_in", "write_attempt", "position_schedule", "run_overrides",
           "links_in", "links_refusal", "LOCK", "check_not_in_use", "lock_run_dir", "unlock_run_dir"]

_calls = itertools.count(1)


def _launch_key() -> tuple[str, str]:
    """(key, short name) of this torchrun launch: the same on every rank and restart, different between launches.

    On one node the launch is its agent (every local rank's parent, across restarts): a later launch given the
    same --rdzv-id gets a directory of its own instead of continuing this one's run. On several nodes the
    rendezvous id is what the nodes share, so it names the launch (give each launch its own: $SLURM_JOB_ID)."""
    run_id = os.environ["TORCHELASTIC_RUN_ID"]  # --standalone: a fresh uuid; else --rdzv-id (default "none")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)
    short = safe[:8] if re.fullmatch(r"[0-9a-f]{8}-[0-9a-f-]{27}", run_id) else safe
    hint = ("pass --standalone or --rdzv-id=<an id unique to this run>, or name the directory: hydra.run.dir=... "
            "(in Python the config key run_dir: pcdist.train({\"run_dir\": ...}))")
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        if run_id == "none":
            raise ConfigError(f"torchrun on several nodes with the rendezvous id 'none': the ranks cannot agree on a "
                              f"new run directory; {hint}")
        return safe, short
    ppid = os.getppid()  # the torchrun agent: the same for every local rank and across restarts
    try:  # its start time in clock ticks since boot (field 22 of /proc/<pid>/stat): tells reused pids apart
        started = Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        if run_id != "none":
            return safe, short
        raise ConfigError(f"torchrun with the rendezvous id 'none' on a system without /proc: the ranks cannot agree "
                          f"on a new run directory; {hint}") from None
    if run_id == "none":
        name = f"p{ppid}"
    elif short != safe:  # --standalone's fresh uuid: a name of its own already
        name = short
    else:  # an --rdzv-id another launch may reuse
        name = f"{safe}-p{ppid}"
    return f"agent-{ppid}-{started}-{safe}", name


def _agreed_name(root: Path, key: str, short: str) -> str:
    """The name the first rank of this launch recorded under root/.launches/key (recording it if this rank is first)."""
    record = root / ".launches" / key
    if not record.is_file():
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f"{key}.{os.getpid()}.tmp")
        tmp.write_text(f"{time.strftime('%Y-%m-%d/%H-%M-%S')}-{short}\n")
        try:
            os.link(tmp, record)  # atomic: exactly one rank's name is published
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return record.read_text().strip()


def new_run_dir(root: str | Path = "runs", call: int = 1) -> Path:
    """A run directory no other launch uses: ``root/<date>/<time>-<id>``.

    One process: the clock and 6 random hex digits (two launches in the same second differ).
    Under torchrun: the name the launch's first rank recorded (see the module docstring), so
    every rank and every restart of the launch agrees on it; ``call`` > 1 (the n-th
    ``pcdist.train`` of one script) appends ``-<call>``. Raises ConfigError where the ranks
    could not agree (torchrun's default rendezvous id 'none' on several nodes).
    """
    root = Path(root)
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("several ranks started without torchrun cannot agree on a new run directory: "
                              "set the config key run_dir (hydra.run.dir=... on the command line)")
        return root / f"{time.strftime('%Y-%m-%d/%H-%M-%S')}-{os.urandom(3).hex()}"
    key, short = _launch_key()
    if call > 1:
        key, short = f"{key}-{call}", f"{short}-{call}"
    return root / _agreed_name(root, key, short)


@functools.lru_cache(maxsize=None)
def launch_run_dir(root: str = "runs") -> str:
    """The new run directory of this launch (``new_run_dir``), one value per process however often it is
    asked for: conf/config.yaml's ``${pcdist.new_run_dir:runs}``."""
    return str(new_run_dir(root))


def next_run_dir() -> Path:
    """The default directory of the next ``pcdist.train`` call in this process."""
    return new_run_dir("runs", call=next(_calls))


if not OmegaConf.has_resolver("pcdist.new_run_dir"):
    OmegaConf.register_new_resolver("pcdist.new_run_dir", launch_run_dir)


# ---------------------------------------------------------------------------------------------
# Resuming

REFUSE, APPLY, WARN = "refused", "applied", "applied, with a warning"
SAME_DATA = "it must hold the same data (only its location may change)"
ON_RESUME: dict[str, tuple[str, str]] = {
    # A key not listed here follows its group's entry ("model"), else it is applied.
    "model": (REFUSE, "it changes the model's shape"),
    "data.name": (REFUSE, "it changes the data set"),
    "data.val_fraction": (REFUSE, "it changes the train/validation split"),
    "data.synthetic_train": (REFUSE, "it changes the data set"),
    "data.synthetic_val": (REFUSE, "it changes the data set"),
    "data.num_classes": (REFUSE, "it changes the model's output"),
    "data.signal": (REFUSE, "it changes the model's input shape"),
    "data.normalize": (REFUSE, "it changes the inputs the model takes, and model.json records the run's once, for "
                               "every checkpoint kept"),
    "trainer.batch_size": (REFUSE, "it changes the global batches (the data order) and what a step is"),
    "trainer.seed": (REFUSE, "it changes the initial weights and the data order"),
    "optim.name": (REFUSE, "the checkpoint holds the other optimizer's state"),
    "data.root": (WARN, SAME_DATA),
    "data.path": (WARN, SAME_DATA),
    "trainer.dtype": (WARN, "the checkpoint's weights and optimizer state are cast to the new precision"),
    "pc.algorithm": (WARN, "the weights so far were trained with the other algorithm"),
    "pc.mode": (WARN, "h_0 and h_L now hold other things (data, labels or a latent): the weights so far were trained "
                      "for the other mode"),
    "parallel": (APPLY, "checkpoints are keyed by layer, so any split resumes"),
}
SCHEDULE_KEYS = ("optim.lr", "optim.warmup_steps", "optim.schedule", "optim.final_lr_ratio", "trainer.max_steps",
                 "trainer.epochs")
"""Keys whose change rebuilds the LR schedule at the resumed step (instead of loading the saved one)."""


LAUNCH_KEYS = ("run_dir", "resume", "parallel", "trainer.stop_at")
"""Settings of the launch, not of the run: a resume takes them from this launch, never from the run
(the mesh follows the processes started now; trainer.stop_at is where this attempt stops)."""


def _of_launch(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in LAUNCH_KEYS)


def _policy(key: str, old: Any = None, new: Any = None, data: str | None = None) -> tuple[str, str]:
    """The decision on a changed ``key`` and why; ``data``: the run's data set (a key only another one reads is
    applied: nothing changes)."""
    if data is not None and ONE_READER.get(key, data) != data:
        return APPLY, f"data={data} does not read it"
    if key == "pc.prior_mean" and (old == "learned") != (new == "learned"):
        return REFUSE, "a learned mean is a parameter of the model, which the checkpoint " + \
            ("holds" if old == "learned" else "does not hold")
    if key in ON_RESUME:
        return ON_RESUME[key]
    if key.split(".")[0] in ON_RESUME:
        return ON_RESUME[key.split(".")[0]]
    if key in SCHEDULE_KEYS:
        return APPLY, "the LR schedule is recomputed at the resumed step"
    return APPLY, "from the resumed step on"


def _nested(flat_keys: dict) -> dict:
    """{"trainer.max_steps": 5} -> {"trainer": {"max_steps": 5}}."""
    out: dict = {}
    for key, value in flat_keys.items():
        *parents, name = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = value
    return out


@dataclass
class Resume:
    """What a run directory holds for this run: a checkpoint to resume (or None), the config to run
    (the run's own settings with what the user passes now) and the settings that changed."""

    run_dir: Path
    checkpoint: Path | None = None
    config: Config | None = None
    """The config this attempt runs with."""
    meta: dict | None = None
    changes: list[tuple[str, Any, Any, str, str]] = field(default_factory=list)
    """(key, old, new, decision, why) per changed setting."""
    unknown_config: bool = False
    """The checkpoint carries no config and the directory no config.yaml: nothing to compare with."""
    overrides: list[str] = field(default_factory=list)
    """The overrides this attempt was given (kept in configs/attempt-<n>.yaml)."""
    sweep: bool = False
    """This run is a job of a sweep (``--multirun``), which never continues a run of other settings."""
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    """Newer checkpoints skipped as damaged, each with why."""
    unstarted: list[str] = field(default_factory=list)
    """The files of an earlier launch that stopped before it logged or checkpointed anything (started over)."""

    @property
    def step(self) -> int:
        return int(self.meta["step"]) if self.meta else 0

    @property
    def schedule_changed(self) -> bool:
        """A changed setting the LR schedule depends on: SCHEDULE_KEYS, or the optimizer steps per training step it
        counts (pc.T under ipc: service/optimizer.py optimizer_steps; a checkpoint records them, one where it
        predates the record, when ipc's schedule ran out at max_steps / T)."""
        from .optimizer import optimizer_steps

        counted = (self.meta or {}).get("optimizer_steps", 1)
        return any(k in SCHEDULE_KEYS for k, *_ in self.changes) or (
            self.config is not None and self.meta is not None and counted != optimizer_steps(self.config))

    def lines(self) -> list[str]:
        """One line per changed setting, with its decision and why."""
        return [f"resume: {k} changed {old!r} -> {new!r}: {decision} ({why})"
                for k, old, new, decision, why in self.changes]

    def skipped_line(self) -> str | None:
        """The one line that names the damaged checkpoints skipped, and why, or None."""
        if not self.skipped:
            return None
        named = "; ".join(f"{p.name} ({why})" for p, why in self.skipped)
        many = len(self.skipped) > 1
        return (f"resume: skipped the damaged checkpoint{'s' * many} {named}; resuming from the newest valid one, "
                f"{self.checkpoint.name} (the damaged one{'s are' if many else ' is'} kept as <name>.damaged)")


RUN_FILES = ("checkpoints", "metrics.jsonl", "train.log", "config.yaml", "configs", "PREEMPTED", "diagnostics.jsonl",
             "wandb")
"""What a run writes into its directory: a directory holding any of them holds a run (model.json, which
every attempt writes anew before it logs anything, does not count)."""


def run_files(run_dir: Path) -> list[str]:
    """The names in RUN_FILES that ``run_dir`` holds."""
    return [name for name in RUN_FILES if (Path(run_dir) / name).exists()]


SWEEP_FILES = ("multirun.yaml", ".pcdist-sweep.json", "optimization_results.yaml")
"""What Hydra and pcdist write into a sweep's folder, beside its jobs' run directories."""


def sweep_in(run_dir: Path) -> list[str]:
    """What makes ``run_dir`` a sweep's folder: SWEEP_FILES, and folders holding a run (its jobs), by name."""
    run_dir = Path(run_dir)
    jobs = [d.name for d in sorted(run_dir.iterdir()) if d.is_dir() and d.name not in RUN_FILES and run_files(d)] \
        if run_dir.is_dir() else []
    return [name for name in SWEEP_FILES if (run_dir / name).exists()] + [f"{name}/" for name in jobs]


def _live_sweep(folder: Path) -> str | None:
    """The sweep launching into ``folder`` now (its claim, sweep.py's ``.pcdist-sweep.json``, names a process that
    runs on this host), as text naming it, else None."""
    import socket

    try:
        claim = json.loads((folder / ".pcdist-sweep.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(claim, dict) or claim.get("host") != socket.gethostname():
        return None
    pid = claim.get("pid")
    if pid == os.getpid() or not running(pid):
        return None
    return f"process {pid}: {printable(' '.join(map(str, claim.get('overrides') or [])))}"


def running(pid) -> bool:
    """Whether process ``pid`` of this host runs."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def links_in(run_dir: Path) -> list[str]:
    """What in ``run_dir`` is a symbolic link, or a file with another hard link: pcdist would write through it
    into a file outside the run (a run folder one was sent, with ``eval.json -> ~/.bashrc``). Below wandb/
    (itself a real folder) the files are wandb's, with its own links."""
    found: list[str] = []

    def walk(folder: str) -> None:
        with os.scandir(folder) as entries:
            for e in entries:
                rel = os.path.relpath(e.path, run_dir)
                if e.is_symlink():
                    found.append(printable(f"{rel} -> {os.readlink(e.path)}"))
                elif e.is_dir(follow_symlinks=False):
                    if rel != "wandb":
                        walk(e.path)
                elif e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_nlink > 1:
                    found.append(printable(f"{rel} (a hard link)"))

    if Path(run_dir).is_symlink():  # the directory itself: a job folder of a sweep one was sent, say
        return [printable(f"the directory itself -> {os.readlink(run_dir)}")]
    if Path(run_dir).is_dir():
        walk(str(run_dir))
    return sorted(found)


def links_refusal(run_dir: Path, found: list[str], writes: str) -> str:
    """The one-line refusal of a run directory that holds links (``links_in``); ``writes``: what would be written."""
    named = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return (f"{run_dir} holds links ({named}): {writes} would write through them into the files they lead to, "
            f"so pcdist writes into no run directory that holds links; nothing was changed: if you trust the "
            f"folder, remove the links, or copy the run without them (cp -rL {run_dir} <new folder>)")


RESTARTS = {"torchrun": "TORCHELASTIC_RESTART_COUNT", "slurm_job": "SLURM_RESTART_COUNT"}


def _restarted() -> bool:
    """This is the same launch restarted by torchrun, or requeued by SLURM."""
    return any(int(os.environ.get(k, "0") or 0) > 0 for k in RESTARTS.values())


def _launch_ids() -> dict[str, str | None]:
    """What names this launch to its own restarts: the torchrun launch (``_launch_key``, the same on its every
    restart) and the SLURM job (the same on its every requeue); None where it is not one."""
    torchrun = None
    if "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            torchrun = _launch_key()[0]
        except ConfigError:
            pass
    return {"torchrun": torchrun, "slurm_job": os.environ.get("SLURM_JOB_ID") or None}


def _restarted_into(run_dir: Path) -> bool:
    """This launch restarted by torchrun or requeued by SLURM into a directory that an earlier attempt of the same
    launch wrote (its configs/attempt-<n>.yaml names the launch): it starts over or resumes there whatever
    ``resume=`` says. A launch refused at its first attempt (the directory another run's, or a project's) wrote
    no attempt there, so torchrun's restart of it is refused again."""
    ids = _launch_ids()
    mine = {k: ids[k] for k, env in RESTARTS.items() if ids[k] is not None and int(os.environ.get(env, "0") or 0) > 0}
    for path in (Path(run_dir) / "configs").glob("attempt-*.yaml") if mine else ():
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("# launch: "):
                try:
                    recorded = json.loads(line[len("# launch: "):])
                except ValueError:
                    continue
                if isinstance(recorded, dict) and any(recorded.get(k) == v for k, v in mine.items()):
                    return True
    return False


LOCK = ".lock"
"""The file a launch's first rank holds a lock on while it uses the run directory (removed when it is done)."""

_held: list = []  # [fd, lock path, the directory if this launch made it]


def lock_run_dir(run_dir: Path, wait_s: float | None = None) -> None:
    """Hold the run directory for this launch (its first rank; the other ranks share it), or refuse in one line
    naming the launch that holds it: two launches into one directory at once (started together, or a resume
    while the run still trains) would mix their steps, logs and checkpoints. A POSIX lock (``lockf``): the
    kernel releases it when its process ends, however it ends, and a forked child (a DataLoader worker) does
    not hold it. ``wait_s``: how long to wait for a process that is still ending (default: 5 s where this is a
    restarted launch, whose earlier attempt may still be ending; none for a new one)."""
    import fcntl
    import socket

    run_dir = Path(run_dir)
    refused = _refused_record(run_dir)
    if refused is not None and refused.is_file() and _restarted():
        raise ConfigError(f"{run_dir}: this torchrun launch was refused the directory at an earlier attempt "
                          f"({printable(refused.read_text(errors='replace').strip())}); torchrun restarted it, but a "
                          f"launch that found another run there does not take the directory over when that run "
                          f"ends: launch again to resume it")
    if run_dir.is_symlink():  # (before anything is written: the lock would be the link's target's)
        raise ConfigError(links_refusal(run_dir, links_in(run_dir), "a run continued there"))
    made = not run_dir.exists()
    path = run_dir / LOCK
    deadline = time.monotonic() + (wait_s if wait_s is not None else 5.0 if _restarted() else 0.0)
    while True:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:  # read-only, a file in its place (a symbolic link), a full disk
            raise ConfigError(f"cannot write in the run directory {run_dir} ({e.strerror or e}: {e.filename}); "
                              f"choose another (hydra.run.dir=..., or the config key run_dir)") from None
        not_ours = _not_a_lock_of_ours(fd)
        if not_ours:  # a hard link to a file elsewhere, another tool's .lock: never written, never removed
            os.close(fd)
            raise ConfigError(f"{run_dir} holds {LOCK}, {not_ours}: pcdist writes its lock there, so it uses no "
                              f"such directory; nothing was changed: choose another (hydra.run.dir=..., or the "
                              f"config key run_dir)")
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            holder = _holder(fd)
            os.close(fd)
            if time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            _remember_refusal(refused, holder)
            raise ConfigError(_in_use(run_dir, holder)) from None
        except OSError as e:  # a filesystem without locks (some network mounts)
            os.close(fd)
            warnings.warn(f"cannot lock {path} on this filesystem ({e.strerror}): a second launch into {run_dir} "
                          f"while this one runs would not be refused")
            return
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            same = False
        if same:  # not unlinked by a launch that just finished with it
            break
        os.close(fd)
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    launch = _launch_name()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {since}"
                      f"{'' if launch is None else f' (launch {launch})'}\n".encode(), 0)
    except OSError:  # a full disk: no empty lock left behind (the caller says why in one line)
        os.unlink(path)
        os.close(fd)
        raise
    _held[:] = [fd, path, run_dir if made else None]


_LOCK_TEXT = re.compile(r"pid \d+ on ")
"""How a lock file of pcdist's begins (``lock_run_dir``; empty between its making and its writing)."""


def _not_a_lock_of_ours(fd: int) -> str | None:
    """Why the open file ``fd`` (a run directory's .lock) is not one pcdist may write and remove, or None: another
    name for a file elsewhere (a hard link), not a regular file, or what another tool wrote."""
    import stat

    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return "which is not a regular file"
    if st.st_nlink > 1:
        return "which is a hard link to another file"
    text = os.pread(fd, 300, 0)
    if text and not _LOCK_TEXT.match(text.decode(errors="replace")):
        return f"which pcdist did not write ({printable(text[:60].decode(errors='replace').strip())!r})"
    return None


REFUSED = ".refused"
"""The folder of a run directory where a torchrun launch refused it (another run held it) records so: torchrun
restarts a refused worker, and the restart, finding the directory free once that run has ended, would otherwise
take it for its own (and train a second job's settings into a run it never started)."""


def _launch_name() -> str | None:
    """This torchrun launch, the same on its every restart (``_launch_key``) and new at each SLURM requeue; None
    outside torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        key = _launch_key()[0]
    except ConfigError:
        return None
    return f"{key}-r{os.environ.get('SLURM_RESTART_COUNT', '0') or '0'}"


def _refused_record(run_dir: Path) -> Path | None:
    """Where this torchrun launch (every restart of it) records a refusal of ``run_dir``; None outside torchrun."""
    name = _launch_name()
    return None if name is None else run_dir / REFUSED / name


def _remember_refusal(record: Path | None, holder: str) -> None:
    """Record a refusal by another run (not by this launch's own earlier attempt, still ending: the lock names
    the launch that holds it)."""
    if record is None or f"(launch {record.name})" in holder:
        return
    try:  # (never through a link: a .refused leading elsewhere, or a record that is one)
        record.parent.mkdir(exist_ok=True)
        if record.parent.is_symlink():
            return
        fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(f"held by {holder}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    except OSError:  # (the refusal itself still stands)
        pass


def _holder(fd: int) -> str:
    """Who holds the lock file ``fd`` (what its holder wrote in it), printable."""
    return printable(os.pread(fd, 200, 0).decode(errors="replace").strip()) or "another launch"


def _in_use(run_dir: Path, holder: str) -> str:
    return (f"{run_dir} is in use by another run ({holder}; its lock: {run_dir / LOCK}): two launches into one run "
            f"directory would mix their steps; wait for it to end, or choose another directory (hydra.run.dir=..., "
            f"or the config key run_dir)")


def check_not_in_use(run_dir: Path) -> None:
    """Refuse, as ``lock_run_dir`` would, a run directory whose lock another process holds, without writing
    anything (``train.py --check``: a launch script's check before torchrun, so that a job launched into a
    run that trains fails at once; two launched together both pass it, and the one refused later by
    ``lock_run_dir`` stays refused through torchrun's restarts)."""
    import fcntl

    path = Path(run_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # no lock file (no run holds it), or one this process may not open: the launch itself decides
        return
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        holder = _holder(fd)
        raise ConfigError(_in_use(Path(run_dir), holder)) from None
    except OSError:  # a filesystem without locks
        pass
    finally:
        os.close(fd)  # (closing releases a lock this check took)


def unlock_run_dir() -> None:
    """Let the run directory go: its lock file removed (while still held, so no launch waits on a removed
    file), and the directory too where this launch made it and nothing else was written there."""
    if not _held:
        return
    fd, path, made = _held
    _held.clear()
    try:
        path.unlink(missing_ok=True)
        if made is not None:
            made.rmdir()
    except OSError:  # the run wrote its files: the directory stays
        pass
    finally:
        os.close(fd)


def _elsewhere(sweep: bool) -> str:
    """The way out of a refused directory: another one."""
    if sweep:
        return "give the sweep a new hydra.sweep.dir"
    return "choose a new run directory (hydra.run.dir=..., or the config key run_dir)"


def find_resume(c: Config, run_dir: Path, passed: dict[str, str] | None = None, sweep: bool = False) -> Resume:
    """The newest valid checkpoint of ``run_dir`` and the config to resume it with.

    ``passed``: the keys the user sets now, each with its override (``config.passed_settings``).
    A resume runs with the run's own saved settings and applies only those keys, except the
    launch's own (``LAUNCH_KEYS``), which always come from ``c``; ``passed=None`` (a config
    composed already) applies every key of ``c``. ``sweep``: this is a job of a sweep, which continues
    only a run of its own settings. Raises ConfigError (one line) when ``resume=`` forbids what the
    directory holds, when a refused setting changed (all of them named, with the override to drop, or
    to add back), when the directory holds a run's files but no valid checkpoint, or (``sweep``) a run
    of other settings, or when it holds links (``links_in``). Reads only: nothing in the directory changes.
    """
    found = links_in(run_dir)
    if found:
        raise ConfigError(links_refusal(run_dir, found, "a run continued there"))
    special = [n for n in (*RUN_FILES, LOCK) if (p := Path(run_dir) / n).exists() and not (p.is_file() or p.is_dir())]
    if special:  # (a named pipe: its open for appending waited forever, silently, with the directory held)
        raise ConfigError(f"{run_dir} holds {', '.join(special)}, which {'is' if len(special) == 1 else 'are'} not "
                          f"a regular file (a named pipe, a socket, a device): a run continued there would write "
                          f"into {'it' if len(special) == 1 else 'them'}; nothing was changed: remove "
                          f"{'it' if len(special) == 1 else 'them'}, or choose another directory")
    held = sweep_in(run_dir)
    if held:  # (hydra.run.dir=<a sweep's folder>: its job's /<n> left out)
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise ConfigError(f"{run_dir} is a sweep's folder ({shown}), whose runs a run there would mix with; to resume "
                          f"one of its jobs name its folder ({Path(run_dir) / '<job>'}), or choose another directory")
    live = None if sweep else _live_sweep(Path(run_dir).absolute().parent)
    if live:  # (a run there now: the sweep, on reaching this job, found another run's files and stopped)
        raise ConfigError(f"{run_dir} is a job folder of the sweep running into {Path(run_dir).absolute().parent} "
                          f"({live}): a run there would mix with it; nothing was changed: choose another directory, "
                          f"or wait until the sweep has ended")
    for rows in ("metrics.jsonl", "diagnostics.jsonl"):  # whole rows, but for a last one cut short (a resume keeps
        if (Path(run_dir) / rows).is_file():  # those of its steps, drops the rest and that one)
            try:
                read_metrics(Path(run_dir) / rows)
            except RunError as e:
                raise ConfigError(f"cannot resume {run_dir}: {e}; nothing in it was changed") from None
    newest, skipped = newest_valid(run_dir)
    r = Resume(Path(run_dir), newest, config=c, overrides=list(dict.fromkeys((passed or {}).values())),
               skipped=skipped, sweep=sweep)
    restarted = _restarted_into(run_dir)
    if r.checkpoint is None:
        r.unstarted = _refuse_without_checkpoint(c, Path(run_dir), skipped, restarted, sweep)
        return r
    if c.resume == "never" and not restarted:
        how = (f"set RUN_NAME=<name> or RUN_DIR=<path> for a new run, or RUN_DIR={run_dir} to continue it" if
               os.environ.get("PCDIST_LAUNCHER") == "slurm" else
               "choose another directory, or resume=auto to continue it")  # (slurm.sbatch's default is resume=never)
        raise ConfigError(f"resume=never but {run_dir} holds a run (checkpoint {r.checkpoint.name}); {how}")
    r.meta = read_meta(r.checkpoint)
    old = saved_config(r.run_dir, r.meta)
    if old is None:
        r.unknown_config = True
        return r
    before, after = flat(old), flat(asdict(c))
    unknown = [k for k in before if k not in after and not _of_launch(k)]
    if unknown:  # a run of a newer pcdist: resumed here, those settings would be dropped without a word
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise ConfigError(f"cannot resume {run_dir}: its checkpoint's settings hold {shown}, which this pcdist does "
                          f"not know (a run of a newer pcdist?); resume it with the pcdist that made it, or start a "
                          f"new run directory")
    if sweep:
        _refuse_other_settings(old, c, Path(run_dir))
    if passed is not None:  # the run's own settings, but for what the user passes now and the launch's
        kept = {k: before[k] for k in after if k in before and k not in passed and not _of_launch(k)}
        r.config = c = load_config(literal(_nested({**after, **kept})))  # the run's text is data: no ${...}
        after = flat(asdict(c))
    for key, new in after.items():  # (the launch's own keys change with every launch: the mesh line says it)
        if key in before and before[key] != new and not _of_launch(key):
            r.changes.append((key, before[key], new, *_policy(key, before[key], new, c.data.name)))
    refused = [(k, o, n, why) for k, o, n, decision, why in r.changes if decision == REFUSE]
    if refused:
        named = ", ".join(f"{k} ({o!r} -> {n!r}: {why})" for k, o, n, why in refused)
        raise ConfigError(f"cannot resume {run_dir} with changed {named}; {_undo(refused, passed, r.run_dir)}, or "
                          f"start a new run directory")
    return r


def _logged(run_dir: Path) -> bool:
    """The directory holds something a run logged or saved: metrics or diagnosis rows, anything in checkpoints/
    (a first checkpoint half written), a pre-emption mark."""
    def rows(name: str) -> bool:
        path = run_dir / name
        return path.is_file() and path.stat().st_size > 0 and bool(path.read_text().strip())

    ckdir = run_dir / "checkpoints"
    return rows("metrics.jsonl") or rows("diagnostics.jsonl") or (run_dir / "PREEMPTED").exists() or \
        (ckdir.is_dir() and any(ckdir.iterdir()))


def _refuse_without_checkpoint(c: Config, run_dir: Path, skipped: list, restarted: bool, sweep: bool) -> list[str]:
    """Refuse a directory that holds no valid checkpoint but a run's files (or damaged checkpoints): a new
    run there would mix with them (a restart of the same torchrun launch, or a SLURM requeue of the same job,
    starts over in its own directory). Files of a launch stopped before it logged or saved anything (Ctrl-C
    during its start) hold nothing to mix with: returns their names, and the run starts over there."""
    if skipped:
        named = "; ".join(f"{p.name} ({why})" for p, why in skipped)
        raise ConfigError(f"cannot resume {run_dir}: every checkpoint in it is damaged ({named}); nothing in it was "
                          f"changed: restore its checkpoints, or {_elsewhere(sweep)}")
    found = run_files(run_dir)
    foreign = [] if restarted else _not_written_by_pcdist(run_dir)
    if foreign:
        raise ConfigError(f"{run_dir} holds files that pcdist did not write ({', '.join(foreign)}), which a run there "
                          f"would overwrite; nothing was changed: {_elsewhere(sweep)}")
    if found and not restarted and not _logged(run_dir):
        return found
    if found and not restarted:
        raise ConfigError(f"{run_dir} holds a run's files ({', '.join(found)}) but no checkpoint to resume (it "
                          f"stopped before its first one), and a new run there would mix with them; "
                          f"{_elsewhere(sweep)}, or remove {run_dir} to start it over")
    if c.resume == "require":
        raise ConfigError(f"resume=require but {run_dir} holds no checkpoint to resume; check the directory "
                          f"(hydra.run.dir, or the config key run_dir) or drop resume=require to start a new run")
    return []


def _not_written_by_pcdist(run_dir: Path) -> list[str]:
    """The files of a run's names in ``run_dir`` that are not what pcdist writes there (a project's own
    config.yaml, in a folder given as hydra.run.dir=.): config.yaml a mapping of pcdist's config groups,
    model.json its layer record, configs/ attempt files only, train.log lines that start with their time."""
    def config_yaml(p: Path) -> bool:
        text = yaml.safe_load(p.read_text())
        return isinstance(text, dict) and {"model", "data", "pc", "trainer"} <= set(text)

    def model_json(p: Path) -> bool:
        text = json.loads(p.read_text())
        return isinstance(text, dict) and {"format", "layers", "inputs"} <= set(text)

    def configs(p: Path) -> bool:
        return p.is_dir() and all(re.fullmatch(r"attempt-\d+\.yaml", q.name) for q in p.iterdir())

    def train_log(p: Path) -> bool:
        with open(p, errors="replace") as f:
            first = f.readline()
        return first == "" or re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d  ", first) is not None

    foreign = []
    for name, ours in (("config.yaml", config_yaml), ("model.json", model_json), ("configs", configs),
                       ("train.log", train_log)):
        path = Path(run_dir) / name
        if not path.exists():
            continue
        try:
            if not ours(path):
                foreign.append(name)
        except (OSError, ValueError, yaml.YAMLError):  # unreadable, or not the format pcdist writes
            foreign.append(name)
    return foreign


def _refuse_other_settings(old: dict, c: Config, run_dir: Path) -> None:
    """A sweep's job refuses a directory holding a run of other settings than the job's own (a sweep into the
    folder of an earlier one): it would resume that run, or report it as this sweep's."""
    before, after = flat(old), flat(asdict(c))
    for key in DATA_PATHS:  # a run of an earlier pcdist recorded them as given (relative to the folder it ran in)
        if isinstance(before.get(key), str):
            before[key] = absolute_path(before[key])
    other = [k for k, v in after.items() if k in before and before[k] != v and not _of_launch(k)]
    if other:
        named = ", ".join(f"{k}={_shown(before[k])} (this job: {_shown(after[k])})" for k in other[:4])
        more = f" and {len(other) - 4} more" if len(other) > 4 else ""
        raise ConfigError(f"{run_dir} holds another run, made with {named}{more}; a sweep never continues a run of "
                          f"other settings: give the sweep a new hydra.sweep.dir, or resume that run on its own: "
                          f"{command()} {shlex.quote(run_dir_override(run_dir))} [the settings to change]")


def _shown(value: Any) -> str:
    """A setting as the command line writes it."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def _undo(refused: list, passed: dict[str, str] | None, run_dir: Path) -> str:
    """How to resume after all: drop the overrides that changed refused keys, or add back the run's own."""
    if passed is not None:
        drop = list(dict.fromkeys(passed[k] for k, *_ in refused if k in passed))
        return f"leave out {' '.join(drop)} (a resume continues with the run's own settings)"
    made = run_overrides(run_dir)
    try:
        source = passed_settings(made) or {}
    except Exception:  # an override kept from a dict that the command line cannot read back
        source = {}
    back = list(dict.fromkeys(source[k] for k, *_ in refused if k in source))
    if back:
        return f"add back {' '.join(back)} (the run was made with: {' '.join(made)})"
    return "set them back"


def run_overrides(run_dir: Path) -> list[str]:
    """The overrides the run's attempts were given, first to last (from configs/attempt-<n>.yaml)."""
    found = []
    for _, path in sorted((int(m.group(1)), p) for p in (Path(run_dir) / "configs").glob("attempt-*.yaml")
                          if (m := re.fullmatch(r"attempt-(\d+)\.yaml", p.name))):
        for line in path.read_text().splitlines():
            if line.startswith("# overrides: "):
                found += json.loads(line[len("# overrides: "):])
    return found


def position_schedule(sched: torch.optim.lr_scheduler.LambdaLR, opt: torch.optim.Optimizer, step: int) -> None:
    """Put a freshly built LambdaLR (this run's schedule) at ``step``, as if it had run from step 0."""
    sched.last_epoch = step
    lrs = [base * f(step) for base, f in zip(sched.base_lrs, sched.lr_lambdas)]
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    sched._last_lr = lrs


def write_attempt(run_dir: Path, c: Config, r: Resume, start: int) -> Path:
    """Keep this attempt's config as run_dir/configs/attempt-<n>.yaml (n = 1, 2, ...); returns its path."""
    folder = Path(run_dir) / "configs"
    folder.mkdir(parents=True, exist_ok=True)
    n = 1 + max((int(m.group(1)) for p in folder.glob("attempt-*.yaml")
                 if (m := re.fullmatch(r"attempt-(\d+)\.yaml", p.name))), default=0)
    how = f"resumed from {r.checkpoint.name} at step {start}" if r.checkpoint else "a new run"
    head = [f"# attempt {n}: {how}, started {time.strftime('%Y-%m-%d %H:%M:%S')}",
            f"# overrides: {json.dumps(r.overrides)}", f"# launch: {json.dumps(_launch_ids())}"]
    head += [f"# {line}" for line in r.lines()]
    path = folder / f"attempt-{n}.yaml"
    path.write_text("\n".join(head) + "\n" + yaml.safe_dump(asdict(c), sort_keys=False))
    return path
