"""The training service's command line: ``pcdist-train``, ``python -m pcdist`` and, in a checkout, ``python train.py``.

    pcdist-train [overrides]                                      # one process
    torchrun --standalone --nproc_per_node=2 -m pcdist            # two layer-parallel processes
    pcdist-train --help                                           # every config group and key, documented

A thin Hydra wrapper over ``pcdist.train``: the configs are the shipped ``conf/``
(``pcdist.service.config.CONF_DIR``), so an installed wheel runs without a checkout. Around it:
the command line checked before Hydra sees it, ``--help`` from the config's own
documentation, ``--check``, and user errors as one line.

A user error (a mistyped key, a value out of range, a mesh that does not fit, missing data
files, a checkpoint of another model, a wandb login missing) is printed as one line and
exits with status 2. Under torchrun every rank finds the same error; only local rank 0
prints it (once per machine), the others wait a moment so that torchrun, which stops every
worker once one has exited, does not stop local rank 0 before it has printed. A neighbour
rank that died or hung is one line too (status 1), without the survivor's traceback.

Hydra writes none of its own files into the run directory, and the directories Hydra creates
for a launch that then fails before training are removed: a failed launch leaves nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import io
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # CPU results independent of memory alignment (exact resume);
# read by MKL at its first call, so setting it here, before any computation, is early enough.

from .config import (CONF_DIR, Config, check_overrides, command, config_keys, did_you_mean, groups,  # noqa: E402
                     load_config)
from ..errors import DISK_ERRNOS, USER_ERRORS, PeerError, printable, stop_status  # noqa: E402

__all__ = ["main", "fail", "before_hydra", "check_overrides", "help_text"]

USAGE = """\
usage: python train.py [group=option ...] [key=value ...]           one process (or pcdist-train, python -m pcdist)
       torchrun --nproc_per_node=N train.py [...]                    N processes (launch/local.sh does this)
       WORLD_SIZE=N python train.py --check [...]                    check config and data for N processes, run nothing
       python train.py --help [...]                                  this text, with the values those overrides give
       python train.py --multirun optim.lr=1e-3,2e-3                 one run directory per job (runs/multirun/...)
       python -m pcdist evaluate|predict|export|compare ...          after training (python -m pcdist evaluate -h)
