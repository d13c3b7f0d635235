"""``pcdist.load(run_dir)``: a trained network back from its run directory, on one process, without the data.

    run = pcdist.load("runs/2026-01-01/12-00-00-abc123")       # checkpoint="last" | "best" | a step
    run.network                      # PCNetwork, all layers (whatever parallel.layer / parallel.data wrote it)
    run.config                       # the resolved Config the checkpoint was written with
    run.metrics                      # metrics.jsonl rows (training energy, validation accuracy, ...)
    run.inputs                       # how inputs were prepared: shape, flattening, normalisation statistics
    run.predict(x)                   # raw inputs -> logits, preprocessed as in training

The layers are rebuilt from the run's model.json (pcdist/service/modelfile.py) or, for runs
written before it, from the layer signatures every checkpoint stores; checkpoints are keyed by
global layer, so a checkpoint written by any split loads into one process. A run directory is read
as data only: the function model.json may name as building the layers (``factory``) is imported and
called only with ``trust_code=True`` (docs/after-training.md, "A run folder from someone else"). A problem (not a run
directory, no checkpoint, a checkpoint of another architecture) raises ``RunError`` or
``CheckpointError``, one line naming it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..engine.energies import energy_of
from ..engine.network import PCNetwork, legacy_signature
from ..errors import ConfigError, RunError
from .autostep import resolve_x_lr
from .checkpoint import (CheckpointError, _checkpoints, _step_of, _verify, latest_checkpoint, load_checkpoint,
                         read_meta, saved_config)
from .config import PYTHON_MODEL, Config, literal, load_config, network_options
from .data import as_float
from .metrics import read_metrics
from .models import model_specs
from .modelfile import Inputs, kind_from_description, kind_from_signature, read_model_file
from .userlayers import UserLayers, call_factory

__all__ = ["load", "Run", "RunError", "find_checkpoint"]


@dataclass
class Run:
    """A run read back: its network, config (pc.x_lr=auto as the step the run chose: x_lr.json), metrics history
    and input preparation."""

    network: PCNetwork
    config: Config
    metrics: list[dict]
    inputs: Inputs
    run_dir: Path
    checkpoint: Path
    step: int

    def preprocess(self, x) -> Tensor:
        """Raw inputs [N, *sample_shape] (numpy or torch; uint8 scaled to [0, 1] as the data loaders do)
        as the network's input node: standardised with the run's statistics, flattened where the
        model reads vectors, in the run's dtype."""
        kind = np.asarray(x).dtype if not torch.is_tensor(x) else None
        if kind is not None and not (np.issubdtype(kind, np.floating) or np.issubdtype(kind, np.integer)
                                     or np.issubdtype(kind, np.bool_)):
            raise RunError(f"inputs have dtype {kind}; this run takes numbers (float, or integers such as uint8 "
                           f"images)")
        t = as_float(x)
        if t.is_complex() or not (t.is_floating_point() or t.dtype == torch.bool):
            raise RunError(f"inputs have dtype {t.dtype}; this run takes real numbers")
        if not torch.isfinite(t).all():
            bad = int((~torch.isfinite(t)).reshape(len(t), -1).any(1).nonzero()[0, 0]) if t.dim() else 0
            raise RunError(f"input {bad} holds NaN or Inf (training refuses such samples too)")
        shape, inp = tuple(self.inputs.sample_shape), self.inputs
        if t.dim() < 1 or tuple(t.shape[1:]) not in (shape, (int(np.prod(shape)),)):
            raise RunError(f"inputs have shape {list(t.shape)}, but this run takes [N, {', '.join(map(str, shape))}]"
                           + (f" (or [N, {int(np.prod(shape))}] flattened)" if len(shape) > 1 else ""))
        t = t.reshape(len(t), *shape).to(getattr(torch, inp.dtype))
        if inp.mean is not None:
            t = (t - inp.mean) / inp.std
        return t.flatten(1) if inp.flatten else t

    @torch.no_grad()
    def predict(self, x, batch: int = 4096) -> Tensor:
        """Logits u_L [N, classes] of raw inputs (one feed-forward pass, as the service evaluates)."""
        supervised_only(self, "predict")
        t = self.preprocess(x)
        device = next(self.network.parameters()).device
        return torch.cat([self.network(c.to(device)).cpu() for c in torch.split(t, batch)]) if len(t) else \
            torch.empty(0, self.network.node_shapes[-1][0])


