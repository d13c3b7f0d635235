"""Trajectories of this checkout against another commit's pcdist, bit for bit.

Runs every configuration of the float64 reference grid (tests/test_reference.py: all
activations x both energies, and pc/ipc x value momentum x SGD/AdamW x depths x energies) and
small conv nets (max, average and no pooling, a fused group of two equal conv layers, pc and ipc)
for three training steps with both engines side by side in one process, and reports for
each whether the value nodes, energies and weights after every step are bit-identical
(torch.equal), else the largest difference.

    python benchmarks/identity.py                    # against dd71a28 (the reference of the latest checks)
    python benchmarks/identity.py --ref 860de00      # the commit before layer kinds

A configuration the other commit cannot build (an activation or an argument it did not have yet) is
reported as such and left out of the count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent)]

import pcdist  # noqa: E402
from baseline import import_ref  # noqa: E402
from test_reference import ACT_NAMES, BATCH_SIZES, DIMS, GRID, OPTIMIZERS, make_batch, make_seq  # noqa: E402


def conv_seq(pool: str | None, act: str, seed: int) -> nn.Sequential:
    """2 x 9 x 9 images: conv (+ pooling), two equal convs (one fused group), a linear head to 3 classes."""
    torch.manual_seed(seed)
    f = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}[act]
    pooled = {"max": [nn.MaxPool2d(2)], "avg": [nn.AvgPool2d(2)], None: []}[pool]
    side = 4 if pool else 9
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), f(), *pooled, nn.Conv2d(4, 4, 3, padding=1), f(),
                         nn.Conv2d(4, 4, 3, padding=1), f(), nn.Flatten(), nn.Linear(4 * side * side, 3)).double()


def trajectory(lib, seq, make_opt, T, x_momentum, algorithm, energy, seed):
    """Value nodes, energies and weights after each of three steps of ``lib``'s engine."""
    images = isinstance(seq[0], nn.Conv2d)
    shape = {"input_shape": (2, 9, 9)} if images else {}  # (older commits take no input_shape for dense nets)
    net = lib.PCNetwork.from_sequential(seq, energy=energy, **shape)
    tr = lib.PCTrainer(net, make_opt(net.parameters()), T=T, x_lr=0.1, x_momentum=x_momentum, algorithm=algorithm)
    gen = torch.Generator().manual_seed(1000 + seed)
    out = []
    for B in BATCH_SIZES:
        if images:
            x = torch.randn(B, 2, 9, 9, generator=gen, dtype=torch.float64)
            y = torch.eye(3, dtype=torch.float64)[torch.randint(0, 3, (B,), generator=gen)]
        else:
            x, y = make_batch(B, seq[0].in_features, seq[-1].out_features, gen)
        stats = tr.step(x, y)
        out += [torch.tensor([stats["energy"], *stats["layer_energies"]], dtype=torch.float64), *tr.value_nodes(),
                *[p.detach().clone() for p in net.to_sequential().parameters()]]
    return out


def cases():
    for act in ACT_NAMES:
        for energy in ("se", "ce"):
            yield f"activations-{act}-{energy}", make_seq([6, 8, 8, 8, 4], [act] * 3, seed=ACT_NAMES.index(act)), \
                OPTIMIZERS["sgd_momentum"], 5, 0.0, "pc", energy, 1
    for i, (a, m, o, d, e) in enumerate(GRID):
        dims, same_act = DIMS[d]
        acts = [ACT_NAMES[(i + (0 if same_act else k)) % len(ACT_NAMES)] for k in range(len(dims) - 2)]
        yield f"grid-{a}-mu{m}-{o}-{d}-{e}", make_seq(dims, acts, seed=100 + i), OPTIMIZERS[o], 4 + i % 4, m, a, e, i
    for i, (pool, act, algorithm) in enumerate((("max", "relu", "pc"), ("avg", "gelu", "ipc"), (None, "tanh", "pc"))):
        yield f"conv-{pool}-{act}-{algorithm}", conv_seq(pool, act, 200 + i), OPTIMIZERS["adamw"], 4, 0.0, \
            algorithm, "ce", 200 + i


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default="dd71a28", help="the git commit to compare with")
    args = ap.parse_args()
    old = import_ref(args.ref)
    torch.set_num_threads(1)
    n = same = 0
    unbuilt = []
    for name, seq, make_opt, T, mu, algorithm, energy, seed in cases():
        new_t = trajectory(pcdist, seq, make_opt, T, mu, algorithm, energy, seed)
        try:
            old_t = trajectory(old, seq, make_opt, T, mu, algorithm, energy, seed)
        except (TypeError, ValueError, KeyError) as e:  # a layer or argument the other commit does not have
            unbuilt.append(name)
            print(f"NOT IN {args.ref} {name}: {' '.join(str(e).split())[:160]}")
            continue
        equal = len(new_t) == len(old_t) and all(torch.equal(a, b) for a, b in zip(new_t, old_t))
        n, same = n + 1, same + equal
        if not equal:
            diff = max(float((a - b).abs().max()) for a, b in zip(new_t, old_t))
            print(f"DIFFERS {name}: max |difference| {diff:.3g}")
    print(f"{same} of {n} configurations bit-identical to {args.ref} (value nodes, energies, weights; 3 steps each)"
          + (f"; {len(unbuilt)} it cannot build left out" if unbuilt else ""))
    return 0 if same == n else 1


if __name__ == "__main__":
    sys.exit(main())