"""


def fail(message: str, status: int = 2) -> None:
    """Print ``error: <message>`` and exit with ``status`` (2: the user's input). Under torchrun the other local
    ranks first wait 3 s: where local rank 0 failed alike it has printed the line and torchrun has stopped them
    (one line in all); where it did not (a file missing on one rank's side), the line is printed naming the rank."""
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if local != 0:
        time.sleep(3)
    where = f" (rank {os.environ.get('RANK', local)})" if local else ""
    print(f"error{where}: {printable(message, keep=chr(10))}", file=sys.stderr, flush=True)
    sys.exit(status)


def preempted_status(signum: int = signal.SIGTERM) -> int:
    """The exit status of a run stopped by ``signum`` (``errors.stop_status``)."""
    return stop_status(signum == signal.SIGINT)


def _ignore_stop_signals() -> None:
    """The run is over: ignore further SIGTERM / SIGUSR1 on the way out. Python puts back their default
    action (death) as the interpreter exits, and a launcher may repeat them until the process is gone
    (launch/slurm_node.sh does): a pre-empted worker killed so would count as failed, and torchrun would
    restart the group."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def before_hydra(conf_dir: Path, argv: list[str]) -> bool:
    """Handle ``--help`` and ``--check`` and refuse bad overrides, before Hydra composes anything. True where
    Hydra will train (False: it only prints, ``--cfg``, ``--info``, ``--hydra-help``, tab completion).

    Hydra's own flags (those, ``-m``, another config tree) pass through.
    """
    from hydra._internal.utils import get_args_parser

    _checked.clear()
    check = "--check" in argv
    args = get_args_parser().parse_args([a for a in argv if a != "--check"])
    own_tree = not (args.config_path or args.config_dir or args.config_name)  # (else: Hydra's own business)
    if args.hydra_help or args.cfg or args.info or args.shell_completion:  # Hydra prints: nothing trains
        problem = check_overrides(conf_dir, args.overrides) if own_tree and (args.cfg or args.info) else None
        if problem:  # (a mistyped key: Hydra's report, advising +key, status 1)
            fail(problem)
        if own_tree and (args.cfg or args.info) and not args.multirun:  # a value of the wrong type: Hydra's report
            from hydra.errors import HydraException

            from .config import composition_error
            try:
                _compose(conf_dir, args.overrides)
            except HydraException as e:
                fail(str(composition_error(e)))
        return False
    if not own_tree:
        return True
    for o in args.overrides:
        if o.split("=", 1)[0] in ("run_dir", "+run_dir", "++run_dir"):
            fail(f"{o}: on the command line the run directory is hydra.run.dir=... (run_dir is its key from Python, "
                 f"pcdist.train)")
        if o.partition("=")[0] in ("hydra.run.dir", "hydra.sweep.dir") and o.partition("=")[2] == "":
            fail(f"{o} names no directory (an unset variable?); give one, or leave it out for a new run directory")
        if o.startswith("~") and o[1:].partition("=")[0] in groups(conf_dir):
            fail(f"{o}: a config group cannot be left out; choose one of its options ({o[1:].partition('=')[0]}=...: "
                 f"python train.py --help lists them)")
    problem = check_overrides(conf_dir, args.overrides)
    if problem:
        fail(problem)
    from hydra.errors import HydraException

    from .config import composition_error

    from ..errors import ConfigError

    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    composed, jobs = None, [list(args.overrides)]
    try:  # a value of the wrong type for its key, an interpolation that does not resolve: one line, not a report
        if args.multirun:  # every job's config and directory, before the first job starts
            from .sweep import check_sweep  # (torch)

            jobs = check_sweep(lambda overrides: _compose(conf_dir, overrides), args.overrides, claim=not check)
        else:
            composed = _compose(conf_dir, args.overrides)
            for key in composed:  # every key resolves (the hydra node's own are Hydra's run's to resolve)
                if key != "hydra" and OmegaConf.is_config(value := composed[key]):
                    OmegaConf.to_container(value, resolve=True)
            run_dir = _named_run_dir(composed, args.overrides) if check else None
            _checked[:] = [(list(args.overrides), composed)]
    except HydraException as e:
        fail(str(composition_error(e)))
    except USER_ERRORS as e:  # (the multirun checks: a job directory's damaged checkpoint)
        fail(str(e))
    except OmegaConfBaseException as e:  # ${oc.env:UNSET}, ${no.such.key}
        key = getattr(e, "full_key", None)
        fail(f"{f'config {key}: ' if key else ''}{str(e).splitlines()[0]} (an override's ${{...}} that does not "
             f"resolve)")
    if args.help:
        try:
            print(help_text(conf_dir, args.overrides))
        except (HydraException, ConfigError) as e:
            fail(" ".join(str(e).split()))
        sys.exit(0)
    if not check:
        return True

    from .checks import check_as_launched  # (torch)
    from .config import passed_settings

    from omegaconf import open_dict

    try:
        world = os.environ.get("WORLD_SIZE", "1")
        if not world.isdigit() or int(world) < 1:
            fail(f"WORLD_SIZE={world!r}: the number of processes to check for must be an integer >= 1")
        meshes = []
        for job in jobs:  # (--check --multirun: each job as one run; a list had been read as one ambiguous value)
            if args.multirun:  # (a single run's config is composed above)
                composed = _compose(conf_dir, job)
                run_dir = _named_run_dir(composed, job)
            with open_dict(composed):
                composed.pop("hydra")
            meshes.append(check_as_launched(load_config(composed), passed_settings(job), int(world), run_dir))
        print("\n".join(f"ok: {m}" for m in dict.fromkeys(meshes)) + (f" ({len(jobs)} jobs)" if len(jobs) > 1 else ""))
    except HydraException as e:
        fail(" ".join(str(e).split()))
    except USER_ERRORS as e:  # (a run directory's damaged checkpoint among them)
        fail(str(e))
    sys.exit(0)


def _named_run_dir(composed, overrides: list[str]) -> Path | None:
    """The run directory ``overrides`` name (``hydra.run.dir=...``), else None: the default names a new one."""
    named = any(o.partition("=")[0].lstrip("+") == "hydra.run.dir" for o in overrides)
    return Path(composed.hydra.run.dir) if named else None


_checked: list = []
"""[(the overrides, the config as ``before_hydra`` composed them, its hydra node included)], for the run."""


@contextlib.contextmanager
def _composed_once():
    """Hydra's main composes the config twice more after ``before_hydra`` has: once only to read ``hydra.mode``
    (``Hydra.get_mode``), then for the run, with ``hydra.mode=RUN`` appended to the same overrides where the mode
    is unset. Each costs ~0.1-0.2 CPU-s, on every rank of every launch. Here Hydra is given the mode read and,
    for the run, the checks' config with that one override applied as Hydra applies it (the mode set and the
    override recorded in ``hydra.overrides.hydra``): the same config (tests/test_cli.py compares them). Any other
    call, a sweep (composed job by job by the checks), or a Hydra without these methods composes as before."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra
    from hydra.types import RunMode
    from omegaconf import open_dict, read_write

    if not _checked or not hasattr(Hydra, "get_mode") or not hasattr(ConfigLoaderImpl, "load_configuration"):
        yield
        return
    overrides, cfg = _checked.pop()
    mode, unused = cfg.hydra.mode, [cfg]
    own_mode, own_load = Hydra.get_mode, ConfigLoaderImpl.load_configuration
    run = {"config_name": "config", "overrides": [*overrides, "hydra.mode=RUN"], "run_mode": RunMode.RUN}

    def load(self, *args, **kwargs):
        if mode is None and unused and not args and all(kwargs.get(k) == v for k, v in run.items()):
            composed = unused.pop()
            with read_write(composed.hydra), open_dict(composed.hydra):
                composed.hydra.mode = RunMode.RUN
                composed.hydra.overrides.hydra.append("hydra.mode=RUN")
            return composed
        return own_load(self, *args, **kwargs)

    Hydra.get_mode = lambda self, config_name, overrides: mode
    ConfigLoaderImpl.load_configuration = load
    try:
        yield
    finally:
        Hydra.get_mode, ConfigLoaderImpl.load_configuration = own_mode, own_load


def _compose(conf_dir: Path, overrides: list[str]):
    """The config Hydra composes from ``conf_dir`` with ``overrides``, its ``hydra`` node included (no run directory,
    no logging setup)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir.resolve()), version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def help_text(conf_dir: Path, overrides: list[str]) -> str:
    """Usage, the config groups and their options (the chosen one starred), then every key with its
    value under ``overrides`` and the documentation written under its field in pcdist/service/schema.py."""
    from omegaconf import OmegaConf

    composed = _compose(conf_dir, overrides)
    chosen = OmegaConf.to_container(composed.hydra.runtime.choices)
    top = {f.name for f in dataclasses.fields(Config)}
    # The values a run gets: the composed files over the dataclass defaults (as load_config merges them).
    cfg = OmegaConf.merge(OmegaConf.structured(Config), {k: v for k, v in composed.items() if k in top})
    lines = [USAGE.replace("python train.py", command()), "config groups (conf/<group>/<option>.yaml; * = chosen):"]
    for group, options in groups(conf_dir).items():
        if group != "hydra":
            lines.append(f"  {group:<11} " + ", ".join(o + "*" * (chosen.get(group) == o) for o in options))
    lines += ["", "keys (value with these overrides; every key is checked before any process starts):"]
    for key, doc in config_keys().items():
        value = OmegaConf.select(cfg, key, default=None)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        lines.append(f"  {key} = {'null' if value is None else value}")
        lines.append(f"      {doc}")
    lines += ["", f"Hydra's own flags (multirun, --cfg job, tab completion): {command()} --hydra-help"]
    return "\n".join(lines)


def _train(cfg) -> float | None:
    import pcdist
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from .config import passed_settings
    from .run import run

    from . import resume

    run_dir = None
    sweep = HydraConfig.get().mode == RunMode.MULTIRUN
    resume.SWEEP[:] = _sweep_again() if sweep else []  # (a stopped job's line gives the sweep's command to continue)
    try:
        c = load_config(cfg)
        c.run_dir = run_dir = HydraConfig.get().runtime.output_dir
        passed = passed_settings(list(HydraConfig.get().overrides.task))  # a resume applies only these
        result = run(c, passed, sweep=sweep)
    except pcdist.Preempted as e:
        # checkpointed, and said so (the logging rank's "interrupted: ..." or "pre-empted: ..." line); the exit
        # status (and, pre-empted, run_dir/PREEMPTED) tell the launcher
        sys.exit(preempted_status(e.signal))
    except KeyboardInterrupt:  # Ctrl-C outside the training steps (loading, the end-of-run evaluation): at once
        _remove_new_dirs()
        print(f"interrupted (Ctrl-C) outside the training steps: stopped at once{_kept(run_dir)}",
              file=sys.stderr, flush=True)
        sys.exit(preempted_status(signal.SIGINT))
    except USER_ERRORS as e:  # the user's input, not a bug: one line, status 2
        _remove_new_dirs()  # now: torchrun may stop this rank while fail() waits
        fail(str(e))
    except PeerError as e:  # a neighbour rank died or hung: one line (the cause is in that rank's own log)
        fail(str(e).split("\n")[0], status=1)
    except OSError as e:  # a full or read-only disk (the run's lock, its first files): one line
        if e.errno not in DISK_ERRNOS:
            raise
        _remove_new_dirs()
        fail(f"{e.filename or 'writing the run directory'}: {e.strerror} (a full or read-only disk, or no "
             f"permission?){f' (run directory: {run_dir})' if run_dir and os.path.isdir(run_dir) else ''}")
    except (RuntimeError, MemoryError) as e:  # a size that does not fit: one line (a config's width typed with extra
        why = str(e).strip().split("\n")[0]  # zeros, say), the run directory removed where nothing was written
        if not isinstance(e, MemoryError) and "out of memory" not in why and "can't allocate memory" not in why:
            raise
        _remove_new_dirs()
        why = why[why.find("can't allocate memory"):] if "can't allocate memory" in why else why  # (not its C++)
        fail(f"out of memory: {why or type(e).__name__} (the config's sizes: model.*, trainer.batch_size, "
             f"data.synthetic_*; {command()} --cfg job shows them)", status=1)
    except FloatingPointError as e:  # the run diverged (trainer.on_divergence=stop): one line
        if sweep:  # a sweep goes on to its next job (and ends with status 1); an Optuna study counts the trial failed
            print(f"error: {run_dir}: {e}", file=sys.stderr, flush=True)  # (no value: a NaN ended the whole study)
            _diverged.append(str(run_dir))
            return None
        fail(str(e), status=1)
    finally:
        _ignore_stop_signals()
    # the objective of a sweeper (Optuna): val/accuracy (direction maximize), or unsupervised the reconstruction's
    # error (direction minimize)
    return result.get("val/accuracy", result.get("val/reconstruction_mse"))


def _sweep_again() -> list[str]:
    """The command line that continues this sweep: as given, in this sweep's folder (a default one is new at every
    launch), without trainer.stop_at (which would stop it again where it stopped); none for an Optuna study (its
    trials are drawn again: each job is continued on its own)."""
    from hydra.core.hydra_config import HydraConfig

    from .config import run_dir_override

    if any("sweeper=optuna" in a for a in _given):
        return []
    keep = [a for a in _given if a.lstrip("+").partition("=")[0] not in ("trainer.stop_at", "hydra.sweep.dir")]
    folder = run_dir_override(os.path.abspath(HydraConfig.get().sweep.dir))  # (quoted as Hydra reads it back)
    return [*keep, folder.replace("hydra.run.dir=", "hydra.sweep.dir=", 1)]


def _kept(run_dir) -> str:
    """What a run stopped outside its training steps keeps: its newest checkpoint, or nothing."""
    from .checkpoint import latest_checkpoint

    newest = latest_checkpoint(run_dir) if run_dir and os.path.isdir(run_dir) else None
    if newest is None:
        return ", nothing trained or checkpointed"
    return f"; the run's newest checkpoint is kept: {newest}"


_diverged: list[str] = []
"""The run directories of this sweep's jobs that diverged."""

