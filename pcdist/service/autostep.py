"""pc.x_lr=auto: the value step chosen from the first batches of a run, and the run's methods.

PC's weight update is backprop's gradient in the limit of small errors (docs/fidelity.md): a value
step large enough to drive the nodes far within T steps makes the output layer learn from a top node
far from the feed-forward one, and on data other than the digits that costs accuracy without a
sign (docs/solvers.md: the 1-D signals MLP at 0.40 against backprop's 0.65 with the old x_lr = 0.1). The
diagnostics on the first batches measure exactly that at the run's own T, solver and init: with ``auto`` the run takes
the largest step of ``CANDIDATES`` for which, on each of the first ``BATCHES`` batches at the
initial weights,

    the inference energy falls at every step (no oscillation or growth), and
    every layer's weight update is within cos >= ``MIN_COS`` (8 degrees) of backprop's gradient

(``pcdist.diagnose``; the smallest candidate if none passes). The layers judged are those both updates reach
(``compared``): a layer without parameters has neither, and one below the error front (T steps from the
feed-forward init reach layers L - T to L) gets no update from PC at any step, which the line says. The choice
is printed in the log and kept in the run directory (``x_lr.json``: the value and the numbers of every
candidate tried); a resumed run reads it back instead of choosing again, and ``pcdist.load`` / ``evaluate``
read it too. Backprop's gradient exists only for supervised PC: in the other modes auto is 0.1 (the old
default).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.parallel import collective
from ..engine.arguments import NEAR_EQUILIBRIUM
from ..engine.diagnostics import diagnose
from ..errors import ConfigError, printable

__all__ = ["CANDIDATES", "BATCHES", "MIN_COS", "choose_x_lr", "resolve_x_lr", "saved_x_lr", "method_options",
           "OTHER_MODES"]

CANDIDATES = (1.0, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001)
BATCHES = 2
MIN_COS = 0.99
OTHER_MODES = 0.1
FILE = "x_lr.json"


def method_options(c, x_lr: float) -> dict:
    """The trainer's value step, optimizer, solver and init from the config (``x_lr`` resolved)."""
    return dict(x_lr=x_lr, x_momentum=c.pc.x_momentum, value_optimizer=c.pc.value_optimizer, solver=c.pc.solver,
                init=c.pc.init)


def _monotone(energies: list[float]) -> bool:
    return all(b <= a * (1 + 1e-6) + 1e-12 for a, b in zip(energies, energies[1:]))


def choose_x_lr(trainer, batches, global_batch: int | None = None) -> tuple[float, list[dict]]:
    """The largest candidate step that passes on every batch of ``batches`` ((x, y) on this rank; see the module
    docstring), and one row of numbers per candidate tried. A smaller step keeps the nodes nearer the feed-forward
    state, so passing is taken to be monotone in the step: a bisection over the candidates tries about four.
    Every rank calls it; all get the same answer (the logging rank decides and broadcasts). ``global_batch``: the
    batch size over every data rank, where their shares differ (diagnose's)."""
    par = trainer.parallel
    rows: list[dict] = []

    def passes(x_lr: float) -> bool:
        trainer.x_lr = x_lr
        ok, row = True, {"x_lr": x_lr, "min_cos": [], "monotone": [], "unreached": []}
        for x, y in batches:
            r = diagnose(trainer, x, y, global_batch=global_batch)
            if r is not None:
                row["min_cos"].append(min((c for c, on in zip(r["cosine"], r["compared"]) if on), default=1.0))
                row["unreached"] = sorted({*row["unreached"], *r["unreached"]})
                row["monotone"].append(_monotone(r["energy"]))
                ok = ok and row["monotone"][-1] and row["min_cos"][-1] >= MIN_COS
            if not _agree(par, ok):
                break
        row["passed"] = ok = _agree(par, ok)
        rows.append(row)
        return ok

    lo, hi, best = 0, len(CANDIDATES) - 1, len(CANDIDATES) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if passes(CANDIDATES[mid]):
            best, hi = mid, mid - 1
        else:
            lo = mid + 1
    trainer.x_lr = CANDIDATES[best]
    return CANDIDATES[best], sorted(rows, key=lambda r: -r["x_lr"])


def _spans(layers: list[int]) -> str:
    """[1, 2, 3, 7] -> "1..3, 7"."""
    spans: list[list[int]] = []
    for layer in layers:
        if spans and layer == spans[-1][1] + 1:
            spans[-1][1] = layer
        else:
            spans.append([layer, layer])
    return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in spans)


