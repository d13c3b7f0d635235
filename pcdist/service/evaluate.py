"""Evaluate and predict from a run directory: ``python -m pcdist evaluate RUN_DIR [overrides]`` and
``python -m pcdist predict RUN_DIR inputs.npz --out predictions.npz``.

Evaluation is chosen by the run's PC mode (``EVALUATORS``, keyed by ``pc.mode``; runs before
modes existed are ``supervised``): its ``Evaluator`` (pcdist/service/evaluators.py), the test that
validation runs during training, here in full (``held_out_test``). The
supervised test is PC's at test time (with h_L free, inference leaves the feed-forward values where they are:
every error is 0): one feed-forward pass, argmax of u_L;
beside it the energy F of the label-clamped network after ``pc.T`` inference steps
(overridable: ``pc.T=50``), per-class accuracy and the confusion matrix. The generative test is
classification by inference and the unsupervised one reconstruction (docs/modes.md; their
inference steps ``pc.eval_T``). Written to ``eval.json`` (and ``confusion.png``) in the run directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..engine.energies import energy_of
from ..engine.precision import restore_tf32, tf32_state
from ..engine.schedules import precision_schedule
from ..engine.trainer import PCTrainer
from .config import (PYTHON_DATA, Config, check_combination, command, config_keys, did_you_mean, literal,
                     load_config)
from .data import Dataset, StreamedData, class_id, load_dataset, sample_pair
from .autostep import method_options, resolve_x_lr
from .evaluators import EVALUATORS
from .checkpoint import read_pt
from .datachecks import data_changes, data_identity
from .load import Run, RunError, load
from .metrics import replace_file
from .models import model_of
from .rundir import links_in, links_refusal

__all__ = ["evaluate", "predict", "EVALUATORS", "held_out_test", "read_inputs"]


EVAL_KEYS = ("pc.", "data.root", "data.path", "data.num_workers", "data.prefetch_factor", "trainer.precision")
"""What an evaluation's overrides may set: the inference (``pc.*`` but ``RUN_OWN``), where the data is and how it
is read, the products' precision. The rest is the run's own: its layers and input preparation come from model.json
and the checkpoint, its held-out split from its data settings."""
RUN_OWN = ("pc.mode", "pc.latent_dim", "pc.precision", "pc.prior_precision", "pc.prior_mean")
"""pc.* keys that make the network (its mode and ends, its energy's precisions and prior): the run's own, as it
was trained (an evaluation took them and computed with the run's all the same)."""


def _with_overrides(c: Config, overrides) -> Config:
    """The run's config with command-line style overrides (``["pc.T=50", "data.root=/data"]``) applied."""
    from dataclasses import asdict

    from omegaconf import OmegaConf

    base = OmegaConf.create(literal(asdict(c)))  # the run's values as they are: no ${...} is resolved
    for o in overrides:
        key, sep, value = o.partition("=")
        if not sep:
            raise RunError(f"override {o!r} is not key=value")
        if OmegaConf.select(base, key, default="__missing__") == "__missing__":
            raise RunError(f"unknown config key {key} in override {o!r}{did_you_mean(key, config_keys())} "
                           f"({command()} --help lists every key)")
        if not any(key == k or key.startswith(k) and k.endswith(".") for k in EVAL_KEYS):
            raise RunError(f"{o}: an evaluation takes pc.* (the inference), data.root and data.path (where the data "
                           f"moved), data.num_workers, data.prefetch_factor and trainer.precision; {key} is the "
                           f"run's own (its layers and input preparation come from model.json and its checkpoint, "
                           f"its held-out split from its data settings)")
        own = OmegaConf.select(base, key)
        if key in RUN_OWN and yaml_value(value) != (OmegaConf.to_container(own) if OmegaConf.is_config(own) else own):
            raise RunError(f"{o}: {key} is the run's own (it makes the network the checkpoint was trained as: "
                           f"{key}={own}); an evaluation takes the inference's pc.* keys "
                           f"(pc.T, pc.x_lr, pc.solver, ...)")
        OmegaConf.update(base, key, yaml_value(value), merge=True)
    c = load_config(literal(OmegaConf.to_container(base, resolve=True)))  # (the escapes undone: escaped again)
    check_combination(c)
    return c


def yaml_value(text: str):
    """A command-line value as YAML reads it (numbers, null, lists, strings), a number in exponent form too
    (``1e-3``: YAML 1.1, PyYAML's, reads it as a string; Hydra's grammar, training's, as the number)."""
    import yaml

    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value) if value.strip() == text.strip() and "e" in value.lower() else value
        except ValueError:
            return value
    return value


def _val_split(c: Config, data, run: Run | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's held-out inputs (raw, as loaded) and labels; ``data`` for runs of data passed from Python. Where
    ``run``'s checkpoint recorded its data (sizes, sample shape, classes, a digest of the labels), data that differ
    are refused in one line (``data.path=`` pointed at another file scored it on that file's split)."""
    if data is None:
        if c.data.name == PYTHON_DATA:
            raise RunError("this run's data was passed to pcdist.train from Python; evaluate it from Python: "
                           "pcdist.evaluate(run_dir, data=...)")
        teacher = model_of(c).teacher(c.model)
        d = c.data
        data = load_dataset(d.name, d.root, teacher, c.trainer.seed, d.val_fraction, d.synthetic_train,
                            d.synthetic_val, d.path, d.num_classes, d.signal)
    if run is not None and isinstance(data, (Dataset, StreamedData)):
        _same_data(run, data_identity(data, labels=c.data.name != "synthetic"))
    if isinstance(data, StreamedData):
        items = [sample_pair(data.val[i], f"StreamedData val sample {i}") for i in range(len(data.val))]
        x = torch.stack([torch.as_tensor(np.asarray(a)) for a, _ in items])
        return x, torch.tensor([class_id(b, f"StreamedData val sample {i}") for i, (_, b) in enumerate(items)])
    if not isinstance(data, Dataset):
        raise RunError(f"data= takes a pcdist.data.Dataset or StreamedData, got {type(data).__name__}")
    return data.x_val, data.y_val


def _same_data(run: Run, identity: dict) -> None:
    """Refuse data other than those ``run``'s checkpoint was trained on (its record; from before it: not checked)."""
    changed = data_changes(read_pt(run.checkpoint / "meta.pt"), identity)
    if changed:
        raise RunError(f"{run.run_dir} was trained on other data than these ({changed}): its evaluation would "
                       f"score other samples; nothing was written: give the run's own data (data.path= or "
                       f"data.root= where they moved)")


@torch.no_grad()
def held_out_test(run: Run, c: Config, x, labels: torch.Tensor, mode: str) -> dict:
    """The full test of PC mode ``mode`` (its ``Evaluator``, pcdist/service/evaluators.py: the one validation
    runs during training, with the per-class accuracy and confusion matrix) on held-out inputs ``x`` (raw, as
    loaded) and ``labels``, in chunks of 1024, in this process."""
    test_of, net, classes = EVALUATORS[mode], run.network, run.inputs.num_classes
    if classes and len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < classes:
        raise RunError(f"the labels go from {int(labels.min())} to {int(labels.max())}, but the run's network has "
                       f"{classes} classes (0 to {classes - 1}): not the data it was trained on")
    tf32 = tf32_state()  # a trainer under trainer.precision sets the TF32 switches on a GPU: the caller's put back
    try:
        trainer = PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=test_of.steps(c),  # as validation:
                            precision=c.trainer.precision, **method_options(c, resolve_x_lr(c, run.run_dir)),
                            precision_schedule=precision_schedule(c.pc.precision_schedule, c.pc.precision_decay))
        test, xs, device = test_of(c, trainer, full=True), run.preprocess(x), next(net.parameters()).device
        for xb, lb in zip(torch.split(xs, 1024), torch.split(labels, 1024)):
            test.add(xb.to(device), lb)
        test.reduce(device)
        return test.report()
    finally:
        restore_tf32(tf32)


def evaluate(run_dir, overrides=(), checkpoint="last", data=None, write: bool = True, layers=None,
             trust_code: bool = False, device="cpu") -> dict:
    """Evaluate a run on its held-out split; writes ``eval.json`` and ``confusion.png`` into the run
    directory (``write``). ``overrides``: ``key=value`` settings for evaluation (``pc.T=50``,
    ``data.root=...`` where the data moved). ``data``: the data of a run trained on data passed from Python.
    ``layers``, ``trust_code``, ``device``: as for ``pcdist.load`` (runs of your own modules that only code
    rebuilds; where it runs: a GPU-trained run's TF32 or bf16 products differ from a CPU's in the last digits)."""
    run = load(run_dir, checkpoint, layers=layers, trust_code=trust_code, device=device)
    found = links_in(run.run_dir) if write else []
    if found:
        raise RunError(links_refusal(run.run_dir, found, "eval.json and confusion.png"))
    c = _with_overrides(run.config, overrides)
    mode = getattr(c.pc, "mode", "supervised")
    if mode not in EVALUATORS:
        raise RunError(f"pc.mode={mode}: no evaluation for this mode yet (known: {', '.join(EVALUATORS)})")
    x, labels = _val_split(c, data, run)
    result = {"run_dir": str(run.run_dir), "checkpoint": run.checkpoint.name, "step": run.step, "split": "val",
              "overrides": list(overrides), **held_out_test(run, c, x, labels, mode)}
    if write:
        replace_file(run.run_dir / "eval.json", json.dumps(result, indent=1))
        if "confusion" in result:
            plot_confusion(result["confusion"], run.run_dir / "confusion.png",
                           f"{run.run_dir.name} step {run.step}: accuracy {result['accuracy']:.4f}")
    return result


def plot_confusion(confusion: list[list[int]], path: Path, title: str) -> Path:
    """The confusion matrix (rows: true class, columns: predicted), counts in the cells."""
    from .metrics import _save, subplots

    m = np.asarray(confusion)
    C = len(m)
    fig, ax = subplots(figsize=(1.5 + 0.45 * C, 1.2 + 0.45 * C) if C <= 20 else (10, 9))
    im = ax.imshow(m, cmap="Blues")
    if C <= 20:
        for i in range(C):
            for j in range(C):
                ax.text(j, i, str(m[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if m[i, j] > m.max() / 2 else "black")
        ax.set_xticks(range(C))
        ax.set_yticks(range(C))
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046)
    _save(fig, path)
    return path


INPUT_KEYS = ("x", "x_test", "x_val")
"""The arrays of an .npz that ``predict`` takes as its inputs, without --key: x, else the held-out inputs of
the files data=arrays reads (x_test or x_val, whichever it holds)."""


def read_inputs(path, key: str | None = None) -> np.ndarray:
    """The inputs array of an .npz (``key``; else ``x``, else its only array, else the one of x_test and x_val
    it holds) or of an .npy file, without unpickling."""
    return _inputs(path, key)[1]


def _inputs(path, key: str | None = None) -> tuple[str | None, np.ndarray]:
    """(the array's name in the .npz, or None for an .npy, the array) of ``read_inputs``."""
    p = Path(path)
    if p.is_dir():
        raise RunError(f"{p} is a folder; predict reads an .npz or .npy file (a data folder's inputs: "
                       f"{p / 'x_val.npy'})")
    if not p.is_file():
        raise RunError(f"{p} does not exist")
    try:
        got = np.load(p, allow_pickle=False)
    except Exception as e:  # (numpy takes any other file for a pickle and says how to load it unsafely)
        why = "predict reads those alone, and never unpickles" if "pickle" in str(e) else e
        raise RunError(f"{p} is not a numpy .npz / .npy file ({why})") from e
    if isinstance(got, np.ndarray):
        return None, got
    keys = list(got.keys())
    if key is not None:
        if key not in keys:
            raise RunError(f"{p} holds no array {key!r} (it holds {', '.join(keys)}); --key names one of them")
        return key, _member(p, got, key)
    if "x" in keys or len(keys) == 1:
        name = "x" if "x" in keys else keys[0]
        return name, _member(p, got, name)
    held = [k for k in INPUT_KEYS[1:] if k in keys]
    if len(held) == 1:
        return held[0], _member(p, got, held[0])
    raise RunError(f"{p} holds arrays {', '.join(keys)}; name the inputs with --key (e.g. --key "
                   f"{held[0] if held else keys[0]}), or save them as x")


def _member(p: Path, got, key: str) -> np.ndarray:
    """Array ``key`` of the .npz ``got`` (read at this point: one of Python objects is a pickle, never read)."""
    try:
        return got[key]
    except ValueError as e:
        why = "an array of Python objects, which would be unpickled: predict never does" if "pickle" in str(e) else e
        raise RunError(f"{p}: array {key!r} cannot be read ({why})") from None


def predict(run_dir, inputs, out=None, checkpoint="last", layers=None, trust_code: bool = False,
            key: str | None = None, device="cpu") -> dict:
    """Logits, predicted labels (and class probabilities for a cross-entropy run) of raw ``inputs``
    (an array, a tensor or an .npz / .npy path; ``key``: the array of the .npz, as ``read_inputs``
    picks it) with the run's preprocessing; saved to ``out`` (.npz). ``layers``, ``trust_code``: as for
    ``pcdist.load`` (and ``device``). The result's ``input`` names the array read, ``out`` the file written (a
    name without .npz gets it, as numpy gives it; its folder is made)."""
    run = load(run_dir, checkpoint, layers=layers, trust_code=trust_code, device=device)
    name, x = _inputs(inputs, key) if isinstance(inputs, (str, Path)) else (None, inputs)
    logits = run.predict(x)
    result = {"logits": logits.numpy(), "labels": logits.argmax(1).numpy()}
    energy = energy_of(run.network.energy)
    if energy.probabilities:
        result["probabilities"] = energy.mean(logits).numpy()
    if out is not None:
        out = Path(out) if str(out).endswith(".npz") else Path(f"{out}.npz")  # (numpy's name for it: said as written)
        out.parent.mkdir(parents=True, exist_ok=True)
        np.savez(out, **result)
    result["input"], result["out"] = name, None if out is None else str(out)
    return result