_given: list[str] = []
"""The command line's arguments as given (before the service adds Hydra's settings of its own)."""


@contextlib.contextmanager
def _study_without_a_best_trial(argv: list[str]):
    """Hydra's Optuna sweeper reads its study's best trial at the end: where no trial completed (each diverged or
    failed) Optuna's "No trials are completed yet" came as a traceback through Hydra's. One line instead, status 1."""
    impl = None
    if any("sweeper=optuna" in a for a in argv):
        with contextlib.suppress(ImportError):  # (the sweep extra; without it Hydra names the missing sweeper)
            from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl as impl
    if impl is None or not hasattr(impl, "sweep"):
        yield
        return
    own = impl.sweep

    def sweep(self, arguments):
        try:
            return own(self, arguments)
        except ValueError as e:
            if "No trials are completed yet" not in str(e):
                raise
            why = f" ({len(_diverged)} diverged: {', '.join(_diverged)})" if _diverged else \
                " (each failed, as said above)"
            fail(f"no trial of the Optuna study completed{why}: it has no best trial, and wrote no "
                 f"optimization_results.yaml", status=1)

    impl.sweep = sweep
    try:
        yield
    finally:
        impl.sweep = own


_new_dirs: list[Path] = []
"""The run directory and those of its parents that did not exist before this launch, deepest first."""


