"""``python -m pcdist export RUN_DIR out.pt2``: a run's network as a ``torch.export`` program that runs without pcdist.

The program takes raw float inputs [N, *sample_shape] (uint8 images divided by 255 first, as
the data loaders do), applies the run's preprocessing (normalisation, flattening) and returns the
logits u_L; the batch size is dynamic. Load it with torch alone:

    program = torch.export.load("out.pt2").module()
    logits = program(x)

``extra_files["pcdist.json"]`` holds the sample shape, dtype, classes and source run. Where a
layer cannot be exported (a module torch.export cannot trace), ``out.state_dict.pt`` is written
instead (for ``out.pt2``): a ``torch.save`` of ``{"state_dict": nn.Sequential(*layers).state_dict(),
"note": ...}`` (tensors only, loadable with ``weights_only=True``; the keys of the layers as
modules, as ``nn.Sequential(*your_layers)`` has them) and the note names the layer and why.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from .load import Run, load, supervised_only

__all__ = ["export", "export_run", "Deployed", "ExportResult"]


class Deployed(nn.Module):
    """Raw inputs -> the run's preprocessing -> the network's layers (plain torch modules)."""

    def __init__(self, run: Run):
        super().__init__()
        inp = run.inputs
        self.layers = run.network.to_sequential()
        self.flatten = inp.flatten
        self.normalize = inp.mean is not None
        if self.normalize:
            self.register_buffer("mean", inp.mean.clone())
            self.register_buffer("std", inp.std.clone())

    def forward(self, x: Tensor) -> Tensor:
        if self.normalize:
            x = (x - self.mean) / self.std
        if self.flatten:
            x = x.flatten(1)
        return self.layers(x)


@contextlib.contextmanager
def _quiet():
    """torch.export's warnings and graph dumps while it tries (a layer it cannot trace: the note says so in one
    line) kept off the terminal."""
    before = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before)


class ExportResult(dict):
    """``path``, ``format`` ("torch.export" or "state_dict"), the program's ``inputs`` layout and, for the fallback,
    ``note``."""


def _first_failing_layer(run: Run, example: Tensor) -> str:
    """Which PC layer torch.export cannot trace, and why (for the fallback's note)."""
    h = Deployed(run)
    x = example
    if h.normalize:
        x = (x - h.mean) / h.std
    if h.flatten:
        x = x.flatten(1)
    for l, m in enumerate(run.network.to_layers(), start=1):
        m = m.to(x.device)  # a run loaded on a GPU: its layers beside the example (the export runs on the CPU)
        try:
            torch.export.export(m, (x,))
        except Exception as e:  # noqa: BLE001 - any tracing failure is reported, not raised
            return f"layer {l} ({type(m).__name__}) cannot be exported by torch.export: {str(e).splitlines()[0]}"
        with torch.no_grad():
            x = m(x)
    return "torch.export failed on the whole network"


def export(run_dir, out, checkpoint="last", layers=None, trust_code: bool = False) -> ExportResult:
    """Write the run's network (with its preprocessing) to ``out`` as a torch.export program, or as a
    state_dict with a note where a layer cannot be exported. Returns what was written. ``layers``,
    ``trust_code``: as for ``pcdist.load`` (runs of your own modules that only code rebuilds)."""
    return export_run(load(run_dir, checkpoint, layers=layers, trust_code=trust_code), out)


def export_run(run: Run, out) -> ExportResult:
    """``export`` for a run already loaded."""
    supervised_only(run, "export")
    out = Path(out)
    model = Deployed(run).to("cpu").eval()  # traced on the host, as its example: a run loaded onto a GPU too
    dtype = getattr(torch, run.inputs.dtype)
    example = torch.randn(3, *run.inputs.sample_shape, dtype=dtype)
    info = {"sample_shape": list(run.inputs.sample_shape), "dtype": run.inputs.dtype,
            "num_classes": run.network.node_shapes[-1][0], "energy": run.network.energy,
            "run_dir": str(run.run_dir), "checkpoint": run.checkpoint.name, "step": run.step,
            "input": "raw float inputs [N, *sample_shape] (uint8 images / 255); output: logits [N, num_classes]"}
    try:
        with _quiet():
            batch = torch.export.Dim("batch", min=1)
            program = torch.export.export(model, (example,), dynamic_shapes={"x": {0: batch}})
    except Exception:  # noqa: BLE001 - fall back to the weights, saying which layer could not be traced
        with _quiet():
            note = _first_failing_layer(run, example)
        layers = torch.nn.Sequential(*run.network.to_layers())  # the layers' own keys ("0.1.weight"): they load
        state = {"state_dict": layers.state_dict(), "note": note, "info": json.dumps(info)}  # into your modules
        out = out.with_name(out.name.removesuffix(".pt2") + ".state_dict.pt") if out.suffix == ".pt2" else out
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, out)
        return ExportResult(path=str(out), format="state_dict", note=note + f"; wrote the state_dict of "
                            f"nn.Sequential(*layers) to {out} instead (torch.load(..., weights_only=True)"
                            f"['state_dict'])")
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, out, extra_files={"pcdist.json": json.dumps(info)})
    return ExportResult(path=str(out), format="torch.export",
                        inputs=f"{run.inputs.dtype} [N, {', '.join(map(str, run.inputs.sample_shape))}]")  # its
    # inputs' one dtype and layout (torch.export fixes both: numpy's float64 into a float32 program is refused)
