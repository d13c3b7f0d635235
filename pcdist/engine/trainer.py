"""Training steps and inference of predictive coding (PC and incremental PC) on a PCNetwork.

Which end nodes are clamped is a property of each call: ``step(x, y)`` and ``infer(x, y)``
clamp h_0 to x and h_L to y, and a None leaves that node free (h_0 then starts at its
prior's mean, h_L at the feed-forward prediction). The three modes of PC are three ways to
call the same engine (pcdist/engine/modes.py):

    supervised     step(x=data,  y=one-hot)      test: feed-forward
    generative     step(x=one-hot, y=data)       test: infer(y=data), argmax h_0
    unsupervised   step(x=None,  y=data)         test: infer(y=data), feed h_0 forward
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import time
import warnings

import torch
from torch import Tensor

from .arguments import ALGORITHMS, NEAR_EQUILIBRIUM, check, check_env
from .capture import Runner, compile_mode
from .exchange import Local
from .inference import check_solver, relax, relax_adaptive, set_precision
from .network import PCNetwork
from .precision import MixedPrecision, cpu_float32, cpu_is_ieee
from .schedules import PrecisionSchedule, inert, warmup_cosine
from .stage import Stage
from .update import WeightUpdate
from .values import ValueNoise, ValueRule, stage_noise, value_rule

__all__ = ["PCTrainer", "warmup_cosine", "ALGORITHMS", "energy_trace", "step_stats", "set_precision", "check_batch"]


def engine_mode(fn):
    """Run a trainer's ``fn`` without autograd's graph and outside inference mode whatever the caller's mode (a
    stage's buffers made under ``torch.inference_mode()``, an evaluation loop, could not be written by a later
    step) and, on a CPU, with IEEE float32 matmuls (``precision.cpu_float32``: a process-wide "medium" would
    compute them in bfloat16), the caller's settings as they were after."""
    fn = torch.no_grad()(fn)

    @functools.wraps(fn)
    def outside(tr, *args, **kw):
        cpu = not tr.mixed.cuda and not cpu_is_ieee()
        if not cpu and not torch.is_inference_mode_enabled():  # (the usual case: no context to enter every step)
            return fn(tr, *args, **kw)
        with torch.inference_mode(False), cpu_float32() if cpu else contextlib.nullcontext():
            return fn(tr, *args, **kw)

    return outside


def _setting(name: str, also=None, kind=None):
    """PCTrainer's ``name``, which may be set on a live trainer: checked (``arguments.RULES``, then ``also(trainer,
    value)``) and stored as ``kind(value)``; the next step or infer runs with it (``cached_stage``'s key, the
    runner's key of a captured step, or ``also`` making what depends on it anew)."""
    def put(self, value):
        check(name, value)
        value = value if kind is None else kind(value)
        if also is not None:
            also(self, value)
        setattr(self, "_" + name, value)

    return property(lambda self: getattr(self, "_" + name), put)


def _drop_precision_rows(tr, schedule) -> None:
    """A new precision schedule: the rows each stage kept of the old one (a function of l, t, L) go, and with them
    the captured steps that copy from those rows."""
    for _, st in tr._stages.values():
        st.precision_rows.clear()
        tr.runner.forget(st)
    _warn_if_inert(schedule, tr.init, tr.value_noise, tr.rule, stacklevel=4)  # (the user's line setting it)


def _warn_if_no_chain(net: PCNetwork, init: str, parallel) -> None:
    """init="deeppcr" on a whole network with no group it solves as one chain (K > 1 equal dense or residual hidden
    layers: layers/dense.py, residual.py; the output group and conv and module groups run the feed-forward pass)."""
    from .layers.dense import DenseGroup
    from .layers.residual import ResidualGroup

    if init == "deeppcr" and parallel.layer_size == 1 and not any(
            isinstance(g, (DenseGroup, ResidualGroup)) and g.K > 1 for g in net.groups[:-1]):
        warnings.warn("init='deeppcr' changes nothing here: it solves groups of several equal dense or residual "
                      "hidden layers as one chain, and this network has none (its value nodes start from the "
                      "feed-forward pass, as with init='ff')", stacklevel=3)