def _remove_new_dirs() -> None:
    """Remove the directories this launch created while they are empty (a launch that failed before training)."""
    from .rundir import unlock_run_dir

    unlock_run_dir()  # its lock file, where a signal came while this launch held the directory
    for d in _new_dirs:
        try:
            d.rmdir()
        except FileNotFoundError:  # another rank of this launch removed it: its parents may still be ours
            continue
        except OSError:  # not empty (the run wrote its files), or not ours to remove
            break


def _remove_new_dirs_on_sigterm() -> None:
    """Until training installs its own handler (preemption.py), a SIGTERM (torchrun stopping this rank because
    another one failed, a scancel) first removes the directories this launch created while they are still empty,
    then ends the process by the signal as before: a launch stopped before training leaves nothing either."""
    def handler(signum, frame):
        _remove_new_dirs()
        if "TORCHELASTIC_RUN_ID" not in os.environ:  # (torchrun stops the others so where one failed: its line)
            with contextlib.suppress(OSError):
                print(f"stopped by {signal.Signals(signum).name} while starting (before the first training step): "
                      f"nothing was trained", file=sys.stderr, flush=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, handler)


def _value(override: str) -> str:
    """The value of ``key=value`` as Hydra reads it (``'a,b'``: ``a,b``; config.run_dir_override writes it so)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    value = OverridesParser.create().parse_overrides([override])[0].value()
    return value if isinstance(value, str) else override.split("=", 1)[1]


def _started(api: bool = True) -> None:
    """Import pcdist's API (torch with it; ``api=False``: a command that needs neither), then give Ctrl-C back its
    KeyboardInterrupt. Until then a Ctrl-C ends the process at once with one line (pcdist/__init__.py): nothing has
    run, and inside torch's import a KeyboardInterrupt can be swallowed. The checks of the command line come before,
    without torch where they can."""
    import pcdist

    if api:
        pcdist.PCTrainer  # noqa: B018 - the first name used imports the whole API
    if signal.getsignal(signal.SIGINT) is pcdist._interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main() -> None:
    """The program: check the command line, then parse it as Hydra overrides and train; then end the process."""
    try:
        _main()
        status = 0
    except KeyboardInterrupt:  # Ctrl-C in the checks before a run, or in an after-training command
        _remove_new_dirs()
        print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        status = preempted_status(signal.SIGINT)
    except BrokenPipeError:  # `python -m pcdist --help | head`: the reader has gone, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 1
    except SystemExit as e:
        status = e.code
    end_process(status)


_BUFFERED = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def _end_at_once(signum, frame) -> NoReturn:
    """Ctrl-C while the process ends (its run's checkpoint and files are written by then; wandb or torch may
    still be finishing): end now, status 130 (``preempted_status``), without the KeyboardInterrupt traceback of
    an exit function."""
    print("Ctrl-C while the process was ending: ended at once", file=sys.stderr, flush=True)
    os._exit(preempted_status(signal.SIGINT))


def end_process(status: int | str | None) -> NoReturn:
    """End the process as Python's own exit does, less the teardown of the interpreter.

    Python's exit waits for the threads that are not daemons, runs the ``atexit`` functions (wandb
    finishing its run, logging flushing its files, multiprocessing reaping DataLoader workers) and
    flushes stdout and stderr; then it tears every module down, which with torch loaded costs about
    0.8 CPU-s per process (a 1-step run: 4.4 -> 3.6 CPU-s), paid by every rank of every launch and
    every command. This does the first three, flushes the files still open (what the teardown would
    have done for them), and ends the process with ``status`` as ``sys.exit`` would (None: 0; a
    message: printed to stderr, 1). An uncaught exception does not come here: Python reports it."""
    if status is None:
        status = 0
    elif not isinstance(status, int):
        print(status, file=sys.stderr)
        status = 1
    if threading.current_thread() is threading.main_thread():  # a Ctrl-C while it ends: one line, not a traceback
        signal.signal(signal.SIGINT, _end_at_once)
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    gc.unfreeze()  # frozen objects are not listed by get_objects
    for f in gc.get_objects():  # open files: the teardown would have flushed them when it freed them
        if type(f) in _BUFFERED:
            try:
                if not f.closed:
                    f.flush()
            except (OSError, ValueError):  # a pipe whose reader has gone, a file closed meanwhile
                pass
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


_VALUED = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
           "--experimental-rerun")
"""Hydra's options that take the next argument as their value."""
_INFO = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
"""The values of Hydra's --info (optional)."""


