"""``train(cfg)``: one training run, from a config to final metrics, on 1 to N ranks.

The same function runs in a single process (tests call it directly) and on every
rank of ``torchrun``: it composes and validates the config (conf/'s defaults, as the
command line), joins the process group, places the rank in the (data, layer) mesh,
loads the data, resumes from the newest valid checkpoint of the run directory
(pcdist/service/rundir.py decides what changed settings mean), trains, evaluates, checkpoints
and logs.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from .backprop import BackpropTrainer
from .checkpoint import load_checkpoint, save_checkpoint
from .config import (PYTHON_DATA, PYTHON_MODEL, Config, command, make_config, network_options, num_layers,
                     passed_settings)
from .data import (DataError, Dataset, StreamedData, augment, check_files, load_dataset, normalization_stats,
                   normalized, one_hot)
from .modelfile import Inputs, write_model_file
from .userlayers import UserLayers
from ..errors import ConfigError
from ..engine.layers import mupc_specs
from ..engine.models import cnn_specs, deconv_specs, vgg_specs
from ..engine.modes import clamps
from ..engine.schedules import precision_schedule
from .loader import Streamed
from .validate import pictures, validate
from .diagnostics import FILE as DIAGNOSTICS_FILE, Diagnostics, check_trace
from .autostep import BATCHES, method_options, resolve_x_lr, settle_x_lr
from .metrics import check_logger, make_logger, truncate_jsonl
from ..engine.network import PCNetwork, mlp_specs
from ..distributed.parallel import Parallel, ParallelDims, collective, init_distributed
from .rundir import Resume, find_resume, next_run_dir, position_schedule, write_attempt
from ..engine.trainer import PCTrainer, warmup_cosine

__all__ = ["train", "run", "check", "Preempted", "choose_mesh", "cpu_threads", "Result"]


class Result(dict):
    """The final metrics of a run (``result["val/accuracy"]``, ``result["run_dir"]``), with the trained
    network beside them: ``result.network`` (this rank's layer slice in a layer-parallel run; the
    whole network from ``pcdist.load(result["run_dir"])``)."""

    network = None


def _device(c: Config) -> torch.device:
    want = c.trainer.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config trainer.device='cuda' but no CUDA device is available; use trainer.device=cpu or auto")
    if want == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return gpu_of_rank(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                       torch.cuda.device_count())


def gpu_of_rank(local_rank: int, local_world: int, gpus: int) -> torch.device:
    """cuda:LOCAL_RANK, or a ConfigError naming both counts when this node runs more processes than it has GPUs."""
    if local_rank >= gpus or local_world > gpus:
        raise ConfigError(f"this node runs {max(local_world, local_rank + 1)} processes but has {gpus} GPU"
                          f"{'s' * (gpus != 1)}: each process needs a GPU of its own; start at most {gpus} per node "
                          f"(torchrun --nproc_per_node={gpus}, or NPROC={gpus} launch/local.sh / make train), or "
                          "train on the CPU with trainer.device=cpu")
    return torch.device(f"cuda:{local_rank}")


def _optimizer(c: Config, params, total_steps: int, device: torch.device | None = None):
    """The configured optimizer and LR schedule; fused kernels, so that a captured step can skip an update
    and read its learning rate from the device (pcdist/engine/update.py)."""
    o = c.optim
    if o.name == "adamw":
        opt = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, fused=True)
    else:
        opt = torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                              fused=device is not None and device.type == "cuda")
    warm = min(o.warmup_steps, total_steps)
    if o.schedule == "cosine":
        return opt, warmup_cosine(opt, warm, total_steps, o.final_lr_ratio)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (warm + 1)))


IMAGE_MODELS = ("cnn", "vgg", "deconv")
"""Models whose data nodes stay images [C, H, W]; the others read samples flattened."""


def end_shapes(c: Config, sample_shape: tuple[int, ...], classes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of h_0 and h_L in pc.mode: (data, label) supervised, (label, data) generative,
    (latent, data) unsupervised; data flattened unless the model keeps images."""
    data = tuple(sample_shape) if c.model.name in IMAGE_MODELS else (math.prod(sample_shape),)
    bottom = {"supervised": data, "generative": (classes,), "unsupervised": (c.pc.latent_dim,)}[c.pc.mode]
    return bottom, (data if c.pc.mode != "supervised" else (classes,))


def model_specs(c: Config, sample_shape: tuple[int, ...], classes: int) -> list:
    """The layer kinds of the configured model. mupc, cnn, vgg and deconv take the shapes of their end nodes
    from the data (a sample's ``sample_shape``, the number of ``classes``) and pc.mode."""
    try:
        return _model_specs(c, sample_shape, classes)
    except ValueError as e:  # a layer the data's shape leaves nothing to (a conv on too small a sample)
        raise ConfigError(f"model.name={c.model.name} on data {c.data.name}'s samples of shape {list(sample_shape)}: "
                          f"{e}") from e


