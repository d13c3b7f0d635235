"""The three modes of PC on one engine, and what each one's test means.

Mode            training clamps                 test
supervised      h_0 = data,    h_L = one-hot    feed-forward from the data, argmax u_L
generative      h_0 = one-hot, h_L = data       classification by inference: h_L = data, h_0 free
                                                (init: its prior's mean), T steps, argmax h_0;
                                                generation: feed-forward from a one-hot h_0
unsupervised    h_0 free (a latent with its     reconstruction: h_L = data, infer h_0, feed it
                prior), h_L = data              forward, compare with the data

Each test is a few calls of ``PCTrainer.infer`` and the layer-parallel feed-forward
(``Parallel.predict``), so it runs on any layer and data split; results come back on the
logging rank (None elsewhere). The "mean prediction" of the top node is what the output
energy says the data should be: u_L (se, zero, callables), sigmoid(u_L) (bce), softmax(u_L) (ce).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .energies import energy_of
from .trainer import PCTrainer

__all__ = ["MODES", "clamps", "mean_prediction", "forward_mean", "classify", "reconstruct", "generate", "sample",
           "local_classification", "local_reconstruction"]

MODES = ("supervised", "generative", "unsupervised")


def clamps(mode: str, data: Tensor, onehot: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """(x, y) for ``trainer.step`` in a mode: what h_0 and h_L are clamped to (None: free)."""
    if mode == "supervised":
        return data, onehot
    if mode == "generative":
        return onehot, data
    if mode == "unsupervised":
        return None, data
    raise ValueError(f"unknown PC mode {mode!r}; allowed: {', '.join(MODES)}")


def mean_prediction(energy, u: Tensor) -> Tensor:
    """The top node the output energy expects from the prediction u_L (sigmoid for bce, softmax for ce)."""
    return energy_of(energy).mean(u)


def local_classification(trainer: PCTrainer, data: Tensor, T: int | None = None) -> Tensor | None:
    """argmax of the inferred h_0 with h_L = data (this rank's rows), on the first layer slice; None elsewhere."""
    own = trainer.infer(None, data, T, gather=False)
    return own[0].argmax(1) if 0 in own else None


def local_reconstruction(trainer: PCTrainer, data: Tensor, T: int | None = None) -> Tensor | None:
    """The mean prediction fed forward from the h_0 inferred for h_L = data (this rank's rows), on the last
    layer slice; None elsewhere."""
    own = trainer.infer(None, data, T, gather=False)
    return forward_mean(trainer, own.get(0, data))


def forward_mean(trainer: PCTrainer, h0: Tensor) -> Tensor | None:
    """The mean prediction fed forward from h_0, layer-parallel: on the last layer slice (None elsewhere);
    ranks past the first pass any tensor of the batch size as ``h0``."""
    out = trainer.parallel.predict(trainer.net, h0)
    return None if out is None else mean_prediction(trainer.net.energy, out)


@torch.no_grad()
def classify(trainer: PCTrainer, data: Tensor, T: int | None = None) -> Tensor | None:
    """Generative classification: the labels argmax h_0 inferred for h_L = data in T steps (the whole batch,
    on the logging rank)."""
    return trainer.parallel.gather_batch(local_classification(trainer, data, T))


@torch.no_grad()
def reconstruct(trainer: PCTrainer, data: Tensor, T: int | None = None) -> Tensor | None:
    """Reconstruction: infer h_0 for h_L = data in T steps, feed it forward (the mean prediction)."""
    return trainer.parallel.gather_batch(local_reconstruction(trainer, data, T))


@torch.no_grad()
def generate(trainer: PCTrainer, h0: Tensor) -> Tensor | None:
    """Generation: the mean prediction fed forward from a clamped h_0 (a one-hot label or a latent)."""
    return trainer.parallel.gather_batch(forward_mean(trainer, h0))


@torch.no_grad()
def sample(trainer: PCTrainer, h0: Tensor | None = None, batch_size: int | None = None, T: int = 100,
           tau: float = 1.0) -> Tensor | None:
    """MCPC sampling: T Langevin steps at temperature ``tau`` with h_L free (and h_0 too unless given),
    from the feed-forward init; returns the top nodes h_L (the whole batch, on the logging rank)."""
    nodes = trainer.infer(h0, None, T, noise=tau, batch_size=batch_size)
    return None if nodes is None else nodes[-1]