def _overrides_at(argv: list[str]) -> int:
    """Where the service's own overrides go among ``argv``: beside the user's (Hydra takes one run of them, before or
    after its options: appended after ``pc.T=5 -m`` they were an argparse error naming arguments nobody typed)."""
    i = 1
    while i < len(argv):
        a = argv[i]
        if a in _VALUED or (a in ("--info", "-i") and i + 1 < len(argv) and argv[i + 1] in _INFO):
            i += 2
        elif a.startswith("-"):
            i += 1
        else:
            return i
    return len(argv) - (argv[-1] in ("--info", "-i"))  # (none given; a bare --info stays last: it takes a value)


def _check_not_shadowed() -> None:
    """``python -m pcdist`` run in a folder that holds a folder named pcdist/ (a clone of this repository), with
    pcdist installed editable: ``import pcdist`` finds that folder, a package of no code, and every name of pcdist's
    API is missing (an AttributeError traceback after the help had worked). One line naming the folder instead."""
    found = sys.modules.get("pcdist")
    if found is not None and getattr(found, "__file__", None) is None:
        where = next(iter(getattr(found, "__path__", None) or []), "a folder named pcdist")
        fail(f"'import pcdist' finds the folder {where} (no pcdist package in it) before the installed pcdist: run "
             f"from another folder, or give that folder another name (git clone ... pcdist-src)")


