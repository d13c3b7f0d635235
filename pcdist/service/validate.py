"""Validation during training in each PC mode, and the pictures of the generative and unsupervised modes.

    supervised     val/accuracy               feed-forward from the data, argmax u_L
                   val/energy                 the energy of the feed-forward init with h_L clamped to the
                                              labels: every hidden error is zero there, so it is the output
                                              energy of the prediction (se or ce loss), a mean per sample
    generative     val/accuracy               classification by inference: h_L = data, h_0 free
                                              (init: its prior's mean, 1/C), pc.eval_T steps, argmax h_0
                   val/reconstruction_mse     the inferred h_0 fed forward against the data (per pixel)
    unsupervised   val/reconstruction_mse     the inferred latent h_0 fed forward against the data

Every rank takes part (inference and the feed-forward run layer-parallel); the sums are
reduced onto the logging rank, which alone gets the metrics (None elsewhere). The pictures
(generative: ``samples.png``, the mean image generated for each class, and MCPC samples
where pc.value_noise > 0; unsupervised: ``reconstructions.png``, held-out images above their
reconstructions)
are drawn by the logging rank into the run directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..engine.energies import OutputEnergy
from ..engine.modes import forward_mean
from ..engine.trainer import PCTrainer

__all__ = ["validate", "pictures", "draw_grid"]


def validate(c, chunks, trainer: PCTrainer, device) -> dict | None:
    """The mode's validation metrics over this rank's validation ``chunks`` ((data, labels) pairs), on the
    logging rank."""
    par, net, mode = trainer.parallel, trainer.net, c.pc.mode
    correct = total = sq = elems = energy = 0.0
    with torch.no_grad():
        for x, labels in chunks:
            if mode == "supervised":
                logits = par.predict(net, x)
                if logits is not None:
                    correct += int((logits.argmax(1).cpu() == labels).sum())
                    total += len(labels)
                    y = torch.nn.functional.one_hot(labels.to(logits.device), logits.shape[1]).to(logits.dtype)
                    energy += float(OutputEnergy(c.model.energy).value(logits, y, y - logits))
                continue
            own = trainer.infer(None, x, c.pc.eval_T, gather=False, solver=c.pc.eval_solver, tol=c.pc.eval_tol)
            if mode == "generative" and 0 in own:  # h_0 lives on the first layer slice
                correct += int((own[0].argmax(1).cpu() == labels).sum())
                total += len(labels)
            recon = forward_mean(trainer, own.get(0, x))  # on the last layer slice, None elsewhere
            if recon is not None:
                sq += float((recon - x).square().sum())
                elems += x.numel()
    summed = par.sum_to_logging([correct, total, sq, elems, energy], device)  # NCCL reduces device tensors only
    if summed is None:
        return None
    correct, total, sq, elems, energy = summed
    out = {}
    if mode != "unsupervised":
        out["val/accuracy"] = correct / max(1.0, total)
    if mode == "supervised":
        out["val/energy"] = energy / max(1.0, total)
    if mode != "supervised":
        out["val/reconstruction_mse"] = sq / max(1.0, elems)
    return out


def pictures(c, x_val, trainer: PCTrainer, image_shape, num_classes: int, run_dir: Path) -> dict[str, Path]:
    """samples.png (generative) or reconstructions.png (unsupervised) of image data, drawn on the logging rank
    (every rank takes part); {name: path} there, {} elsewhere and for data that are not images."""
    mode, par = c.pc.mode, trainer.parallel
    if mode == "supervised" or len(image_shape) != 3 or image_shape[0] not in (1, 3):
        return {}
    out: dict[str, Path] = {}
    dev, dt = x_val.device, x_val.dtype
    with torch.no_grad():
        if mode == "generative":
            onehot = torch.eye(num_classes, dtype=dt, device=dev)
            rows = [forward_mean(trainer, onehot)]
            if c.pc.value_noise > 0:  # MCPC: Langevin samples of h_L given each label, from the feed-forward init
                for _ in range(3):
                    own = trainer.infer(onehot, None, c.pc.eval_T, noise=c.pc.value_noise, gather=False)
                    rows.append(own.get(trainer.net.num_layers))
            if par.is_logging:
                labels = ["mean"] + [f"MCPC sample (tau {c.pc.value_noise:g})"] * (len(rows) - 1)
                out["samples"] = draw_grid([r.reshape(-1, *image_shape) for r in rows], labels,
                                           f"Generated digits per class (columns 0..{num_classes - 1})",
                                           Path(run_dir) / "samples.png")
            return out
        x = x_val[:10]  # unsupervised
        own = trainer.infer(None, x, c.pc.eval_T, gather=False)
        recon = forward_mean(trainer, own.get(0, x))
        if par.is_logging:
            out["reconstructions"] = draw_grid([x.reshape(-1, *image_shape), recon.reshape(-1, *image_shape)],
                                               ["held-out", "reconstruction"],
                                               f"Held-out images and their reconstructions (h_0 inferred in "
                                               f"{c.pc.eval_T or c.pc.T} steps, fed forward)",
                                               Path(run_dir) / "reconstructions.png")
    return out


def draw_grid(rows, labels, title: str, path: Path) -> Path:
    """Rows of images [n, C, H, W] (values clipped to [0, 1]) as one picture, a label per row."""
    from .metrics import _pyplot, _save

    plt = _pyplot()
    n = max(len(r) for r in rows)
    fig, axes = plt.subplots(len(rows), n, figsize=(0.9 * n + 1.4, 0.95 * len(rows) + 0.5), squeeze=False)
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
    fig.tight_layout()
    _save(fig, path)
    return path