def _model_specs(c: Config, sample_shape: tuple[int, ...], classes: int) -> list:
    m = c.model
    bottom, top = end_shapes(c, sample_shape, classes)
    if m.name == "mupc":
        return mupc_specs(math.prod(bottom), m.width, m.depth, math.prod(top), m.activation)
    if m.name == "cnn":
        return cnn_specs(bottom, m.channels, m.kernel_size, m.pool, m.head, classes, m.activation, m.stride, m.padding)
    if m.name == "vgg":
        return vgg_specs(m.variant, bottom, classes, m.activation)
    if m.name == "deconv":
        return deconv_specs(math.prod(bottom), top, m.channels, m.kernel_size, m.activation)
    return mlp_specs(m.dims, m.activation, m.init)


def make_network(c: Config, specs: list, layers: tuple[int, int], dtype, device) -> PCNetwork:
    """The configured network's layer slice ``layers``: its output energy, precisions and the prior of h_0."""
    return PCNetwork(specs, energy=c.model.energy, layers=layers, seed=c.trainer.seed, dtype=dtype, device=device,
                     **network_options(c))


def _load_data(c: Config, data: Dataset | StreamedData | None, user: UserLayers | None = None
               ) -> tuple[Dataset | StreamedData, Inputs]:
    """This run's data: ``data`` if given, else data.name's; checked against the model and the batch size.

    Conv models (cnn, vgg) take images as they are ([N, C, H, W]); the vector models (mlp, mupc)
    take in-memory inputs flattened to [N, features] (a view), and streamed batches flattened as
    they arrive (pcdist.loader). ``data.normalize`` standardises in-memory inputs per channel.
    Returns the data and how its inputs were prepared (saved in the run's model.json).
    """
    if data is None:
        data = _dataset(c)
    elif not isinstance(data, (Dataset, StreamedData)):
        raise DataError(f"pcdist.train(cfg, data=...) takes a pcdist.data.Dataset (tensors in memory) or "
                        f"StreamedData (torch Datasets), got {type(data).__name__}")
    _check_data(c, data)
    shape = tuple(data.sample_shape)
    flatten = _flattens(c, shape, user)
    inputs = Inputs(shape, flatten, c.trainer.dtype, data.num_classes)
    if c.data.normalize:
        if not isinstance(data, Dataset):
            raise ConfigError("config data.normalize=true standardises in-memory data; for streamed data "
                              "(an arrays folder, torch Datasets) normalise the arrays or the Dataset yourself")
        inputs.mean, inputs.std = normalization_stats(data)
        data = normalized(data, (inputs.mean, inputs.std))
    if c.data.augment and len(data.sample_shape) != 3:
        raise ConfigError(f"config data.augment=true crops and flips images [C, H, W], but data {c.data.name}'s "
                          f"samples have shape {list(data.sample_shape)}")
    if not flatten:
        return data, inputs
    return (data.flat() if isinstance(data, Dataset) else data), inputs


def _dataset_args(c: Config) -> tuple:
    """``load_dataset``'s arguments for the configured data."""
    d = c.data
    teacher = c.model.dims if c.model.name == "mlp" else [64, c.model.width, 10]  # data=synthetic's shape
    return (d.name, d.root, tuple(teacher), c.trainer.seed, d.val_fraction, d.synthetic_train, d.synthetic_val,
            d.path, d.num_classes, d.signal)


def _dataset(c: Config) -> Dataset | StreamedData:
    """The configured data set (data.name's)."""
    name, root, teacher, *rest = _dataset_args(c)
    return load_dataset(name, root, list(teacher), *rest)


def check_model_on_data(c: Config, loaded: dict | None = None) -> None:
    """The configured data against the configured model, as a run checks them before it trains (a sweep checks
    every job so before the first starts); ``loaded``: data sets already read, by their arguments."""
    loaded = {} if loaded is None else loaded
    args = _dataset_args(c)
    if args not in loaded:
        loaded[args] = _dataset(c)
    ds = loaded[args]
    _check_data(c, ds)
    model_specs(c, tuple(ds.sample_shape), ds.num_classes)


def _flattens(c: Config, sample_shape: tuple[int, ...], user: UserLayers | None) -> bool:
    """Whether the model reads flattened samples: the vector models (mlp, mupc), and the user's layers
    when the first one starts with an nn.Linear."""
    if user is not None:
        return user.flattens(sample_shape)
    return c.model.name not in IMAGE_MODELS


def _num_train(ds: Dataset | StreamedData | Streamed) -> int:
    """Training samples."""
    return len(ds.data if isinstance(ds, Streamed) else ds)


def _channels_last(c: Config, sample_shape: tuple[int, ...]) -> str | None:
    """The one line for image or signal samples laid out channels-last ([H, W, C], [L, C]), which conv models
    read channels-first ([C, H, W], [C, L]); None if they do not look so."""
    shape = tuple(sample_shape)
    if len(shape) not in (2, 3) or not (shape[-1] <= 4 and shape[-1] < min(shape[:-1])):
        return None
    image = len(shape) == 3
    want = [shape[-1], *shape[:-1]]
    layout, axes = ("[H, W, C]", "0, 3, 1, 2") if image else ("[L, C]", "0, 2, 1")
    source = f"data {c.data.name}" + (f" ({c.data.path})" if c.data.path else "")
    return (f"{source} has samples of shape {list(shape)}, channels-last {layout}, but model.name="
            f"{c.model.name} reads {'images [C, H, W]' if image else 'signals [C, L]'} channels-first; transpose "
            f"the arrays to [N, {', '.join(map(str, want))}]: x.transpose({axes}) (numpy) or x.permute({axes}) (torch)")


