"""The weight update of a step: the data-axis reduce, a skip of diverged updates, the optimizer and its schedule.

Every decision is taken on the device, so a step never waits for the host:

* ``skip_above``: an update is skipped where the step's energy F (the mean over the global batch of every
  layer's energy) is not finite or exceeds the limit. It is summed on the device over every rank by one
  tiny all-reduce, so every rank decides alike; fused Adam, AdamW and SGD skip
  the update themselves when handed it as ``found_inf`` (as under AMP's GradScaler), any other optimizer's
  parameters and state are restored where it is set. State any optimizer creates in a skipped first step
  is left at zeros (a fresh state for Adam, AdamW and SGD without dampening; fused SGD would leave its
  momentum buffers as allocated), on the state's own device. Skipped updates are counted on the device too.
* The learning rate schedule advances once per optimizer step, skipped or not (the schedule counts
  training steps, as a resumed run positions it).
* Under a captured step (``planned``) the learning rates are device tensors: before each step the host
  steps the schedule through the step's optimizer steps (1 for pc, T for ipc) and copies their rates
  into a device table ``plan`` [steps + 1, groups]; the optimizer reads row i at its i-th step (each
  group's ``lr`` points at that row while it steps, and is a float again for the schedule after).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
from torch import Tensor

from .capture import host_work

__all__ = ["WeightUpdate"]

_FOUND_INF = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


class WeightUpdate:
    """The weight step of a trainer (see the module docstring). ``steps``: optimizer steps per training step.

    ``sync``: called after every optimizer step (the compute copy of mixed precision); ``grads``: before
    it (the compute copy's gradients into the master weights')."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler, par, skip_above: float | None, planned: bool,
                 steps: int, device: torch.device, grads=None, sync=None):
        self.optimizer, self.scheduler, self.par = optimizer, scheduler, par
        self.skip_above, self.planned, self.steps = skip_above, planned, steps
        self.grads, self.sync = grads, sync
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.flag = torch.zeros((), dtype=torch.float32, device=device)  # 1.0: skip this update
        groups = optimizer.param_groups
        # fused CUDA kernels read a float32 rate; the CPU ones read a double (the float rate exactly)
        dtype = torch.float32 if device.type == "cuda" else torch.float64
        self.plan = torch.zeros(steps + 1, len(groups), dtype=dtype, device=device) if planned else None
        self._restore: dict = {}
        self._vote: Tensor | None = None
        self._bad = torch.zeros((), dtype=torch.bool, device=device)
        self._settled = False  # a fused optimizer has made all its state
        self._layout = self._optimizer_layout()
        self._entries = 0  # parameters with optimizer state, the most seen

    def _optimizer_layout(self) -> tuple:  # (per step: O(1), add_param_group appends a group)
        return id(self.optimizer.state), len(self.optimizer.param_groups)

    def outdated(self) -> bool:
        """The optimizer changed under this update: a parameter group added (``add_param_group``), its state
        loaded (``load_state_dict`` makes every state tensor anew) or dropped (``optimizer.state.clear()``, a
        ``del`` of a parameter's). Its rates table and the steps captured with it (which update the state tensors
        they were captured with, by address) are then the old optimizer's."""
        entries = len(self.optimizer.state)
        if entries < self._entries:
            return True
        self._entries = entries
        return self._optimizer_layout() != self._layout

    def held(self) -> tuple[tuple, tuple]:
        """What a captured step holds as it was at its capture: (``settings()``, ``frozen()``)."""
        return self.settings(), self.frozen()

    def settings(self) -> tuple:
        """The optimizer's settings other than the learning rate, per group (``weight_decay``, ``betas``,
        ``momentum``, ``eps``, ...: the keys of its ``defaults``), which a captured step replays as they were at
        its capture (the rates come from the plan): written between steps, they make a capture of their own (a
        tensor setting by identity: the graph reads its value)."""
        keys = [k for k in self.optimizer.defaults if k != "lr"]
        return tuple(tuple((k, ("tensor", id(g[k])) if isinstance(g.get(k), Tensor) else g.get(k)) for k in keys)
                     for g in self.optimizer.param_groups)

    # -- host work, around a step's core --------------------------------------------------
    def prepare(self) -> None:
        """Before a step's core runs: under a plan, its learning rates, stepping the schedule as the step will."""
        if self.plan is None:
            return
        schedule = None if self.scheduler is None else self.scheduler.state_dict()
        rates = [g["lr"] for g in self.optimizer.param_groups]
        self._taken = 0  # optimizer steps of this training step taken (``unprepare``)
        rows, tensors = [], []
        for i in range(self.steps + 1):
            row = []
            for j, g in enumerate(self.optimizer.param_groups):
                lr = g["lr"]
                if isinstance(lr, Tensor):  # a scheduler writes a tensor rate in place: this row's value, copied
                    tensors.append((i, j, lr.detach().clone()))  # on its device (no host read)
                    lr = 0.0
                row.append(lr)
            rows.append(row)
            if i < self.steps and self.scheduler is not None:
                with warnings.catch_warnings():  # stepped ahead of the optimizer on purpose
                    warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*before.*optimizer.step.*")
                    self.scheduler.step()
        with host_work():  # (copied in before the core runs: no read, whatever HostReads around the step sees)
            host = torch.tensor(rows, dtype=torch.float64, device="cpu").to(self.plan.dtype)
            if self.plan.device.type == "cuda":
                host = host.pin_memory()
            self.plan.copy_(host, non_blocking=True)
            for i, j, lr in tensors:
                self.plan[i, j].copy_(lr)
        self._before = schedule, rates, {j: lr for i, j, lr in tensors if i == 0}  # (tensor rates: their values)

    def unprepare(self) -> None:
        """After a step's core raised: the schedule and the learning rates where an eager step leaves them, stepped
        once per optimizer step it took before it raised (``prepare`` stepped them through the whole step)."""
        if self.plan is None:
            return
        schedule, rates, values = self._before
        if schedule is not None:
            self.scheduler.load_state_dict(schedule)
        for j, (g, lr) in enumerate(zip(self.optimizer.param_groups, rates)):
            if isinstance(lr, Tensor):  # the schedule wrote it in place: its value before, in its own dtype
                lr.copy_(values[j])
            g["lr"] = lr
        for _ in range(self._taken if self.scheduler is not None else 0):
            self.scheduler.step()

    @contextmanager
    def capturable(self):
        """While a step's core runs in Python under a captured mode on a CUDA device (its first calls, its capture,
        an eager fallback): optimizers that have the option step with device-side counters (those of an optimizer
        stepped before, kept on the host: its step count, NAdam's mu_product, moved to the device). The groups'
        own ``capturable`` is put back after (a replay reads none of it), so that a ``state_dict`` saved from the
        optimizer steps wherever it is loaded: a CPU's Adam refuses ``capturable=True``."""
        groups = [g for g in self.optimizer.param_groups if "capturable" in g]
        own = [g["capturable"] for g in groups]
        for g in groups:
            g["capturable"] = True
        for state in self.optimizer.state.values():
            for k, v in (state.items() if isinstance(state, dict) else ()):
                if isinstance(v, Tensor) and v.dim() == 0 and v.device != self.flag.device:
                    state[k] = v.to(self.flag.device, torch.float32 if k == "step" else v.dtype)
        try:
            yield
        finally:
            for g, c in zip(groups, own):
                g["capturable"] = c

    def frozen(self) -> tuple[int, ...]:
        """The optimizer's parameters frozen now (``requires_grad_(False)``), by position: a captured step leaves
        alone those frozen when it was captured, so a parameter frozen or unfrozen later makes a capture of its own."""
        params = (p for g in self.optimizer.param_groups for p in g["params"])
        return tuple(i for i, p in enumerate(params) if not p.requires_grad)

    @property
    def skipped_updates(self) -> int:
        """Updates skipped so far (a host read: call it where the step is logged)."""
        return int(self.skipped)

    # -- the core --------------------------------------------------------------------------
    def __call__(self, st, i: int = 0) -> None:
        """Optimizer step i of this training step, from the gradients in .grad; skipped where the energy
        ``st.energy_log`` diverged (with ``skip_above``)."""
        self.par.reduce_grads()
        if self.grads is not None:
            self.grads(st.idle)
        for g in self.optimizer.param_groups:  # frozen (requires_grad_(False)), or not in this stage's energy (a
            for p in g["params"]:  # learned prior while h_0 is clamped): no gradient, so no update
                if not p.requires_grad or id(p) in st.idle:
                    p.grad = None
        if self.skip_above is None:
            self._step(i)
        else:
            self._decide(st)
            self._guarded(i)
            self.skipped.add_(self.flag.to(torch.int64))
        if self.plan is None and self.scheduler is not None:
            self.scheduler.step()
        elif self.plan is not None:
            self._taken += 1
        if self.sync is not None:
            self.sync()
        st.weights_changed()

    def _decide(self, st) -> None:
        """flag = 1 where F is not finite or above the limit: [non-finite terms, sum of B x energies, B] summed
        over the ranks (each data replica's batch counted once, by its first layer slice)."""
        e = st.energy_log
        if self._vote is None:
            self._vote = torch.zeros(3, dtype=torch.float64, device=e.device)
        v = self._vote
        v[0].copy_((~torch.isfinite(e)).sum())
        v[1].copy_(e.sum()).mul_(st.B)
        v[2].fill_(st.B if self.par.layer_rank == 0 else 0)
        self.par.all_sum(v)
        torch.logical_or(v[0] > 0, v[1] > self.skip_above * v[2], out=self._bad)
        self.flag.copy_(self._bad)

    def _step(self, i: int) -> None:
        """optimizer.step(), reading the planned rates (row i) under a plan."""
        opt = self.optimizer
        if self.plan is None:
            opt.step()
            return
        rates = [g["lr"] for g in opt.param_groups]
        for j, g in enumerate(opt.param_groups):
            # (a CPU's Adam with foreach=True refuses a tensor rate, and capturable=True: the plan's value, read
            # on the host, which on a CPU waits for nothing)
            eager_only = self.plan.device.type != "cuda" and g.get("foreach") and not g.get("capturable")
            if eager_only:
                with host_work():
                    g["lr"] = self.plan[i, j].item()
            else:
                g["lr"] = self.plan[i, j]
        try:
            opt.step()
        finally:
            for g, lr in zip(opt.param_groups, rates):
                g["lr"] = lr

    def _guarded(self, i: int) -> None:
        """The step, with no effect where ``flag`` is set."""
        opt = self.optimizer
        if isinstance(opt, _FOUND_INF) and all(g.get("fused") for g in opt.param_groups):
            # The fused kernels skip the update (and undo the step count) themselves, but leave state they
            # create in a skipped step as allocated (fused SGD's momentum buffers come from empty_like): zeroed
            # here. Looked for until a step creates none.
            before = None if self._settled else {key for key, _ in self._tensors()}
            opt.found_inf = self.flag
            try:
                self._step(i)
            finally:
                del opt.found_inf
            if before is not None:
                self._settled = not self._zero_new_state(before, self._bad)
            return
        saved = {}
        for key, t in self._tensors():
            saved[key] = b = self._restore.get(key)
            if b is None:
                saved[key] = self._restore[key] = b = torch.empty_like(t)
            b.copy_(t)
        self._step(i)
        bad = self.flag > 0
        for key, t in self._tensors():
            if key in saved:
                torch.where(_on(bad, t), saved[key], t, out=t)
            else:  # state the optimizer created in this step: as if never stepped (zeros)
                t.masked_fill_(_on(bad, t), 0)

    def _zero_new_state(self, before: set, bad: Tensor) -> bool:
        """State a fused optimizer created in this step (keys not in ``before``) as if never stepped (zeros) where
        the update was skipped (``bad``). Whether there was any."""
        new = [t for key, t in self._tensors() if key not in before]
        for t in new:
            t.masked_fill_(_on(bad, t), 0)
        return bool(new)

    def _tensors(self) -> list[tuple[tuple, Tensor]]:
        """Everything an optimizer step writes, keyed: the parameters and the tensors of their state."""
        out = []
        for i, g in enumerate(self.optimizer.param_groups):
            for j, p in enumerate(g["params"]):
                out.append(((i, j), p.data))
                out += [((i, j, k), v) for k, v in self.optimizer.state.get(p, {}).items() if isinstance(v, Tensor)]
        return out


def _on(mask: Tensor, t: Tensor) -> Tensor:
    """``mask`` on ``t``'s device. A copy (a host read) only for state an optimizer keeps on the host beside
    device parameters (a non-capturable Adam's ``step`` on a GPU), which is never inside a captured step."""
    return mask if mask.device == t.device else mask.to(t.device)
