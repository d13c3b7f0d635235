"""The configured optimizer and its learning-rate schedule (``optim.*``)."""

from __future__ import annotations

import torch

from ..engine.trainer import warmup_cosine
from ..errors import ConfigError
from .config import Config, given_keys


def optimizer_steps(c: Config) -> int:
    """Optimizer steps per training step: pc.T under ipc (a weight step at every inference step), else 1. The
    engine steps the LR schedule after each (engine/update.py), so the schedule counts them."""
    return c.pc.T if c.pc.algorithm == "ipc" else 1


def make_optimizer(c: Config, params, total_steps: int, device: torch.device | None = None):
    """The configured optimizer and LR schedule over ``total_steps`` training steps (``optimizer_steps`` each: ipc's
    warm-up and cosine span the run, not its first max_steps / T steps); fused kernels, so that a captured step can
    skip an update and read its learning rate from the device (pcdist/engine/update.py)."""
    o, k = c.optim, optimizer_steps(c)
    total_steps = total_steps * k
    if o.name == "adamw":
        opt = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, fused=True)
    else:
        opt = torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                              fused=device is not None and device.type == "cuda")
    warm = min(o.warmup_steps * k, total_steps)
    if o.schedule == "cosine":
        return opt, warmup_cosine(opt, warm, total_steps, o.final_lr_ratio)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (warm + 1)))


def warmup_note(c: Config, overrides: list[str]) -> str | None:
    """The one line for a warm-up the user set (``overrides``) longer than the run (it is shortened to the run: the
    peak rate at its end); a preset's, in a short run made for a try, goes unsaid."""
    if "optim.warmup_steps" not in given_keys(overrides) or c.optim.warmup_steps <= c.trainer.max_steps:
        return None
    return (f"note: optim.warmup_steps={c.optim.warmup_steps} is longer than the run (trainer.max_steps="
            f"{c.trainer.max_steps}): the warm-up is shortened to the run, and no cosine decay follows")


_READS = {"momentum": ("optim.name", "sgd"), "betas": ("optim.name", "adamw"),
          "final_lr_ratio": ("optim.schedule", "cosine")}
"""optim.* keys that only one optimizer or schedule reads: key -> (the choosing key, the choice that reads it)."""


def check_optim_keys(c, passed: dict[str, str] | None) -> None:
    """Refuse an optim.* key the user sets (``passed``) that the chosen optimizer or schedule does not read (momentum
    under adamw, betas under sgd, final_lr_ratio under a constant schedule), which would change nothing."""
    for key, override in (passed or {}).items():
        group, _, field = key.partition(".")
        if group != "optim" or field not in _READS or not override.lstrip("+").startswith(key):  # not a group's
            continue
        chooser, reader = _READS[field]
        chosen = getattr(c.optim, chooser.split(".")[1])
        if chosen != reader:
            raise ConfigError(f"{override}: {chooser}={chosen} does not read optim.{field} ({reader} does), so it "
                              f"would change nothing; drop it or set {chooser}={reader}")

