"""The one inference routine: T Jacobi steps on a Stage's free value nodes, for every caller.

A training step (pc and ipc), test-time inference (``PCTrainer.infer``), the energy trace
(``PCTrainer.trace``) and the diagnostics (``pcdist.diagnose``) all run ``relax``; they differ only
in what they do around each step (the hooks) and in whether the value step is fused into the
error pass. Inference step t is

    precisions pi_l(t)          (a schedule's row t, a device tensor built once per stage)
    errors                      e = pi (h - u) and each layer's signal; the boundary exchange posted
    record(t)                   (e.g. the energies of step t)
    backproject                 v_in <- beta v_in - P
    each_step(t)                (ipc: the weight gradients of step t, before the values move)
    update_values               h <- h - x_lr v, after the boundary messages
    noise(t)                    MCPC: h += sqrt(2 x_lr tau) xi
    after_step(t)               (ipc: the weight update of step t)

and ``final=True`` adds an evaluation of the errors at the nodes where inference stopped (t = T,
every layer's signal, no exchange): what pc's weight update and the trace's last row read.

With ``fused`` (pc without momentum: the weights and every prediction stay fixed until the value
step) each group's error pass also takes h -= x_lr e and the back-projection adds x_lr P straight
into h (pcdist/engine/stage.py); the errors are then not kept, so an energy trace runs unfused.
Nothing here reads a device value on the host: the routine is part of a step's capturable core.
"""

from __future__ import annotations

from typing import Callable

import torch

from .schedules import PrecisionSchedule

__all__ = ["relax", "set_precision"]

Hook = Callable[[int], None] | None


def relax(st, par, T: int, x_lr: float, *, fused: bool, schedule: PrecisionSchedule | None = None,
          noise: Hook = None, record: Hook = None, each_step: Hook = None, after_step: Hook = None,
          need_all_deltas: bool = False, final: bool = False) -> None:
    """T inference steps on the Stage ``st`` through the exchange ``par`` (see the module docstring)."""
    for t in range(T + final):
        last = t == T
        set_precision(st, schedule, t)
        par.errors(st, need_all_deltas=need_all_deltas or last, exchange=not last,
                   step_lr=x_lr if fused and not last else None)
        if record is not None:
            record(t)
        if last:
            return
        par.backproject(st)
        if each_step is not None:
            each_step(t)
        par.update_values(st, x_lr, more=t < T - 1)
        if noise is not None:
            noise(t)
        if after_step is not None:
            after_step(t)


def set_precision(st, schedule: PrecisionSchedule | None, t: int) -> None:
    """pi_l(t) = pi_l * factor(l, t, L) on the slice's layers (the schedule's step t); nothing without a schedule.

    Each step's row is computed on the host once per stage and kept on the device, so the step itself
    only copies it (a captured step replays the copy)."""
    if schedule is None:
        return
    row = st.precision_rows.get(t)
    if row is None:
        net = st.net
        base = net.precision or (1.0,) * net.num_layers
        row = st.precision_rows[t] = torch.tensor(
            [base[l - 1] * schedule(l, t, net.num_layers) for l in range(net.first, net.stop)],
            dtype=st.precision.dtype).to(st.precision.device)
    st.precision.copy_(row)
