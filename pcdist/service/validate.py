"""Validation during training in each PC mode, and the pictures of the generative and unsupervised modes.

Each mode's metrics are its ``Evaluator``'s (pcdist/service/evaluators.py, the test ``python -m pcdist
evaluate`` runs too): val/accuracy and val/energy (supervised), val/accuracy and val/reconstruction_mse
(generative), val/reconstruction_mse (unsupervised). Every rank takes part (inference and the feed-forward run
layer-parallel); the sums are reduced onto the logging rank, which alone gets the metrics (None elsewhere). The
pictures (generative: ``samples.png``, the mean image generated for each class, and MCPC samples where
pc.value_noise > 0; unsupervised: ``reconstructions.png``, held-out images above their reconstructions) are drawn
by the logging rank into the run directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..distributed.exchange import failures, report_failure
from ..engine.modes import forward_mean
from ..engine.trainer import PCTrainer
from .data import DataError
from .evaluators import EVALUATORS

__all__ = ["validate", "pictures", "draw_grid"]


def validate(c, chunks, trainer: PCTrainer, device) -> dict | None:
    """The mode's validation metrics (its ``Evaluator``, pcdist/service/evaluators.py) over this rank's validation
    ``chunks`` ((data, labels) pairs), on the logging rank (None elsewhere)."""
    test = EVALUATORS[c.pc.mode](c, trainer)
    with torch.no_grad():
        for x, labels in agreed(chunks, trainer.parallel, device):
            test.add(x, labels)
    return test.metrics() if test.reduce(device) else None


def agreed(chunks, par, device):
    """The validation ``chunks``, each taken by every rank together (every data rank has as many: ``val_split``):
    a bad sample met reading one (streamed data: only the ranks that read it meet it) stops every rank at that
    chunk, each raising a DataError (the others naming the rank that met it), so that all of them checkpoint the
    step trained before it; a rank that raised alone was left waiting for its peers. One tiny all-reduce per
    chunk, where there are peers."""
    if par.logging_rank is None:  # one process
        yield from chunks
        return
    chunks = iter(chunks)
    while True:
        item, bad = None, None
        try:
            item = next(chunks)
        except StopIteration:
            pass
        except DataError as e:
            bad = e
            report_failure(str(e))
        vote = par.all_sum(torch.tensor([0.0 if bad is None else 1.0], device=device), "the validation's vote")
        if vote.item() > 0:
            if bad is not None:
                raise bad
            said = failures(range(torch.distributed.get_world_size()))
            raise DataError("; ".join(f"rank {r} met a bad validation sample: {why}" for r, why in said.items())
                            or "another rank met a bad validation sample")
        if item is None:
            return
        yield item


def pictures(c, held_out: Callable[[], torch.Tensor], trainer: PCTrainer, image_shape, num_classes: int,
             run_dir: Path, device, dtype) -> dict[str, Path]:
    """samples.png (generative) or reconstructions.png (unsupervised: of the first held-out inputs, which
    ``held_out()`` reads) of image data in ``dtype`` on ``device``, drawn on the logging rank (every rank takes
    part); {name: path} there, {} elsewhere, for data that are not images and with logger.plots=false (the same
    config on every rank: all skip the collective inference together)."""
    mode, par = c.pc.mode, trainer.parallel
    if mode == "supervised" or not c.logger.plots or len(image_shape) != 3 or image_shape[0] not in (1, 3):
        return {}
    out: dict[str, Path] = {}
    with torch.no_grad():
        if mode == "generative":
            onehot = torch.eye(num_classes, dtype=dtype, device=device)
            rows = [forward_mean(trainer, onehot)]
            if c.pc.value_noise > 0:  # MCPC: Langevin samples of h_L given each label, from the feed-forward init
                for _ in range(3):
                    own = trainer.infer(onehot, None, c.pc.eval_T, noise=c.pc.value_noise, gather=False,
                                        global_batch=num_classes * par.data_size)  # each data rank: every label
                    rows.append(own.get(trainer.net.num_layers))
            if par.is_logging:
                labels = ["mean"] + [f"MCPC sample (tau {c.pc.value_noise:g})"] * (len(rows) - 1)
                out["samples"] = draw_grid([r.reshape(-1, *image_shape) for r in rows], labels,
                                           f"Generated digits per class (columns 0..{num_classes - 1})",
                                           Path(run_dir) / "samples.png")
            return out
        x = held_out()[:10]  # unsupervised
        own = trainer.infer(None, x, c.pc.eval_T, gather=False, solver=c.pc.eval_solver, tol=c.pc.eval_tol)  # (as
        recon = forward_mean(trainer, own.get(0, x))  # val/reconstruction_mse infers: evaluators.Unsupervised)
        if par.is_logging:
            out["reconstructions"] = draw_grid([x.reshape(-1, *image_shape), recon.reshape(-1, *image_shape)],
                                               ["held-out", "reconstruction"],
                                               "Held-out images and their reconstructions (h_0 inferred "
                                               + (f"by the adaptive solver, tol {c.pc.eval_tol}" if
                                                  c.pc.eval_solver == "adaptive" else
                                                  f"in {c.pc.eval_T or c.pc.T} {c.pc.eval_solver or c.pc.solver} "
                                                  f"steps") + ", fed forward)",
                                               Path(run_dir) / "reconstructions.png")
    return out


def draw_grid(rows, labels, title: str, path: Path) -> Path:
    """Rows of images [n, C, H, W] (values clipped to [0, 1]) as one picture, a label per row."""
    from .metrics import _save, subplots, tight_layout

    n = max(len(r) for r in rows)
    fig, axes = subplots(len(rows), n, figsize=(0.9 * n + 1.4, 0.95 * len(rows) + 0.5), squeeze=False)
    for i, (r, label) in enumerate(zip(rows, labels)):
        for j in range(n):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            if j < len(r):
                img = r[j].detach().float().clamp(0, 1).cpu()
                ax.imshow((img[0] if img.shape[0] == 1 else img.permute(1, 2, 0)).numpy(), cmap="gray", vmin=0, vmax=1)
        axes[i][0].set_ylabel(label, fontsize=7, rotation=0, ha="right", va="center")
    fig.suptitle(title, fontsize=9)
    tight_layout(fig)
    _save(fig, path)
    return path

