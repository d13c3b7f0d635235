"""Fused PC training step vs the per-layer autograd loop vs the matmul limit.

Per training step (float32, batch 64, T = 20, AdamW, torch threads = cores):
  loop    the usual PyTorch PC code: a Python loop over layers, gradients from autograd
  pcdist  pcdist.PCTrainer.step
  limit   the batched matmuls pcdist's step performs, alone, into preallocated buffers
  torch_ops  pcdist with its fused error kernel off (PCDIST_NATIVE=0): the error pass as
             separate torch ops, as on a machine without a C compiler

The four run interleaved (round-robin, several rounds) in one process; each ratio is
the median over rounds of the ratio within a round (pcdist and limit run back to back),
so machine drift between rounds cancels out. Writes
benchmarks/results/fusion.json and benchmarks/results/fusion_depth.png.

    python benchmarks/fusion.py            # full run (a few minutes on 2 cores)
    python benchmarks/fusion.py --quick    # fewer rounds, for a smoke test
    python benchmarks/fusion.py --activation gelu   # writes fusion_gelu.json / fusion_gelu_depth.png
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import pcdist

OUT = Path(__file__).resolve().parent / "results"
SHAPES = {  # name: (input, hidden widths, output)
    "A": (64, [128] * 32, 10),
    "B": (784, [512] * 16, 10),
    "C": (784, [128, 128], 10),
}
DEPTHS = [4, 8, 16, 32, 64]


ACTIVATIONS = {"tanh": nn.Tanh, "gelu": nn.GELU}


def make_seq(d_in: int, hidden: list[int], d_out: int, activation: str = "tanh") -> nn.Sequential:
    dims = [d_in, *hidden, d_out]
    mods: list[nn.Module] = []
    for i in range(len(dims) - 1):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            mods.append(ACTIVATIONS[activation]())
    return nn.Sequential(*mods)


class LoopPC:
    """The per-layer PC loop researchers write: autograd through a Python loop over layers."""

    def __init__(self, seq: nn.Sequential, T: int, x_lr: float):
        self.linears = [m for m in seq if isinstance(m, nn.Linear)]
        self.acts = [m for m in seq if not isinstance(m, nn.Linear)]
        self.T, self.x_lr = T, x_lr
        self.opt = torch.optim.AdamW(seq.parameters(), lr=1e-4, fused=True)

    def energy(self, hs: list[torch.Tensor]) -> torch.Tensor:
        L, E = len(self.linears), 0.0
        for l, lin in enumerate(self.linears, start=1):
            u = lin(hs[l - 1])
            if l < L:
                u = self.acts[l - 1](u)
            E = E + 0.5 * (hs[l] - u).square().sum()
        return E

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.no_grad():
            hs = [x]
            for lin, act in zip(self.linears[:-1], self.acts):
                hs.append(act(lin(hs[-1])))
            hs.append(y)
        hidden = [h.requires_grad_(True) for h in hs[1:-1]]
        for _ in range(self.T):
            grads = torch.autograd.grad(self.energy([x, *hidden, y]), hidden)
            with torch.no_grad():
                for h, g in zip(hidden, grads):
                    h.sub_(self.x_lr * g)
        self.opt.zero_grad(set_to_none=True)
        (self.energy([x, *[h.detach() for h in hidden], y]) / x.shape[0]).backward()
        self.opt.step()


class MatmulLimit:
    """Exactly the matmuls of one pcdist step, as batched matmuls into preallocated buffers.

    Every operand is row-major, as in pcdist's pc step (which back-projects through a
    row-major copy of w^T made once per batch; the copy is not a matmul and not counted here).
    """

    def __init__(self, net: pcdist.PCNetwork, B: int, T: int):
        self.T = T
        kw = dict(dtype=torch.float32)
        self.groups = []
        for g in net.groups:
            K, I, O = g.weight.shape
            self.groups.append(dict(K=K, w=g.weight.detach().clone(), wT=g.weight.detach().transpose(1, 2).contiguous(),
                                    h=torch.randn(K, B, I, **kw),
                                    a=torch.empty(K, B, O, **kw), d=torch.randn(K, B, O, **kw),
                                    bp=torch.empty(K, B, I, **kw), gw=torch.empty(K, I, O, **kw)))

    def step(self) -> None:
        gs = self.groups
        for gr in gs:  # feed-forward init: a chain, one matmul per layer
            for k in range(gr["K"]):
                torch.mm(gr["h"][k], gr["w"][k], out=gr["a"][k])
        for t in range(self.T + 1):  # T inference steps + the final evaluation
            for gr in gs[1:]:
                if t > 0:  # step 1 reuses the init's predictions; layer 1's input is clamped
                    torch.bmm(gr["h"], gr["w"], out=gr["a"])
                if t < self.T:
                    torch.bmm(gr["d"], gr["wT"], out=gr["bp"])
        for gr in gs:  # weight gradients
            torch.bmm(gr["h"].transpose(1, 2), gr["d"], out=gr["gw"])


def make_variants(shape, B: int, T: int, x_lr: float, activation: str = "tanh"):
    d_in, hidden, d_out = shape
    torch.manual_seed(0)
    seq = make_seq(d_in, hidden, d_out, activation)
    x = torch.randn(B, d_in)
    y = nn.functional.one_hot(torch.randint(0, d_out, (B,)), d_out).float()
    loop = LoopPC(copy.deepcopy(seq), T, x_lr)
    net = pcdist.PCNetwork.from_sequential(seq)
    trainer = pcdist.PCTrainer(net, torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True), T=T, x_lr=x_lr)
    limit = MatmulLimit(net, B, T)
    # pcdist with the error pass as separate torch ops (PCDIST_NATIVE=0), as on a machine without a C compiler.
    ops_net = pcdist.PCNetwork.from_sequential(seq)
    ops = pcdist.PCTrainer(ops_net, torch.optim.AdamW(ops_net.parameters(), lr=1e-4, fused=True), T=T, x_lr=x_lr)
    os.environ["PCDIST_NATIVE"] = "0"
    try:
        ops.stage(B)  # the kernel choice is made when the buffers are built
    finally:
        del os.environ["PCDIST_NATIVE"]
    # pcdist and limit run next to each other in every round: their ratio is taken per round.
    return {"loop": lambda: loop.step(x, y), "torch_ops": lambda: ops.step(x, y),
            "pcdist": lambda: trainer.step(x, y), "limit": limit.step}


def time_interleaved(variants: dict, rounds: int, min_time: float) -> dict[str, list[float]]:
    """Seconds per call of each variant in every round; variants alternate within a round."""
    for f in variants.values():  # warm-up
        f()
        f()
    samples = {k: [] for k in variants}
    for _ in range(rounds):
        for name, f in variants.items():
            n, t0 = 0, time.perf_counter()
            while True:
                f()
                n += 1
                dt = time.perf_counter() - t0
                if dt >= min_time:
                    break
            samples[name].append(dt / n)
    return samples


def ratio(samples: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of num/den within the round: drift between rounds cancels out."""
    return statistics.median(a / b for a, b in zip(samples[num], samples[den]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few rounds (smoke test)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--T", type=int, default=20)
    ap.add_argument("--activation", choices=sorted(ACTIVATIONS), default="tanh", help="of every hidden layer")
    ap.add_argument("--out", type=Path, default=OUT, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    rounds, min_time = (3, 0.05) if args.quick else (15, 0.3)
    kw = dict(B=args.batch, T=args.T, x_lr=0.1, activation=args.activation)
    stem = "fusion" if args.activation == "tanh" else f"fusion_{args.activation}"

    shapes = {}
    for name, shape in SHAPES.items():
        samples = time_interleaved(make_variants(shape, **kw), rounds, min_time)
        med = {k: statistics.median(v) for k, v in samples.items()}
        shapes[name] = {
            "dims": f"{shape[0]} -> {len(shape[1])} hidden x {shape[1][0]} -> {shape[2]}",
            "seconds": med,
            "loop/pcdist": ratio(samples, "loop", "pcdist"),
            "pcdist/limit": ratio(samples, "pcdist", "limit"),
            "torch_ops/pcdist": ratio(samples, "torch_ops", "pcdist"),
            "rounds": samples,
        }
        print(f"shape {name} ({shapes[name]['dims']}): loop {med['loop'] * 1e3:8.2f} ms  pcdist {med['pcdist'] * 1e3:8.2f} ms  "
              f"limit {med['limit'] * 1e3:8.2f} ms  loop/pcdist {shapes[name]['loop/pcdist']:5.2f}x  "
              f"pcdist/limit {shapes[name]['pcdist/limit']:5.2f}x  "
              f"(torch ops {med['torch_ops'] * 1e3:.2f} ms: kernel gain {shapes[name]['torch_ops/pcdist']:4.2f}x)", flush=True)

    depth = {}
    for n in DEPTHS:
        samples = time_interleaved(make_variants((64, [128] * n, 10), **kw), max(3, rounds // 2), min_time)
        med = {k: statistics.median(v) for k, v in samples.items()}
        depth[n] = med
        print(f"depth {n:3d} hidden x 128: " + "  ".join(f"{k} {v * 1e3:8.2f} ms" for k, v in med.items()), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "config": {"dtype": "float32", "batch": args.batch, "T": args.T, "activation": args.activation,
                   "threads": torch.get_num_threads(),
                   "torch": torch.__version__, "machine": platform.machine(), "quick": args.quick},
        "shapes": shapes,
        "depth": {str(k): v for k, v in depth.items()},
    }
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot_depth(depth, args.out / f"{stem}_depth.png", args.activation)
    print(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '_depth.png')}")


def plot_depth(depth: dict, path: Path, activation: str = "tanh") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = sorted(depth)
    for name, style in (("loop", "o-"), ("torch_ops", "x:"), ("pcdist", "s-"), ("limit", "^--")):
        ax.plot(xs, [depth[n][name] * 1e3 for n in xs], style, label=name.replace("_", " "))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("hidden layers (width 128)")
    ax.set_ylabel("ms per training step (T = 20)")
    ax.set_title(f"PC training step vs depth, {activation}, float32, batch 64")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
