"""``--multirun``: every job of a sweep checked before the first one starts.

Hydra's basic sweeper launches the jobs one after the other, each into ``hydra.sweep.dir/<job
number>``. Left to itself, a bad value in the second job stops the sweep after the first has run (and
leaves its directory and multirun.yaml behind), and a sweep into the directory of an earlier one
resumes, or reports as its own, the earlier sweep's runs. ``check_sweep`` expands the sweep as the
basic sweeper does (the product of the swept values, in its order), composes and checks each job's
config as ``train.py --check`` does, and its data against its model, and checks each job's directory:
a run of other settings there, or runs in the sweep directory that are no job of this sweep, are
refused, naming the directory and the way out. Other sweepers (Optuna) choose their jobs as they
go: their sweep directory must hold no runs yet, and each job is checked again as it starts
(``pcdist.service.run.run(..., sweep=True)``).

Two different sweeps launched at once into one new folder both pass these checks (it holds nothing yet);
``claim`` then marks the folder as the first one's before Hydra writes into it (multirun.yaml, the
jobs), and the second is refused before it writes anything.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from hydra.errors import HydraException
from omegaconf import open_dict

from ..errors import USER_ERRORS, ConfigError, printable
from .config import CONF_DIR, load_config, override_values, passed_settings
from .rundir import run_files, running

__all__ = ["check_sweep"]


def _config_loader():
    """Hydra's config loader over conf/, as its sweepers have one (a glob sweep lists a group's options with it)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path

    return ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF_DIR)))


