"""The training service's command line: ``pcdist-train``, ``python -m pcdist`` and, in a checkout, ``python train.py``.

    pcdist-train [overrides]                                      # one process
    torchrun --standalone --nproc_per_node=2 -m pcdist            # two layer-parallel processes
    pcdist-train --help                                           # every config group and key, documented

A thin Hydra wrapper over ``pcdist.train``: the configs are the shipped ``conf/``
(``pcdist.config.CONF_DIR``), so an installed wheel runs without a checkout. Around it:
the command line checked before Hydra sees it, ``--help`` from the config's own
documentation, ``--check``, and user errors as one line.

A user error (a mistyped key, a value out of range, a mesh that does not fit, missing data
files, a checkpoint of another model, a wandb login missing) is printed as one line and
exits with status 2. Under torchrun every rank finds the same error; only local rank 0
prints it (once per machine), the others wait a moment so that torchrun, which stops every
worker once one has exited, does not stop local rank 0 before it has printed.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # CPU results independent of memory alignment (exact resume);
# read by MKL at its first call, so setting it here, before any computation, is early enough.

from .config import CONF_DIR, Config, config_keys, did_you_mean, load_config  # noqa: E402

__all__ = ["main", "fail", "before_hydra", "check_overrides", "help_text"]

USAGE = """\
usage: python train.py [group=option ...] [key=value ...]           one process (or pcdist-train, python -m pcdist)
       torchrun --nproc_per_node=N train.py [...]                    N processes (launch/local.sh does this)
       WORLD_SIZE=N python train.py --check [...]                    check the overrides for N processes, run nothing
       python train.py --help [...]                                  this text, with the values those overrides give
       python train.py --multirun optim.lr=1e-3,2e-3                 one run directory per job (runs/multirun/...)
       python -m pcdist evaluate|predict|export|compare ...          after training (python -m pcdist evaluate -h)
"""


def fail(message: str) -> None:
    """Print ``error: <message>`` once (local rank 0) and exit with status 2."""
    if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(3)  # torchrun stops every worker once one exits: let local rank 0 print first
    sys.exit(2)


def preempted_status() -> int:
    """The exit status of a pre-empted run: 3, or ``$PCDIST_PREEMPTED_STATUS``. launch/slurm.sbatch sets 0,
    so that torchrun's agent neither restarts the stopped workers nor reports them as failed (with a
    traceback); RUN_DIR/PREEMPTED tells the script to requeue. Anything but a number 0-255 means 3."""
    value = os.environ.get("PCDIST_PREEMPTED_STATUS", "3")
    return int(value) if value.isdigit() and int(value) < 256 else 3


def _ignore_stop_signals() -> None:
    """The run is over: ignore further SIGTERM / SIGUSR1 on the way out. Python puts back their default
    action (death) as the interpreter exits, and a launcher may repeat them until the process is gone
    (launch/slurm_node.sh does): a pre-empted worker killed so would count as failed, and torchrun would
    restart the group."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def before_hydra(conf_dir: Path, argv: list[str]) -> None:
    """Handle ``--help`` and ``--check`` and refuse bad overrides, before Hydra composes anything.

    Hydra's own flags (``--hydra-help``, ``--cfg``, ``--info``, ``-m``, ...) pass through.
    """
    from hydra._internal.utils import get_args_parser

    check = "--check" in argv
    args = get_args_parser().parse_args([a for a in argv if a != "--check"])
    if (args.hydra_help or args.cfg or args.info or args.shell_completion or args.config_path or args.config_dir
            or args.config_name):  # Hydra's own business, or another config tree
        return
    problem = check_overrides(conf_dir, args.overrides)
    if problem:
        fail(problem)
    from hydra.errors import HydraException

    from .config import composition_error

    try:  # a value of the wrong type for its key: one line, not Hydra's report (each job of a sweep is
        # checked as Hydra launches it: pcdist.train validates its config)
        _compose(conf_dir, _fixed(args.overrides) if args.multirun else args.overrides)
    except HydraException as e:
        fail(str(composition_error(e)))
    if not (args.help or check):
        return

    from .data import DataError
    from ..errors import ConfigError
    from .run import check as check_run

    try:
        if args.help:
            print(help_text(conf_dir, args.overrides))
        else:
            cfg = load_config(_compose(conf_dir, args.overrides))
            print(f"ok: {check_run(cfg, int(os.environ.get('WORLD_SIZE', '1')))}")
    except HydraException as e:
        fail(" ".join(str(e).split()))
    except (ConfigError, DataError) as e:
        fail(str(e))
    sys.exit(0)


def _fixed(overrides: list[str]) -> list[str]:
    """The overrides of a --multirun that are not sweeps (``optim.lr=1e-3,2e-3``, ``x=interval(0,1)``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [text for text, o in zip(overrides, parsed) if not o.is_sweep_override()]


def _groups(conf_dir: Path) -> dict[str, list[str]]:
    """Config group -> its options (conf/<group>/<option>.yaml)."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(conf_dir.iterdir()) if d.is_dir()}


