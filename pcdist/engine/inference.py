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

``solver``: inference is gradient flow dh/dt = -g(h) on the energy, and the step above is its
explicit Euler step of size dt = x_lr. ``"heun"`` (2nd order) and ``"rk4"`` (classic 4th order)
take S = 2 or 4 evaluations per step instead (errors, back-projection and one boundary exchange
each; the stage combinations are ``engine.values.Tableau``); T still counts solver steps, each
hook runs once per step (record and each_step at its first evaluation, after_step after its
last). ``relax_adaptive`` (inference at test time only) integrates the same flow to t = T x_lr
with Heun steps whose size follows a tolerance, reading one error norm per step on the host.

With ``fused`` (pc without momentum: the weights and every prediction stay fixed until the value
step) each group's error pass also takes h -= x_lr e and the back-projection adds x_lr P straight
into h (pcdist/engine/stage.py); the errors are then not kept, so an energy trace runs unfused.
Nothing here reads a device value on the host: the routine is part of a step's capturable core.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import torch

from .arguments import finite
from .schedules import PrecisionSchedule
from .values import TABLEAUS

__all__ = ["relax", "relax_adaptive", "set_precision", "SOLVERS", "check_solver"]

SOLVERS = ("euler", *TABLEAUS)

Hook = Callable[[int], None] | None


def relax(st, par, T: int, x_lr: float, *, fused: bool, schedule: PrecisionSchedule | None = None,
          noise: Hook = None, record: Hook = None, each_step: Hook = None, after_step: Hook = None,
          need_all_deltas: bool = False, final: bool = False, solver: str) -> None:
    """T inference steps of ``solver`` on the Stage ``st`` through the exchange ``par`` (see the module docstring;
    every caller passes its trainer's solver: no default that a new caller could fall back to silently).

    Where the weights hold (no ``after_step``), the target is clamped and inference starts at the
    feed-forward state without noise, node n's gradient is exactly zero before step L - 1 - n: the error
    front. Adam on the values zeroes it there rather than scale round-off up to full steps (``ValueOptimizer``),
    and pc's weight gradients are zeroed below it (``Stage.front``).
    """
    vo = st.values
    vo.tableau = TABLEAUS.get(solver)
    front = st.init in ("ff", "deeppcr") and noise is None and after_step is None and not st.free_top \
        and not vo.rule.decay  # (AdamW's decay on the values moves every node at once: there is no front)
    vo.front = st.net.num_layers - 1 if front else None
    S = 1 if vo.tableau is None else vo.tableau.stages
    st.front = st.net.num_layers - T * S if front and final else 0  # the weight gradients' front (Stage.front)
    for t in range(T + final):
        last = t == T
        set_precision(st, schedule, t)
        for s in range(S):
            par.errors(st, need_all_deltas=need_all_deltas or last, exchange=not last,
                       step_lr=x_lr if fused and not last else None)
            if record is not None and s == 0:
                record(t)
            if last:
                return
            par.backproject(st)
            if each_step is not None and s == 0:
                each_step(t)
            vo.stage = s
            par.update_values(st, x_lr, more=t < T - 1 or s < S - 1)
        if noise is not None:
            noise(t)
        if after_step is not None:
            after_step(t)


