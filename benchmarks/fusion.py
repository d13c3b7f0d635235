"""Fused PC training step vs the per-layer autograd loop vs the matmul limit.

Per training step (float32, batch 64, T = 20, AdamW, torch threads = cores):
  loop    the usual PyTorch PC code: a Python loop over layers, gradients from autograd
  pcdist  pcdist.PCTrainer.step
  limit   the batched matmuls pcdist's step performs, alone, into preallocated buffers
  torch_ops  pcdist with its fused error kernel off (PCDIST_NATIVE=0): the error pass as
             separate torch ops, as on a machine without a C compiler
  baseline   (with --baseline REF) pcdist as it was at git commit REF, same network
  module     (shape A) the same layers as pcdist's generic ``module`` kind (pcdist.AnyModule: K equal
             layers vmapped, VJPs by autograd, traced into aten graphs), the path any nn.Module takes
  module_eager  (shape A) the module kind on its eager calls (PCDIST_TRACE=0: no traced graphs)

Shapes A, B, C are MLPs (dense layers); M is a μPC network (residual layers) of A's shape:
64 -> 32 x 128 -> 10. The variants run interleaved (round-robin, several rounds) in one
process; each ratio is the median over rounds of the ratio within a round (pcdist and
limit run back to back), so machine drift between rounds cancels out. Writes
benchmarks/results/fusion.json and benchmarks/results/fusion_depth.png.

    python benchmarks/fusion.py            # full run (a few minutes on 2 cores)
    python benchmarks/fusion.py --quick    # fewer rounds
    python benchmarks/fusion.py --tiny     # tiny shapes, a smoke test of the script (not a measurement)
    python benchmarks/fusion.py --activation gelu   # writes fusion_gelu.json / fusion_gelu_depth.png (relu too)
    python benchmarks/fusion.py --baseline 860de00  # also times that commit's engine on A, B, C
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
SHAPES = {  # name: (input, hidden widths, output, model)
    "A": (64, [128] * 32, 10, "mlp"),
    "B": (784, [512] * 16, 10, "mlp"),
    "C": (784, [128, 128], 10, "mlp"),
    "M": (64, [128] * 32, 10, "mupc"),
}
DEPTHS = [4, 8, 16, 32, 64]
TINY_SHAPES = {"A": (16, [16] * 4, 4, "mlp"), "B": (32, [24] * 3, 4, "mlp"), "C": (32, [16, 16], 4, "mlp"),
               "M": (16, [16] * 4, 4, "mupc")}
TINY_DEPTHS = [2, 4]


ACTIVATIONS = {"tanh": nn.Tanh, "gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU, "softplus": nn.Softplus,
               "elu": nn.ELU, "mish": nn.Mish}


def make_seq(d_in: int, hidden: list[int], d_out: int, activation: str = "tanh") -> nn.Sequential:
    dims = [d_in, *hidden, d_out]
    mods: list[nn.Module] = []
    for i in range(len(dims) - 1):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            mods.append(ACTIVATIONS[activation]())
    return nn.Sequential(*mods)


def make_layers(shape, activation: str) -> list[nn.Module]:
    """One torch module per PC layer: Linear (+ activation) for an MLP, μPC's residual layers otherwise."""
    d_in, hidden, d_out, model = shape
    if model == "mupc":
        return list(pcdist.mupc_layers(d_in, hidden[0], len(hidden) + 1, d_out, activation))
    mods = list(make_seq(d_in, hidden, d_out, activation))
    return [nn.Sequential(*mods[i : i + 2]) for i in range(0, len(mods) - 1, 2)] + [mods[-1]]


