"""What a launch checks before any process group exists: the (data, layer) mesh for the world size
(``choose_mesh``), the device, backend, logger and data files (``check``), the run's length (``check_length``),
and all of it as a launch will run, before it starts (``check_as_launched``: ``train.py --check`` and a sweep's
jobs)."""

from __future__ import annotations

import os
from pathlib import Path

from ..distributed.parallel import ParallelDims
from ..engine.arguments import check_env
from ..errors import ConfigError
from .config import Config, absolute_data_paths, check_combination, num_layers
from .data import DataError, check_files
from .datachecks import check_model_on_data
from .device import cpu_threads, pick_device
from .metrics import check_logger
from .models import check_model_keys
from .optimizer import check_optim_keys
from .rundir import check_not_in_use, find_resume


def check(c: Config, world: int) -> str:
    """Everything about the user's input that can fail before any process group exists: the engine's
    environment switches, the mesh for ``world`` ranks, the device, the logger, the data files. Returns how
    the mesh was chosen."""
    check_env()  # PCDIST_NATIVE=off: one line before the run starts, not a traceback at its first step
    mesh = choose_mesh(c, world)
    if c.pc.algorithm == "bp" and world > 1:
        raise ConfigError(f"pc.algorithm=bp (the backprop twin) trains in one process, but this launch has {world}; "
                          "run it without torchrun")
    device = pick_device(c)
    if device.type == "cpu":
        cpu_threads(c.trainer.threads, os.environ)  # OMP_NUM_THREADS=abc: one line here, not at every rank's start
    if c.parallel.backend == "nccl" and device.type != "cuda":
        raise ConfigError("config parallel.backend='nccl' needs CUDA devices; use parallel.backend=auto or gloo")
    if c.parallel.backend == "gloo" and device.type == "cuda" and c.parallel.layer > 1:
        raise ConfigError(f"config parallel.backend=gloo cannot send CUDA tensors between the {c.parallel.layer} layer "
                          "slices (torch's gloo has no GPU send/receive); use parallel.backend=auto (NCCL), "
                          "parallel.layer=1, or trainer.device=cpu")
    check_logger(c.logger)
    check_files(c.data.name, c.data.root)
    if c.data.name == "arrays" and c.data.path is not None and not Path(c.data.path).expanduser().exists():
        raise DataError(f"data.path={c.data.path}: no such file or folder; expected an .npz with x_train, y_train, "
                        f"x_val, y_val or a folder of those four .npy files")
    return mesh


def check_as_launched(c: Config, passed: dict[str, str] | None, world: int, run_dir: Path | None = None,
                      sweep: bool = False, loaded: dict | None = None) -> str:
    """What the launch of ``c`` (``passed``: the keys the user sets) on ``world`` ranks will run, checked before it
    starts, in the order a run checks it: where ``run_dir`` already holds a run, that run's own settings (or
    find_resume's refusal; ``sweep``: a sweep's job continues only its own run), then the run's length, the model
    and optim keys the user sets, the mesh, device, logger and files (``check``) and the data against the model
    (``loaded``: data sets read already, each read once). Returns how the mesh was chosen."""
    absolute_data_paths(c)  # as the run will record them
    if run_dir is not None:
        c.run_dir = str(run_dir)
        if run_dir.is_dir():
            check_not_in_use(run_dir)
        if run_dir.is_dir() or c.resume == "require":  # (resume=require of a job not run yet: refused now, not
            c = find_resume(c, run_dir, passed, sweep).config  # after the jobs before it, leaving its folder)
    check_combination(c)
    check_length(c, passed)
    check_model_keys(c, passed)
    check_optim_keys(c, passed)
    mesh = check(c, world)
    check_model_on_data(c, loaded)
    return mesh


def check_length(c: Config, passed: dict[str, str] | None) -> None:
    """trainer.max_steps passed while trainer.epochs is set (passed too, or from a preset or the resumed run):
    the epochs would silently win, so say so and refuse."""
    if c.trainer.epochs is None or passed is None or "trainer.max_steps" not in passed:
        return
    setter = passed.get("trainer.epochs", "the run's own settings")
    epochs = setter if setter.startswith("trainer.epochs=") else f"trainer.epochs={c.trainer.epochs} (from {setter})"
    raise ConfigError(f"{epochs} and {passed['trainer.max_steps']} both set how long the run trains, and "
                      f"trainer.epochs would win; set one: trainer.epochs=null to train trainer.max_steps steps, or "
                      f"leave out trainer.max_steps")


def choose_mesh(c: Config, world: int) -> str:
    """Fill in ``parallel.layer`` when it is null (what the world size leaves after
    ``parallel.data``) and check the mesh against the world size; one line says how it was chosen."""
    p, layers = c.parallel, num_layers(c)
    if world == 1 and p.data * (p.layer or 1) > 1:
        n = p.data * (p.layer or 1)
        raise ConfigError(f"parallel.data={p.data} x parallel.layer={p.layer or 1} needs {n} processes, but this is "
                          f"one process; launch it with torchrun --nproc_per_node={n} train.py ... (or "
                          f"NPROC={n} launch/local.sh ...)")
    how = "as configured"
    if p.layer is None:
        if world % p.data:
            raise ConfigError(f"parallel.data={p.data} does not divide the {world} processes; use a divisor of "
                              f"{world} (parallel.layer takes the rest)")
        p.layer, how = world // p.data, f"parallel.layer = {world} process{'es' * (world != 1)} / parallel.data"
        if p.layer > layers:
            fits = [d for d in range(p.data, world + 1) if world % d == 0 and world // d <= layers]
            raise ConfigError(f"{world} processes with parallel.data={p.data} leave {p.layer} layer ranks, but the "
                              f"model has only {layers} layers; use parallel.data={fits[0]} or a deeper model")
    ParallelDims(p.data, p.layer).validate(world, layers)
    return (f"mesh: {world} rank{'s' * (world > 1)} = parallel.data {p.data} x parallel.layer {p.layer} ({how}), "
            f"{layers} layers split into {p.layer} slice{'s' * (p.layer != 1)}")