def _check_data(c: Config, ds) -> None:
    shape = "" if len(getattr(ds, "sample_shape", ())) < 2 else f" ({' x '.join(map(str, ds.sample_shape))})"
    if c.model.name in ("cnn", "vgg") and _channels_last(c, ds.sample_shape):
        raise DataError(_channels_last(c, ds.sample_shape))
    if c.model.name in IMAGE_MODELS and len(ds.sample_shape) not in (2, 3):
        one = " (one-channel signals [N, L]: add data.signal=true)" if len(ds.sample_shape) == 1 else ""
        raise DataError(f"model.name={c.model.name} takes images [C, H, W] (or signals [C, L]), but data "
                        f"{c.data.name}'s samples have shape {list(ds.sample_shape)}{one}")
    if c.model.name == "mlp" and c.pc.mode == "supervised":
        _check_mlp_ends(c, ds, shape)
    elif c.model.name == "mlp":  # the data sit at h_L, a label (generative) or a latent (unsupervised) at h_0
        bottom = ds.num_classes if c.pc.mode == "generative" else c.pc.latent_dim
        said = f"{ds.num_classes} classes" if c.pc.mode == "generative" else f"pc.latent_dim={c.pc.latent_dim}"
        for key, got, want, what in (("model.dims[0]", c.model.dims[0], bottom, f"h_0: {said}"),
                                     ("model.dims[-1]", c.model.dims[-1], ds.num_features,
                                      f"h_L: data {c.data.name}'s {ds.num_features} features{shape}")):
            if got != want:
                raise DataError(f"pc.mode={c.pc.mode} needs {key}={want} ({what}), but model.dims="
                                f"{list(c.model.dims)}")
    if isinstance(ds, Dataset):  # streamed batches are checked as they are read (pcdist.loader)
        for name, x, labels in (("train", ds.x_train, ds.y_train), ("val", ds.x_val, ds.y_val)):
            if not torch.isfinite(x).all():
                raise DataError(f"data {c.data.name} {name} inputs contain NaN or Inf")
            if labels.is_floating_point() or (labels.numel() and (int(labels.min()) < 0
                                                                   or int(labels.max()) >= ds.num_classes)):
                raise DataError(f"data {c.data.name} {name} labels must be integer class ids in [0, {ds.num_classes})")
    if _num_train(ds) < c.trainer.batch_size:
        raise DataError(f"data {c.data.name} has {_num_train(ds)} training samples, fewer than "
                        f"trainer.batch_size={c.trainer.batch_size}")


def _check_mlp_ends(c: Config, ds, shape: str) -> None:
    """model.dims against the data's input features and classes, both fixes said at once (with a note where the
    labels start at 1, which leaves class 0 empty)."""
    dims = list(c.model.dims)
    wrong = [f"{ds.num_features} input features{shape} but model.dims[0]={dims[0]}"] * (ds.num_features != dims[0])
    wrong += [f"{ds.num_classes} classes but model.dims[-1]={dims[-1]}"] * (ds.num_classes != dims[-1])
    if not wrong:
        return
    fixed = ",".join(map(str, [ds.num_features, *dims[1:-1], ds.num_classes]))
    raise DataError(f"data {c.data.name} has {' and '.join(wrong)}; set model.dims=[{fixed}]{_empty_class_0(ds)}")


def _empty_class_0(ds) -> str:
    """A note for labels that start at 1 (in-memory data): the classes counted include an empty class 0."""
    if not isinstance(ds, Dataset) or not len(ds.y_train) or int(ds.y_train.min()) < 1:
        return ""
    low = int(torch.cat([ds.y_train, ds.y_val]).min())
    return (f" (no label is below {low}, so class{'es' * (low > 1)} 0{f'-{low - 1}' if low > 1 else ''} "
            f"{'are' if low > 1 else 'is'} empty: labels are class ids from 0; if yours start at {low}, subtract "
            f"{low}, y - {low})")


def _batch_indices(n: int, B: int, step: int, seed: int) -> torch.Tensor:
    """The global batch of ``step``: epoch-wise permutations seeded by (seed, epoch), last partial batch dropped."""
    per_epoch = n // B
    epoch, i = divmod(step, per_epoch)
    return _permutation(n, seed * 7919 + epoch)[i * B : (i + 1) * B]