def supervised_only(run: Run, what: str) -> None:
    """``what`` (predict, export) feeds data to h_0 and reads logits at h_L: a supervised run's network. A generative
    or unsupervised run's data sit at h_L (its inputs are labels or a latent): a RunError saying so."""
    mode = run.config.pc.mode
    if mode != "supervised":
        raise RunError(f"{what} feeds data to h_0 and reads logits at h_L, a supervised run's network; "
                       f"{run.run_dir} is pc.mode={mode} (its data sit at h_L): evaluate it (python -m pcdist "
                       f"evaluate), or infer with its network and a PCTrainer (docs/modes.md)")


def _layer_source(p: Path, specs: list, layers, factory: str | None, trust_code: bool):
    """Where the layers come from: the caller's ``layers``, the run's recorded ``factory`` (only with
    ``trust_code``: it is code from the run folder's model.json), or None (rebuilt from model.json's data).
    Refuses, in one line, a run whose layers only code rebuilds when neither was allowed."""
    if layers is not None:
        return layers
    if factory and trust_code:
        return lambda: call_factory(factory)
    missing = [l for l, s in enumerate(specs, start=1) if s is None]
    if not missing:
        return None
    if factory:
        raise RunError(f"{p}: layers {missing} are modules that only code rebuilds, and the run's model.json names "
                       f"{factory!r} to build them; pcdist never imports or runs code named by a run folder unless "
                       f"told to: if you trust {factory}, pass pcdist.load(run_dir, trust_code=True) (on the "
                       f"command line --trust-code), or pass the modules: pcdist.load(run_dir, layers=...)")
    raise RunError(f"{p}: layers {missing} are the user's own modules and the run recorded no importable "
                   f"function that builds them; pass them: pcdist.load(run_dir, layers=...)")


def _run_dir(run_dir) -> Path:
    p = Path(run_dir)
    if not p.exists():
        raise RunError(f"{p} does not exist")
    if not p.is_dir():
        raise RunError(f"{p} is not a directory; give a run directory (it holds config.yaml and checkpoints/)")
    if not (p / "checkpoints").is_dir() and not (p / "config.yaml").is_file():
        raise RunError(f"{p} is not a pcdist run directory (no config.yaml, no checkpoints/)")
    return p


def find_checkpoint(run_dir, checkpoint="last") -> Path:
    """The checkpoint folder of ``run_dir``: "last" (the newest valid one), "best" (the kept checkpoint
    with the highest logged val/accuracy) or a step number."""
    p = _run_dir(run_dir)
    kept = _checkpoints(p / "checkpoints")
    if not kept:
        raise RunError(f"{p} holds no checkpoint (checkpoints/ is empty or missing): the run stopped before its "
                       f"first checkpoint")
    steps = ", ".join(str(_step_of(k)) for k in kept)
    if checkpoint == "last":
        found = latest_checkpoint(p)
        if found is None:
            raise RunError(f"{p}: every checkpoint is damaged (steps {steps})")
        return found
    if checkpoint == "best":
        rows = read_metrics(p / "metrics.jsonl") if (p / "metrics.jsonl").is_file() else []
        acc = {r["step"]: r["val/accuracy"] for r in rows if isinstance(r.get("val/accuracy"), (int, float))
               and not isinstance(r["val/accuracy"], bool) and math.isfinite(r["val/accuracy"])}  # (a number)
        scored = [(acc[_step_of(k)], k) for k in kept if _step_of(k) in acc]
        if not scored:
            raise RunError(f"{p}: no kept checkpoint (steps {steps}) has a logged val/accuracy; use checkpoint='last' "
                           f"or a step")
        for _, found in sorted(scored, key=lambda s: (s[0], s[1].name), reverse=True):  # the best valid one
            try:
                _verify(found)
                return found
            except CheckpointError as e:
                warnings.warn(f"skipping damaged checkpoint {found}: {e}", stacklevel=3)
        raise RunError(f"{p}: every checkpoint with a logged val/accuracy is damaged (steps "
                       f"{', '.join(str(_step_of(k)) for _, k in scored)})")
    else:
        try:
            step = int(checkpoint)
            if step != float(checkpoint) or isinstance(checkpoint, bool):  # (20.7 loaded step 20)
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            raise RunError(f"checkpoint={checkpoint!r}: use 'last', 'best' or a step number") from None
        found = p / "checkpoints" / f"step-{step:08d}"
        if not found.is_dir():
            raise RunError(f"{p} has no checkpoint at step {step} (kept: steps {steps})")
    _verify(found)
    return found