def _warn_if_inert(schedule, init: str, value_noise: float, rule: ValueRule, stacklevel: int) -> None:
    why = inert(schedule, init, value_noise, rule.decay if rule.name == "adamw" else 0.0)
    if why:
        warnings.warn(why, stacklevel=stacklevel)


def _new_T(tr, T: int) -> None:
    """ipc takes an optimizer step per inference step: its plan of learning rates is made for the new T."""
    if tr.algorithm == "ipc":
        tr._new_update(tr.optimizer, tr.scheduler, steps=T)


def _fixed(name: str):
    raise AttributeError(f"PCTrainer.{name} is fixed when the trainer is made (set anew it would be ignored): "
                         f"make a new PCTrainer with {name}=...")


class LiveSettings:
    """PCTrainer's settings as attributes: what may be set on a live trainer (its next step runs with it: checked as
    the constructor checks it, and what depends on it made anew) and what is fixed when it is made (refused)."""

    T = _setting("T", _new_T, operator.index)
    x_lr = _setting("x_lr", kind=float)
    value_noise = _setting("value_noise", lambda self, v: _check_method(self.rule, self.solver, v, self.init,
                                                                        self.parallel), float)
    noise_seed = _setting("noise_seed", kind=operator.index)
    init = _setting("init", lambda self, v: _check_method(self.rule, self.solver, self.value_noise, v, self.parallel))
    precision_schedule = _setting("precision_schedule", _drop_precision_rows)
    x_momentum = property(lambda self: self.rule.momentum, lambda self, v: _fixed("x_momentum"))  # (its rule's)
    rule = property(lambda self: self._rule, lambda self, v: _fixed("rule"))  # the value optimizer's ValueRule
    value_optimizer = property(lambda self: self._rule, lambda self, v: _fixed("value_optimizer"))
    skip_above = property(lambda self: self._skip_above, lambda self, v: _fixed("skip_above"))
    algorithm = property(lambda self: self._algorithm, lambda self, v: _fixed("algorithm"))
    precision = property(lambda self: self.mixed.name, lambda self, v: _fixed("precision"))
    compile = property(lambda self: self._compile, lambda self, v: _fixed("compile"))

    @property
    def solver(self) -> str:
        return self._solver

    @solver.setter
    def solver(self, value: str) -> None:
        self._solver = _check_method(self.rule, check_solver(value), self.value_noise, self.init, self.parallel)[1]

    optimizer = property(lambda self: self.update.optimizer,
                         lambda self, o: self._new_update(o, self.scheduler, self.update.steps))
    scheduler = property(lambda self: self.update.scheduler,
                         lambda self, s: self._new_update(self.optimizer, s, self.update.steps))

    def _new_update(self, optimizer, scheduler, steps: int) -> None:
        """The weight update of this optimizer, schedule and optimizer steps per training step (a live trainer's
        new ones: checked as the trainer's own were, and its captured steps, which step the old, dropped)."""
        _check_optimizer(self.net, optimizer, scheduler)
        old = getattr(self, "update", None)
        self._eager = _beyond_the_plan(scheduler) if self.compile == "graph" else None  # (the step then runs eagerly)
        self.update = WeightUpdate(optimizer, scheduler, self.parallel, self._skip_above,
                                   planned=self.compile == "graph" and self._eager is None, steps=steps,
                                   device=self._device,
                                   grads=self.mixed.grads if self.mixed.pairs else None,
                                   sync=self.mixed.weights if self.mixed.pairs else None)
        if old is not None:
            self.update.skipped = old.skipped  # (the count goes on)
            for _, st in self._stages.values():
                self.runner.forget(st)

    def _capturable(self):
        return self.update.capturable()

    def _trained(self) -> list[Tensor]:
        """The parameters whose .grad a step writes: the network's, and the optimizer's (bf16: its float32 copies)."""
        found = {id(p): p for p in self.net.parameters()}
        found.update((id(p), p) for g in self.optimizer.param_groups for p in g["params"])
        return list(found.values())

    @property
    def skipped_updates(self) -> int:
        """Weight updates skipped by ``skip_above`` (a host read: ask where the step is logged); set it on resume."""
        return self.update.skipped_updates

    @skipped_updates.setter
    def skipped_updates(self, n: int) -> None:
        self.update.skipped.fill_(operator.index(n))