def _agree(par, ok: bool) -> bool:
    """The logging rank's verdict on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    t = torch.tensor([1.0 if ok else 0.0])
    if dist.get_backend() == "nccl":
        t = t.cuda()
    with collective("pc.x_lr=auto's verdict (a broadcast)"):  # a lost peer: one line naming it, within the timeout
        dist.broadcast(t, src=par.logging_rank if par.logging_rank is not None else 0, async_op=True).wait(
            dist.distributed_c10d._get_default_store().timeout)
    return bool(t.item() > 0.5)


CHOSEN_FOR = ("T", "solver", "init", "value_optimizer", "x_momentum", "algorithm")
"""The pc.* settings the step is chosen at (kept in x_lr.json beside it)."""


def saved_x_lr(run_dir: str | Path, meta: dict | None = None) -> float | None:
    """The step a run with pc.x_lr=auto chose: its checkpoint's record (``meta``, from 2026-11-29 on: None where
    that checkpoint was trained with a number, whatever x_lr.json holds from an earlier auto), else its x_lr.json;
    None if neither has it (a run not yet started; a checkpoint of before the record whose x_lr.json was not
    copied with it)."""
    if meta and "x_lr" in meta:
        x_lr = meta["x_lr"]
        if x_lr is not None and (isinstance(x_lr, bool) or not isinstance(x_lr, (int, float)) or not x_lr > 0):
            raise ConfigError(f"{run_dir}: its checkpoint records the value step pc.x_lr=auto chose as "
                              f"{printable(repr(x_lr)[:40])}, not a number > 0: the checkpoint is damaged; resume "
                              f"from another (pcdist.load's checkpoint=), or set pc.x_lr to a number")
        return None if x_lr is None else float(x_lr)
    path = Path(run_dir) / FILE
    if not path.is_file():
        return None
    try:
        return float(json.loads(path.read_text())["x_lr"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} is damaged ({type(e).__name__}: {e}); it holds the value step pc.x_lr=auto "
                          f"chose: restore it, or set pc.x_lr to a number") from None


def resolve_x_lr(c, run_dir: str | Path | None, meta: dict | None = None) -> float:
    """pc.x_lr as a number: itself, or what the run chose (its checkpoint's ``meta``, else x_lr.json), or 0.1
    outside supervised mode; a run directory with neither (not yet started) gives 0.1 as well."""
    if c.pc.x_lr != "auto":
        return float(c.pc.x_lr)
    if c.pc.mode != "supervised" or run_dir is None:
        return OTHER_MODES
    saved = saved_x_lr(run_dir, meta)
    return OTHER_MODES if saved is None else saved


def settle_x_lr(c, trainer, run_dir: Path, batches, resumed: dict | None, is_logging: bool, say) -> float:
    """For pc.x_lr=auto: choose the step (or read the run's choice when resuming: ``resumed``, the meta of the
    checkpoint it resumes), set it on the trainer, say it and keep it in run_dir/x_lr.json; returns it. Any other
    pc.x_lr is returned as it is."""
    if c.pc.x_lr != "auto":
        return float(c.pc.x_lr)
    if c.pc.mode != "supervised":
        trainer.x_lr = OTHER_MODES
        if is_logging:
            say(f"pc.x_lr=auto: {OTHER_MODES:g} (pc.mode={c.pc.mode}: the step is chosen against backprop's "
                "gradient, which only supervised PC has)")
        return OTHER_MODES
    saved = saved_x_lr(run_dir, resumed) if resumed is not None else None
    if saved is not None:
        trainer.x_lr = saved
        if is_logging:
            record = json.loads((run_dir / FILE).read_text()) if (run_dir / FILE).is_file() else {}
            at = record.get("chosen_for", {})
            moved = [f"pc.{k} {at[k]} -> {getattr(c.pc, k)}" for k in CHOSEN_FOR
                     if k in at and at[k] != getattr(c.pc, k)]
            note = (f"; it was chosen at other settings ({', '.join(moved)}) and is kept: set pc.x_lr to a number to "
                    f"change it" if moved else "")
            when = f"at step {record['step']}" if record.get("step") else "at its start"
            say(f"pc.x_lr=auto: {saved:g}, as this run chose {when} ({FILE if record else 'its checkpoint'}){note}")
        return saved
    step = (resumed or {}).get("step", 0)  # (a run trained with a number, resumed with auto: its weights now)
    x_lr, rows = choose_x_lr(trainer, batches, c.trainer.batch_size)
    if is_logging:
        tried = ", ".join(f"{r['x_lr']:g}" + ("" if r["passed"] else f" (cos {min(r['min_cos'] or [0]):.3f}"
                                                + ("" if all(r["monotone"]) else ", energy not falling") + ")")
                          for r in rows)
        unreached = sorted({layer for r in rows for layer in r["unreached"]})
        every = "at every layer" if not unreached else (
            f"at every layer PC updates (layers {_spans(unreached)} get no update from it at any step: pc.T={c.pc.T} "
            f"steps from the feed-forward init do not reach them; raise pc.T, or pc.init=backward or newton)")
        test = (f"inference energy falls at every step and whose weight update is within cos {MIN_COS} of "
                f"backprop's gradient {every} on the first {len(batches)} batches")
        if step:
            test += f" (at the weights of step {step}, this run's now)"
        if any(r["passed"] for r in rows):
            say(f"pc.x_lr=auto: {x_lr:g}, the largest step whose {test} (tried {tried}; {FILE})")
        else:  # an init near equilibrium, say, whose update's cosine the step does not move
            why = (f": pc.init={c.pc.init} starts the nodes near the equilibrium, whose update is PC's own whatever "
                   f"the step, and the smallest step keeps them there" if c.pc.init in NEAR_EQUILIBRIUM else "")
            say(f"pc.x_lr=auto: {x_lr:g}, the smallest step tried: none is a step whose {test} (tried {tried}; "
                f"{FILE}){why}; set pc.x_lr to a number for this run")
        chosen_for = {k: getattr(c.pc, k) for k in CHOSEN_FOR}
        (run_dir / FILE).write_text(json.dumps({"x_lr": x_lr, "min_cos": MIN_COS, "chosen_for": chosen_for,
                                                "step": step, "candidates": rows}, indent=1))
    return x_lr