def _inputs_without_model_file(p: Path, c: Config, meta: dict, in_shape: tuple[int, ...]) -> Inputs:
    """How a run without model.json fed its inputs: a run from before the file (the data node's shape, ``in_shape``),
    or one whose file was lost, which its checkpoint's record of the data tells (its samples' shape: images a
    vector model read flattened)."""
    lost = "data" in meta  # checkpoints record their data from 2026-11-29, long after model.json came
    if c.data.normalize:
        raise RunError(f"{p / 'model.json'} is missing: it holds the input normalisation this run was trained with "
                       f"(data.normalize=true); restore it from where the run was made" if lost else
                       f"{p} was trained with data.normalize=true before runs saved their normalisation "
                       f"statistics (model.json): its inputs cannot be prepared as in training")
    sample = tuple(meta["data"].get("sample_shape") or in_shape) if lost else in_shape
    flatten = sample != in_shape and math.prod(sample) == math.prod(in_shape) and len(in_shape) == 1
    return Inputs(sample if flatten else in_shape, flatten, c.trainer.dtype)


def _config(p: Path, meta: dict) -> Config:
    saved = saved_config(p, meta)
    if saved is None:
        raise RunError(f"{p}: neither its checkpoint nor config.yaml holds the run's config")
    try:
        return load_config(literal(saved))  # the folder's text is data: no ${...} is resolved
    except ConfigError as e:  # (a setting this pcdist does not know: a run of a newer one)
        raise RunError(f"{p}: the run's settings (its checkpoint's, else config.yaml) cannot be read by this pcdist: "
                       f"{e}") from None


def _specs(p: Path, model: dict | None, signature: list) -> list:
    if model is not None:
        if len(model["layers"]) != len(signature):
            raise CheckpointError(f"{p}: model.json describes {len(model['layers'])} layers but the checkpoint holds "
                                  f"{len(signature)}: the checkpoint comes from another architecture")
        return [kind_from_description(d) for d in model["layers"]]
    return [kind_from_signature(s) for s in signature]