def check_sweep(compose, overrides: list[str], claim: bool = True) -> list[list[str]]:
    """Check every job of the sweep ``overrides`` describe before any starts; ``compose(overrides)`` gives the
    config Hydra composes (with its ``hydra`` section). Raises ConfigError (one line, naming the job). Then, where
    the sweep will run (``claim``; not for ``--check``), claim its directory (``claim_sweep_dir``). Returns each
    job's overrides (a sweeper that draws its jobs as it goes, Optuna's: the fixed ones alone)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    loader = _config_loader()
    for o in parsed:  # what glob(...) lists the group's options with (without it: "ConfigLoader is not set")
        o.config_loader = loader
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    head = compose(fixed)
    if not str(head.hydra.sweep.dir).strip():  # (a quoted '': the jobs and multirun.yaml went into this folder)
        raise ConfigError("hydra.sweep.dir names no directory (an empty value); give the sweep a folder of its own")
    sweep_dir = Path(head.hydra.sweep.dir)
    held = run_files(sweep_dir)
    if held:  # (a run's own folder given as hydra.sweep.dir)
        raise ConfigError(f"sweep directory {sweep_dir} holds a run ({', '.join(held)}), whose files "
                          f"this sweep's jobs would mix with; give the sweep a new hydra.sweep.dir (no job was "
                          f"started)")
    jobs = [fixed]
    if not str(head.hydra.sweeper._target_).endswith(".BasicSweeper"):
        _refuse_earlier_runs(sweep_dir, set(), "it holds the runs of an earlier sweep")
        _check_search_space(compose, parsed, fixed)
    else:
        swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
        jobs, loaded = BasicSweeper.split_arguments(parsed, None)[0], {}
        dirs: dict = {}  # a job's directory -> the first job that runs there
        for num, job in enumerate(jobs):
            job_dir = _check_job(compose, num, job, swept, loaded)
            if job_dir is not None and job_dir.resolve() == sweep_dir.resolve():
                shown = f" ({_values(job, swept)})" if _values(job, swept) else ""
                raise ConfigError(f"sweep job {num}{shown} would run in the sweep's own folder "
                                  f"{sweep_dir} (hydra.sweep.subdir={head.hydra.sweep.subdir}), beside its "
                                  f"multirun.yaml; give the jobs folders of their own (the default "
                                  f"${{hydra.job.num}}); no job was started")
            if job_dir is not None and job_dir in dirs:
                raise ConfigError(f"sweep jobs {dirs[job_dir]} and {num} ({_values(job, swept)}) would both run in "
                                  f"{job_dir} (hydra.sweep.subdir={head.hydra.sweep.subdir}), the second resuming or "
                                  f"refusing the first's run: give each job a directory of its own (a subdir that "
                                  f"names every swept key, or the default ${{hydra.job.num}}), or sweep each "
                                  f"combination once; no job was started")
            dirs[job_dir] = f"{num} ({_values(job, swept)})"
        if None not in dirs:  # every job's directory known before Hydra launches it
            _refuse_earlier_runs(sweep_dir, set(dirs), "it holds runs that are no job of this sweep")
    if claim:
        claim_sweep_dir(sweep_dir, overrides)
    return jobs


CLAIM = ".pcdist-sweep.json"
"""The file in a sweep directory that names the sweep running into it (its overrides, process and host)."""


def claim_sweep_dir(sweep_dir: Path, overrides: list[str]) -> None:
    """Mark ``sweep_dir`` as this sweep's (``CLAIM``). The same sweep launched again (to resume it; each rank of
    a torchrun launch) shares the claim; a claim of other overrides is refused while its process runs on this
    host (or on another host: nothing tells here whether it still runs), and taken over once it has ended (the
    checks above have found its runs, if any, to be this sweep's jobs)."""
    mine = sorted(o for o in overrides if o.partition("=")[0].lstrip("+") != "hydra.sweep.dir")
    record = json.dumps({"overrides": mine, "pid": os.getpid(), "host": socket.gethostname()})
    path = sweep_dir / CLAIM
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        with open(path, "x") as f:
            f.write(record)
        return
    except FileExistsError:
        if not sweep_dir.is_dir():
            raise ConfigError(f"hydra.sweep.dir={sweep_dir}: a file is there, not a folder; choose another") from None
    except OSError as e:  # a read-only or full disk
        raise ConfigError(f"cannot claim the sweep directory {sweep_dir}: {e.strerror or e}") from None
    try:
        theirs = json.loads(path.read_text())
    except (OSError, ValueError):  # unreadable: written by no pcdist, or cut short; taken over below
        theirs = {}
    theirs = theirs if isinstance(theirs, dict) else {}
    if theirs.get("overrides") == mine:
        return
    if theirs.get("host") != socket.gethostname() or running(theirs.get("pid")):
        said = printable(" ".join(map(str, theirs.get("overrides") or [])))
        raise ConfigError(f"sweep directory {sweep_dir}: another sweep is launching into it (process "
                          f"{printable(theirs.get('pid'))} on {printable(theirs.get('host'))}: {said}), which this "
                          f"sweep would mix with its own; give the sweep a new hydra.sweep.dir, or remove {path} if "
                          f"that sweep has ended (no job was started)")
    path.write_text(record)


def _check_job(compose, num: int, job: list[str], swept: set[str], loaded: dict) -> Path | None:
    """Job ``num`` of the sweep: its config valid for this launch and its data, its directory free or holding its
    own run (``loaded``: the data sets read so far, each once). Returns the directory (None where Hydra names
    it only as it launches the job)."""
    from .checks import check_as_launched

    composed = compose([*job, f"hydra.job.num={num}"])
    try:
        job_dir = Path(composed.hydra.sweep.dir) / str(composed.hydra.sweep.subdir)
    except Exception:  # noqa: BLE001 - a subdir that Hydra resolves only as it launches the job
        job_dir = None  # (hydra.job.override_dirname): the job's own check in run() covers its directory
    with open_dict(composed):
        composed.pop("hydra")  # Hydra's own section resolves only in a running job
    values = _values(job, swept)
    try:
        check_as_launched(load_config(composed), passed_settings(job), int(os.environ.get("WORLD_SIZE", "1")),
                          job_dir, sweep=True, loaded=loaded)
    except USER_ERRORS as e:
        raise ConfigError(f"sweep job {num} ({values}): {e}; no job was started") from None
    return job_dir


def _check_search_space(compose, parsed, fixed: list[str]) -> None:
    """A search space's values that can be listed (choice, range), each with the fixed settings: a bad one is one
    line before the first trial, not an error after the trials before it drew valid ones (their folders then
    refused the corrected relaunch)."""
    for o in parsed:
        if not o.is_sweep_override():
            continue
        for value in override_values(o):
            setting = f"{o.get_key_element()}={value}"
            try:
                composed = compose([*fixed, setting])
                with open_dict(composed):
                    composed.pop("hydra")
                load_config(composed)
            except (*USER_ERRORS, HydraException) as e:
                raise ConfigError(f"the search space's {setting}: {' '.join(str(e).split())}; no trial was "
                                  f"started") from None


def _values(job: list[str], swept: set[str]) -> str:
    """A job's swept settings, as its overrides: "pc.T=5 trainer.seed=1"."""
    return " ".join(o for o in job if o.split("=", 1)[0] in swept)


def _refuse_earlier_runs(sweep_dir: Path, jobs: set[Path], why: str) -> None:
    """Refuse a sweep directory holding runs other than ``jobs`` (an earlier sweep's)."""
    held = sorted(d.name for d in sweep_dir.iterdir() if d.is_dir() and d not in jobs and run_files(d)) \
        if sweep_dir.is_dir() else []
    if held:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise ConfigError(f"sweep directory {sweep_dir}: {why} ({shown}), which this sweep would mix with its own; "
                          f"give the sweep a new hydra.sweep.dir (no job was started)")
