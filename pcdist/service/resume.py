"""How a run starts in its directory, new or resumed (what ``find_resume`` in rundir.py decided): the lines that
say so (``announce``), the rows of steps trained again dropped from the logs (``forget_lost_steps``), and the line
for a run with nothing left to train (``nothing_to_train``); the checkpoint, schedule and RNG restored
(``restore_checkpoint``)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import torch

from .checkpoint import CheckpointError, load_checkpoint
from .config import PYTHON_DATA, PYTHON_MODEL, Config, command, run_dir_override
from .diagnostics import FILE as DIAGNOSTICS_FILE
from .metrics import truncate_jsonl
from .optimizer import optimizer_steps
from .rundir import Resume, position_schedule, write_attempt


SWEEP: list[str] = []
"""While a ``--multirun`` runs: its command line's arguments (cli.py), the way to continue a job of it."""


def resume_command(c: Config, run_dir, alone: bool = False) -> str:
    """How to continue the run in ``run_dir``: its command line (in a launch/slurm.sbatch job, which sets
    PCDIST_LAUNCHER=slurm and refuses hydra.run.dir=, its resubmission; under launch/local.sh, PCDIST_LAUNCHER=local,
    that script), or for data or layers passed from Python the call that passes them again; in a sweep the sweep's
    command line (``alone``: the job's own)."""
    if c.data.name == PYTHON_DATA or c.model.name == PYTHON_MODEL:
        given = ", ".join(k for k, on in (("data=...", c.data.name == PYTHON_DATA),
                                          ("layers=...", c.model.name == PYTHON_MODEL)) if on)
        return f"pcdist.train({{'run_dir': '{run_dir}'}}, {given}) with the same {given.replace('=...', '')}"
    if os.environ.get("PCDIST_LAUNCHER") == "slurm":  # (the script's path as the job found it)
        script = os.environ.get("PCDIST_SLURM_SCRIPT", "launch/slurm.sbatch")
        return f"RUN_DIR={shlex.quote(str(run_dir))} sbatch [its sbatch options] {shlex.quote(script)}"
    if os.environ.get("PCDIST_LAUNCHER") == "local":  # launch/local.sh's workers: the script again, by its path
        script = os.environ.get("PCDIST_LOCAL_SCRIPT", "launch/local.sh")  # (python train.py: none in the caller's
        return f"{shlex.quote(script)} {shlex.quote(run_dir_override(run_dir))}"  # folder, and one process)
    if SWEEP and not alone:  # the sweep again: it resumes this job, then runs those after it
        return f"{command()} {shlex.join(SWEEP)} (the same sweep: it continues this job, then runs the rest)"
    return f"{command()} {shlex.quote(run_dir_override(run_dir))}"  # (a folder with spaces: one argument)


def nothing_to_train(c: Config, run_dir: Path, step: int, sweep: bool = False) -> str:
    """The one line for a rerun into a run that has nothing left to train."""
    t = c.trainer
    if step >= t.max_steps:
        way = (f"a sweep's jobs keep their settings: to train longer, launch the sweep with a larger "
               f"trainer.max_steps into a new hydra.sweep.dir, or continue this run on its own: "
               f"{resume_command(c, run_dir, alone=True)} trainer.max_steps=..." if sweep else
               "raise trainer.max_steps to train on, or leave out the run directory for a new run")
        return (f"{run_dir} is already finished: its newest checkpoint is step {step} and trainer.max_steps="
                f"{t.max_steps}; nothing to train ({way})")
    return (f"{run_dir} is at step {step}, at or past trainer.stop_at={t.stop_at}; nothing to train (raise "
            f"trainer.stop_at)")


def forget_lost_steps(run_dir: Path, start: int) -> int:
    """Drop the rows a run logged after the checkpoint it resumes at ``start`` (0: a restart before the first
    checkpoint), which it trains again: from metrics.jsonl (steps after ``start``, and the diagnosis at
    ``start``, which the attempt makes again before its first update) and diagnostics.jsonl (the diagnoses at
    ``start`` and after). Returns how many metrics rows were dropped."""
    run_dir = Path(run_dir)
    truncate_jsonl(run_dir / DIAGNOSTICS_FILE, lambda r: r.get("step", 0) < start)
    return truncate_jsonl(run_dir / "metrics.jsonl", lambda r: r.get("step", 0) < start or (
        r.get("step", 0) == start and not any(k.startswith("diag/") for k in r)))


def announce(c: Config, resume, run_dir: Path, start: int, opt, logger, dropped: int = 0) -> None:
    """Keep this attempt's config and say, one line each, how the run starts and what changed."""
    attempt = write_attempt(run_dir, c, resume, start).relative_to(run_dir)
    gone = f"dropped the {dropped} metrics.jsonl rows of the steps after {start}, which are trained again"
    if resume.checkpoint is None:
        if resume.unstarted:
            logger.say(f"start: {run_dir} holds the files of a launch that stopped before it logged a step "
                       f"({', '.join(resume.unstarted)}): the run starts over there")
        logger.say(f"new run in {run_dir} (config: {attempt})")
        if dropped:  # a torchrun restart before the first checkpoint
            logger.say(f"restart: {gone}")
        return
    if resume.skipped:
        logger.say(resume.skipped_line())
    logger.say(f"resumed from {resume.checkpoint} at step {start} of {c.trainer.max_steps} with the run's own "
               f"settings (config: {attempt})")
    if dropped:
        logger.say(f"resume: {gone}")
    for line in resume.lines():
        logger.say(line)
    if resume.unknown_config:
        logger.say("resume: the checkpoint carries no config and the directory no config.yaml: changed settings are "
                   "not checked")
    if resume.schedule_changed:
        logger.say(f"resume: the LR schedule is recomputed at step {start}: lr {resume.meta['lr']:.4g} -> "
                   f"{opt.param_groups[0]['lr']:.4g}")


def restore_checkpoint(resume: Resume, net, opt, sched) -> None:
    """Load the checkpoint the run resumes from (none: a new run) into the network and the optimizer, and put
    the LR schedule and torch's RNG where the run left them (where the schedule changed, this run's schedule
    at the resumed step)."""
    if resume.checkpoint is None:
        return
    meta = load_checkpoint(resume.checkpoint, net, opt)
    missing = [k for k in ("scheduler", "lr", "rng") if k not in meta]
    if missing:  # (every pcdist wrote them: a file made elsewhere, its manifest signed again)
        raise CheckpointError(f"{resume.checkpoint / 'meta.pt'} holds no {', '.join(missing)}: not a checkpoint file "
                              f"pcdist wrote; nothing in the run directory was changed")
    if resume.schedule_changed:  # this run's schedule, at the resumed step
        position_schedule(sched, opt, resume.step * optimizer_steps(resume.config))
    else:
        sched.load_state_dict(meta["scheduler"])
        for g in opt.param_groups:
            g["lr"] = meta["lr"]
    torch.set_rng_state(meta["rng"])