@functools.lru_cache(maxsize=2)
def _permutation(n: int, seed: int) -> torch.Tensor:
    """One epoch's order, drawn once per epoch (randperm of 60000 takes ~1-2 ms: a step of a small model)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


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
    if data is not None:
        c.data.name = PYTHON_DATA
        if passed is not None:
            passed["data.name"] = "data=... (pcdist.train's argument)"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    c.run_dir = str(c.run_dir or next_run_dir())
    resume = find_resume(c, Path(c.run_dir), passed, sweep)  # the run's own settings, or a one-line refusal
    c = resume.config
    check_length(c, passed)
    if data is None and c.data.name == PYTHON_DATA:
        raise ConfigError(f"config data.name={PYTHON_DATA!r} stands for data passed to pcdist.train(cfg, data=...), "
                          f"and none was passed")
    mesh = check(c, world)
    device = _device(c)
    threads = ""
    if device.type == "cpu":
        n, why = cpu_threads(c.trainer.threads, os.environ)
        torch.set_num_threads(n)
        threads = f"; {n} torch thread{'s' * (n > 1)} per rank ({why})"
    else:  # every stage has fixed shapes: let cuDNN time its convolution algorithms once
        torch.backends.cudnn.benchmark = True
    distributed = world > 1
    if distributed:
        init_distributed(device, timeout_s=c.parallel.timeout_s,
                         backend=None if c.parallel.backend == "auto" else c.parallel.backend)
    torchrun = distributed or "TORCHELASTIC_RUN_ID" in os.environ  # every attempt says its mesh, one rank or more
    try:
        return _run(c, device, distributed, data, user=user, resume=resume, mesh=mesh + threads if torchrun else None)
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


def check(c: Config, world: int) -> str:
    """Everything about the user's input that can fail before any process group exists: the mesh
    for ``world`` ranks, the device, the logger, the data files. Returns how the mesh was chosen."""
    mesh = choose_mesh(c, world)
    if c.pc.algorithm == "bp" and world > 1:
        raise ConfigError(f"pc.algorithm=bp (the backprop twin) trains in one process, but this launch has {world}; "
                          "run it without torchrun")
    device = _device(c)
    if c.parallel.backend == "nccl" and device.type != "cuda":
        raise ConfigError("config parallel.backend='nccl' needs CUDA devices; use parallel.backend=auto or gloo")
    if c.parallel.backend == "gloo" and device.type == "cuda" and c.parallel.layer > 1:
        raise ConfigError(f"config parallel.backend=gloo cannot send CUDA tensors between the {c.parallel.layer} layer "
                          "slices (torch's gloo has no GPU send/receive); use parallel.backend=auto (NCCL), "
                          "parallel.layer=1, or trainer.device=cpu")
    check_logger(c.logger)
    check_files(c.data.name, c.data.root)
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
        raise ConfigError(f"parallel.data={p.data} x parallel.layer={p.layer or 1} needs {n} processes, but this is one "
                          f"process; launch it with torchrun --nproc_per_node={n} train.py ... (or "
                          f"NPROC={n} launch/local.sh ...)")
    how = "as configured"
    if p.layer is None:
        if world % p.data:
            raise ConfigError(f"parallel.data={p.data} does not divide the {world} processes; use a divisor of "
                              f"{world} (parallel.layer takes the rest)")
        p.layer, how = world // p.data, f"parallel.layer = {world} processes / parallel.data"
        if p.layer > layers:
            fits = [d for d in range(p.data, world + 1) if world % d == 0 and world // d <= layers]
            raise ConfigError(f"{world} processes with parallel.data={p.data} leave {p.layer} layer ranks, but the "
                              f"model has only {layers} layers; use parallel.data={fits[0]} or a deeper model")
    ParallelDims(p.data, p.layer).validate(world, layers)
    return (f"mesh: {world} rank{'s' * (world > 1)} = parallel.data {p.data} x parallel.layer {p.layer} ({how}), {layers} layers "
            f"split into {p.layer} slices")


def cpu_threads(configured: int, env) -> tuple[int, str]:
    """torch threads per rank on CPU and why: ``trainer.threads`` if > 0, else OMP_NUM_THREADS if
    set (torchrun sets it to 1 itself when it starts several processes and finds it unset), else
    the cores this process may use / the ranks on this machine."""
    if configured:
        return configured, "trainer.threads"
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp:
        first = omp.split(",")[0].strip()
        if not first.isdigit() or int(first) < 1:
            raise ConfigError(f"OMP_NUM_THREADS={omp!r} is not a number of threads >= 1; unset it or set "
                              "trainer.threads")
        return int(first), "OMP_NUM_THREADS"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = int(env.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, cores // local), f"{cores} cores / {local} rank{'s' * (local > 1)} on this machine"


def _run(c: Config, device: torch.device, distributed: bool, data=None, loop=None, user: UserLayers | None = None,
         resume: Resume | None = None, mesh: str | None = None) -> Result:
    """Everything after the process group: data, mesh, model, resume (``find_resume``'s), the
    training ``loop`` (``_loop``; benchmarks/service.py passes one that times it beside the bare
    engine step); ``mesh``: the line that says how the mesh was chosen (the logging rank says it)."""
    if resume is None:  # a caller that has not looked at the directory yet (benchmarks/service.py): every rank
        resume = find_resume(c, Path(c.run_dir), None)  # looks before any rank writes into it
        if distributed:
            with collective("the run-directory barrier"):
                dist.barrier()
    dtype = getattr(torch, c.trainer.dtype)
    ds, inputs = _load_data(c, data, user)
    image_shape = tuple(inputs.sample_shape)  # for the pictures of generated and reconstructed images
    if user is not None:
        specs = user.specs(inputs.node_shape())
    else:
        specs = model_specs(c, image_shape, ds.num_classes)
    if distributed:
        par = Parallel.from_mesh(ParallelDims(c.parallel.data, c.parallel.layer), specs, device=device,
                                 micro_batches=c.parallel.micro_batches, timeout_s=c.parallel.timeout_s)
    else:
        par = Parallel.single(len(specs))
    if c.trainer.epochs is not None:
        c.trainer.max_steps = c.trainer.epochs * (_num_train(ds) // c.trainer.batch_size)
    run_dir = Path(c.run_dir)
    start, end = resume.step, min(c.trainer.max_steps, c.trainer.stop_at or c.trainer.max_steps)
    if user is not None:
        net = user.network(c.model.energy, par.layers, inputs.node_shape(), dtype, device, **network_options(c))
    else:
        net = make_network(c, specs, par.layers, dtype, device)
    is_rank0 = not distributed or dist.get_rank() == 0
    if is_rank0:
        _record_model(c, run_dir, specs, net, inputs, user)
    if resume.checkpoint is not None and start >= end:
        if par.is_logging:
            print(_nothing_to_train(c, run_dir, start), flush=True)
        done = Result(step=start, run_dir=str(run_dir), finished=True)
        load_checkpoint(resume.checkpoint, net, None)
        done.network = net
        return done
    opt, sched = _optimizer(c, net.parameters(), c.trainer.max_steps, device)
    skip = c.trainer.max_energy if c.trainer.on_divergence == "skip" else None
    if c.pc.algorithm == "bp":
        trainer = BackpropTrainer(net, opt, scheduler=sched, skip_above=skip)
    else:
        if c.pc.init in ("newton", "newton_cr", "backward") and par.layer_size > 1:
            raise ConfigError(f"config pc.init={c.pc.init} solves for the equilibrium over the whole network: it runs "
                              f"on one layer slice, but parallel.layer={par.layer_size}; use parallel.layer=1 (a data "
                              "axis is fine) or pc.init=ff")
        trainer = PCTrainer(net, opt, T=c.pc.T, algorithm=c.pc.algorithm,
                            scheduler=sched, parallel=par, skip_above=skip,
                            **method_options(c, resolve_x_lr(c, run_dir if resume.checkpoint is not None else None)),
                            precision_schedule=precision_schedule(c.pc.precision_schedule, c.pc.precision_decay),
                            value_noise=c.pc.value_noise, noise_seed=c.trainer.seed, compile=c.trainer.compile,
                            precision=c.trainer.precision)
        trainer.steps_done = start  # the value noise of step s is drawn from s, resumed or not
    if resume.checkpoint is not None:
        meta = load_checkpoint(resume.checkpoint, net, opt)
        if resume.schedule_changed:  # this run's schedule, at the resumed step
            position_schedule(sched, opt, start)
        else:
            sched.load_state_dict(meta["scheduler"])
            for g in opt.param_groups:
                g["lr"] = meta["lr"]
        torch.set_rng_state(meta["rng"])
    dropped = forget_lost_steps(run_dir, start) if par.is_logging else 0  # never a step twice in metrics.jsonl
    logger = make_logger(par.is_logging, run_dir, asdict(c), c.logger, c.trainer.max_steps, c.trainer.progress,
                         [s.signature() for s in specs])  # the plots describe the network that trained
    if isinstance(trainer, PCTrainer):
        trainer.runner.say = logger.say  # a stage that cannot be captured says so in train.log
    try:
        if mesh is not None:
            logger.say(mesh)
        if par.is_logging:
            _announce(c, resume, run_dir, start, opt, logger, dropped)
        B, seed, n = c.trainer.batch_size, c.trainer.seed, _num_train(ds)
        if isinstance(ds, StreamedData):
            ds = Streamed(ds, lambda step: _batch_indices(n, B, step, seed), par, B, c.data.num_workers,
                          c.data.prefetch_factor, device, dtype, flatten=inputs.flatten,
                          data_at_top=c.pc.mode != "supervised")
        if isinstance(trainer, PCTrainer):  # pc.x_lr=auto: the step from the first batches (autostep.py)
            first = [ds.batch(s) if isinstance(ds, Streamed) else _shard(c, ds, par, _batch_indices(n, B, s, seed),
                                                                          device, dtype) for s in range(BATCHES)]
            settle_x_lr(c, trainer, run_dir, [clamps(c.pc.mode, x, y) for x, y in first],
                        resume.checkpoint is not None, par.is_logging, logger.say)
        batches = _batches(c, ds, par, start, end, device, dtype)
        result = (loop or _loop)(c, ds, batches, net, opt, sched, trainer, par, logger, run_dir, start, device, dtype,
                                 is_rank0, image_shape=image_shape)
        x, y = ds.batch(0) if isinstance(ds, Streamed) else _shard(c, ds, par, _batch_indices(n, B, 0, seed), device,
                                                                   dtype)
        trace = trainer.trace(*clamps(c.pc.mode, x, y))  # collective: every rank takes part
        if trace is not None:
            logger.log_trace(trace)
            check_trace(trace, getattr(trainer, "x_lr", None), c.pc.T, logger)
        result = Result(result, run_dir=str(run_dir), finished=result["step"] >= c.trainer.max_steps)
        result.network = net
        if par.is_logging:
            logger.say(_end_line(c, result))
        return result
    finally:
        logger.close()


def _record_model(c: Config, run_dir: Path, specs, net: PCNetwork, inputs: Inputs, user: UserLayers | None) -> None:
    """run_dir/model.json: the layers, their nesting and the input preparation, so that ``pcdist.load``
    rebuilds the network and its inputs without the data (pcdist/service/modelfile.py)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    structure = user.structure() if user is not None else {}
    write_model_file(run_dir, specs, c.model.energy, structure, inputs, user.factory if user is not None else None)
    if user is not None and user.unbuildable(specs):
        print(f"model.json: layers {user.unbuildable(specs)} are modules that only code can rebuild and no importable "
              f"function made them; pcdist.load({str(run_dir)!r}, layers=...) needs them (or pass "
              f"pcdist.train(cfg, layers=<an importable function>))", flush=True)


def _nothing_to_train(c: Config, run_dir: Path, step: int) -> str:
    """The one line for a rerun into a run that has nothing left to train."""
    t = c.trainer
    if step >= t.max_steps:
        return (f"{run_dir} is already finished: its newest checkpoint is step {step} and trainer.max_steps="
                f"{t.max_steps}; nothing to train (raise trainer.max_steps to train on, or leave out the run "
                f"directory for a new run)")
    return (f"{run_dir} is at step {step}, at or past trainer.stop_at={t.stop_at}; nothing to train (raise "
            f"trainer.stop_at)")


def forget_lost_steps(run_dir: Path, start: int) -> int:
    """Drop the rows a run logged after the checkpoint it resumes at ``start`` (0: a restart before the first
    checkpoint), which it trains again: from metrics.jsonl (steps after ``start``) and diagnostics.jsonl (the
    diagnoses at ``start`` and after). Returns how many metrics rows were dropped."""
    run_dir = Path(run_dir)
    truncate_jsonl(run_dir / DIAGNOSTICS_FILE, lambda r: r.get("step", 0) < start)
    return truncate_jsonl(run_dir / "metrics.jsonl", lambda r: r.get("step", 0) <= start)


def _announce(c: Config, resume, run_dir: Path, start: int, opt, logger, dropped: int = 0) -> None:
    """Keep this attempt's config and say, one line each, how the run starts and what changed."""
    attempt = write_attempt(run_dir, c, resume, start).relative_to(run_dir)
    gone = f"dropped the {dropped} metrics.jsonl rows of the steps after {start}, which are trained again"
    if resume.checkpoint is None:
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


def _end_line(c: Config, result: dict) -> str:
    """The run's last line: where it ended, the validation metrics, the directory; after trainer.stop_at, how
    to go on."""
    acc = "".join(f"{k} {result[k]:.4f}; " if k == "val/accuracy" else f"{k} {result[k]:.4g}; "
                  for k in ("val/accuracy", "val/reconstruction_mse") if k in result)
    if result["finished"]:
        return f"step {result['step']}: {acc}run directory: {result['run_dir']}"
    return (f"stopped early at step {result['step']} of {c.trainer.max_steps} (trainer.stop_at={c.trainer.stop_at}): "
            f"{acc}run directory: {result['run_dir']}; to train on, resume it with its own settings: {command()} "
            f"hydra.run.dir={result['run_dir']}")


def _batches(c: Config, ds, par: Parallel, start: int, end: int, device, dtype):
    """This rank's (x, y) of every step start..end-1 (``data.augment``: crops and flips drawn from
    (seed, step) for the whole global batch, so every split of it draws alike)."""
    B, seed = c.trainer.batch_size, c.trainer.seed
    if isinstance(ds, Streamed):
        steps = ds.train(start, end)
    else:
        steps = (_shard(c, ds, par, _batch_indices(len(ds.x_train), B, step, seed), device, dtype)
                 for step in range(start, end))
    rows = torch.tensor_split(torch.arange(B), par.data_size)[par.data_rank]
    for step, (x, y) in enumerate(steps, start):
        if c.data.augment and par.is_first:
            x = augment(x, torch.Generator().manual_seed(seed * 104_729 + step), rows, B)
        yield x, y


def _shard(c: Config, ds, par: Parallel, idx: torch.Tensor, device, dtype):
    """This data rank's share of a global batch, on the device, labels one-hot."""
    idx = torch.tensor_split(idx, par.data_size)[par.data_rank]
    return to_device(ds.x_train[idx], device, dtype), to_device(one_hot(ds.y_train[idx], ds.num_classes, dtype),
                                                                 device, dtype)


def to_device(t: torch.Tensor, device: torch.device, dtype) -> torch.Tensor:
    """A host batch on the device: on a GPU through pinned memory without waiting (the step queued before it
    keeps running), elsewhere a plain conversion."""
    if torch.device(device).type != "cuda":
        return t.to(device=device, dtype=dtype)
    return t.to(dtype).pin_memory().to(device, non_blocking=True)


def _val_chunks(ds, par: Parallel, device, dtype):
    """This data rank's share of the validation set: (x on the device, labels) chunks."""
    if isinstance(ds, Streamed):
        yield from ds.val_chunks()
        return
    rows = torch.tensor_split(torch.arange(len(ds.x_val)), par.data_size)[par.data_rank]
    for chunk in torch.split(rows, 1024):
        yield ds.x_val[chunk].to(device=device, dtype=dtype), ds.y_val[chunk]


class Preempted(RuntimeError):
    """SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) arrived: the run checkpointed and stopped; rerunning resumes it.
    ``signal``: the one every rank agreed on (SIGINT: the user's Ctrl-C; else the launcher's pre-emption)."""

    def __init__(self, message: str, signal_number: int = signal.SIGTERM):
        super().__init__(message)
        self.signal = signal_number


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def _catch_stop_signals() -> tuple[dict, object]:
    """Record SIGTERM / SIGUSR1 / SIGINT instead of dying, so the current step can finish and checkpoint; a
    second stop signal that is a Ctrl-C exits at once. Returns the record and SIGINT's previous handler."""
    got = {"signal": 0}
    before = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, functools.partial(_on_stop_signal, got))
    return got, before


