"""``ServiceTrainer``: one training run of the service on this rank, its parts as attributes.

``pcdist.service.run.run`` checks the config, picks the device and joins the process group; the trainer
does everything after that. Its constructor loads and checks the data (datachecks.py), places this rank
in the (data, layer) mesh, builds the network (models.py), the optimizer (optimizer.py) and the engine's
trainer (``PCTrainer``, or ``BackpropTrainer`` for pc.algorithm=bp), restores the checkpoint the run resumes
from (rundir.py's ``find_resume`` chose it; resume.py restores it) and opens the logger. ``train`` says how
the run starts and runs ``train_step`` from step to step, each with its logging, evaluation, checkpoint
and stop vote (preemption.py), to the end of the run; ``close`` closes the logger and gives the stop signals
back their handlers::

    trainer = ServiceTrainer(c, device, distributed)
    try:
        result = trainer.train()
    finally:
        trainer.close()
"""

from __future__ import annotations

import math
import signal
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.parallel import Parallel, ParallelDims, barrier
from ..engine.arguments import NEAR_EQUILIBRIUM
from ..engine.modes import clamps
from ..engine.schedules import precision_schedule
from ..engine.trainer import PCTrainer
from ..errors import ConfigError
from .autostep import BATCHES, method_options, resolve_x_lr, settle_x_lr
from .backprop import BackpropTrainer
from .batches import batch_indices, shard, step_batches, val_chunks
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, set_aside
from .config import Config, backprop_note, network_options, unread_pc_note
from .data import DataError, StreamedData
from .datachecks import check_same_data, load_data, num_train, signals_hint, unread_keys_note
from .diagnostics import Diagnostics, check_trace
from .loader import Streamed
from .metrics import make_logger
from .models import make_network, model_specs, record_model
from .optimizer import make_optimizer, optimizer_steps, warmup_note
from .preemption import Preempted, StopVote, catch_stop_signals, restore_signals, stop_message
from .resume import announce, forget_lost_steps, nothing_to_train, restore_checkpoint, resume_command
from .rundir import Resume, find_resume
from .userlayers import UserLayers
from .validate import pictures, validate

__all__ = ["ServiceTrainer", "Result"]


class Result(dict):
    """The final metrics of a run (``result["val/accuracy"]``, ``result["run_dir"]``), with the trained
    network beside them: ``result.network`` (this rank's layer slice in a layer-parallel run; the
    whole network from ``pcdist.load(result["run_dir"])``)."""

    network = None