def relax_adaptive(st, par, T: int, x_lr: float, tol: float, max_steps: int | None = None,
                   schedule: PrecisionSchedule | None = None) -> dict:
    """Heun steps of adaptive size integrating the flow to t = T x_lr (inference at test time; not capturable).
    A precision ``schedule``'s step k holds over the time [k x_lr, (k + 1) x_lr), as for Euler's steps of x_lr: the
    adaptive steps integrate that flow (none crosses the time a row changes).

    Each step's local error is Heun's against Euler's, dt/2 (k_1 - k_0), per entry over tol (1 + |h|), and
    its root mean square over every node of every rank (one all-reduce) decides: at most 1 the step is
    taken, else the nodes are put back. Either way the next dt is dt min(5, max(0.2, 0.9 / sqrt(err))),
    starting from x_lr and never past the end (nor a schedule's row: a step cut short so, and taken, keeps the
    size proposed before it where that is larger); after ``max_steps`` tries (default 100 T) it stops where it is,
    with a warning saying how far it got. Returns {"accepted", "rejected", "evaluations", "t"}."""
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (tol > 0 and math.isfinite(tol)):
        raise ValueError(f"the adaptive solver's tolerance must be a finite number > 0, got {tol!r}")
    vo = st.values
    vo.tableau = TABLEAUS["heun"]
    boundary = st.send_error is not None
    like = st.node(st.net.stop - 1)
    count = float(vo.owned_count(boundary))
    end, t, dt = T * x_lr, 0.0, x_lr
    max_steps = 100 * T if max_steps is None else max_steps
    done = {"accepted": 0, "rejected": 0, "evaluations": 0}
    try:
        while t < end * (1 - 1e-12) and done["accepted"] + done["rejected"] < max_steps:
            step = min(dt, end - t)
            if schedule is not None:  # this time's row, for a step that ends where the next row starts
                k = min(T - 1, int(t / x_lr * (1 + 1e-12)))
                set_precision(st, schedule, k)
                step = min(step, (k + 1) * x_lr - t)
            vo.estimate = [tol, torch.zeros((), dtype=torch.float64, device=like.device)]
            for s in range(2):
                par.errors(st, exchange=True)
                par.backproject(st)
                vo.stage = s
                par.update_values(st, step, more=s == 0)
            done["evaluations"] += 2
            total = par.all_sum(torch.stack([vo.estimate[1].double(),
                                             torch.tensor(count, dtype=torch.float64, device=like.device)]),
                                "the adaptive solver's error all-reduce")
            sq, n = total.tolist()
            err = math.sqrt(sq / max(n, 1.0))
            if err <= 1.0:
                t += step
                done["accepted"] += 1
            else:
                vo.restore()
                done["rejected"] += 1
            # (an error estimate that is not finite, a trial step that overflowed: shrink, as for a large one)
            grown = step * (0.2 if not math.isfinite(err) else min(5.0, max(0.2, 0.9 / math.sqrt(err))) if err > 0
                            else 5.0)
            # a step cut short by a row's end (or the end) says nothing against the size proposed before it
            dt = max(dt, grown) if err <= 1.0 and step < dt else grown
    finally:
        vo.estimate = None
    done["t"] = t
    if t < end * (1 - 1e-12):
        warnings.warn(f"the adaptive solver stopped at t = {t:.4g} of {end:.4g} after {max_steps} steps: its tolerance "
                      f"{tol:g} asks for more (raise it: trainer.infer(tol=...), the service's pc.eval_tol); the "
                      f"inference is cut short", stacklevel=3)
    return done


def check_solver(solver: str, *, adaptive: bool = False) -> str:
    """``solver``, or a ValueError listing the solvers (``adaptive``: "adaptive" is allowed too)."""
    allowed = SOLVERS + (("adaptive",) if adaptive else ())
    if solver not in allowed:
        raise ValueError(f"unknown inference solver {solver!r}; allowed: {', '.join(allowed)}"
                         + ("" if adaptive or solver != "adaptive" else
                            " (the adaptive solver runs at test time only: trainer.infer(..., solver='adaptive'))"))
    return solver


def set_precision(st, schedule: PrecisionSchedule | None, t: int) -> None:
    """pi_l(t) = pi_l * factor(l, t, L) on the slice's layers (the schedule's step t); nothing without a schedule.

    Each step's row is computed on the host once per stage and kept on the device, so the step itself
    only copies it (a captured step replays the copy): the schedule is a function of (l, t, L) alone (one
    that changes over training is set anew: ``trainer.precision_schedule = ...``, which drops the rows)."""
    if schedule is None:
        return
    row = st.precision_rows.get(t)
    if row is None:
        net = st.net
        base = net.precision or (1.0,) * net.num_layers
        row = []
        for l in range(net.first, net.stop):  # (host floats: no device read)
            f = schedule(l, t, net.num_layers)
            if not finite(f) or f < 0:
                raise ValueError(f"the precision schedule gave {f!r} for layer {l} at inference step {t}: its "
                                 f"factors must be finite numbers >= 0")
            row.append(base[l - 1] * float(f))
        row = st.precision_rows[t] = torch.tensor(row, dtype=st.precision.dtype).to(st.precision.device)
    st.precision.copy_(row)
