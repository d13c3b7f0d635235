"""``pc.algorithm=bp``: the backprop twin of a PC run (the same network, data, optimizer, schedule, seed).

``BackpropTrainer`` has PCTrainer's interface (``step``, ``trace``, ``skipped_updates``), so the
service's loop, checkpoints, evaluation and metrics are the ones a PC run uses. Its loss is the
network's output energy at the feed-forward prediction, which is PC's batch objective F at the
feed-forward init (every hidden error is 0 there: each h_l equals its prediction u_l), so ``train/energy``
means the same thing in both runs:

    F = mean over the batch of E_out(u_L(x), y)      (se: 0.5 ||y - u||^2; ce: -sum y log_softmax(u))

and one optimizer step per batch on dF/dtheta by autograd through ``net.forward``.
"""

from __future__ import annotations

import contextlib
import time
import warnings

import torch
from torch import Tensor

from ..distributed.parallel import Parallel
from ..engine.energies import OutputEnergy
from ..engine.network import PCNetwork
from ..engine.precision import cpu_float32, cpu_is_ieee, set_tf32

__all__ = ["BackpropTrainer", "bp_loss"]


def bp_loss(energy, u_BO: Tensor, y_BO: Tensor) -> Tensor:
    """The batch mean of E_out(u, y): PC's F at the feed-forward init (any output energy pcdist has)."""
    return OutputEnergy(energy).value(u_BO, y_BO, y_BO - u_BO) / u_BO.shape[0]


class BackpropTrainer:
    """Autograd training steps on a PCNetwork's feed-forward pass (one process, all layers)."""

    def __init__(self, net: PCNetwork, optimizer: torch.optim.Optimizer, scheduler=None,
                 skip_above: float | None = None, precision: str = "fp32"):
        """``precision``: as PC's (trainer.precision): fp32 / tf32 set the GPU's TF32 switches at each step, bf16
        runs the forward pass under autocast (bfloat16 products, float32 weights, the loss in float32)."""
        if not net.owns_all:
            raise ValueError("backprop trains the whole network in one process; this network owns a layer slice")
        self.net, self.optimizer, self.scheduler, self.skip_above = net, optimizer, scheduler, skip_above
        self.precision = precision
        self.parallel = Parallel.single(net.num_layers)  # what the service's validation reads
        self.skipped_updates = 0

    def step(self, x: Tensor, y: Tensor, log: bool = True, global_batch: int | None = None) -> dict:
        """One optimizer step on F(x, y); returns F (``energy``) and its per-layer terms (the output's)."""
        clock = [time.perf_counter()]
        self.optimizer.zero_grad(set_to_none=True)
        if x.is_cuda:
            set_tf32(self.precision == "tf32")
        with torch.enable_grad(), contextlib.nullcontext() if x.is_cuda or cpu_is_ieee() else cpu_float32():
            with torch.autocast(x.device.type, torch.bfloat16, enabled=self.precision == "bf16"):
                u = self.net(x)
            loss = bp_loss(self.net.energy, u.float() if self.precision == "bf16" else u, y)  # (autocast's bf16 out)
            clock.append(time.perf_counter())
            loss.backward()
        clock.append(time.perf_counter())
        value = float(loss.detach()) if (log or self.skip_above is not None) else None
        if self.skip_above is not None and not (value is not None and value <= self.skip_above):
            self.skipped_updates += 1
        else:
            self.optimizer.step()
        if self.scheduler is not None:  # once per step, skipped or not (engine/update.py: what a resume positions)
            with warnings.catch_warnings():  # (a first step skipped: the optimizer has not stepped, on purpose)
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*before.*optimizer.step.*")
                self.scheduler.step()
        clock.append(time.perf_counter())
        if not log:
            return {}
        phases = dict(zip(("forward", "backward", "weights"), (b - a for a, b in zip(clock, clock[1:]))))
        return {"energy": value, "layer_energies": [0.0] * (self.net.num_layers - 1) + [value], "phase_s": phases}

    def trace(self, x: Tensor, y: Tensor) -> None:
        """Backprop has no inference steps to trace."""
        return None
