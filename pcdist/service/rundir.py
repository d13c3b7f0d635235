"""The run directory: a new one per launch, resuming one (a visible choice), and the config of every attempt.

* A run that names no directory gets ``runs/<date>/<time>-<id>``, which no other launch
  uses (``new_run_dir``). Every rank of one torchrun launch, and every restart of it,
  must find the same directory without talking to each other, so under torchrun the
  first rank to start picks the name and records it in ``runs/.launches/<launch key>``;
  the others, and restarted workers, read it there.
* A directory that holds a checkpoint is resumed (``resume=auto``); ``resume=never``
  refuses to continue it, ``resume=require`` refuses to start fresh. A finished run is
  reported in one line and left untouched.
* A setting changed on resume is refused, applied, or applied with a warning, per key
  (``ON_RESUME``), one line each; the config of every attempt is kept as
  ``configs/attempt-<n>.yaml`` (``config.yaml`` is the latest).
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import OmegaConf

from .checkpoint import latest_checkpoint
from .config import Config
from ..errors import ConfigError

__all__ = ["new_run_dir", "launch_run_dir", "next_run_dir", "Resume", "find_resume", "ON_RESUME", "SCHEDULE_KEYS",
           "write_attempt", "position_schedule"]

_calls = itertools.count(1)


def _launch_key() -> tuple[str, str]:
    """(key, short name) of this torchrun launch: the same on every rank and restart, different between launches."""
    run_id = os.environ["TORCHELASTIC_RUN_ID"]  # --standalone: a fresh uuid; else --rdzv-id (default "none")
    if run_id != "none":
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)
        return safe, safe[:8] if re.fullmatch(r"[0-9a-f]{8}-[0-9a-f-]{27}", run_id) else safe
    hint = ("pass --standalone or --rdzv-id=<an id unique to this run>, or name the directory: hydra.run.dir=... "
            "(Python: run_dir=...)")
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"torchrun on several nodes with the rendezvous id 'none': the ranks cannot agree on a new "
                          f"run directory; {hint}")
    ppid = os.getppid()  # the torchrun agent: the same for every local rank and across restarts
    try:  # its start time in clock ticks since boot (field 22 of /proc/<pid>/stat): tells reused pids apart
        started = Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        raise ConfigError(f"torchrun with the rendezvous id 'none' on a system without /proc: the ranks cannot agree "
                          f"on a new run directory; {hint}") from None
    return f"agent-{ppid}-{started}", f"p{ppid}"


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
                              "set run_dir=... (hydra.run.dir=... on the command line)")
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
    "trainer.batch_size": (REFUSE, "it changes the global batches (the data order) and what a step is"),
    "trainer.seed": (REFUSE, "it changes the initial weights and the data order"),
    "optim.name": (REFUSE, "the checkpoint holds the other optimizer's state"),
    "data.root": (WARN, SAME_DATA),
    "data.path": (WARN, SAME_DATA),
    "trainer.dtype": (WARN, "the checkpoint's weights and optimizer state are cast to the new precision"),
    "pc.algorithm": (WARN, "the weights so far were trained with the other algorithm"),
    "parallel": (APPLY, "checkpoints are keyed by layer, so any split resumes"),
}
SCHEDULE_KEYS = ("optim.lr", "optim.warmup_steps", "optim.schedule", "optim.final_lr_ratio", "trainer.max_steps",
                 "trainer.epochs")
"""Keys whose change rebuilds the LR schedule at the resumed step (instead of loading the saved one)."""
_NOT_SETTINGS = ("run_dir", "resume")


def _policy(key: str) -> tuple[str, str]:
    if key in ON_RESUME:
        return ON_RESUME[key]
    if key.split(".")[0] in ON_RESUME:
        return ON_RESUME[key.split(".")[0]]
    if key in SCHEDULE_KEYS:
        return APPLY, "the LR schedule is recomputed at the resumed step"
    return APPLY, "from the resumed step on"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@dataclass
class Resume:
    """What a run directory holds for this run: a checkpoint to resume (or None) and the settings that changed."""

    run_dir: Path
    checkpoint: Path | None = None
    meta: dict | None = None
    changes: list[tuple[str, Any, Any, str, str]] = field(default_factory=list)
    """(key, old, new, decision, why) per changed setting."""
    unknown_config: bool = False
    """The checkpoint carries no config and the directory no config.yaml: nothing to compare with."""

    @property
    def step(self) -> int:
        return int(self.meta["step"]) if self.meta else 0

    @property
    def schedule_changed(self) -> bool:
        return any(k in SCHEDULE_KEYS for k, *_ in self.changes)

    def lines(self) -> list[str]:
        """One line per changed setting, with its decision and why."""
        return [f"resume: {k} changed {old!r} -> {new!r}: {decision} ({why})"
                for k, old, new, decision, why in self.changes]


def find_resume(c: Config, run_dir: Path) -> Resume:
    """The newest valid checkpoint of ``run_dir`` and how this run's settings differ from the ones that wrote it.

    Raises ConfigError (one line) when ``resume=`` forbids what the directory holds, or when
    a refused setting changed (all of them named).
    """
    r = Resume(Path(run_dir), latest_checkpoint(run_dir))
    if r.checkpoint is None:
        if c.resume == "require":
            raise ConfigError(f"resume=require but {run_dir} holds no checkpoint to resume; check the directory "
                              f"(hydra.run.dir / run_dir) or drop resume=require to start a new run")
        return r
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0  # the same launch, restarted
    if c.resume == "never" and not restarted:
        raise ConfigError(f"resume=never but {run_dir} holds a run (checkpoint {r.checkpoint.name}); choose another "
                          f"directory, or resume=auto to continue it")
    r.meta = torch.load(r.checkpoint / "meta.pt", weights_only=True, map_location="cpu")
    old = r.meta.get("config")
    if old is None and (r.run_dir / "config.yaml").is_file():  # checkpoints written before configs were kept in them
        old = yaml.safe_load((r.run_dir / "config.yaml").read_text())
    if old is None:
        r.unknown_config = True
        return r
    before, after = _flat(old), _flat(asdict(c))
    for key in after:
        if key in before and key not in _NOT_SETTINGS and before[key] != after[key]:
            r.changes.append((key, before[key], after[key], *_policy(key)))
    refused = [f"{k} ({old!r} -> {new!r}: {why})" for k, old, new, decision, why in r.changes if decision == REFUSE]
    if refused:
        raise ConfigError(f"cannot resume {run_dir} with changed {', '.join(refused)}; set them back, or start a new "
                          f"run directory")
    return r


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
    head = [f"# attempt {n}: {how}, started {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    head += [f"# {line}" for line in r.lines()]
    path = folder / f"attempt-{n}.yaml"
    path.write_text("\n".join(head) + "\n" + yaml.safe_dump(asdict(c), sort_keys=False))
    return path
