"""Training steps of predictive coding (PC and incremental PC) on a PCNetwork."""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor

from .stage import INITS, Stage
from .network import PCNetwork
from ..distributed.parallel import Parallel

__all__ = ["PCTrainer", "warmup_cosine", "ALGORITHMS"]

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
    ):
        if isinstance(T, bool) or not isinstance(T, int) or T < 1:
            raise ValueError(f"T (inference steps) must be an integer >= 1, got {T!r}")
        if not (isinstance(x_lr, (int, float)) and math.isfinite(x_lr) and x_lr > 0):
            raise ValueError(f"x_lr (value-node learning rate) must be a finite number > 0, got {x_lr!r}")
        if not (isinstance(x_momentum, (int, float)) and 0.0 <= x_momentum < 1.0):
            raise ValueError(f"x_momentum must be in [0, 1), got {x_momentum!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; allowed: 'pc', 'ipc'")
        parallel = parallel if parallel is not None else Parallel.single(net.num_layers)
        if (net.first, net.stop) != tuple(parallel.layers):
            raise ValueError(f"the network owns layers [{net.first}, {net.stop}) but this rank's slice is {parallel.layers}")
        self.net, self.optimizer, self.scheduler, self.parallel = net, optimizer, scheduler, parallel
        self.T, self.x_lr, self.x_momentum, self.algorithm = T, float(x_lr), float(x_momentum), algorithm
        self._stage: Stage | None = None
        if init not in INITS:
            raise ValueError(f"unknown value-node init {init!r}; allowed: 'ff' (feed-forward), 'deeppcr'")
        self.init = init
        self.skip_above = skip_above
        self.skipped_updates = 0

    def stage(self, batch_size: int) -> Stage:
        """The preallocated Stage for this batch size, rebuilt when the batch size or a
        parameter's storage changes (e.g. after ``net.to(...)``)."""
        key = (batch_size, *(p.data_ptr() for p in self.net.parameters()))
        if self._stage is None or self._stage_key != key:
            # pc keeps the weights for T steps: a row-major w^T copy per batch pays off; ipc does not.
            self._stage = Stage(self.net, batch_size, self.x_momentum, self.init,
                                static_weights=self.algorithm == "pc")
            self._stage_key = key
        return self._stage

    @torch.no_grad()
    def step(self, x: Tensor, y: Tensor, log: bool = True) -> dict:
        """One training step on a batch; returns the batch-mean energy F and its per-layer terms.

        With ``log=False`` no energy is computed or gathered (nothing to synchronise
        on); in a parallel run only the logging rank gets the stats, others get {}.
        ``stats["phase_s"]`` holds this rank's host seconds per phase (feed-forward
        init, inference, weight update; on GPUs kernels may still be in flight).
        """
        B = self._check_batch(x, y)
        st, par = self.stage(B), self.parallel
        clock = [time.perf_counter()]
        st.begin(x if par.is_first else None, y if par.is_last else None)
        par.feedforward(st)
        clock.append(time.perf_counter())
        energies = None
        if self.algorithm == "pc":
            for t in range(self.T):
                par.errors(st, step_lr=self.x_lr)
                par.backproject(st)
                par.update_values(st, self.x_lr, more=t < self.T - 1)
            clock.append(time.perf_counter())
            par.errors(st, need_all_deltas=True, exchange=False)
            if log or self.skip_above is not None:
                energies = st.layer_energies()
            par.weight_grads(st)
            self._optimizer_step(st, energies)
        else:
            for t in range(self.T):
                par.errors(st, need_all_deltas=True)
                if (log and t == self.T - 1) or self.skip_above is not None:
                    energies = st.layer_energies()
                par.backproject(st)
                par.weight_grads(st)
                par.update_values(st, self.x_lr, more=t < self.T - 1)
                self._optimizer_step(st, energies)
            clock.append(time.perf_counter())
        clock.append(time.perf_counter())
        if energies is None or not log:
            return {}
        full = par.gather_layer_energies(energies, B)
        if full is None:
            return {}
        layer = full.tolist()
        phases = dict(zip(("init", "inference", "weights"), (b - a for a, b in zip(clock, clock[1:]))))
        return {"energy": math.fsum(layer), "layer_energies": layer, "phase_s": phases}

    @torch.no_grad()
    def trace(self, x: Tensor, y: Tensor) -> list[list[float]] | None:
        """Per-layer energies at the init and after each of the T inference steps, weights untouched.

        Every rank must call it; the logging rank gets the list, others None.
        """
        B = self._check_batch(x, y)
        st, par = self.stage(B), self.parallel
        st.begin(x if par.is_first else None, y if par.is_last else None)
        par.feedforward(st)
        out = []
        for t in range(self.T + 1):
            par.errors(st, exchange=t < self.T)
            full = par.gather_layer_energies(st.layer_energies(), B)
            if full is not None:
                out.append(full.tolist())
            if t < self.T:
                par.backproject(st)
                par.update_values(st, self.x_lr, more=t < self.T - 1)
        return out if par.is_logging else None

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

    def _check_batch(self, x: Tensor, y: Tensor) -> int:
        s_in, s_out = self.net.node_shapes[0], self.net.node_shapes[-1]
        if x.ndim != 1 + len(s_in) or tuple(x.shape[1:]) != s_in:
            raise ValueError(f"x must have shape [batch, {', '.join(map(str, s_in))}] (the model's input "
                             f"{'width' if len(s_in) == 1 else 'shape'}), got {list(x.shape)}")
        if y.ndim != 1 + len(s_out) or tuple(y.shape[1:]) != s_out or y.shape[0] != x.shape[0]:
            raise ValueError(
                f"y must have shape [{x.shape[0]}, {', '.join(map(str, s_out))}] (batch, the model's output width; "
                f"one-hot labels), got {list(y.shape)}"
            )
        return x.shape[0]

    def value_nodes(self) -> list[Tensor]:
        """Copies of the value nodes h_0 .. h_L at the end of the last step's inference.

        On a layer slice [a, b): h_{a-1} .. h_{b-1}, where h_{a-1} (for a > 1) is the
        copy last received from the upstream rank, not a node this rank owns.
        """
        if self._stage is None:
            raise RuntimeError("value_nodes() is only defined after a step()")
        st = self._stage
        return [st.node(n).clone() for n in range(self.net.first - 1, self.net.stop)]


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, final_ratio: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up from 0 to the base LR over ``warmup_steps``, then cosine decay to final_ratio x base."""
    if warmup_steps < 0 or total_steps < 1 or warmup_steps > total_steps:
        raise ValueError(f"need 0 <= warmup_steps <= total_steps and total_steps >= 1, got {warmup_steps}, {total_steps}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