class PCTrainer(LiveSettings):
    """Runs PC training steps: feed-forward init, T Jacobi inference steps, weight update.

    ``algorithm="pc"`` takes one weight step per batch from a fresh evaluation after inference;
    ``"ipc"`` one at every inference step from the same evaluation as the value step. ``scheduler``
    (any torch LR scheduler but ReduceLROnPlateau, which needs a metric) is stepped after every optimizer
    step, skipped or not. ``parallel``: the exchange of a layer slice in a torch.distributed job
    (``pcdist.distributed.Parallel.from_mesh``);
    ``net`` then owns exactly that slice (without it: ``engine.exchange.Local``, one process).
    ``init``: "ff" (feed-forward), "deeppcr" (engine/deeppcr.py), or near the equilibrium of inference:
    "newton", "newton_cr", "backward" (engine/equilibrium.py; one layer slice). ``value_optimizer``:
    "sgd" (momentum ``x_momentum``), "nesterov", "adam", "adamw" or a ``ValueRule``; ``solver``: "euler",
    "heun" or "rk4" (T counts solver steps; engine/inference.py); ``infer`` also takes "adaptive".
    ``skip_above``: skip the weight update (counted in ``skipped_updates``) when the step's energy F
    is not finite or exceeds this value; decided on the device (engine/update.py).
    ``precision_schedule``: ``factor(layer, t, num_layers)`` scaling each layer's precision at
    inference step t (engine/schedules.py top_down). ``value_noise``: the temperature tau of MCPC's
    Langevin term h += sqrt(2 x_lr tau) xi, drawn per (``noise_seed``, step) so any layer or data split
    draws alike (engine/values.py ValueNoise). ``compile``: "none" (eager), "graph" (each stage's step
    captured as CUDA graphs and replayed; on a CPU the same capturable core runs eagerly) or "auto"
    (graph on CUDA; engine/capture.py). ``precision``: "fp32", "tf32" or "bf16" (engine/precision.py). ``say``:
    where one-line notes go (a stage that cannot be captured).
    """

    def __init__(
        self,
        net: PCNetwork,
        optimizer: torch.optim.Optimizer,
        T: int = 20,
        x_lr: float = 0.1,
        x_momentum: float = 0.0,
        algorithm: str = "pc",
        scheduler=None,
        parallel=None,
        skip_above: float | None = None,
        init: str = "ff",
        precision_schedule: PrecisionSchedule | None = None,
        value_noise: float = 0.0,
        noise_seed: int = 0,
        compile: str = "auto",
        precision: str = "fp32",
        say=print,
        value_optimizer: str | ValueRule = "sgd",
        solver: str = "euler",
    ):
        _check_arguments(net, T, x_lr, x_momentum, algorithm, init, value_noise, optimizer, scheduler, skip_above,
                         noise_seed, precision_schedule)
        parallel = _check_slice(net, parallel)
        self._rule, self._solver = _check_method(value_rule(value_optimizer, x_momentum), check_solver(solver),
                                                value_noise, init, parallel)
        self.net, self.parallel = net, parallel
        self._T, self._x_lr, self._algorithm = operator.index(T), float(x_lr), algorithm
        self._init, self._skip_above, self._precision_schedule = init, skip_above, precision_schedule
        self._value_noise, self._noise_seed = float(value_noise), operator.index(noise_seed)
        _warn_if_inert(precision_schedule, init, self._value_noise, self._rule, stacklevel=3)
        _warn_if_no_chain(net, init, parallel)
        self.steps_done = 0  # training steps taken (the noise of step s is drawn from s; set it on resume)
        self._inferred = 0  # infer calls made (their noise is drawn from their own count)
        self._stages: dict[tuple, tuple[tuple, Stage]] = {}  # (B, free ends, ...) -> (weights' addresses, Stage)
        self._stage: Stage | None = None
        self.mixed = MixedPrecision(precision, net)
        # The same Parameter objects for the trainer's life, the master's too (under bf16 a bias-free network's
        # compute copy shares none of them: a cast or moved master is seen by its own storage only)
        self._params = list(dict.fromkeys([*self.mixed.compute.parameters(), *net.parameters()]))
        self._device = next(net.parameters()).device
        self._compile = compile_mode(compile, self._device)
        self._generator = torch.Generator(device=self._device)  # value noise (graph-safe: seeded per call on the host)
        self.runner = Runner(self.compile, self._device, say,
                             (self._generator,) if self._device.type == "cuda" else (), self._capturable, self._trained)
        self._new_update(optimizer, scheduler, steps=self.T if algorithm == "ipc" else 1)

    max_stages = 8  # stages kept at once (cached_stage); a training run uses two or three

    def stage(self, batch_size: int, free_bottom: bool = False, free_top: bool = False) -> Stage:
        """The preallocated Stage for this batch size and these free ends, rebuilt when a parameter's
        storage changes (e.g. after ``net.to(...)``); the ``max_stages`` most recently used are kept
        (``cached_stage``)."""
        self._stage = cached_stage(self, (batch_size, free_bottom, free_top))
        return self._stage

    @engine_mode
    def step(self, x: Tensor | None, y: Tensor | None, log: bool = True, global_batch: int | None = None) -> dict:
        """One training step on a batch: h_0 clamped to ``x`` and h_L to ``y`` (None: free); returns the
        batch-mean energy F, its per-layer terms and, with a free h_0, its prior's term.

        With ``log=False`` nothing is read back on the host; in a parallel run only the logging rank gets
        the stats, others get {}. ``stats["phase_s"]`` holds this rank's host seconds per phase
        (feed-forward init, inference, weight update; a replayed step has one phase, ``replay``).
        ``global_batch``: the batch size over the data axis (value noise draws the global batch).
        """
        st = self._begin(x, y, None)
        noise = self._noise(st, self.value_noise, global_batch, self.steps_done)
        self.parallel.begin_step()
        if self.update.outdated():  # (add_param_group, load_state_dict on the live optimizer)
            self._new_update(self.optimizer, self.scheduler, self.update.steps)
        self.update.prepare()
        clock = [time.perf_counter()]
        held = self.update.held() if self.runner.mode == "graph" and self._eager is None else ((), ())
        key = ("step", st, self.x_lr, noise, self.T, self.solver, *held)  # a replay's constants
        if self._eager is not None and key[:2] not in self.runner.eager:  # (the whole stage: one line, one entry,
            self.runner.fallback(key[:2], self._eager)  # whatever x_lr and the rest do from step to step)
        try:
            self.runner(key, lambda: self._train(st, noise, log, clock))
        except BaseException:
            self.update.unprepare()  # (a step that raised, Ctrl-C in it: the schedule stays where it was)
            raise
        st.drop_idle_grads()  # (a replay leaves the .grad another stage's replay put back: none, as eager)
        clock.append(time.perf_counter())
        self.steps_done += 1
        if not log:
            return {}
        full = self.parallel.gather_layer_energies(st.energy_log, st.B, st.energy_index)
        if full is None:
            return {}
        names = ("init", "inference", "weights") if len(clock) == 5 else ("replay",)  # eager, or a replay
        return step_stats(full, dict(zip(names, (b - a for a, b in zip(clock, clock[1:])))), st.free_bottom)

    def _train(self, st: Stage, noise, log: bool, clock: list) -> None:
        """The core of a training step (capturable: no host reads, no branch on device values)."""
        st.restart()  # afresh, also where the core runs again eagerly after its capture failed
        par, T, ipc = self.parallel, self.T, self.algorithm == "ipc"
        want = log or self.skip_above is not None or self.compile == "graph"  # a captured step always records
        last, every = (T - 1 if ipc else T), ipc and self.skip_above is not None  # each ipc update checks its own

        def record(t: int) -> None:  # the energies the host reads at log points and the skip decides on
            if want and (t == last or every):
                st.energy_log.copy_(st.layer_energies())

        par.feedforward(st)
        clock.append(time.perf_counter())
        if ipc:
            relax(st, par, T, self.x_lr, fused=False, schedule=self.precision_schedule, noise=noise, record=record,
                  each_step=lambda t: par.weight_grads(st), after_step=lambda t: self.update(st, t),
                  need_all_deltas=True, solver=self.solver)
            clock.append(time.perf_counter())
        else:
            relax(st, par, T, self.x_lr, fused=True, schedule=self.precision_schedule, noise=noise, record=record,
                  final=True, solver=self.solver)
            clock.append(time.perf_counter())
            par.weight_grads(st)
            self.update(st)
        clock.append(time.perf_counter())

    @engine_mode
    def infer(self, x: Tensor | None = None, y: Tensor | None = None, T: int | None = None, noise: float = 0.0,
              batch_size: int | None = None, gather: bool = True, global_batch: int | None = None,
              solver: str | None = None, tol: float = 1e-3):
        """Inference with the weights untouched: clamp what is given (``x`` at h_0, ``y`` at h_L; None
        leaves that end free), run ``T`` steps (default the trainer's) of ``solver`` (default the trainer's;
        "adaptive": Heun steps of size set by ``tol`` up to t = T x_lr, ``relax_adaptive``), and return the
        value nodes h_0 .. h_L. ``noise``: a Langevin temperature tau (MCPC: sampling). ``batch_size``: for
        a call that clamps nothing. Every rank of a parallel run calls it alike; the nodes are gathered onto
        the logging rank (the whole batch of every data rank), None elsewhere; ``gather=False`` returns this
        rank's own nodes instead, as {node index: [B_local, ...]}.
        """
        T, solver = self.T if T is None else check("T", T), check_solver(solver or self.solver, adaptive=True)
        check("value_noise", noise)
        _check_method(self.rule, solver, noise, self.init, self.parallel)
        st, par = self._begin(x, y, batch_size), self.parallel
        draw = self._noise(st, noise, global_batch, -1 - self._inferred)
        self._inferred += 1

        def core() -> None:
            st.restart()
            par.feedforward(st)
            if solver == "adaptive":  # a step count that depends on the data: run eagerly, never captured
                self.last_infer = relax_adaptive(st, par, T, self.x_lr, tol, schedule=self.precision_schedule)
            else:
                relax(st, par, T, self.x_lr, fused=True, schedule=self.precision_schedule, noise=draw, solver=solver)

        core() if solver == "adaptive" else self.runner(("infer", st, T, draw, solver, self.x_lr), core)
        dtype = self.mixed.master_dtype
        own = {n: st.node(n).to(dtype, copy=True) for n in range(0 if self.net.first == 1 else self.net.first,
                                                                 self.net.stop)}
        return own if not gather else par.gather_nodes(own, self.net.num_layers)

    def trace(self, x: Tensor | None, y: Tensor | None) -> list[list[float]] | None:
        """Per-layer energies at the init and after each of the T inference steps, weights untouched (with a
        free h_0 each row starts with its prior's energy); every rank calls it, the logging rank gets the list."""
        return energy_trace(self, x, y)

    # -- the pieces ------------------------------------------------------------------
    def _begin(self, x: Tensor | None, y: Tensor | None, batch_size: int | None) -> Stage:
        """The stage of this batch, with the batch copied in and the compute weights current (host work)."""
        B = check_batch(self.net, x, y, batch_size)
        st = self.stage(B, x is None, y is None)
        self.mixed.begin()
        st.begin(x if self.parallel.is_first else None, y if self.parallel.is_last else None)
        return st

    def _noise(self, st: Stage, tau: float, global_batch: int | None, call: int) -> ValueNoise | None:
        return stage_noise(st, self.parallel, self.x_lr, tau, global_batch, self._generator, self.noise_seed, call)

    def value_nodes(self) -> list[Tensor]:
        """Copies of the value nodes h_0 .. h_L at the end of the last step's (or infer's) inference; on a
        layer slice [a, b): h_{a-1} .. h_{b-1}, h_{a-1} (a > 1) the copy last received from upstream."""
        if self._stage is None:
            raise RuntimeError("value_nodes() is only defined after a step()")
        st = self._stage
        return [st.node(n).clone() for n in range(self.net.first - 1, self.net.stop)]


