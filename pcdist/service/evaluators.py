"""Each PC mode's test on held-out data, one ``Evaluator`` per mode (``EVALUATORS``, keyed by ``pc.mode``),
used by the validation during training (pcdist/service/validate.py: the ``val/`` metrics) and by
``python -m pcdist evaluate`` (pcdist/service/evaluate.py: eval.json).

    supervised     accuracy                   feed-forward from the data, argmax u_L
                   val/energy (training)      the energy of the feed-forward init with h_L clamped to the
                                              labels: every hidden error is zero there, so it is the output
                                              energy of the prediction (se or ce loss), a mean per sample
                   loss, energy (evaluate)    the label-clamped energy at the feed-forward init and after
                                              pc.T inference steps
    generative     accuracy                   classification by inference: h_L = data, h_0 free
                                              (init: its prior's mean, 1/C), pc.eval_T steps, argmax h_0
                   reconstruction_mse         the inferred h_0 fed forward against the data (per element)
    unsupervised   reconstruction_mse         the inferred latent h_0 fed forward against the data

An evaluator adds up its sums over chunks of held-out data (``add``); every rank takes part (inference and
the feed-forward run layer-parallel, each rank adding what its layer slice holds), and ``reduce`` sums them onto
the logging rank, which alone then reads ``metrics`` (the val/ keys) or ``report`` (eval.json's keys, with the
per-class accuracy and confusion matrix of the ``full`` test).
"""

from __future__ import annotations

import math

import torch

from ..engine.energies import OutputEnergy
from ..engine.modes import forward_mean
from ..engine.trainer import PCTrainer
from .data import one_hot

__all__ = ["Evaluator", "Supervised", "Generative", "Unsupervised", "EVALUATORS"]


class Evaluator:
    """One PC mode's test (see the module docstring): ``add`` each chunk (data, labels) of this rank's held-out
    data, ``reduce`` onto the logging rank, then ``metrics`` or ``report`` there. ``full``: the test of
    ``python -m pcdist evaluate`` (a confusion matrix, the supervised label-clamped energies), in one process."""

    mode = "?"

    def __init__(self, c, trainer: PCTrainer, full: bool = False):
        self.c, self.trainer, self.full = c, trainer, full
        self.correct = self.total = self.sq = self.elems = self.energy = self.loss = 0.0
        C = self.classes() if full else None
        self.confusion = None if C is None else torch.zeros(C, C, dtype=torch.int64)

    @staticmethod
    def steps(c) -> int:
        """The inference steps of its test (``python -m pcdist evaluate``'s trainer runs them)."""
        return c.pc.eval_T or c.pc.T

    def classes(self) -> int | None:
        """The number of classes of the network's label node (None: a mode without labels in the network)."""
        return None

    def add(self, x: torch.Tensor, labels: torch.Tensor) -> None:
        """Add this rank's sums over one chunk of held-out data ``x`` (on the device) and ``labels`` (on the CPU)."""
        raise NotImplementedError

    def reduce(self, device) -> bool:
        """Sum every rank's sums onto the logging rank; True there, False elsewhere."""
        values = [self.correct, self.total, self.sq, self.elems, self.energy, self.loss]
        summed = self.trainer.parallel.sum_to_logging(values, device)  # NCCL reduces device tensors only
        if summed is None:
            return False
        self.correct, self.total, self.sq, self.elems, self.energy, self.loss = summed
        return True

    def metrics(self) -> dict:
        """The val/ metrics logged during training."""
        raise NotImplementedError

    def report(self) -> dict:
        """eval.json's test (``python -m pcdist evaluate``)."""
        raise NotImplementedError

    def _classified(self, predicted: torch.Tensor, labels: torch.Tensor) -> None:
        """Count the predicted classes (on the CPU) against the labels."""
        self.correct += int((predicted == labels).sum())
        self.total += len(labels)
        if self.confusion is not None:
            C = len(self.confusion)
            self.confusion += torch.bincount(labels * C + predicted, minlength=C * C).reshape(C, C)

    def _reconstructed(self, recon: torch.Tensor | None, x: torch.Tensor) -> None:
        """Add the squared error of a reconstruction (None on a rank that holds none)."""
        if recon is not None:
            self.sq += float((recon - x).square().sum())
            self.elems += x.numel()

    def _classes_report(self) -> dict:
        """The accuracy, per-class accuracy and confusion matrix (rows: true class, columns: predicted)."""
        confusion, C = self.confusion, len(self.confusion)
        n = int(confusion.sum())
        per_class = [None if int(confusion[k].sum()) == 0 else float(confusion[k, k] / confusion[k].sum())
                     for k in range(C)]
        return {"accuracy": float(confusion.diag().sum()) / max(1, n), "per_class_accuracy": per_class,
                "confusion": confusion.tolist()}