def _on_stop_signal(got: dict, signum: int, frame) -> None:
    """Remember the first stop signal; a Ctrl-C after it stops the process at once, without a checkpoint."""
    if signum == signal.SIGINT and got["signal"]:
        print("second Ctrl-C: stopped at once, before the checkpoint of this step (the run directory keeps its "
              "newest checkpoint)", file=sys.stderr, flush=True)
        os._exit(130)
    got["signal"] = got["signal"] or signum


def _restore_sigint(before) -> None:
    """Give Ctrl-C back its handler from before training (in a script: KeyboardInterrupt)."""
    if threading.current_thread() is threading.main_thread() and before is not None:
        signal.signal(signal.SIGINT, before)


def _stop_message(signum: int, done: int, path: Path, run_dir) -> str:
    """How the run stopped, its checkpoint, and how to resume it."""
    how = "by Ctrl-C (SIGINT)" if signum == signal.SIGINT else "by a signal"
    return f"stopped {how} after step {done}; checkpoint {path}; rerun with hydra.run.dir={run_dir} to resume"


class _StopVote:
    """Which stop signal any rank got, agreed by all (0: none): each step posts this rank's signal number in
    a MAX all-reduce (``async_op``) and reads the vote posted one step earlier, long complete by then, so
    the vote never holds a rank up (a blocking all-reduce per step would line the ranks up at every step).
    Every rank reads the same votes in the same steps, so all stop after the same step, at most two steps
    after the signal, and agree on which signal it was (the largest number: a pre-emption over a Ctrl-C).
    The vote is a host tensor over a gloo group (on GPUs too), so reading it never waits for the device."""

    def __init__(self, distributed: bool, device: torch.device):
        self.distributed = distributed
        self.group = dist.new_group(backend="gloo") if distributed and device.type == "cuda" else None
        self._posted: tuple | None = None

    def __call__(self, signum: int) -> int:
        """The vote posted at the previous call (0 at the first); posts ``signum`` for the next."""
        stop = self.finish()
        if not self.distributed:
            self._posted = (None, signum)
            return stop
        t = torch.tensor([float(signum)])
        self._posted = (dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True), t)
        return stop

    def finish(self) -> int:
        """Wait for the vote in flight (if any) and return it."""
        if self._posted is None:
            return 0
        work, t = self._posted
        self._posted = None
        if work is None:
            return int(t)
        with collective("the stop-signal all-reduce"):
            work.wait()
        return int(t.item())


