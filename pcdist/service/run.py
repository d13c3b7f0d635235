"""``train(cfg)``: one training run, from a config to final metrics, on 1 to N ranks.

The same function runs in a single process (tests call it directly) and on every
rank of ``torchrun``: it composes and validates the config (conf/'s defaults, as the
command line), joins the process group, places the rank in the (data, layer) mesh,
loads the data, resumes from the newest valid checkpoint of the run directory
(pcdist/service/rundir.py decides what changed settings mean), trains, evaluates, checkpoints
and logs.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from .backprop import BackpropTrainer
from .checkpoint import load_checkpoint, save_checkpoint
from .config import PYTHON_DATA, PYTHON_MODEL, Config, command, make_config, network_options, passed_settings
from .data import Dataset, StreamedData
from .userlayers import UserLayers
from ..errors import ConfigError
from ..engine.modes import clamps
from ..engine.schedules import precision_schedule
from .loader import Streamed
from .validate import pictures, validate
from .diagnostics import Diagnostics, check_trace
from .autostep import BATCHES, method_options, resolve_x_lr, settle_x_lr
from .metrics import make_logger
from ..distributed.parallel import Parallel, ParallelDims, collective, init_distributed
from .rundir import Resume, find_resume, next_run_dir, position_schedule
from ..engine.trainer import PCTrainer
from .batches import batch_indices, step_batches, shard, val_chunks
from .checks import check, check_length, choose_mesh
from .datachecks import load_data, num_train
from .device import pick_device, cpu_threads
from .models import record_model, make_network, model_specs
from .optimizer import make_optimizer
from .preemption import Preempted, StopVote, catch_stop_signals, restore_sigint, stop_message
from .resume import announce, nothing_to_train, forget_lost_steps

__all__ = ["train", "run", "check", "Preempted", "choose_mesh", "cpu_threads", "Result"]


class Result(dict):
    """The final metrics of a run (``result["val/accuracy"]``, ``result["run_dir"]``), with the trained
    network beside them: ``result.network`` (this rank's layer slice in a layer-parallel run; the
    whole network from ``pcdist.load(result["run_dir"])``)."""

    network = None


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
    device = pick_device(c)
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
    ds, inputs = load_data(c, data, user)
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
        c.trainer.max_steps = c.trainer.epochs * (num_train(ds) // c.trainer.batch_size)
    run_dir = Path(c.run_dir)
    start, end = resume.step, min(c.trainer.max_steps, c.trainer.stop_at or c.trainer.max_steps)
    if user is not None:
        net = user.network(c.model.energy, par.layers, inputs.node_shape(), dtype, device, **network_options(c))
    else:
        net = make_network(c, specs, par.layers, dtype, device)
    is_rank0 = not distributed or dist.get_rank() == 0
    if is_rank0:
        record_model(c, run_dir, specs, net, inputs, user)
    if resume.checkpoint is not None and start >= end:
        if par.is_logging:
            print(nothing_to_train(c, run_dir, start), flush=True)
        done = Result(step=start, run_dir=str(run_dir), finished=True)
        load_checkpoint(resume.checkpoint, net, None)
        done.network = net
        return done
    opt, sched = make_optimizer(c, net.parameters(), c.trainer.max_steps, device)
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
            announce(c, resume, run_dir, start, opt, logger, dropped)
        B, seed, n = c.trainer.batch_size, c.trainer.seed, num_train(ds)
        if isinstance(ds, StreamedData):
            ds = Streamed(ds, lambda step: batch_indices(n, B, step, seed), par, B, c.data.num_workers,
                          c.data.prefetch_factor, device, dtype, flatten=inputs.flatten,
                          data_at_top=c.pc.mode != "supervised")
        if isinstance(trainer, PCTrainer):  # pc.x_lr=auto: the step from the first batches (autostep.py)
            first = [ds.batch(s) if isinstance(ds, Streamed) else shard(c, ds, par, batch_indices(n, B, s, seed),
                                                                          device, dtype) for s in range(BATCHES)]
            settle_x_lr(c, trainer, run_dir, [clamps(c.pc.mode, x, y) for x, y in first],
                        resume.checkpoint is not None, par.is_logging, logger.say)
        batches = step_batches(c, ds, par, start, end, device, dtype)
        result = (loop or _loop)(c, ds, batches, net, opt, sched, trainer, par, logger, run_dir, start, device, dtype,
                                 is_rank0, image_shape=image_shape)
        x, y = ds.batch(0) if isinstance(ds, Streamed) else shard(c, ds, par, batch_indices(n, B, 0, seed), device,
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


def _loop(c, ds, batches, net, opt, sched, trainer, par, logger, run_dir, start, device, dtype, is_rank0,
          until: int | None = None, image_shape: tuple[int, ...] = ()) -> dict:
    """Train from step ``start`` to the end of the run, taking each step's batch from ``batches``;
    ``until``: stop after that step instead, without the end-of-run evaluation and checkpoint (for
    benchmarks). ``image_shape``: the data's sample shape, for the pictures of the generative and
    unsupervised modes."""
    t_cfg = c.trainer
    result: dict = {"step": start}
    end = min(t_cfg.max_steps, t_cfg.stop_at or t_cfg.max_steps)
    got, before = catch_stop_signals()
    try:
        result = _steps(c, ds, batches, net, opt, sched, trainer, par, logger, run_dir, start, device, dtype, is_rank0,
                        until, image_shape, got, result, end)
    finally:
        restore_sigint(before)
    if c.pc.diagnostics and par.is_logging:
        Diagnostics(c, run_dir, logger).plot()
    return result


def _steps(c, ds, batches, net, opt, sched, trainer, par, logger, run_dir, start, device, dtype, is_rank0, until,
           image_shape, got, result, end) -> dict:
    """The training steps of ``_loop``; ``got``: the stop signal this rank caught (``catch_stop_signals``)."""
    t_cfg = c.trainer
    clock = {"t": time.perf_counter(), "step": start, "comm": par.comm_seconds}
    vote = StopVote(par.logging_rank is not None, device)  # every rank stops after the same step
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
            val = validate(c, val_chunks(ds, par, device, dtype), trainer, device)
            images = pictures(c, next(val_chunks(ds, par, device, dtype))[0], trainer, image_shape,
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
            raise Preempted(stop_message(stop, done, path, run_dir), stop)
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
