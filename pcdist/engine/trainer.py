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

import math
import time

import torch
from torch import Tensor

from ..distributed.parallel import Parallel
from .network import PCNetwork
from .schedules import PrecisionSchedule, warmup_cosine
from .stage import INITS, Stage
from .values import value_noise

__all__ = ["PCTrainer", "warmup_cosine", "ALGORITHMS", "energy_trace", "step_stats", "set_precision", "check_batch"]

ALGORITHMS = ("pc", "ipc")


class PCTrainer:
    """Runs PC training steps: feed-forward init, T Jacobi inference steps, weight update.

    ``algorithm="pc"`` takes one weight step per batch from a fresh evaluation
    after inference; ``"ipc"`` takes a weight step at every inference step from the
    same evaluation as the value step. ``scheduler`` (any torch LR scheduler) is
    stepped after every optimizer step.

    ``parallel`` places a layer slice of a torch.distributed job (see
    ``pcdist.parallel.Parallel.from_mesh``); ``net`` then owns exactly that slice.
    Without it the trainer is the single-process case of the same schedule.

    ``init``: "ff" (the feed-forward pass) or "deeppcr" (each fused group's chain
    solved in O(log K) parallel steps, see pcdist.deeppcr).

    ``skip_above``: check the energy before every weight update and skip the update
    (counted in ``skipped_updates``) when it is not finite or exceeds this value on
    any rank. It costs one synchronisation per update, so it is off by default.

    ``precision_schedule``: ``factor(layer, t, num_layers)`` scaling each layer's precision at
    inference step t (pcdist.engine.schedules.top_down). ``value_noise``: the temperature tau of
    MCPC's Langevin term h += sqrt(2 x_lr tau) xi in every training step's inference, xi drawn per
    (``noise_seed``, step, inference step, node) so any layer or data split draws alike.
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
        parallel: Parallel | None = None,
        skip_above: float | None = None,
        init: str = "ff",
        precision_schedule: PrecisionSchedule | None = None,
        value_noise: float = 0.0,
        noise_seed: int = 0,
    ):
        _check_arguments(T, x_lr, x_momentum, algorithm, init, value_noise)
        parallel = _check_slice(net, parallel)
        self.net, self.optimizer, self.scheduler, self.parallel = net, optimizer, scheduler, parallel
        self.T, self.x_lr, self.x_momentum, self.algorithm = T, float(x_lr), float(x_momentum), algorithm
        self.init, self.skip_above, self.skipped_updates = init, skip_above, 0
        self.precision_schedule, self.value_noise, self.noise_seed = precision_schedule, float(value_noise), noise_seed
        self.steps_done = 0  # training steps taken (the noise of step s is drawn from s; set it on resume)
        self._inferred = 0  # infer calls made (their noise is drawn from their own count)
        self._stages: dict[tuple, tuple[tuple, Stage]] = {}
        self._stage: Stage | None = None

    def stage(self, batch_size: int, free_bottom: bool = False, free_top: bool = False) -> Stage:
        """The preallocated Stage for this batch size and these free ends, rebuilt when a parameter's
        storage changes (e.g. after ``net.to(...)``)."""
        ptrs = tuple(p.data_ptr() for p in self.net.parameters())
        key = (batch_size, free_bottom, free_top)
        cached = self._stages.get(key)
        if cached is None or cached[0] != ptrs:
            # pc keeps the weights for T steps: a row-major w^T copy per batch pays off; ipc does not.
            st = Stage(self.net, batch_size, self.x_momentum, self.init, static_weights=self.algorithm == "pc",
                       free_bottom=free_bottom, free_top=free_top,
                       dynamic_precision=self.precision_schedule is not None)
            cached = self._stages[key] = (ptrs, st)
        self._stage = cached[1]
        return self._stage

    @torch.no_grad()
    def step(self, x: Tensor | None, y: Tensor | None, log: bool = True, global_batch: int | None = None) -> dict:
        """One training step on a batch: h_0 clamped to ``x`` and h_L to ``y`` (None: free); returns the
        batch-mean energy F, its per-layer terms and, with a free h_0, its prior's term.

        With ``log=False`` no energy is computed or gathered (nothing to synchronise
        on); in a parallel run only the logging rank gets the stats, others get {}.
        ``stats["phase_s"]`` holds this rank's host seconds per phase (feed-forward
        init, inference, weight update; on GPUs kernels may still be in flight).
        ``global_batch``: the batch size over the data axis (value noise draws the global batch).
        """
        st, par = self._begin(x, y, None, global_batch)
        clock = [time.perf_counter()]
        par.feedforward(st)
        clock.append(time.perf_counter())
        energies = None
        noise = value_noise(st, self.parallel, self.x_lr, self.value_noise, self.noise_seed, self.steps_done, global_batch)
        if self.algorithm == "pc":
            for t in range(self.T):
                self._relax(st, t, noise, more=t < self.T - 1)
            clock.append(time.perf_counter())
            self._set_precision(st, self.T)
            par.errors(st, need_all_deltas=True, exchange=False)
            if log or self.skip_above is not None:
                energies = st.layer_energies()
            par.weight_grads(st)
            self._optimizer_step(st, energies)
        else:
            for t in range(self.T):
                self._set_precision(st, t)
                par.errors(st, need_all_deltas=True)
                if (log and t == self.T - 1) or self.skip_above is not None:
                    energies = st.layer_energies()
                par.backproject(st)
                par.weight_grads(st)
                par.update_values(st, self.x_lr, more=t < self.T - 1)
                if noise is not None:
                    noise(t)
                self._optimizer_step(st, energies)
            clock.append(time.perf_counter())
        clock.append(time.perf_counter())
        self.steps_done += 1
        if energies is None or not log:
            return {}
        full = par.gather_layer_energies(energies, st.B, st.energy_index)
        if full is None:
            return {}
        return step_stats(full, clock, st.free_bottom)

    @torch.no_grad()
    def infer(self, x: Tensor | None = None, y: Tensor | None = None, T: int | None = None, noise: float = 0.0,
              batch_size: int | None = None, gather: bool = True, global_batch: int | None = None):
        """Inference with the weights untouched: clamp what is given (``x`` at h_0, ``y`` at h_L; None
        leaves that end free), run ``T`` steps (default the trainer's), and return the value nodes
        h_0 .. h_L. ``noise``: a Langevin temperature tau (MCPC: sampling). ``batch_size``: for a call
        that clamps nothing.

        Every rank of a parallel run calls it alike; the nodes are gathered onto the logging rank (the
        whole batch of every data rank), None elsewhere. ``gather=False`` returns this rank's own
        nodes instead, as {node index: [B_local, ...]}.
        """
        T = self.T if T is None else _check_T(T)
        _check_noise(noise)
        st, par = self._begin(x, y, batch_size, global_batch)
        par.feedforward(st)
        draw = value_noise(st, par, self.x_lr, noise, self.noise_seed, -1 - self._inferred, global_batch)
        self._inferred += 1
        for t in range(T):
            self._relax(st, t, draw, more=t < T - 1)
        own = {n: st.node(n).clone() for n in range(0 if self.net.first == 1 else self.net.first, self.net.stop)}
        return own if not gather else par.gather_nodes(own, self.net.num_layers)

    def trace(self, x: Tensor | None, y: Tensor | None) -> list[list[float]] | None:
        """Per-layer energies at the init and after each of the T inference steps, weights untouched
        (with a free h_0 each row starts with its prior's energy).

        Every rank must call it; the logging rank gets the list, others None.
        """
        return energy_trace(self, x, y)

    # -- the pieces ------------------------------------------------------------------
    def _begin(self, x: Tensor | None, y: Tensor | None, batch_size: int | None, global_batch: int | None):
        B = check_batch(self.net, x, y, batch_size)
        st = self.stage(B, x is None, y is None)
        st.begin(x if self.parallel.is_first else None, y if self.parallel.is_last else None)
        return st, self.parallel

    def _relax(self, st: Stage, t: int, noise, more: bool) -> None:
        """Inference step t: errors with the fused value step, back-projections, the value step (+ noise)."""
        par = self.parallel
        self._set_precision(st, t)
        par.errors(st, step_lr=self.x_lr)
        par.backproject(st)
        par.update_values(st, self.x_lr, more=more)
        if noise is not None:
            noise(t)

    def _set_precision(self, st: Stage, t: int) -> None:
        """pi_l(t) on this slice's layers (``set_precision``)."""
        set_precision(st, self.net, self.precision_schedule, t)

    def _optimizer_step(self, st: Stage, energies: Tensor | None = None) -> None:
        """Finish the gradient reduce; step the optimizer and the schedule, or skip both if the
        energy diverged on any rank."""
        self.parallel.reduce_grads()
        if self.skip_above is not None:
            bad = not bool(torch.isfinite(energies).all()) or float(energies.sum()) > self.skip_above
            if self.parallel.any_rank(bad, energies.device):
                self.skipped_updates += 1
                return
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        st.weights_changed()

    def value_nodes(self) -> list[Tensor]:
        """Copies of the value nodes h_0 .. h_L at the end of the last step's (or infer's) inference.

        On a layer slice [a, b): h_{a-1} .. h_{b-1}, where h_{a-1} (for a > 1) is the
        copy last received from the upstream rank, not a node this rank owns.
        """
        if self._stage is None:
            raise RuntimeError("value_nodes() is only defined after a step()")
        st = self._stage
        return [st.node(n).clone() for n in range(self.net.first - 1, self.net.stop)]


@torch.no_grad()
def energy_trace(tr: PCTrainer, x: Tensor | None, y: Tensor | None) -> list[list[float]] | None:
    """``tr.trace(x, y)``: the per-layer energies of T inference steps from the init, weights untouched."""
    st, par = tr._begin(x, y, None, None)
    par.feedforward(st)
    out = []
    for t in range(tr.T + 1):
        tr._set_precision(st, t)
        par.errors(st, exchange=t < tr.T)
        full = par.gather_layer_energies(st.layer_energies(), st.B, st.energy_index)
        if full is not None:
            out.append(full.tolist()[0 if st.free_bottom else 1:])
        if t < tr.T:
            par.backproject(st)
            par.update_values(st, tr.x_lr, more=t < tr.T - 1)
    return out if par.is_logging else None


def step_stats(full: Tensor, clock: list[float], free_bottom: bool) -> dict:
    """A step's stats from the gathered energies ``full`` (the prior's term, then one per layer) and the
    host clock read at the phases' ends: the energy F, its per-layer terms, the prior's term with a free
    h_0, and the seconds per phase (feed-forward init, inference, weight update)."""
    stats = {"energy": math.fsum(full.tolist()), "layer_energies": full[1:].tolist(),
             "phase_s": dict(zip(("init", "inference", "weights"), (b - a for a, b in zip(clock, clock[1:]))))}
    if free_bottom:
        stats["prior_energy"] = float(full[0])
    return stats


def set_precision(st: Stage, net: PCNetwork, sched: PrecisionSchedule | None, t: int) -> None:
    """pi_l(t) = pi_l * factor(l, t, L) on the slice's layers (the schedule's step t); nothing without a schedule."""
    if sched is None:
        return
    base = net.precision or (1.0,) * net.num_layers
    st.precision.copy_(torch.tensor([base[l - 1] * sched(l, t, net.num_layers) for l in range(net.first, net.stop)],
                                    dtype=st.precision.dtype))


def _check_slice(net: PCNetwork, parallel: Parallel | None) -> Parallel:
    """``parallel`` (the single-process case where None), checked to place the layers ``net`` owns."""
    parallel = parallel if parallel is not None else Parallel.single(net.num_layers)
    if (net.first, net.stop) != tuple(parallel.layers):
        raise ValueError(f"the network owns layers [{net.first}, {net.stop}) but this rank's slice is "
                         f"{parallel.layers}")
    return parallel


def _check_arguments(T, x_lr, x_momentum, algorithm, init, value_noise) -> None:
    _check_T(T)
    if not (isinstance(x_lr, (int, float)) and math.isfinite(x_lr) and x_lr > 0):
        raise ValueError(f"x_lr (value-node learning rate) must be a finite number > 0, got {x_lr!r}")
    if not (isinstance(x_momentum, (int, float)) and 0.0 <= x_momentum < 1.0):
        raise ValueError(f"x_momentum must be in [0, 1), got {x_momentum!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; allowed: 'pc', 'ipc'")
    if init not in INITS:
        raise ValueError(f"unknown value-node init {init!r}; allowed: 'ff' (feed-forward), 'deeppcr'")
    _check_noise(value_noise)


def _check_T(T) -> int:
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(f"T (inference steps) must be an integer >= 1, got {T!r}")
    return T


def _check_noise(tau) -> None:
    if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau >= 0):
        raise ValueError(f"value noise (the temperature tau) must be a finite number >= 0, got {tau!r}")


def check_batch(net: PCNetwork, x: Tensor | None, y: Tensor | None, batch_size: int | None = None) -> int:
    """The batch size of a step clamping h_0 to ``x`` and h_L to ``y`` (``batch_size`` where both are None);
    a ValueError naming the expected shape otherwise."""
    s_in, s_out = net.node_shapes[0], net.node_shapes[-1]
    B = x.shape[0] if x is not None else y.shape[0] if y is not None else batch_size
    if B is None:
        raise ValueError("with both ends free (x=None, y=None) give batch_size=")
    for name, t, shape, node, side in (("x", x, s_in, "h_0", "input"), ("y", y, s_out, "h_L", "output")):
        if t is not None and (t.ndim != 1 + len(shape) or tuple(t.shape[1:]) != shape or t.shape[0] != B):
            what = "width" if len(shape) == 1 else "shape"
            raise ValueError(f"{name} must have shape [{'batch' if name == 'x' else B}, "
                             f"{', '.join(map(str, shape))}] ({node}: the model's {side} {what}), got "
                             f"{list(t.shape)}")
    return B