def check_overrides(conf_dir: Path, overrides: list[str]) -> str | None:
    """The first problem with the command-line overrides as one line, or None.

    A key that is not in the config gets a did-you-mean from the known keys (Hydra itself would
    advise appending it with ``+key``, which the structured config then refuses); a group option
    that does not exist lists the options.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        return f"cannot read the override: {' '.join(str(e).split())}"
    keys, groups = config_keys(), _groups(conf_dir)
    for o in parsed:
        key = o.key_or_group
        if o.is_delete() or key.split(".")[0].split("/")[0] == "hydra" or o.package:
            continue
        if key in groups:
            v = None if o.is_sweep_override() else o.value()
            if isinstance(v, str) and v not in groups[key]:
                return (f"{key}={v}: no such option in conf/{key}/ (options: {', '.join(groups[key])})"
                        f"{did_you_mean(v, groups[key])}")
            continue
        if key in keys:
            if o.is_add():
                return f"config key {key} already exists: set it with {key}=... (without +, which adds a new key)"
            continue
        if any(key.startswith(k + ".") for k in keys):  # an element of a list-valued key, e.g. model.dims.0
            continue
        return f"unknown config key {key}{did_you_mean(key, keys)} (python train.py --help lists every key)"
    return None


def _compose(conf_dir: Path, overrides: list[str], hydra: bool = False):
    """The config Hydra composes from ``conf_dir`` with ``overrides`` (no run directory, no logging setup)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir.resolve()), version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def help_text(conf_dir: Path, overrides: list[str]) -> str:
    """Usage, the config groups and their options (the chosen one starred), then every key with its
    value under ``overrides`` and the documentation written under its field in pcdist/service/config.py."""
    from omegaconf import OmegaConf

    composed = _compose(conf_dir, overrides, hydra=True)
    chosen = OmegaConf.to_container(composed.hydra.runtime.choices)
    top = {f.name for f in dataclasses.fields(Config)}
    # The values a run gets: the composed files over the dataclass defaults (as load_config merges them).
    cfg = OmegaConf.merge(OmegaConf.structured(Config), {k: v for k, v in composed.items() if k in top})
    lines = [USAGE, "config groups (conf/<group>/<option>.yaml; * = chosen):"]
    for group, options in _groups(conf_dir).items():
        if group != "hydra":
            lines.append(f"  {group:<11} " + ", ".join(o + "*" * (chosen.get(group) == o) for o in options))
    lines += ["", "keys (value with these overrides; every key is checked before any process starts):"]
    for key, doc in config_keys().items():
        value = OmegaConf.select(cfg, key, default=None)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        lines.append(f"  {key} = {'null' if value is None else value}")
        lines.append(f"      {doc}")
    lines += ["", "Hydra's own flags (multirun, --cfg job, tab completion): python train.py --hydra-help"]
    return "\n".join(lines)


def _train(cfg) -> float | None:
    import pcdist
    from hydra.core.hydra_config import HydraConfig

    from .checkpoint import CheckpointError
    from .data import DataError

    cfg.run_dir = HydraConfig.get().runtime.output_dir
    try:
        result = pcdist.train(cfg)
    except pcdist.Preempted as e:  # checkpointed; exit status 3 and run_dir/PREEMPTED tell the launcher
        if int(os.environ.get("RANK", "0") or 0) == 0:  # every rank stops after the same step: one line says so
            print(f"pre-empted: {e}", flush=True)
        sys.exit(preempted_status())
    except (pcdist.ConfigError, DataError, CheckpointError) as e:  # the user's input, not a bug: one line, status 2
        fail(str(e))
    finally:
        _ignore_stop_signals()
    shown = [f"{k} {result[k]:.4f}" if k == "val/accuracy" else f"{k} {result[k]:.4g}"
             for k in ("val/accuracy", "val/reconstruction_mse") if k in result]
    if shown:
        print(f"step {result['step']}: {', '.join(shown)}; run directory: {result['run_dir']}", flush=True)
    return result.get("val/accuracy")  # the objective of a sweeper (Optuna: direction maximize)


def main() -> None:
    """Check the command line, then parse it as Hydra overrides and train."""
    import hydra

    from ..errors import ConfigError
    from .commands import COMMANDS, main as command
    from .rundir import launch_run_dir

    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:  # after training: evaluate, predict, export, compare
        sys.exit(command(sys.argv[1:]))
    before_hydra(CONF_DIR, sys.argv[1:])  # --help, --check, mistyped keys
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Under torchrun every rank runs Hydra: none writes Hydra's own files (the logging rank
        # writes the resolved config.yaml itself), and all agree on the run directory (pcdist/service/rundir.py).
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    if not any(a.startswith(("hydra.run.dir=", "--help", "-h", "--cfg", "-c", "--info", "--multirun", "-m"))
               for a in sys.argv[1:]):
        try:  # the new run directory, named before Hydra resolves it (cached: Hydra gets the same)
            launch_run_dir()
        except ConfigError as e:
            fail(str(e))
    hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")(_train)()


if __name__ == "__main__":
    main()