class Supervised(Evaluator):
    """The supervised test (PC's at test time: with h_L free the feed-forward values are already at equilibrium,
    every error 0): one feed-forward pass, argmax of u_L."""

    mode = "supervised"

    @staticmethod
    def steps(c) -> int:
        return c.pc.T

    def classes(self) -> int:
        return self.trainer.net.node_shapes[-1][0]

    def add(self, x, labels):
        logits = self.trainer.parallel.predict(self.trainer.net, x)
        if logits is not None:
            self._classified(logits.argmax(1).cpu(), labels)
            y = torch.nn.functional.one_hot(labels.to(logits.device), logits.shape[1]).to(logits.dtype)
            # the label-clamped energy at the feed-forward init: pi_L E_out (every hidden error 0 there)
            pi_L = (self.trainer.net.precision or (1.0,))[-1]
            ff = pi_L * float(OutputEnergy(self.c.model.energy).value(logits, y, y - logits))
            if self.full:
                self.loss += ff  # whatever pc.init starts inference from
            else:
                self.energy += ff
        if self.full:  # every rank takes part in the trace
            trace = self.trainer.trace(x, one_hot(labels, len(self.confusion), x.dtype).to(x.device))
            self.energy += math.fsum(trace[-1]) * len(labels)

    def metrics(self):
        return {"val/accuracy": self.correct / max(1.0, self.total), "val/energy": self.energy / max(1.0, self.total)}

    def report(self):
        n = int(self.total)
        out = self._classes_report()
        return {"mode": self.mode, "samples": n, "accuracy": out["accuracy"], "loss": self.loss / max(1, n),
                "energy": self.energy / max(1, n), "T": self.c.pc.T, "per_class_accuracy": out["per_class_accuracy"],
                "confusion": out["confusion"]}


class Generative(Evaluator):
    """Classification by inference (the data clamped at h_L, h_0 free from its prior's mean, ``pc.eval_T`` steps,
    argmax h_0) and the reconstruction error of the inferred h_0 fed forward (pcdist.engine.modes)."""

    mode = "generative"

    def classes(self) -> int:
        return self.trainer.net.node_shapes[0][0]

    def add(self, x, labels):
        c = self.c
        own = self.trainer.infer(None, x, c.pc.eval_T, gather=False, solver=c.pc.eval_solver, tol=c.pc.eval_tol)
        if 0 in own:  # h_0 lives on the first layer slice
            self._classified(own[0].argmax(1).cpu(), labels)
        self._reconstructed(forward_mean(self.trainer, own.get(0, x)), x)  # on the last layer slice

    def metrics(self):
        return {"val/accuracy": self.correct / max(1.0, self.total),
                "val/reconstruction_mse": self.sq / max(1.0, self.elems)}

    def report(self):
        out = self._classes_report()
        return {"mode": self.mode, "samples": int(self.total), "accuracy": out["accuracy"],
                "reconstruction_mse": self.sq / max(1, self.elems), "T": self.steps(self.c),
                "per_class_accuracy": out["per_class_accuracy"], "confusion": out["confusion"]}


class Unsupervised(Evaluator):
    """Reconstruction: the latent h_0 inferred for the data clamped at h_L in ``pc.eval_T`` steps, fed forward,
    against the data (error per element of the mean prediction)."""

    mode = "unsupervised"

    def add(self, x, labels):
        c = self.c
        own = self.trainer.infer(None, x, c.pc.eval_T, gather=False, solver=c.pc.eval_solver, tol=c.pc.eval_tol)
        recon = forward_mean(self.trainer, own.get(0, x))  # on the last layer slice, None elsewhere
        self.total += len(x) if recon is not None else 0
        self._reconstructed(recon, x)

    def metrics(self):
        return {"val/reconstruction_mse": self.sq / max(1.0, self.elems)}

    def report(self):
        return {"mode": self.mode, "samples": int(self.total), "reconstruction_mse": self.sq / max(1, self.elems),
                "T": self.steps(self.c)}


EVALUATORS: dict[str, type[Evaluator]] = {e.mode: e for e in (Supervised, Generative, Unsupervised)}
"""Each PC mode's test, keyed by ``pc.mode`` (a mode without an entry cannot be evaluated yet)."""