def cached_stage(tr: PCTrainer, key: tuple) -> Stage:
    """``tr.stage``: the Stage for ``key`` (batch size, free ends), made where missing or where a parameter's storage
    changed. The trainer keeps its ``max_stages`` most recently used (each holds its batch's buffers and, replayed,
    its graphs), so that inference over ever new batch sizes does not grow memory without bound; a stage that goes
    takes with it all the runner kept for it."""
    ptrs = tuple(p.data_ptr() for p in tr._params)
    key = (*key, tr.init, tr.precision_schedule is not None)  # (both set on a live trainer: a stage of their own)
    cached = tr._stages.pop(key, None)  # put back last: the most recently used
    if cached is None or cached[0] != ptrs:
        if cached is not None:
            tr.runner.forget(cached[1])
        tr.mixed.check()
        # pc keeps the weights for T steps: a row-major w^T copy per batch pays off; ipc does not.
        B, free_bottom, free_top = key[:3]
        cached = (ptrs, Stage(tr.mixed.compute, B, tr.rule, tr.init, static_weights=tr.algorithm == "pc",
                              free_bottom=free_bottom, free_top=free_top,
                              dynamic_precision=tr.precision_schedule is not None, dtype=tr.mixed.master_dtype))
    tr._stages[key] = cached
    if len(tr._stages) > tr.max_stages:
        tr.runner.forget(tr._stages.pop(next(iter(tr._stages)))[1])
    return cached[1]