def _loop(c, ds, batches, net, opt, sched, trainer, par, logger, run_dir, start, device, dtype, is_rank0,
          until: int | None = None, image_shape: tuple[int, ...] = ()) -> dict:
    """Train from step ``start`` to the end of the run, taking each step's batch from ``batches``;
    ``until``: stop after that step instead, without the end-of-run evaluation and checkpoint (for
    benchmarks). ``image_shape``: the data's sample shape, for the pictures of the generative and
    unsupervised modes."""
    t_cfg = c.trainer
    result: dict = {"step": start}
    end = min(t_cfg.max_steps, t_cfg.stop_at or t_cfg.max_steps)
    got, before = _catch_stop_signals()
    try:
        result = _steps(c, ds, batches, net, opt, sched, trainer, par, logger, run_dir, start, device, dtype, is_rank0,
                        until, image_shape, got, result, end)
    finally:
        _restore_sigint(before)
    if c.pc.diagnostics and par.is_logging:
        Diagnostics(c, run_dir, logger).plot()
    return result


def _steps(c, ds, batches, net, opt, sched, trainer, par, logger, run_dir, start, device, dtype, is_rank0, until,
           image_shape, got, result, end) -> dict:
    """The training steps of ``_loop``; ``got``: the stop signal this rank caught (``_catch_stop_signals``)."""
    t_cfg = c.trainer
    clock = {"t": time.perf_counter(), "step": start, "comm": par.comm_seconds}
    vote = _StopVote(par.logging_rank is not None, device)  # every rank stops after the same step
    diag = Diagnostics(c, run_dir, logger) if c.pc.diagnostics else None  # pcdist/service/diagnostics.py
    for step in range(start, end if until is None else until):
        done = step + 1
        stop = vote(got["signal"])
        x, y = next(batches)
        # Steps that end in a checkpoint are always checked: no diverged weights are ever checkpointed.
        ckpt = done % t_cfg.ckpt_every == 0 or done == end or stop
        log = done % t_cfg.log_every == 0 or ckpt
        if diag is not None and diag.due(step):  # before the update: PC against backprop on this batch
            diag(step, trainer, x, y, t_cfg.batch_size)
        stats = trainer.step(*clamps(c.pc.mode, x, y), log=log, global_batch=t_cfg.batch_size)
        metrics = acc = val = None
        if log and c.pc.mode == "supervised":  # the batch's accuracy after its update (collective)
            batch = validate(c, [(x, None if y is None else y.argmax(1).cpu())], trainer, device)
            if stats and batch is not None:
                stats["accuracy"] = batch["val/accuracy"]
        if log and stats:
            stats["skipped_updates"] = trainer.skipped_updates
            metrics = _check_and_log(stats, done, t_cfg, opt, par, logger, run_dir, clock)
            result.update(metrics)
        if done % t_cfg.eval_every == 0 or done == end:
            val = validate(c, _val_chunks(ds, par, device, dtype), trainer, device)
            images = pictures(c, next(_val_chunks(ds, par, device, dtype))[0], trainer, image_shape,
                              ds.num_classes, run_dir)
            if val is not None:
                logger.log(val, done)
                logger.log_images(images, done)
                result.update(val)
                acc = val.get("val/accuracy")
        if metrics is not None or val is not None:
            logger.progress(done, metrics and metrics["train/energy"], acc, metrics and metrics["perf/samples_per_s"],
                            val and val.get("val/reconstruction_mse"))
        if ckpt:
            meta = {"step": done, "model": net.signature(),
                    "scheduler": sched.state_dict(), "lr": opt.param_groups[0]["lr"], "rng": torch.get_rng_state(),
                    "config": asdict(c)}  # what pcdist/service/rundir.py compares a resumed run's settings with
            path = save_checkpoint(run_dir, done, net, opt, meta, t_cfg.ckpt_keep, writer=par.data_rank == 0,
                                   leader=is_rank0)
        result["step"] = done
        if stop:
            vote.finish()
            if is_rank0 and stop != signal.SIGINT:  # a pre-emption: the launcher requeues (a Ctrl-C: the user stops)
                (Path(run_dir) / "PREEMPTED").write_text(f"{done}\n")
            raise Preempted(_stop_message(stop, done, path, run_dir), stop)
    vote.finish()
    return result