class ServiceTrainer:
    """One training run on this rank, after the process group exists.

    ``config``: the validated Config (``trainer.max_steps`` filled in from ``trainer.epochs``);
    ``device``, ``dtype``, ``distributed`` (a process group of several ranks), ``is_rank0``;
    ``run_dir`` and ``resume`` (where the run starts: ``find_resume``'s); ``data`` (a Dataset, or
    ``Streamed`` once training starts), ``inputs`` (how its inputs are prepared, as model.json records);
    ``specs`` (the layer kinds), ``parallel`` (this rank's place in the mesh), ``network`` (this
    rank's layer slice); ``optimizer``, ``scheduler``, ``engine`` (the engine's trainer) and ``logger``,
    all None where the run has nothing left to train (``finished``: its directory was at its end already;
    ``train`` only says so); ``step``: the steps done; ``end``: the step the run stops after
    (trainer.max_steps, or trainer.stop_at); ``dropped``: the metrics.jsonl rows of steps trained again,
    dropped; ``result``: the metrics so far.
    """

    def __init__(self, config: Config, device: torch.device, distributed: bool, data=None,
                 user: UserLayers | None = None, resume: Resume | None = None, mesh_line: str | None = None):
        """``data``: the user's own data (``pcdist.train(cfg, data=...)``), else data.name's; ``user``: the
        user's own layers; ``resume``: ``find_resume``'s answer (None: look at the run directory now);
        ``mesh_line``: the line that says how the mesh was chosen (the logging rank says it)."""
        self.config, self.device, self.distributed, self.user = config, device, distributed, user
        self.mesh_line = mesh_line
        self.run_dir = Path(config.run_dir)
        self.resume = resume if resume is not None else self._find_resume()
        self.dtype = getattr(torch, config.trainer.dtype)
        self.data, self.inputs, self.data_identity = load_data(config, data, user)
        if self.resume.checkpoint is not None:
            check_same_data(self.run_dir, self.resume.meta, self.data_identity)
        self.specs = self._model_specs()
        self.parallel = self._place_in_mesh()
        t = config.trainer
        if t.epochs is not None:
            t.max_steps = t.epochs * (num_train(self.data) // t.batch_size)
        self.step, self.end = self.resume.step, min(t.max_steps, t.stop_at or t.max_steps)
        self.network = self._make_network()
        self.is_rank0 = not distributed or dist.get_rank() == 0
        self.finished = self.resume.checkpoint is not None and self.step >= self.end  # nothing left to train
        self.optimizer = self.scheduler = self.engine = self.logger = None
        self._engine_notes: list[str] = []  # the engine's notes on settings that change nothing here (start says them)
        self.dropped = 0  # metrics.jsonl rows of the steps trained again, dropped (never a step twice)
        self.result: dict = {"step": self.step}
        self._started = False
        self._first = self.step + 1  # this attempt's first step says so at once (``train_step``)
        self._vote: StopVote | None = None  # made by the first ``_steps``: on GPUs a gloo group, made once
        self._signals: tuple[dict, dict] | None = None  # (the stop signal caught, the handlers before): ``train``
        if not self.finished:
            self.optimizer, self.scheduler = make_optimizer(config, self.network.parameters(), t.max_steps, device)
            self.engine = self._make_engine()
            restore_checkpoint(self.resume, self.network, self.optimizer, self.scheduler)  # (a refusal: before any
            if self.is_rank0:  # write) once the run will train: a finished or refused launch writes nothing
                record_model(config, self.run_dir, self.specs, self.network, self.inputs, user)
                set_aside(self.resume.skipped)
            if self.parallel.is_logging:
                self.dropped = forget_lost_steps(self.run_dir, self.step)
            self.logger = self._make_logger()

    def _find_resume(self) -> Resume:
        """Where the run starts, for a caller that has not looked at the directory yet (benchmarks/service.py):
        every rank looks before any rank writes into it."""
        resume = find_resume(self.config, self.run_dir, None)
        if self.distributed:
            barrier("the run-directory barrier")
        return resume

    def _model_specs(self) -> list:
        """The layer kinds: the user's layers on the data's node shapes (whose end nodes must be the mode's: checked
        here, before anything is written), or the configured model's."""
        if self.user is None:
            return model_specs(self.config, tuple(self.inputs.sample_shape), self.data.num_classes)
        specs, c = self.user.specs(self.inputs.node_shape()), self.config
        data = (f"data {c.data.name}'s samples", tuple(self.inputs.node_shape()))
        labels = (f"the {self.data.num_classes} classes", (self.data.num_classes,))
        bottom, top = {"supervised": (data, labels), "generative": (labels, data),
                       "unsupervised": ((f"pc.latent_dim={c.pc.latent_dim}", (c.pc.latent_dim,)), data)}[c.pc.mode]
        for end, (what, want), got in (("first layer reads", bottom, specs[0].in_shape),
                                       ("last layer predicts", top, specs[-1].out_shape)):
            if tuple(got) != want:
                raise ConfigError(f"layers=...: the {end} {list(got)}, but pc.mode={c.pc.mode} puts {what} "
                                  f"{list(want)} there")
        return specs

    def _place_in_mesh(self) -> Parallel:
        """This rank's place in the (data, layer) mesh and its layer slice."""
        p = self.config.parallel
        if not self.distributed:
            return Parallel.single(len(self.specs))
        return Parallel.from_mesh(ParallelDims(p.data, p.layer), self.specs, device=self.device,
                                  micro_batches=p.micro_batches, timeout_s=p.timeout_s,
                                  free_bottom=self.config.pc.mode == "unsupervised",
                                  learned_prior=self.config.pc.mode != "supervised"
                                  and network_options(self.config)["prior"].mean == "learned")

    def _make_network(self):
        """This rank's layer slice of the network: the user's layers, or the configured model."""
        c, layers = self.config, self.parallel.layers
        if self.user is not None:
            return self.user.network(c.model.energy, layers, self.inputs.node_shape(), self.dtype, self.device,
                                     **network_options(c))
        return make_network(c, self.specs, layers, self.dtype, self.device)

    def _make_engine(self):
        """The engine's trainer: ``BackpropTrainer`` for pc.algorithm=bp, else ``PCTrainer`` as pc.* says."""
        c, par = self.config, self.parallel
        skip = c.trainer.max_energy if c.trainer.on_divergence == "skip" else None
        skipped = (self.resume.meta or {}).get("skipped_updates", 0)  # (counted over the run, resumed or not)
        if c.pc.algorithm == "bp":
            engine = BackpropTrainer(self.network, self.optimizer, scheduler=self.scheduler, skip_above=skip,
                                     precision=c.trainer.precision)
            engine.skipped_updates = skipped
            return engine
        if c.pc.init in NEAR_EQUILIBRIUM and par.layer_size > 1:
            raise ConfigError(f"config pc.init={c.pc.init} solves for the equilibrium over the whole network: it runs "
                              f"on one layer slice, but parallel.layer={par.layer_size}; use parallel.layer=1 (a data "
                              "axis is fine) or pc.init=ff")
        resumed_dir = self.run_dir if self.resume.checkpoint is not None else None
        with warnings.catch_warnings(record=True) as caught:  # a setting that changes nothing: said as a note line
            warnings.simplefilter("always", UserWarning)
            engine = PCTrainer(self.network, self.optimizer, T=c.pc.T, algorithm=c.pc.algorithm,
                               scheduler=self.scheduler, parallel=par, skip_above=skip,
                               **method_options(c, resolve_x_lr(c, resumed_dir, self.resume.meta)),
                               precision_schedule=precision_schedule(c.pc.precision_schedule, c.pc.precision_decay),
                               value_noise=c.pc.value_noise, noise_seed=c.trainer.seed, compile=c.trainer.compile,
                               precision=c.trainer.precision)
        for w in caught:
            if w.category is UserWarning and "changes nothing here" in str(w.message):
                self._engine_notes.append(f"note: {w.message}")
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        engine.steps_done = self.step  # the value noise of step s is drawn from s, resumed or not
        engine.skipped_updates = skipped
        return engine

    def _make_logger(self):
        """metrics.jsonl, wandb and the progress line on the logging rank; a no-op logger elsewhere."""
        c = self.config
        logger = make_logger(self.parallel.is_logging, self.run_dir, asdict(c), c.logger, c.trainer.max_steps,
                             c.trainer.progress, [s.signature() for s in self.specs])  # the network that trained
        if isinstance(self.engine, PCTrainer):
            self.engine.runner.say = logger.say  # a stage that cannot be captured says so in train.log
        return logger

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (x, y) of ``step``'s global batch, on the device."""
        if isinstance(self.data, Streamed):
            return self.data.batch(step)
        c = self.config
        idx = batch_indices(num_train(self.data), c.trainer.batch_size, step, c.trainer.seed)
        return shard(c, self.data, self.parallel, idx, self.device, self.dtype)

    def start(self) -> None:
        """Say how the run starts (the mesh, new or resumed, what changed), start streaming the data and settle
        pc.x_lr=auto on the first batches (autostep.py). ``train`` calls it first; once."""
        if self._started:
            return
        self._started = True
        c, par = self.config, self.parallel
        if self.mesh_line is not None:
            self.logger.say(self.mesh_line)
        if par.is_logging:
            announce(c, self.resume, self.run_dir, self.step, self.optimizer, self.logger, self.dropped)
            for hint in (signals_hint(c, self.inputs.sample_shape) if self.user is None else None,
                         unread_keys_note(c, isinstance(self.data, StreamedData)), unread_pc_note(c),
                         warmup_note(c, self.resume.overrides), backprop_note(c, self.resume.overrides),
                         *self._engine_notes):
                if hint:
                    self.logger.say(hint)
        if self.is_rank0:  # the stop that PREEMPTED recorded is over: this attempt trains on
            (self.run_dir / "PREEMPTED").unlink(missing_ok=True)
        B, seed, n = c.trainer.batch_size, c.trainer.seed, num_train(self.data)
        if isinstance(self.data, StreamedData):
            self.data = Streamed(self.data, lambda step: batch_indices(n, B, step, seed), par, B, c.data.num_workers,
                                 c.data.prefetch_factor, self.device, self.dtype, flatten=self.inputs.flatten,
                                 data_at_top=c.pc.mode != "supervised")
        if isinstance(self.engine, PCTrainer):  # pc.x_lr=auto: the step from the first batches (autostep.py)
            first = [self.batch(s) for s in range(BATCHES)]
            settle_x_lr(c, self.engine, self.run_dir, [clamps(c.pc.mode, x, y) for x, y in first],
                        self.resume.meta if self.resume.checkpoint is not None else None, par.is_logging,
                        self.logger.say)

    def train(self, until: int | None = None) -> Result:
        """Train from ``step`` to the end of the run, then trace the inference of the first batch and say the
        last line; returns the final metrics, the trained network as ``result.network``. ``until``: stop after
        that step instead, without the end-of-run evaluation, checkpoint, trace and last line (for benchmarks;
        call it again to go on). A run with nothing left to train says so and returns its checkpoint."""
        if self.finished:
            return self._nothing_to_train()
        if self._signals is None:  # caught from the start (a stop then: after the first steps) until ``close``
            self._signals = catch_stop_signals()
            self._signals[0]["resume"] = resume_command(self.config, self.run_dir)  # (said by a second Ctrl-C,
            self._signals[0]["record"] = self.record  # in train.log too)
        self.start()
        self._steps(self.end if until is None else until, self._signals[0])
        if until is None:  # finished and checkpointed: a Ctrl-C in the trace and pictures below stops at once
            restore_signals({signal.SIGINT: self._signals[1].get(signal.SIGINT)})  # (it was kept and ignored)
        c = self.config
        if c.pc.diagnostics and c.logger.plots and self.parallel.is_logging:
            Diagnostics(c, self.run_dir, self.logger).plot()
        if until is not None:
            return Result(self.result, run_dir=str(self.run_dir), finished=False)
        x, y = self.batch(0)
        trace = self.engine.trace(*clamps(c.pc.mode, x, y))  # collective: every rank takes part
        if trace is not None:
            self.logger.log_trace(trace)
            check_trace(trace, getattr(self.engine, "x_lr", None), c.pc.T, self.logger)
        result = Result(self.result, run_dir=str(self.run_dir), finished=self.result["step"] >= c.trainer.max_steps)
        result.network = self.network
        if self.parallel.is_logging:
            self.logger.say(_end_line(c, result))
        return result

    def _nothing_to_train(self) -> Result:
        """The run's directory is at or past its end: say so in one line, and return the checkpoint's network."""
        if self.parallel.is_logging:
            print(nothing_to_train(self.config, self.run_dir, self.step, self.resume.sweep), flush=True)
        done = Result(step=self.step, run_dir=str(self.run_dir), finished=True)
        load_checkpoint(self.resume.checkpoint, self.network, None)
        done.network = self.network
        return done

    def _steps(self, last: int, got: dict) -> None:
        """Steps ``step + 1`` to ``last``, each on its batch; ``got``: the stop signal this rank caught
        (``catch_stop_signals``), which every rank votes on (``StopVote``) so that all stop after the same step."""
        c = self.config
        self._clock = {"t": time.perf_counter(), "step": self.step, "comm": self.parallel.comm_seconds,
                       "skipped": self.engine.skipped_updates, "aside": 0.0, "comm_aside": 0.0}
        if self._vote is None:  # every rank makes it at the same call, as a new group must be
            self._vote = StopVote(self.parallel.logging_rank is not None, self.device,
                                  self.parallel.timeout)
        self._diagnostics = Diagnostics(c, self.run_dir, self.logger) if c.pc.diagnostics else None  # diagnostics.py
        batches = step_batches(c, self.data, self.parallel, self.step, last, self.device, self.dtype)
        try:
            while self.step < last:
                stop = self._vote(got["signal"])
                x, y = next(batches)
                self.train_step(x, y, stop)
        finally:
            batches.close()  # a stop before the end: the data's worker processes stop now
        self._vote.finish()

    def train_step(self, x: torch.Tensor, y: torch.Tensor, stop: int = 0) -> None:
        """Step ``step + 1`` on this rank's batch (x, y): the engine's step (diagnosed against backprop first
        where due), then its bookkeeping: the metrics every trainer.log_every steps (stopping on a diverged
        energy), the evaluation every trainer.eval_every, the checkpoint every trainer.ckpt_every and at the
        end. ``stop``: the stop signal every rank agreed on; the step checkpoints and raises ``Preempted``."""
        t_cfg = self.config.trainer
        step = self.step
        done = step + 1
        t0, comm0 = time.perf_counter(), self.parallel.comm_seconds
        # Steps that end in a checkpoint are always checked: no diverged weights are ever checkpointed.
        ckpt = done % t_cfg.ckpt_every == 0 or done == self.end or stop
        evaluates = done % t_cfg.eval_every == 0 or done == self.end
        # and streamed data's evaluation: a bad validation sample, met there, keeps the training done (checkpointed)
        log = done % t_cfg.log_every == 0 or ckpt or (evaluates and isinstance(self.data, Streamed))
        if self._diagnostics is not None and self._diagnostics.due(step):  # before the update: PC against backprop
            self._diagnostics(step, self.engine, x, y, t_cfg.batch_size)
            self._aside(t0, comm0)
        lr = self.optimizer.param_groups[0]["lr"]  # what this step trains with (under ipc: its first weight step)
        stats = self.engine.step(*clamps(self.config.pc.mode, x, y), log=log, global_batch=t_cfg.batch_size)
        if stats:
            stats["lr"] = lr
        metrics = self._log_step(stats, x, y, done) if log else None
        t1, comm1 = time.perf_counter(), self.parallel.comm_seconds
        try:
            val = self._evaluate(done) if evaluates else None
        except DataError:  # a bad validation sample, found as streamed data is read: keep the training done
            if log:  # its energy was checked: the weights are finite
                self._checkpoint(done)
            raise
        if metrics is not None or val is not None:
            acc = None if val is None else val.get("val/accuracy")
            self.logger.progress(done, metrics and metrics["train/energy"], acc,
                                 metrics and metrics["perf/samples_per_s"], val and val.get("val/reconstruction_mse"))
        elif done == self._first:  # not a logged step: a line all the same, so that a slow run shows it trains
            self.logger.progress(done, first_step_s=time.perf_counter() - t0)
        path = self._checkpoint(done) if ckpt else None
        self._aside(t1, comm1)  # (the evaluation and the checkpoint: not the step's time)
        self.step = self.result["step"] = done
        if stop and self._signals is not None:
            self._signals[0]["saved"] = done
        if stop and done < self.end:  # (a stop voted at the last step: the run ends as it would have, finished)
            self._vote.finish()
            # a pre-emption: the launcher requeues (a Ctrl-C: the user stops)
            if self.is_rank0 and stop != signal.SIGINT:
                (self.run_dir / "PREEMPTED").write_text(f"{done}\n")
            message = stop_message(stop, done, path, resume_command(self.config, self.run_dir))
            # one line, on the terminal and in train.log (the record a requeued job's reader has)
            self.logger.say(f"{'interrupted' if stop == signal.SIGINT else 'pre-empted'}: {message}")
            raise Preempted.of(message, stop)

    def _log_step(self, stats: dict | None, x, y, done: int) -> dict | None:
        """A logged step: the batch's accuracy after its update (collective, supervised), then its metrics
        (``_check_and_log``); None on a rank that logs nothing."""
        c = self.config
        if c.pc.mode == "supervised":
            batch = validate(c, [(x, None if y is None else y.argmax(1).cpu())], self.engine, self.device)
            if stats and batch is not None:
                stats["accuracy"] = batch["val/accuracy"]
        if not stats:
            return None
        stats["skipped_updates"] = self.engine.skipped_updates
        metrics = self._check_and_log(stats, done)
        self.result.update(metrics)
        return metrics

    def _aside(self, since: float, comm: float) -> None:
        """The time (and the communication's) since ``since`` and ``comm`` (an evaluation, a checkpoint, a
        diagnosis) left out of the steps' perf/*."""
        self._clock["aside"] += time.perf_counter() - since
        self._clock["comm_aside"] += self.parallel.comm_seconds - comm

    def _check_and_log(self, stats: dict, done: int) -> dict:
        """Stop on a diverged energy (naming step, layer, value); else log the step's metrics."""
        t_cfg, par, clock = self.config.trainer, self.parallel, self._clock
        energy, layers = stats["energy"], stats["layer_energies"]
        if t_cfg.on_divergence == "stop" and (not math.isfinite(energy) or energy > t_cfg.max_energy):
            bad = max(range(len(layers)), key=lambda i: layers[i] if math.isfinite(layers[i]) else math.inf)
            last = latest_checkpoint(self.run_dir)
            raise FloatingPointError(
                f"step {done}: the energy diverged to {energy} (layer {bad + 1}: {layers[bad]}; limit "
                f"trainer.max_energy={t_cfg.max_energy}); "
                + (f"the last good checkpoint is {last}" if last else "no checkpoint was written before it")
                + ". Lower optim.lr or pc.x_lr")
        now = time.perf_counter()
        elapsed, steps = max(now - clock["t"] - clock["aside"], 1e-9), max(1, done - clock["step"])
        metrics = {"train/energy": energy, **({"train/accuracy": stats["accuracy"]} if "accuracy" in stats else {}),
                   "train/lr": stats["lr"],
                   "train/skipped_updates": stats["skipped_updates"],
                   "perf/samples_per_s": steps * t_cfg.batch_size / elapsed, "perf/step_s": elapsed / steps,
                   "perf/comm_fraction": (par.comm_seconds - clock["comm"] - clock["comm_aside"]) / elapsed,
                   **{f"train/layer_energy/{l}": e for l, e in enumerate(layers, 1)},
                   **({"train/prior_energy": stats["prior_energy"]} if "prior_energy" in stats else {}),
                   **{f"perf/{k}_s": v for k, v in stats.get("phase_s", {}).items()}}
        self.logger.log(metrics, done)
        skipped = stats["skipped_updates"] - clock["skipped"]
        if skipped >= steps * optimizer_steps(self.config):  # (on_divergence=skip: said where it is all there is)
            self.logger.say(f"step {done}: every weight update since step {clock['step']} was skipped ({skipped}: "
                            f"an energy above trainer.max_energy={t_cfg.max_energy} or not finite, "
                            f"trainer.on_divergence=skip): the weights are not training; lower optim.lr or pc.x_lr, "
                            f"or raise trainer.max_energy")
        clock.update(t=now, step=done, comm=par.comm_seconds, skipped=stats["skipped_updates"], aside=0.0,
                     comm_aside=0.0)
        return metrics

    def _evaluate(self, done: int) -> dict | None:
        """The validation metrics after step ``done`` (collective), logged with the pictures of the generative
        and unsupervised modes; None on a rank that logs nothing."""
        c, par = self.config, self.parallel
        with warnings.catch_warnings(record=True) as caught:  # the adaptive solver cut short: said in train.log
            warnings.simplefilter("always")
            val = validate(c, val_chunks(self.data, par, self.device, self.dtype), self.engine, self.device)
        cut = [str(w.message) for w in caught if str(w.message).startswith("the adaptive solver stopped")]
        for w in caught:
            if not str(w.message).startswith("the adaptive solver stopped"):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if cut:
            self.logger.say(f"step {done}: validation's inference: {cut[0]} ({len(cut)} of its chunks)")
        images = pictures(c, self._first_val_inputs, self.engine, tuple(self.inputs.sample_shape),
                          self.data.num_classes, self.run_dir, self.device, self.dtype)
        if val is not None:
            self.logger.log(val, done)
            self.logger.log_images(images, done)
            self.result.update(val)
        return val

    def _first_val_inputs(self) -> torch.Tensor:
        """This rank's first validation chunk's inputs (read only where a picture needs them: streamed data restart
        their validation loader for it)."""
        chunks = val_chunks(self.data, self.parallel, self.device, self.dtype)
        try:
            return next(chunks)[0]
        finally:
            chunks.close()

    def _checkpoint(self, done: int) -> Path:
        """Checkpoint after step ``done``: the weights, the optimizer, the schedule, the RNG and the config."""
        c = self.config
        meta = {"step": done, "model": self.network.signature(), "scheduler": self.scheduler.state_dict(),
                "skipped_updates": self.engine.skipped_updates,
                "lr": self.optimizer.param_groups[0]["lr"], "optimizer_steps": optimizer_steps(c),  # per step,
                "rng": torch.get_rng_state(),  # which the LR schedule counts (rundir.Resume.schedule_changed)
                # the value step pc.x_lr=auto chose (beside x_lr.json; a number set is the config's)
                "x_lr": getattr(self.engine, "x_lr", None) if c.pc.x_lr == "auto" else None,
                "config": asdict(c),  # what pcdist/service/rundir.py compares a resumed run's settings with
                "data": self.data_identity}  # and the data (datachecks.check_same_data)
        return save_checkpoint(self.run_dir, done, self.network, self.optimizer, meta, c.trainer.ckpt_keep,
                               writer=self.parallel.data_rank == 0, leader=self.is_rank0)

    def record(self, line: str) -> None:
        """``line`` in train.log (the logging rank's), where the run's logger is open."""
        if self.logger is not None:
            self.logger.record(line)

    def close(self) -> None:
        """Close the logger (wandb, the progress line, metrics.jsonl), stop the data's worker processes and give the
        stop signals back their handlers from before training (in a script: SIGTERM ends it again)."""
        try:
            if self.logger is not None:
                self.logger.close()
        finally:
            if isinstance(self.data, Streamed):
                self.data.close()
            if self._signals is not None:
                restore_signals(self._signals[1])
                self._signals = None


def _end_line(c: Config, result: dict) -> str:
    """The run's last line: where it ended, the validation metrics, the directory; after trainer.stop_at, how
    to go on."""
    acc = "".join(f"{k} {result[k]:.4f}; " if k == "val/accuracy" else f"{k} {result[k]:.4g}; "
                  for k in ("val/accuracy", "val/reconstruction_mse") if k in result)
    if result.get("train/skipped_updates"):
        acc += f"{result['train/skipped_updates']} weight updates skipped (trainer.on_divergence=skip); "
    if result["finished"]:
        return f"step {result['step']}: {acc}run directory: {result['run_dir']}"
    return (f"stopped early at step {result['step']} of {c.trainer.max_steps} (trainer.stop_at={c.trainer.stop_at}): "
            f"{acc}run directory: {result['run_dir']}; to train on, resume it with its own settings: "
            f"{resume_command(c, result['run_dir'])}")