def _device(device) -> torch.device:
    """``load``'s device, or a RunError naming it where this machine has no such device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise RunError(f"device {device!r} is not a device (cpu, cuda, cuda:N or auto)") from e
    if d.type not in ("cpu", "cuda"):
        raise RunError(f"device {device!r}: pcdist runs on cpu or cuda (cuda:N), or auto")
    if d.type == "cuda" and (not torch.cuda.is_available() or (d.index or 0) >= torch.cuda.device_count()):
        have = f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA device"
        raise RunError(f"device {device!r}: this machine has {have}; use cpu (or auto)")
    return d


def load(run_dir, checkpoint="last", layers=None, device="cpu", trust_code: bool = False) -> Run:
    """The run in ``run_dir`` at ``checkpoint`` ("last", "best" or a step) on one process.

    ``layers``: your modules (or a function returning them), for runs of your own layers that
    pcdist cannot rebuild by itself (generic module layers); they come back trained, as the same
    classes. ``trust_code``: import and call the function the run recorded as building its layers
    (model.json's ``factory``); without it that code is never run, and a run that needs it is
    refused with one line naming it. ``device``: where the network goes ("cpu", "cuda", "cuda:N", or "auto": a GPU
    where there is one).
    """
    device = _device(device)
    p = _run_dir(run_dir)
    for attempt in range(3):
        path = find_checkpoint(p, checkpoint)
        try:
            return _load(p, path, layers, device, trust_code)
        except (CheckpointError, RunError, OSError):
            if path.is_dir() or attempt == 2 or checkpoint not in ("last", "best"):
                raise
            # removed while it was read: the run is training and pruned it; its newer one is read


def _load(p: Path, path: Path, layers, device: torch.device, trust_code: bool) -> Run:
    meta = read_meta(path)
    signature = legacy_signature(meta.get("model")) or meta.get("model")
    if not isinstance(signature, list):
        raise CheckpointError(f"{path}: its meta.pt holds no layer signatures")
    c = _config(p, meta)
    c.pc.x_lr = resolve_x_lr(c, p, meta)  # what the run trained with, as a resume and evaluate take it
    try:
        model = read_model_file(p)
        if model is not None and not isinstance(model, dict):
            raise TypeError(f"it holds a {type(model).__name__}, not an object")
        specs = _specs(p, model, signature)
        inputs = Inputs.from_json(model["inputs"]) if model is not None else None
        energy = model["energy"] if model else c.model.energy
        energy_of(energy)  # a name pcdist knows (ValueError otherwise)
        end = specs[0] if c.pc.mode == "supervised" else specs[-1]  # where the data sit: h_0, or h_L
        reads = None if end is None else tuple(end.in_shape if c.pc.mode == "supervised" else end.out_shape)
        if inputs is not None and reads is not None and tuple(inputs.node_shape()) != reads:
            raise ValueError(f"its inputs {list(inputs.node_shape())} are not the node its data sit at {list(reads)}")
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        if isinstance(e, RunError):
            raise
        raise RunError(f"{p / 'model.json'} is damaged or was not written by pcdist ({type(e).__name__}: {e})") from e
    if any(s is None for s in specs) and inputs is not None and c.model.name != PYTHON_MODEL:
        # a registered model's module layers (deconv's) are pcdist's own: rebuilt from the run's settings
        built = model_specs(c, tuple(inputs.sample_shape), inputs.num_classes)
        specs = [b if s is None else s for s, b in zip(specs, built)]
    dtype = getattr(torch, c.trainer.dtype)
    if model is None:
        data_node = specs[0].in_shape if c.pc.mode == "supervised" else specs[-1].out_shape  # (h_L: generative's)
        inputs = _inputs_without_model_file(p, c, meta, tuple(data_node))
    source = _layer_source(p, specs, layers, (model or {}).get("factory"), trust_code)
    if source is not None:
        user = UserLayers.of(source)
        if len(user.modules) != len(signature):
            raise CheckpointError(f"{path} holds {len(signature)} layers but {len(user.modules)} modules were given: "
                                  f"they are not the run's architecture")
        try:
            net = user.network(energy, (1, len(signature) + 1), inputs.node_shape(), dtype, device,
                               **network_options(c))
        except Exception as e:
            raise CheckpointError(f"the layers given do not build the run's network: {e}") from e
    else:
        try:
            net = PCNetwork(specs, energy=energy, dtype=dtype, device=device, init=False, **network_options(c))
            net.structure = {int(l): v for l, v in (model or {}).get("structure", {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
            raise RunError(f"{p / 'model.json'} is damaged or was not written by pcdist ({type(e).__name__}: "
                           f"{e})") from e
    load_checkpoint(path, net, None)  # checks the signatures: a checkpoint of another architecture is refused
    net.eval()
    metrics = read_metrics(p / "metrics.jsonl") if (p / "metrics.jsonl").is_file() else []
    return Run(net, c, metrics, inputs, p, path, int(meta["step"]))
