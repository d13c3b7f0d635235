"""``train(cfg)``: one training run, from a config to final metrics, on 1 to N ranks.

The same function runs in a single process (tests call it directly) and on every
rank of ``torchrun``: it composes and validates the config (conf/'s defaults, as the
command line), resumes the run directory with the run's own settings (rundir.py decides
what changed settings mean), checks the launch (checks.py), picks the device and its threads
(device.py) and joins the process group; ``ServiceTrainer`` (trainer.py) does the rest: the
data, the rank's place in the mesh, the model, the resumed checkpoint, training, evaluation,
checkpoints and logs.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.exchange import report_failure
from ..distributed.parallel import barrier, init_distributed, leave_process_group
from ..engine import native
from ..engine.arguments import env_choice
from ..engine.precision import restore_tf32, tf32_state
from ..errors import ConfigError
from .checks import check, check_length, choose_mesh
from .config import (PYTHON_DATA, PYTHON_MODEL, Config, absolute_data_paths, check_combination, flat, make_config,
                     passed_settings)
from .checkpoint import CheckpointError
from .data import DataError, Dataset, StreamedData
from .device import cpu_threads, pick_device, use_device
from .models import check_model_keys
from .optimizer import check_optim_keys
from .preemption import Interrupted, Preempted
from .resume import resume_command
from .rundir import find_resume, lock_run_dir, next_run_dir, unlock_run_dir
from .trainer import Result, ServiceTrainer
from .userlayers import UserLayers

__all__ = ["train", "run", "check", "Preempted", "Interrupted", "choose_mesh", "cpu_threads", "Result"]


def train(cfg=None, data: Dataset | StreamedData | None = None, layers=None) -> Result:
    """Train as configured; returns the final metrics (complete on the logging rank) and, as
    ``result.network``, the trained network (this rank's layer slice under torchrun).

    ``cfg``: a dict applied on top of conf/'s defaults, as overrides on the command line are
    (``{"data": "mnist", "optim": {"lr": 0.01}}``: a string for a group picks its file), a list
    of command-line overrides (``["data=mnist", "optim.lr=0.01"]``), a DictConfig composed
    already (``pcdist.compose([...])``), or None (the defaults). ``data``: your own data instead
    of ``data.name``: a ``pcdist.data.Dataset`` (tensors in memory) or
    ``pcdist.data.StreamedData`` (torch Datasets, read by DataLoader worker processes).
    ``layers``: your own model instead of ``model``: one torch module per PC layer (or an
    nn.Sequential, or a function returning either; an importable function is recorded in the run
    so that ``pcdist.load`` rebuilds the exact modules). Their weights are the initial weights.
    ``run_dir`` unset: a new directory (pcdist/service/rundir.py). A ``run_dir`` that holds a
    checkpoint is resumed with the run's own settings, changed only where ``cfg`` sets a key.
    """
    return run(make_config(cfg), passed_settings(cfg), data, layers)


def run(c: Config, passed: dict[str, str] | None, data: Dataset | StreamedData | None = None,
        layers=None, sweep: bool = False) -> Result:
    """``train`` of a validated Config; ``passed``: the keys the user set now, each with its override
    (``passed_settings``; None: every key), which a resume applies to the run's saved settings.
    ``sweep``: a job of a sweep (``--multirun``), which continues only a run of its own settings."""
    user = None
    if layers is not None:
        user = UserLayers.of(layers)
        c.model.name, c.model.depth = PYTHON_MODEL, len(user.modules)
    elif c.model.name == PYTHON_MODEL:
        raise ConfigError(f"config model.name={PYTHON_MODEL!r} stands for layers passed to pcdist.train(cfg, "
                          f"layers=...), and none were passed")
    if data is not None:  # it replaces the data set and its files (a preset's data.root)
        c.data.name, c.data.root, c.data.path = PYTHON_DATA, None, None
        if passed is not None:
            passed["data.name"] = "data=... (pcdist.train's argument)"
    absolute_data_paths(c)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    c.run_dir = str(c.run_dir or next_run_dir())
    first = int(os.environ.get("RANK", "0")) == 0  # holds the directory for the launch (the others share it)
    if first:
        lock_run_dir(Path(c.run_dir))
    try:
        return _run(c, passed, data, user, world, sweep)
    finally:
        if first:
            unlock_run_dir()


def _check_launcher(world: int) -> None:
    """Several ranks need the rendezvous torchrun sets up: WORLD_SIZE left set in a shell (or a job's environment)
    for a plain ``python train.py`` is one line, not torch's traceback."""
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if world > 1 and missing:
        raise ConfigError(f"WORLD_SIZE={world} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                          f"not: this process was not started by torchrun; launch it with torchrun "
                          f"--nproc_per_node={world} train.py [overrides], or unset WORLD_SIZE")


def _run(c: Config, passed: dict[str, str] | None, data, user: UserLayers | None, world: int, sweep: bool) -> Result:
    resume = find_resume(c, Path(c.run_dir), passed, sweep)  # the run's own settings, or a one-line refusal
    c = resume.config
    check_combination(c)
    check_length(c, passed)
    check_model_keys(c, passed)
    check_optim_keys(c, passed)
    missing = [what for what, gone in (("data", data is None and c.data.name == PYTHON_DATA),
                                       ("layers", user is None and c.model.name == PYTHON_MODEL)) if gone]
    if missing and resume.checkpoint is not None:  # (the command line cannot pass them)
        raise ConfigError(f"{c.run_dir} was trained on {' and '.join(missing)} passed to pcdist.train from Python; "
                          f"continue it there: {resume_command(c, c.run_dir)}")
    if data is None and c.data.name == PYTHON_DATA:
        raise ConfigError(f"config data.name={PYTHON_DATA!r} stands for data passed to pcdist.train(cfg, data=...), "
                          f"and none was passed")
    mesh = check(c, world)
    _check_launcher(world)
    device = pick_device(c)
    # the caller's TF32 switches, torch threads and cuDNN search, put back when the run ends (the run sets its own)
    tf32, caller = tf32_state(), (torch.get_num_threads(), torch.backends.cudnn.benchmark)
    threads = use_device(c, device)
    distributed = world > 1
    torchrun = distributed or "TORCHELASTIC_RUN_ID" in os.environ  # every attempt says its mesh, one rank or more
    failed = True  # until the run ends or stops as every rank does (pre-empted: after the same step)
    try:
        if distributed and device.type == "cpu" and env_choice("PCDIST_NATIVE") == "1":
            native.library()  # the fused CPU kernel, compiled at its first use (tens of seconds, once per machine and
            # version): before the ranks meet, not in a first step whose peers wait only parallel.timeout_s for it
        if distributed:
            init_distributed(device, timeout_s=c.parallel.timeout_s,
                             backend=None if c.parallel.backend == "auto" else c.parallel.backend)
            _check_same_settings(c)
        trainer = ServiceTrainer(c, device, distributed, data, user=user, resume=resume,
                                 mesh_line=mesh + threads if torchrun else None)
        try:
            result = trainer.train()
            failed = False
            return result
        except Preempted:
            failed = False
            raise
        except Exception as e:  # the run's end, which the caller says on stderr, in its record too
            trainer.record(f"error: {str(e).splitlines()[0] if str(e).strip() else type(e).__name__}")
            raise
        finally:
            trainer.close()
            if distributed and not failed:  # the logging rank's last writes (its line, plots, wandb) done before
                barrier("the end-of-run barrier", device=device)  # the first rank lets the directory go
    except (ConfigError, DataError, CheckpointError, FloatingPointError) as e:  # its peers name this rank and why
        if distributed and dist.is_initialized():
            report_failure(str(e))
        raise
    finally:
        restore_tf32(tf32)
        torch.set_num_threads(caller[0])
        torch.backends.cudnn.benchmark = caller[1]
        if distributed and dist.is_initialized():
            leave_process_group(failed)


def _check_same_settings(c: Config) -> None:
    """Every rank of a launch trains one run: a rank started with other settings than rank 0 (another node's
    environment or script, say) is refused in one line naming the keys that differ, where it would otherwise fail
    in an exchange of the wrong size. Rank 0 leaves its settings in the rendezvous store (per torchrun attempt)."""
    mine = flat(asdict(c))
    key = "pcdist/settings"  # the store is this attempt's own (rendezvous.py): restart counts differ between nodes
    store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
    if rank == 0:
        store.set(key, json.dumps(mine, default=str))
        return
    theirs = json.loads(store.get(key))  # waits for rank 0 (within the store's timeout)
    mine = json.loads(json.dumps(mine, default=str))
    differ = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    if differ:
        shown = ", ".join(f"{k}={mine.get(k)!r} (rank 0: {theirs.get(k)!r})" for k in differ[:4])
        raise ConfigError(f"rank {rank} was started with other settings than rank 0: {shown}"
                          f"{f' and {len(differ) - 4} more' if len(differ) > 4 else ''}; every rank of a launch must "
                          f"get the same overrides")
