"""``pc.diagnostics=true``: PC against backprop during a run, logged and drawn (docs/fidelity.md).

Every ``pc.diagnostics_every`` steps (and before the first update) the run calls
``pcdist.diagnose`` (pcdist/engine/diagnostics.py) on the step's batch, with the weights as they
are, on every rank (layer-parallel: each rank measures its own layers, one reduce). The logging
rank then

* logs the scalars to metrics.jsonl and wandb: ``diag/cosine/<l>`` and ``diag/norm_ratio/<l>``
  (PC's weight update against backprop's gradient, per layer), ``diag/value_change/<n>`` (rms value
  change over inference / rms activation, per free node), ``diag/energy_init`` and ``diag/energy_final``
  (the batch energy after the feed-forward init and after T inference steps), ``diag/energy_ratio``
  (final / init) and ``diag/unstable`` (1 when the energy grew over the inference steps by more than
  round-off, ``grew``);
* appends the whole record (with the energy per layer at every inference step) to diagnostics.jsonl;
* says, once, when inference is unstable, with the likely fix (``unstable_hint``);
* at the end draws diagnostics_energy.png (energy per layer over the inference steps, first and last
  diagnosed batch) and diagnostics_cosine.png (cos per layer over training).

With ``pc.diagnostics=false`` nothing here runs. Independently, the end-of-run trace of one batch
(``check_trace``) is checked for the same instability, at no cost: the run computes it anyway.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..engine.diagnostics import classify_inference, diagnose, unstable_hint

__all__ = ["Diagnostics", "check_trace", "grew", "scalars", "plot_diagnostics", "read_diagnostics"]

FILE = "diagnostics.jsonl"


def scalars(d: dict) -> dict:
    """The metrics of one diagnosis (``diagnose``'s dict) as flat ``diag/...`` numbers."""
    out = {f"diag/cosine/{l}": c for l, c in enumerate(d["cosine"], 1)}
    out.update({f"diag/norm_ratio/{l}": r for l, r in enumerate(d["norm_ratio"], 1)})
    out.update({f"diag/value_change/{n}": v for n, v in d["value_change"].items()})
    e0, eT = d["energy"][0], d["energy"][-1]
    out.update({"diag/energy_init": e0, "diag/energy_final": eT,
                "diag/energy_ratio": eT / e0 if e0 > 0 else math.nan,
                "diag/unstable": float(grew(d["energy"]))})
    return out


class Diagnostics:
    """The run's diagnostics (``pc.diagnostics``): ``due(step)``, then ``__call__`` on every rank."""

    def __init__(self, c, run_dir: Path, logger):
        self.every = c.pc.diagnostics_every or c.trainer.eval_every
        self.path = Path(run_dir) / FILE
        self.logger, self.warned = logger, False

    def due(self, step: int) -> bool:
        """Diagnose before the update of step ``step + 1`` (weights after ``step`` updates)?"""
        return step % self.every == 0

    def __call__(self, step: int, trainer, x, y, global_batch: int | None = None) -> dict | None:
        d = diagnose(trainer, x, y, global_batch=global_batch)  # collective: every rank takes part
        if d is None:
            return None
        d = {"step": step, **d, "value_change": {str(k): v for k, v in d["value_change"].items()},
             "activation_scale": {str(k): v for k, v in d["activation_scale"].items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(d) + "\n")
        self.logger.log(scalars({**d, "value_change": {int(k): v for k, v in d["value_change"].items()}}), step)
        if grew(d["energy"]) and not self.warned:
            self.logger.say(unstable_hint(d["energy"], d["x_lr"], d["T"], f" at step {step} (pc.diagnostics)"))
            self.warned = True
        return d

    def plot(self) -> None:
        """diagnostics_energy.png and diagnostics_cosine.png from diagnostics.jsonl (this run's every attempt)."""
        if self.path.is_file():
            plot_diagnostics(read_diagnostics(self.path), self.path.parent)


GREW = 1e-3
"""How much (relative) the energy must grow over the inference steps to be called unstable: far above the
round-off of two float32 evaluations of the same energy (~1e-6), far below any real blow-up (x1.1 and up)."""
FLOOR = 1e-9
"""And by how much at least (absolute): a network that fits its batch (energy 0 at the init, or 1e-12) ends with
round-off of that size, which a ratio to ~0 would call a blow-up; O(1) activations' float32 round-off squared and
summed over a layer stays far below it, a real blow-up far above."""


def grew(energy: list[float]) -> bool:
    """Whether the total energy over the inference steps (index 0: the feed-forward init) ended higher than it
    started by more than round-off (``GREW``, ``FLOOR``), or is not finite: an unstable inference."""
    if not all(math.isfinite(e) for e in energy):
        return True
    return classify_inference(energy) == "diverging" and energy[-1] > energy[0] * (1 + GREW) + FLOOR


def check_trace(trace: list[list[float]] | None, x_lr: float, T: int, logger) -> bool:
    """Say so when the end-of-run inference trace (energy per layer per step) grew; True if it did."""
    if not trace:
        return False
    energy = [math.fsum(row) for row in trace]
    if not grew(energy):
        return False
    logger.say(unstable_hint(energy, x_lr, T, " (one batch at the final weights)"))
    return True


def read_diagnostics(path: str | Path) -> list[dict]:
    """The records of a diagnostics.jsonl."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_diagnostics(records: list[dict], run_dir: Path) -> dict[str, Path]:
    """diagnostics_energy.png (energy per layer over the inference steps: the first and the last diagnosed
    batch) and diagnostics_cosine.png (cos of PC's update and backprop's gradient per layer, and the norm
    ratio, over training); returns {name: path}."""
    from .metrics import _save, subplots, tight_layout

    import matplotlib as mpl

    if not records:
        return {}
    L = len(records[0]["cosine"])
    colour = (lambda l: f"C{l % 10}") if L <= 10 else (lambda l: mpl.colormaps["viridis"](l / max(1, L - 1)))
    out = {}
    shown = [records[0], records[-1]] if len(records) > 1 else [records[0]]
    fig, axes = subplots(1, len(shown), figsize=(5.2 * len(shown), 4.0), squeeze=False)
    for ax, r in zip(axes[0], shown):
        trace = r["energy_trace"]
        for l in range(L):
            ax.plot(range(len(trace)), [max(t[l], 1e-30) for t in trace], color=colour(l), lw=1.1,
                    label=f"layer {l + 1}" if L <= 10 else None)
        ax.plot(range(len(trace)), r["energy"], "k:", lw=1.2, label="total")
        ax.set_yscale("log")
        pos = [e for t in trace for e in t if e > 0] or [1.0]
        ax.set_ylim(max(min(pos), max(pos) * 1e-12) / 2, max(max(pos), max(r["energy"])) * 2)
        ax.set_xlabel("inference step (0: feed-forward init)")
        ax.set_ylabel("batch-mean energy (0: off the axis)")
        ax.set_title(f"step {r['step']}: inference {r['inference']} (x_lr {r['x_lr']:g}, T {r['T']})", fontsize=9)
        if L <= 10:
            ax.legend(fontsize=7, ncol=2)
    tight_layout(fig)
    out["diagnostics_energy"] = run_dir / "diagnostics_energy.png"
    _save(fig, out["diagnostics_energy"])
    fig, (ax, ax2) = subplots(1, 2, figsize=(10.4, 4.0))
    steps = [r["step"] for r in records]
    for l in range(L):
        ax.plot(steps, [r["cosine"][l] for r in records], "o-", ms=3, color=colour(l),
                label=f"layer {l + 1}" if L <= 10 else None)
        ax2.plot(steps, [r["norm_ratio"][l] for r in records], "o-", ms=3, color=colour(l))
    lowest = min(min(r["cosine"]) for r in records)
    ax.set_ylim(min(-0.05, lowest - 0.05), 1.05)
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.set_xlabel("training step")
    ax.set_ylabel("cos(PC update, backprop gradient)")
    ax.set_title("Direction of PC's weight update per layer (1: backprop's)", fontsize=9)
    ax2.set_yscale("symlog", linthresh=1e-3)
    ax2.axhline(1.0, color="grey", lw=0.6)
    ax2.set_xlabel("training step")
    ax2.set_ylabel("||PC update|| / ||backprop gradient||")
    ax2.set_title("Size of PC's weight update per layer (0: not reached by inference)", fontsize=9)
    if L <= 10:
        ax.legend(fontsize=7, ncol=2)
    else:
        fig.colorbar(mpl.cm.ScalarMappable(mpl.colors.Normalize(1, L), mpl.colormaps["viridis"]), ax=ax2,
                     label="layer")
    tight_layout(fig)
    out["diagnostics_cosine"] = run_dir / "diagnostics_cosine.png"
    _save(fig, out["diagnostics_cosine"])
    return out
