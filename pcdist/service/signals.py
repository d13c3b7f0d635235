"""A generated 1-D signal classification task (no download): ten motifs at random positions in noise.

Each sample is a signal [channels, length]: one of ten short motifs (``MOTIFS``: bumps, pulses,
ramps, bursts, chirps, each ``motif`` samples long) placed at a uniformly random offset, scaled by a
random amplitude in [0.8, 1.2], on a random low-frequency background (two sines of random frequency
below 2 periods per signal and random phase, amplitude ``drift``) plus white noise of standard
deviation ``noise``. The class is the motif. A second channel (``channels=2``) carries the
signal's first difference, as a sensor pair would.

What it takes to classify: the motif's shape wherever it sits. A convolution with pooling shares
its detector over positions; a dense layer must learn every offset apart. So a small CNN (three
Conv1d layers) does clearly better than an MLP of the same budget, as the issue behind it asked
(docs/fidelity.md has the figures). Everything is drawn from ``torch.Generator().manual_seed(seed)``:
the same seed gives the same arrays on every machine.

    python -m pcdist.service.signals signals.npz          # x_train [4000, 1, 64], y_train, x_val, y_val
    python train.py data=arrays data.path=signals.npz model=cnn ...
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

__all__ = ["MOTIFS", "make_signals", "save_signals", "motif_bank"]

MOTIFS = ("bump", "dip", "sine", "inverted sine", "pulse", "ramp up", "ramp down", "double bump", "burst", "chirp")


def motif_bank(length: int = 12) -> torch.Tensor:
    """The ten motifs [10, length], each scaled to peak absolute value 1, in ``MOTIFS`` order."""
    t = torch.linspace(0.0, 1.0, length, dtype=torch.float64)
    window = torch.exp(-((t - 0.5) ** 2) / (2 * 0.2**2))
    m = torch.stack([
        torch.exp(-((t - 0.5) ** 2) / (2 * 0.15**2)),                                  # bump
        -torch.exp(-((t - 0.5) ** 2) / (2 * 0.15**2)),                                 # dip
        torch.sin(2 * math.pi * t),                                                     # sine
        -torch.sin(2 * math.pi * t),                                                    # inverted sine
        ((t > 0.25) & (t < 0.75)).double(),                                             # pulse
        t,                                                                              # ramp up
        1.0 - t,                                                                        # ramp down
        torch.exp(-((t - 0.25) ** 2) / (2 * 0.08**2)) + torch.exp(-((t - 0.75) ** 2) / (2 * 0.08**2)),  # double bump
        torch.sin(2 * math.pi * 3 * t) * window,                                        # burst
        torch.sin(2 * math.pi * (0.5 * t + 1.5 * t**2)) * window,                       # chirp
    ])
    return m / m.abs().amax(1, keepdim=True)


def _draw(n: int, gen: torch.Generator, length: int, channels: int, motif: int, noise: float,
          drift: float) -> tuple[torch.Tensor, torch.Tensor]:
    bank = motif_bank(motif)
    labels = torch.randint(0, len(MOTIFS), (n,), generator=gen)
    offset = torch.randint(0, length - motif + 1, (n,), generator=gen)
    amp = 0.8 + 0.4 * torch.rand(n, 1, generator=gen, dtype=torch.float64)
    t = torch.arange(length, dtype=torch.float64) / length
    freq = 2.0 * torch.rand(n, 2, 1, generator=gen, dtype=torch.float64)
    phase = 2 * math.pi * torch.rand(n, 2, 1, generator=gen, dtype=torch.float64)
    x = drift * torch.sin(2 * math.pi * freq * t + phase).sum(1) / math.sqrt(2)
    x = x + noise * torch.randn(n, length, generator=gen, dtype=torch.float64)
    rows = torch.arange(n)[:, None]
    cols = offset[:, None] + torch.arange(motif)
    x[rows, cols] += amp * bank[labels]
    out = [x]
    if channels == 2:
        out.append(torch.diff(x, dim=1, prepend=x[:, :1]))
    return torch.stack(out, 1).float(), labels


def make_signals(n_train: int = 4000, n_val: int = 1000, length: int = 64, channels: int = 1, seed: int = 0,
                 motif: int = 12, noise: float = 0.12, drift: float = 0.25) -> dict[str, np.ndarray]:
    """The task as arrays (``data=arrays``' names): x_train [n_train, channels, length] float32, y_train
    [n_train] int64, x_val, y_val; the validation samples are drawn after the training ones."""
    if channels not in (1, 2):
        raise ValueError(f"channels must be 1 (the signal) or 2 (the signal and its first difference), got {channels}")
    if not 1 <= motif <= length:
        raise ValueError(f"motif length {motif} must be in [1, length={length}]")
    gen = torch.Generator().manual_seed(seed)
    x_tr, y_tr = _draw(n_train, gen, length, channels, motif, noise, drift)
    x_va, y_va = _draw(n_val, gen, length, channels, motif, noise, drift)
    return {"x_train": x_tr.numpy(), "y_train": y_tr.numpy(), "x_val": x_va.numpy(), "y_val": y_va.numpy()}


def save_signals(path: str, **kw) -> dict[str, np.ndarray]:
    """``make_signals(**kw)`` written to ``path`` (an .npz for ``data=arrays data.path=...``); returns the arrays."""
    arrays = make_signals(**kw)
    np.savez(path, **arrays)
    return arrays


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="the .npz to write")
    ap.add_argument("--n-train", type=int, default=4000)
    ap.add_argument("--n-val", type=int, default=1000)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    arrays = save_signals(a.path, n_train=a.n_train, n_val=a.n_val, length=a.length, channels=a.channels, seed=a.seed)
    print(f"wrote {a.path}: x_train {list(arrays['x_train'].shape)}, x_val {list(arrays['x_val'].shape)}, "
          f"{len(MOTIFS)} classes")


if __name__ == "__main__":
    main()