@engine_mode
def energy_trace(tr: PCTrainer, x: Tensor | None, y: Tensor | None) -> list[list[float]] | None:
    """``tr.trace(x, y)``: the per-layer energies of T inference steps from the init, weights untouched."""
    st, par = tr._begin(x, y, None), tr.parallel
    rows = torch.zeros(tr.T + 1, len(st.energy_log), dtype=st.energy_log.dtype, device=st.energy_log.device)
    st.restart()
    par.feedforward(st)
    relax(st, par, tr.T, tr.x_lr, fused=False, schedule=tr.precision_schedule,
          record=lambda t: rows[t].copy_(st.layer_energies()), final=True, solver=tr.solver)
    full = par.gather_layer_energies(rows, st.B, st.energy_index)
    return None if full is None else [row[0 if st.free_bottom else 1:] for row in full.tolist()]


def step_stats(full: Tensor, phases: dict[str, float], free_bottom: bool) -> dict:
    """A step's stats from the gathered energies ``full`` (the prior's term, then one per layer) and the
    host seconds per phase: the energy F, its per-layer terms, the prior's term with a free h_0, and
    ``phase_s``."""
    stats = {"energy": math.fsum(full.tolist()), "layer_energies": full[1:].tolist(), "phase_s": phases}
    if free_bottom:
        stats["prior_energy"] = float(full[0])
    return stats