def _main() -> None:
    import hydra

    _check_not_shadowed()
    if sys.argv[1:] in (["--version"], ["-V"]):  # pcdist's (Hydra would print its own)
        from importlib.metadata import PackageNotFoundError, version

        import pcdist

        try:
            torch = f", torch {version('torch')}"
        except PackageNotFoundError:
            torch = ""
        print(f"pcdist {pcdist.__version__} (Hydra {hydra.__version__}{torch})")
        return

    from ..errors import ConfigError
    from .commands import COMMANDS, main as run_command

    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:  # after training: evaluate, predict, export, compare
        _started(api=sys.argv[1] != "compare")  # compare reads the runs' files and draws: no torch
        sys.exit(run_command(sys.argv[1:]))
    word = sys.argv[1] if len(sys.argv) > 1 else "="
    hint = "" if "=" in word or word.startswith("-") else did_you_mean(word, COMMANDS)
    if hint:  # a mistyped command (evalute), which Hydra would read as an override without a value
        fail(f"{word}: no such command{hint} (the commands: {', '.join(COMMANDS)}; training takes key=value "
             f"overrides: {command()} --help)")
    # Hydra writes none of its own files (.hydra/, a log): the run directory holds the run's files only, and
    # a resume that does not continue (refused, or nothing left to train) changes nothing in it.
    _given[:] = sys.argv[1:]
    at = _overrides_at(sys.argv)
    sys.argv[at:at] = ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    if not before_hydra(CONF_DIR, sys.argv[1:]):  # --help, --check, mistyped keys: without torch where it can
        hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")(_train)()  # it prints
        return
    _started()
    from .rundir import launch_run_dir

    named = [_value(a) for a in sys.argv[1:] if a.startswith("hydra.run.dir=")]
    ours = False  # the run directory is this launch's own name (every torchrun rank gets the same one)
    if not named and not any(a.startswith(("--multirun", "-m")) for a in sys.argv[1:]):
        try:  # the new run directory, named before Hydra resolves it (cached: Hydra gets the same)
            named, ours = [launch_run_dir("runs")], True  # as conf/config.yaml asks (cached by the argument)
        except ConfigError as e:
            fail(str(e))
    if named:  # Hydra creates them before the run starts
        path = Path(named[-1]).absolute()
        _new_dirs[:] = [p for p in [path, *path.parents] if not p.exists()]
        if ours and path not in _new_dirs:  # another rank of this launch made it first: it is this launch's still
            _new_dirs.insert(0, path)
        _remove_new_dirs_on_sigterm()
        try:  # what Hydra would do next, with a traceback where it fails
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file in its place, a read-only or full disk
            _remove_new_dirs()
            why = "a file is there" if path.is_file() else e.strerror or e
            fail(f"cannot make the run directory {path}: {why} (choose another: hydra.run.dir=...)")
    try:
        with _composed_once(), _study_without_a_best_trial(sys.argv[1:]):
            hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")(_train)()
    finally:  # a launch that failed before training leaves no empty run directory behind
        _remove_new_dirs()
    if _diverged:
        fail(f"{len(_diverged)} job(s) of the sweep diverged: {', '.join(_diverged)}", status=1)


if __name__ == "__main__":
    main()