def _check_and_log(stats, done, t_cfg, opt, par, logger, run_dir, clock) -> dict:
    """Stop on a diverged energy (naming step, layer, value); else log the step's metrics."""
    energy, layers = stats["energy"], stats["layer_energies"]
    if t_cfg.on_divergence == "stop" and (not math.isfinite(energy) or energy > t_cfg.max_energy):
        bad = max(range(len(layers)), key=lambda i: layers[i] if math.isfinite(layers[i]) else math.inf)
        raise FloatingPointError(
            f"step {done}: the energy diverged to {energy} (layer {bad + 1}: {layers[bad]}; limit "
            f"trainer.max_energy={t_cfg.max_energy}); the last good checkpoint is in {run_dir / 'checkpoints'}. "
            "Lower optim.lr or pc.x_lr")
    now = time.perf_counter()
    elapsed, steps = now - clock["t"], max(1, done - clock["step"])
    metrics = {"train/energy": energy, **({"train/accuracy": stats["accuracy"]} if "accuracy" in stats else {}),
               "train/lr": opt.param_groups[0]["lr"],
               "train/skipped_updates": stats["skipped_updates"],
               "perf/samples_per_s": steps * t_cfg.batch_size / elapsed, "perf/step_s": elapsed / steps,
               "perf/comm_fraction": (par.comm_seconds - clock["comm"]) / elapsed,
               **{f"train/layer_energy/{l}": e for l, e in enumerate(layers, 1)},
               **({"train/prior_energy": stats["prior_energy"]} if "prior_energy" in stats else {}),
               **{f"perf/{k}_s": v for k, v in stats.get("phase_s", {}).items()}}
    logger.log(metrics, done)
    clock.update(t=now, step=done, comm=par.comm_seconds)
    return metrics