def _check_slice(net: PCNetwork, parallel):
    """``parallel`` (the single-process exchange where None), checked to place the layers ``net`` owns."""
    parallel = parallel if parallel is not None else Local(net.num_layers)
    if (net.first, net.stop) != tuple(parallel.layers):
        raise ValueError(f"the network owns layers [{net.first}, {net.stop}) but this rank's slice is "
                         f"{parallel.layers}")
    return parallel


def _beyond_the_plan(scheduler) -> str | None:
    """Why a captured step cannot follow ``scheduler``, or None: a captured step reads its learning rates from a
    device table written before each step, but momentum and betas as they were when it was captured, which
    OneCycleLR and CyclicLR cycle (``cycle_momentum``, their default), inside a SequentialLR or ChainedScheduler too."""
    inner = getattr(scheduler, "_schedulers", None) or [scheduler]
    if any(getattr(s, "cycle_momentum", False) for s in inner):
        return ("its scheduler cycles momentum (cycle_momentum=True), which a captured step would hold at its "
                "capture's value (cycle_momentum=False captures it)")
    return None


def _check_optimizer(net: PCNetwork, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """An optimizer of the network's own parameters, and a scheduler the trainer can step: one over other tensors
    (the modules that ``from_sequential`` / ``from_layers`` copied, another network) would train nothing,
    silently."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer over net.parameters() (inference only: "
                        f"torch.optim.SGD(net.parameters(), lr=0.0)), got {type(optimizer).__name__}")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError("scheduler=ReduceLROnPlateau steps on a metric, which the trainer does not have: step it "
                         "yourself where you measure one (scheduler.step(val_loss)) and pass scheduler=None")
    if scheduler is not None and getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("the scheduler steps another optimizer than the trainer's (it would leave the trainer's "
                         "rate as it is, silently): make it over the trainer's optimizer; on a live trainer, set "
                         "trainer.scheduler = None, then the new optimizer, then its scheduler")
    own = {id(p) for p in net.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
    if foreign:
        raise ValueError(f"the optimizer holds {len(foreign)} tensor(s) that are not this network's parameters "
                         f"(shapes {[list(p.shape) for p in foreign[:4]]}{' ...' if len(foreign) > 4 else ''}): "
                         f"from_sequential and from_layers copy the weights; build the optimizer over "
                         f"net.parameters()")


def _check_arguments(net, T, x_lr, x_momentum, algorithm, init, value_noise, optimizer, scheduler, skip_above,
                     noise_seed, precision_schedule) -> None:
    """Each argument against its rule (arguments.py: the service's pc.* keys are checked by the same rules), and the
    engine's environment switches (PCDIST_NATIVE, ...) against theirs."""
    check_env()
    _check_optimizer(net, optimizer, scheduler)
    for name, value in (("T", T), ("x_lr", x_lr), ("x_momentum", x_momentum), ("algorithm", algorithm),
                        ("init", init), ("value_noise", value_noise), ("skip_above", skip_above),
                        ("noise_seed", noise_seed), ("precision_schedule", precision_schedule)):
        check(name, value)


def _check_method(rule: ValueRule, solver: str, noise: float, init: str, parallel) -> tuple[ValueRule, str]:
    """(rule, solver) if they go together (and with value noise and the init), else a ValueError."""
    check_solver(solver, adaptive=True)
    if solver != "euler" and not (rule.plain and rule.momentum == 0.0):
        raise ValueError(f"solver={solver!r} integrates the gradient flow itself: it takes value_optimizer='sgd' "
                         f"without momentum, got {rule.name!r} with momentum {rule.momentum}")
    if solver != "euler" and noise:
        raise ValueError(f"value noise (MCPC's Langevin step) is an Euler-Maruyama step: use solver='euler', "
                         f"not {solver!r}")
    if init in NEAR_EQUILIBRIUM and parallel.layer_size > 1:
        raise ValueError(f"init={init!r} solves for the equilibrium over the whole network: it runs on one layer "
                         "slice (parallel.layer=1; a data axis is fine)")
    return rule, solver


def check_batch(net: PCNetwork, x: Tensor | None, y: Tensor | None, batch_size: int | None = None) -> int:
    """The batch size of a step clamping h_0 to ``x`` and h_L to ``y`` (``batch_size`` where both are None);
    a ValueError naming the expected shape otherwise."""
    s_in, s_out = net.node_shapes[0], net.node_shapes[-1]
    for name, t in (("x", x), ("y", y)):
        if t is not None and not torch.is_tensor(t):
            raise TypeError(f"{name} must be a tensor (or None: a free end), got {type(t).__name__}")
    if x is not None and not x.is_floating_point():
        raise ValueError(f"x must hold floats, got {x.dtype}: scale it as in training (uint8 images: x / 255)")
    if y is not None and y.is_complex():  # (integers and bools, a one-hot, are taken as they are)
        raise ValueError(f"y must hold real numbers, got {y.dtype}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    B = x.shape[0] if x is not None else y.shape[0] if y is not None else batch_size
    if B is None:
        raise ValueError("with both ends free (x=None, y=None) give batch_size= (trainer.infer; a training step "
                         "clamps x, y or both)")
    if B < 1:
        raise ValueError(f"the batch is empty: {'x' if x is not None else 'y'} has no rows")
    if batch_size is not None and batch_size != B:
        raise ValueError(f"batch_size={batch_size}, but {'x' if x is not None else 'y'} has {B} rows")
    for name, t, shape, node, side in (("x", x, s_in, "h_0", "input"), ("y", y, s_out, "h_L", "output")):
        if t is not None and (t.ndim != 1 + len(shape) or tuple(t.shape[1:]) != shape or t.shape[0] != B):
            what = "width" if len(shape) == 1 else "shape"
            raise ValueError(f"{name} must have shape [{'batch' if name == 'x' else B}, "
                             f"{', '.join(map(str, shape))}] ({node}: the model's {side} {what}), got "
                             f"{list(t.shape)}"
                             + ("; class ids? one-hot them: torch.nn.functional.one_hot(y, "
                                f"{shape[0]}).to(torch.float32)" if name == "y" and t.ndim == 1 and len(shape) == 1
                                and not t.is_floating_point() else ""))
    return B
