"""Each PC mode's test of a run on held-out data (``EVALUATORS``, keyed by ``pc.mode``), for
``python -m pcdist evaluate`` (pcdist/service/evaluate.py)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..engine.modes import mean_prediction, reconstruct
from ..engine.trainer import PCTrainer
from .autostep import method_options, resolve_x_lr
from .config import Config
from .data import one_hot
from .load import Run

__all__ = ["EVALUATORS", "evaluate_supervised", "evaluate_generative", "evaluate_unsupervised"]


@torch.no_grad()
def evaluate_supervised(run: Run, c: Config, x, labels: torch.Tensor) -> dict:
    """Feed-forward accuracy (PC's test), per-class accuracy, confusion matrix; the label-clamped energy
    at the feed-forward init (``loss``, the output energy) and after ``pc.T`` inference steps (``energy``)."""
    net = run.network
    C = net.node_shapes[-1][0]
    trainer = PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=c.pc.T,
                        **method_options(c, resolve_x_lr(c, run.run_dir)))
    xs = run.preprocess(x)
    device = next(net.parameters()).device
    confusion = torch.zeros(C, C, dtype=torch.int64)
    energy = loss = 0.0
    for xb, lb in zip(torch.split(xs, 1024), torch.split(labels, 1024)):
        xb = xb.to(device)
        pred = net(xb).argmax(1).cpu()
        confusion += torch.bincount(lb * C + pred, minlength=C * C).reshape(C, C)
        trace = trainer.trace(xb, one_hot(lb, C, xb.dtype).to(device))
        loss += math.fsum(trace[0]) * len(lb)
        energy += math.fsum(trace[-1]) * len(lb)
    n = int(confusion.sum())
    per_class = [None if int(confusion[k].sum()) == 0 else float(confusion[k, k] / confusion[k].sum())
                 for k in range(C)]
    return {"mode": "supervised", "samples": n, "accuracy": float(confusion.diag().sum()) / max(1, n),
            "loss": loss / max(1, n), "energy": energy / max(1, n), "T": c.pc.T, "per_class_accuracy": per_class,
            "confusion": confusion.tolist()}


def _mode_trainer(run: Run, c: Config) -> PCTrainer:
    net = run.network
    return PCTrainer(net, torch.optim.SGD(net.parameters(), lr=0.0), T=c.pc.eval_T or c.pc.T,
                     **method_options(c, resolve_x_lr(c, run.run_dir)))


@torch.no_grad()
def evaluate_generative(run: Run, c: Config, x, labels: torch.Tensor) -> dict:
    """Classification by inference (the data clamped at h_L, h_0 free from its prior's mean, ``pc.eval_T`` steps,
    argmax h_0), per-class accuracy and confusion matrix; the reconstruction error of the inferred h_0 fed
    forward (pcdist.engine.modes)."""
    trainer, xs = _mode_trainer(run, c), run.preprocess(x)
    C = run.network.node_shapes[0][0]
    confusion, sq = torch.zeros(C, C, dtype=torch.int64), 0.0
    for xb, lb in zip(torch.split(xs, 1024), torch.split(labels, 1024)):
        h = trainer.infer(None, xb.to(next(run.network.parameters()).device), solver=c.pc.eval_solver,
                          tol=c.pc.eval_tol)
        confusion += torch.bincount(lb * C + h[0].argmax(1).cpu(), minlength=C * C).reshape(C, C)
        sq += float((mean_prediction(run.network.energy, run.network(h[0])).cpu() - xb.cpu()).square().sum())
    n = int(confusion.sum())
    per_class = [None if int(confusion[k].sum()) == 0 else float(confusion[k, k] / confusion[k].sum())
                 for k in range(C)]
    return {"mode": "generative", "samples": n, "accuracy": float(confusion.diag().sum()) / max(1, n),
            "reconstruction_mse": sq / max(1, xs.numel()), "T": trainer.T, "per_class_accuracy": per_class,
            "confusion": confusion.tolist()}


@torch.no_grad()
def evaluate_unsupervised(run: Run, c: Config, x, labels: torch.Tensor) -> dict:
    """Reconstruction: the latent h_0 inferred for the data clamped at h_L in ``pc.eval_T`` steps, fed forward,
    against the data (error per element of the mean prediction)."""
    trainer, xs = _mode_trainer(run, c), run.preprocess(x)
    sq = 0.0
    for xb in torch.split(xs, 1024):
        sq += float((reconstruct(trainer, xb.to(next(run.network.parameters()).device)).cpu()
                     - xb.cpu()).square().sum())
    return {"mode": "unsupervised", "samples": len(xs), "reconstruction_mse": sq / max(1, xs.numel()),
            "T": trainer.T}


EVALUATORS: dict[str, Callable[[Run, Config, torch.Tensor, torch.Tensor], dict]] = {
    "supervised": evaluate_supervised,
    "generative": evaluate_generative,
    "unsupervised": evaluate_unsupervised,
}
"""Each PC mode's test, keyed by ``pc.mode`` (a mode without an entry cannot be evaluated yet)."""