class LoopPC:
    """The per-layer PC loop researchers write: autograd through a Python loop over layers,
    u_l = layers[l](h_{l-1})."""

    def __init__(self, layers: list[nn.Module], T: int, x_lr: float):
        self.layers, self.T, self.x_lr = layers, T, x_lr
        self.opt = torch.optim.AdamW([p for m in layers for p in m.parameters()], lr=1e-4, fused=True)

    def energy(self, hs: list[torch.Tensor]) -> torch.Tensor:
        E = 0.0
        for l, layer in enumerate(self.layers, start=1):
            E = E + 0.5 * (hs[l] - layer(hs[l - 1])).square().sum()
        return E

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.no_grad():
            hs = [x]
            for layer in self.layers[:-1]:
                hs.append(layer(hs[-1]))
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

    def __init__(self, net: pcdist.PCNetwork, B: int, T: int, device=None, dtype=torch.float32):
        self.T = T
        kw = dict(dtype=dtype, device=device)
        self.groups = []
        for g in net.groups:
            K, I, O = g.weight.shape
            w = g.weight.detach().to(**kw)
            self.groups.append(dict(K=K, w=w.clone(), wT=w.transpose(1, 2).contiguous(),
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


def make_variants(shape, B: int, T: int, x_lr: float, activation: str = "tanh", baseline=None,
                  module: bool = False):
    d_in, hidden, d_out, model = shape
    torch.manual_seed(0)
    layers = make_layers(shape, activation)
    x = torch.randn(B, d_in)
    y = nn.functional.one_hot(torch.randint(0, d_out, (B,)), d_out).float()

    def trainer(lib, generic: bool = False):
        if lib is baseline:  # an engine from before from_layers: the same MLP as one Sequential
            net = lib.PCNetwork.from_sequential(nn.Sequential(*pcdist.PCNetwork.from_layers(layers).to_sequential()))
        elif generic:
            net = lib.PCNetwork.from_layers([pcdist.AnyModule(m) for m in layers], input_shape=(d_in,))
        else:
            net = lib.PCNetwork.from_layers(layers)
        return lib.PCTrainer(net, torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True), T=T, x_lr=x_lr)

    loop = LoopPC(copy.deepcopy(layers), T, x_lr)
    main = trainer(pcdist)
    variants = {"loop": lambda: loop.step(x, y)}
    # pcdist with the error pass as separate torch ops (PCDIST_NATIVE=0), as on a machine without a C compiler.
    ops = trainer(pcdist)
    os.environ["PCDIST_NATIVE"] = "0"
    try:
        ops.stage(B)  # the kernel choice is made when the buffers are built
    finally:
        del os.environ["PCDIST_NATIVE"]
    if any(getattr(g, "kernel", None) is not None for g in main.stage(B).groups):
        variants["torch_ops"] = lambda: ops.step(x, y)
    if baseline is not None and model == "mlp":
        old = trainer(baseline)
        variants["baseline"] = lambda: old.step(x, y)
    if module:
        generic = trainer(pcdist, generic=True)
        variants["module"] = lambda: generic.step(x, y)
        # The module kind on its eager calls (PCDIST_TRACE=0: vmap + autograd at every call, no traced graphs).
        eager = trainer(pcdist, generic=True)
        os.environ["PCDIST_TRACE"] = "0"
        try:
            eager.stage(B)  # the calls are traced (or not) when the buffers are built
        finally:
            del os.environ["PCDIST_TRACE"]
        variants["module_eager"] = lambda: eager.step(x, y)
    # pcdist and limit run next to each other in every round: their ratio is taken per round.
    variants["pcdist"] = lambda: main.step(x, y)
    variants["limit"] = MatmulLimit(main.net, B, T).step
    return variants


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
    ap.add_argument("--quick", action="store_true", help="few rounds")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and two rounds: a smoke test, not a measurement")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--T", type=int, default=20)
    ap.add_argument("--activation", choices=sorted(ACTIVATIONS), default="tanh", help="of every hidden layer")
    ap.add_argument("--baseline", metavar="REF", help="also time pcdist at this git commit (shapes A, B, C)")
    ap.add_argument("--out", type=Path, default=OUT, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    if args.tiny and args.out == OUT:  # a smoke test never writes over the results the docs quote
        args.out = OUT / "tiny"
    torch.set_num_threads(os.cpu_count() or 1)
    rounds, min_time = (2, 0.01) if args.tiny else (3, 0.05) if args.quick else (15, 0.3)
    baseline = None
    if args.baseline:
        from baseline import import_ref

        baseline = import_ref(args.baseline)
    kw = dict(B=args.batch, T=args.T, x_lr=0.1, activation=args.activation, baseline=baseline)
    stem = "fusion" if args.activation == "tanh" else f"fusion_{args.activation}"
    ratios = [("loop", "pcdist"), ("pcdist", "limit"), ("torch_ops", "pcdist"), ("baseline", "pcdist"),
              ("module", "pcdist"), ("module_eager", "module")]

    shapes = {}
    for name, shape in (TINY_SHAPES if args.tiny else SHAPES).items():
        samples = time_interleaved(make_variants(shape, **kw, module=name == "A"), rounds, min_time)
        med = {k: statistics.median(v) for k, v in samples.items()}
        shapes[name] = {
            "dims": f"{shape[0]} -> {len(shape[1])} hidden x {shape[1][0]} -> {shape[2]} ({shape[3]})",
            "seconds": med,
            **{f"{a}/{b}": ratio(samples, a, b) for a, b in ratios if a in samples},
            "rounds": samples,
        }
        r = shapes[name]
        print(f"shape {name} ({r['dims']}): " + "  ".join(f"{k} {v * 1e3:8.2f} ms" for k, v in med.items()) + "  "
              + "  ".join(f"{k} {v:5.3f}x" for k, v in r.items() if "/" in k), flush=True)

    depth = {}
    for n in TINY_DEPTHS if args.tiny else DEPTHS:
        d_in, hidden, d_out, _ = (TINY_SHAPES if args.tiny else SHAPES)["A"]
        kw_depth = {**kw, "baseline": None}
        samples = time_interleaved(make_variants((d_in, hidden[:1] * n, d_out, "mlp"), **kw_depth),
                                   max(2 if args.tiny else 3, rounds // 2), min_time)
        med = {k: statistics.median(v) for k, v in samples.items()}
        depth[n] = med
        print(f"depth {n:3d} hidden x {hidden[0]}: " + "  ".join(f"{k} {v * 1e3:8.2f} ms" for k, v in med.items()),
              flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "config": {"dtype": "float32", "batch": args.batch, "T": args.T, "activation": args.activation,
                   "threads": torch.get_num_threads(), "baseline": args.baseline,
                   "torch": torch.__version__, "machine": platform.machine(), "quick": args.quick, "tiny": args.tiny},
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
        if name in depth[xs[0]]:
            ax.plot(xs, [depth[n][name] * 1e3 for n in xs], style, label=name.replace("_", " "))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("hidden layers")
    ax.set_ylabel("ms per training step (T = 20)")
    ax.set_title(f"PC training step vs depth, {activation}, float32, batch 64")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
