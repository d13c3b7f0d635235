"""Schedules: the weight learning rate over training, precisions over the inference steps.

A precision schedule is a callable ``factor(layer, t, num_layers) -> float`` that scales
layer l's precision pi_l at inference step t (t = 0 .. T - 1; t = T is the evaluation after
inference that the weight update reads). Each rank evaluates it for its own layers, so it
stays as local as the precisions themselves.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

__all__ = ["warmup_cosine", "top_down", "inert", "PrecisionSchedule", "PRECISION_SCHEDULES", "precision_schedule"]

PrecisionSchedule = Callable[[int, int, int], float]
PRECISION_SCHEDULES = ("none", "top_down")


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, final_ratio: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up from 0 to the base LR over ``warmup_steps``, then cosine decay to final_ratio x base."""
    if warmup_steps < 0 or total_steps < 1 or warmup_steps > total_steps:
        raise ValueError("need 0 <= warmup_steps <= total_steps and total_steps >= 1, "
                         f"got {warmup_steps}, {total_steps}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def top_down(decay: float = 0.1) -> PrecisionSchedule:
    """Layers switched on from the top: at inference step t, layer l (depth L - l below the output)
    has its full precision once t >= L - l, and decay^(L - l - t) times it before.

    It damps the layers the output's error has not reached yet, which matters where they have errors
    of their own: after an init near equilibrium (``init="backward"``, ``"newton"``, ``"newton_cr"``),
    under value noise, or with a value decay (``ValueRule("adamw")``). After the feed-forward init
    (``"ff"``, ``"deeppcr"``) without those, a layer has no error before the front reaches it (only the
    output layer has one at t = 0, and each step carries it one layer down), so the schedule changes
    nothing there (``inert``: the trainer warns). In the spirit of Qi et al. ("Towards the training of
    deeper predictive coding neural networks", ICML 2026): a per-layer precision that re-balances the
    errors across depth during relaxation. ``decay`` 1 is no schedule, 0 switches layers on outright.
    """
    if not (isinstance(decay, (int, float)) and 0.0 <= decay <= 1.0):
        raise ValueError(f"precision decay must be a number in [0, 1], got {decay!r}")

    def factor(layer: int, t: int, num_layers: int) -> float:
        behind = num_layers - layer - t
        return 1.0 if behind <= 0 else decay ** behind

    factor.__name__ = f"top_down({decay:g})"
    factor.behind_the_front = decay < 1.0  # it acts only on layers the output's error has not reached (inert)
    return factor


def inert(schedule, init: str, value_noise: float, value_decay: float) -> str | None:
    """Why ``schedule`` changes nothing under these settings (None where it may act): ``top_down`` damps only the
    layers the error front has not reached, which have no error after the feed-forward init unless value noise or
    a value decay moves their nodes."""
    if not getattr(schedule, "behind_the_front", False) or init not in ("ff", "deeppcr") or value_noise \
            or value_decay:
        return None
    return (f"precision_schedule={schedule.__name__} changes nothing here: after init={init!r} without value noise "
            f"or a value decay, the layers it damps have no error yet (layer l has none before step L - l); it acts "
            f"after init='backward', 'newton' or 'newton_cr', or with value noise (docs/modes.md)")


def precision_schedule(name: str, decay: float = 0.1) -> PrecisionSchedule | None:
    """A named schedule: "none" (None) or "top_down"."""
    if name == "none":
        return None
    if name == "top_down":
        return top_down(decay)
    raise ValueError(f"unknown precision schedule {name!r}; allowed: {', '.join(PRECISION_SCHEDULES)}")
