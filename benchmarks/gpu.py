"""The PC step on a GPU: eager and replayed as CUDA graphs, against the per-layer loop, the matmul limit
and backprop (eager and CUDA-graphed) on the same network; and, on any machine, the host work of a step.

Per training step (float32 unless said, AdamW, ms):
  eager      pcdist.PCTrainer(compile="none"): every op dispatched by the host
  graph      pcdist.PCTrainer(compile="graph"): each stage's step captured once and replayed
             (on a CPU the same capturable core runs eagerly: a CPU measures its host work, not a replay)
  graph_torch  (GPU) the same without pcdist's Triton kernels (PCDIST_TRITON=0: the init chain and the dense
             error pass as torch ops), so graph_torch/graph is what those kernels gain
  graph_cublas (GPU) the same with every product on cuBLAS (PCDIST_GEMM=torch): what the Triton GEMM
             gains where it was timed faster (pcdist/engine/gemm.py)
  graph_cl   (GPU, conv nets) the same with channels-last image nodes (PCDIST_CHANNELS_LAST=1: cuDNN's NHWC
             convolutions, pcdist/engine/layers/conv.py), graph_rm with row-major ones (=0), so graph_rm/graph_cl
             is what that layout gains (``graph`` is one of them: auto picks channels-last where the
             convolutions run on tensor cores, TF32 or bfloat16); limit_cl its convolutions alone, channels-last
  graph_grouped (GPU, conv nets with a group of two or more equal layers) the same with each group's
             convolutions as one grouped convolution (PCDIST_CONV_GROUPED=1), graph_layers layer by layer (=0);
             ``graph`` is one of them per shape (auto: timed once)
  loop       the per-layer PC loop researchers write (autograd through a Python loop; fusion.py's LoopPC)
  limit      the batched matmuls (and convolutions) of one pcdist step alone, into preallocated buffers,
             replayed as a CUDA graph on a GPU: the arithmetic floor of the step
  bp_eager   backprop on the same layers as nn.Sequential (se or ce loss, fused AdamW)
  bp_graph   the same, forward + backward + optimizer step captured as one CUDA graph (GPU only)

Networks: the issue's table (MLPs A, B, C; μPC of width 128 at 8 / 32 / 128 / 512 layers, T = 8; a small
CNN, PCX's VGG-5 at batch 128 and a 17-conv stack), the depth sweep (MLPs of width 128, 4 to 512 hidden
layers, T = 20) and, on a GPU, the wide MLP (width 1024, batch 1024, 32 layers) in fp32, tf32 and bf16
against each one's matmul limit.

Host work, measurable anywhere (pcdist.engine.capture.HostReads): the aten ops one step dispatches
(``ops``; ``kernels``: those that are not views) and the values it reads on the host (``reads``), for
the eager step and the step under ``compile="graph"`` (on a GPU: a replay; on a CPU: the core, eager). The
``ops`` section counts them against depth with the fused CPU kernel off (PCDIST_NATIVE=0), as a GPU runs.

The variants of a network run interleaved (round-robin, the device synchronised around each timed
batch of calls); each ratio is the median over rounds of the ratio within a round.

    python benchmarks/gpu.py                 # everything this device can run (GPU: ~10 min)
    python benchmarks/gpu.py --quick         # fewer rounds, the depth sweep to 128
    python benchmarks/gpu.py --only table    # sections: table, depth, wide, ops (--only table,depth)
    python benchmarks/gpu.py --tiny          # tiny shapes: a smoke test of the script (not a measurement)

Writes benchmarks/results/gpu_<device>.json and gpu_<device>_{depth,table}.png (device: cuda or cpu).
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
import torch.nn.functional as F
from torch import nn

import pcdist
from conv import ConvLimit
from fusion import LoopPC, MatmulLimit, make_layers
from pcdist.engine.capture import WARMUP, HostReads
from pcdist.engine.models import conv_specs, vgg_specs

OUT = Path(__file__).resolve().parent / "results"


def networks(tiny: bool) -> dict:
    """name: (layers (torch modules, one per PC layer) or layer kinds, input shape, batch, T, energy)."""
    if tiny:
        return {"A": (make_layers((16, [16] * 4, 4, "mlp"), "tanh"), (16,), 8, 3, "se"),
                "mupc-8": (make_layers((16, [16] * 7, 4, "mupc"), "relu"), (16,), 8, 3, "se"),
                "conv-small": (conv_specs((1, 8, 8), [(4, 3, 1, "max")], [], 4, "relu"), (1, 8, 8), 8, 3, "ce")}
    mupc = {f"mupc-{L}": (make_layers((64, [128] * (L - 1), 10, "mupc"), "relu"), (64,), 64, 8, "se")
            for L in (8, 32, 128, 512)}
    return {
        "A": (make_layers((64, [128] * 32, 10, "mlp"), "tanh"), (64,), 64, 20, "se"),
        "B": (make_layers((784, [512] * 16, 10, "mlp"), "tanh"), (784,), 64, 20, "se"),
        "C": (make_layers((784, [128, 128], 10, "mlp"), "tanh"), (784,), 64, 20, "se"),
        **mupc,
        "conv-small": (conv_specs((1, 8, 8), [(32, 3, 1, "max"), (64, 3, 1, "max")], [], 10, "relu"),
                       (1, 8, 8), 64, 10, "ce"),
        "vgg5": (vgg_specs("vgg5", (3, 32, 32), 10, "relu"), (3, 32, 32), 128, 7, "ce"),
        "conv-deep": (conv_specs((3, 16, 16), [(16, 3, 1, None)] * 17, [], 10, "relu"), (3, 16, 16), 64, 10, "ce"),
    }


def build(layers, in_shape, B: int, device, dtype=torch.float32, energy: str = "se"):
    """The PCNetwork, the same layers as plain modules (for the loop and backprop) and a batch."""
    torch.manual_seed(0)
    if isinstance(layers[0], nn.Module):
        net = pcdist.PCNetwork.from_layers(layers, energy=energy)
    else:
        net = pcdist.PCNetwork(layers, energy=energy)
    net = net.to(device=device, dtype=dtype)
    x = torch.randn(B, *in_shape, device=device, dtype=dtype)
    d_out = net.node_shapes[-1][0]
    y = F.one_hot(torch.randint(0, d_out, (B,), device=device), d_out).to(dtype)
    return net, x, y


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def graphed(fn, device, warmup: int = 3):
    """fn captured as one CUDA graph after ``warmup`` eager calls on a side stream; returns its replay, which
    holds fn (and so its object's buffers, which the graph reads and writes: freed, a replay would write into
    memory reused by others, what crashed VGG-5's limit_cl on an H200)."""
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()

    def replay(fn=fn):
        g.replay()

    return replay


class Backprop:
    """Backprop on the same layers (nn.Sequential), the output energy's loss, fused AdamW."""

    def __init__(self, net: pcdist.PCNetwork, x, y, energy: str, graph: bool):
        self.model = nn.Sequential(*copy.deepcopy(net).to_layers())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True, capturable=graph)
        self.x, self.y, self.energy = x, y, energy
        self.step = graphed(self._step, x.device) if graph else self._step

    def _step(self) -> None:
        u = self.model(self.x)
        if self.energy == "ce":
            loss = F.cross_entropy(u, self.y)
        else:
            loss = 0.5 * (u - self.y).square().sum(1).mean()
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.opt.step()


def variants(layers, in_shape, B: int, T: int, energy: str, device, loop: bool, dtype=torch.float32,
             precision: str = "fp32") -> tuple[dict, dict]:
    """The timed variants of one network, and the host work of its step (eager and under compile=graph)."""
    net, x, y = build(layers, in_shape, B, device, dtype, energy)
    cuda = torch.device(device).type == "cuda"

    def trainer(compile: str):
        n = copy.deepcopy(net)
        opt = torch.optim.AdamW(n.parameters(), lr=1e-4, fused=True)
        sched = pcdist.warmup_cosine(opt, 10, 10 ** 6)  # a real run's schedule: the rates come from the device
        return pcdist.PCTrainer(n, opt, T=T, x_lr=0.05, scheduler=sched, compile=compile, precision=precision)

    eager, graph = trainer("none"), trainer("graph")
    out = {"eager": lambda: eager.step(x, y, log=False), "graph": lambda: graph.step(x, y, log=False)}
    def built_under(env: dict):
        """A replayed trainer whose step is built and captured with ``env`` set (most kernels are chosen when the
        stage is built, bf16's Triton GEMM as each product first runs: so the capture too)."""
        tr, before = trainer("graph"), {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            for _ in range(2 + WARMUP):  # past the stage's first call, its check and warm-up: captured here
                tr.step(x, y, log=False)
        finally:
            for k, v in before.items():
                os.environ.pop(k) if v is None else os.environ.update({k: v})
        return tr

    if cuda:  # replayed without any Triton kernel (torch ops, cuBLAS), and with all but the Triton GEMM
        plain, cublas = built_under({"PCDIST_TRITON": "0"}), built_under({"PCDIST_GEMM": "torch"})
        out["graph_torch"] = lambda: plain.step(x, y, log=False)
        out["graph_cublas"] = lambda: cublas.step(x, y, log=False)
        if any(g.kind.kind == "conv" for g in net.groups):
            nhwc, nchw = built_under({"PCDIST_CHANNELS_LAST": "1"}), built_under({"PCDIST_CHANNELS_LAST": "0"})
            out["graph_cl"] = lambda: nhwc.step(x, y, log=False)
            out["graph_rm"] = lambda: nchw.step(x, y, log=False)
            out["limit_cl"] = graphed(ConvLimit(net, B, T, device, torch.bfloat16 if precision == "bf16" else dtype,
                                                channels_last=True).step, device)
        if any(g.kind.kind == "conv" and g.K > 1 for g in net.groups):  # a conv group's convolutions as one, or not
            grouped, layers = built_under({"PCDIST_CONV_GROUPED": "1"}), built_under({"PCDIST_CONV_GROUPED": "0"})
            out["graph_grouped"] = lambda: grouped.step(x, y, log=False)
            out["graph_layers"] = lambda: layers.step(x, y, log=False)
    if loop:
        ref = LoopPC([m.to(device=device, dtype=dtype) for m in copy.deepcopy(net).to_layers()], T, 0.05)
        out["loop"] = lambda: ref.step(x, y)
    ldt = torch.bfloat16 if precision == "bf16" else dtype  # the limit in the step's product dtype
    lim = MatmulLimit(net, B, T, device, ldt) if all(g.kind.kind in ("dense", "residual") for g in net.groups) \
        else ConvLimit(net, B, T, device, ldt)
    out["limit"] = graphed(lim.step, device) if cuda else lim.step
    bp = Backprop(net, x, y, energy, graph=False)
    out["bp_eager"] = bp.step
    if cuda:
        out["bp_graph"] = Backprop(net, x, y, energy, graph=True).step
    work = {}
    for name, tr in (("eager", eager), ("graph", graph)):
        for _ in range(5):  # past the graph's check, warm-up and capture
            tr.step(x, y, log=False)
        sync(device)
        with HostReads(strict=not cuda) as reads:
            tr.step(x, y, log=False)
        sync(device)
        work[name] = {"ops": reads.ops, "kernels": reads.kernels, "reads": len(reads.reads),
                      "captured": bool(tr.runner.programs)}
    return out, work


def time_interleaved(fns: dict, rounds: int, min_time: float, device) -> dict[str, list[float]]:
    """Seconds per call of each variant in every round, the device synchronised around each timed batch."""
    calls = {}
    for name, f in fns.items():  # warm-up, and how many calls fill min_time
        f()
        sync(device)
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < min_time / 4 or n < 2:
            f()
            n += 1
            sync(device)
        calls[name] = max(1, int(n * min_time / max(1e-9, time.perf_counter() - t0)))
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                f()
            sync(device)
            samples[name].append((time.perf_counter() - t0) / calls[name])
    return samples


def ratio(samples: dict, num: str, den: str) -> float:
    return statistics.median(a / b for a, b in zip(samples[num], samples[den]))


RATIOS = (("eager", "graph"), ("graph_torch", "graph"), ("graph_cublas", "graph"), ("graph_rm", "graph_cl"),
          ("graph_layers", "graph_grouped"),
          ("graph", "limit"), ("graph_cl", "limit_cl"),
          ("loop", "graph"), ("bp_graph", "graph"), ("bp_eager", "graph"))


def measure(name: str, spec, device, rounds: int, min_time: float, loop: bool, without=(), **kw) -> dict:
    layers, in_shape, B, T, energy = spec
    fns, work = variants(layers, in_shape, B, T, energy, device, loop, **kw)
    fns = {k: f for k, f in fns.items() if k not in without}
    samples = time_interleaved(fns, rounds, min_time, device)
    med = {k: statistics.median(v) for k, v in samples.items()}
    res = {"batch": B, "T": T, "layers": len(layers), "ms": {k: v * 1e3 for k, v in med.items()}, "host": work,
           **{f"{a}/{b}": ratio(samples, a, b) for a, b in RATIOS if a in samples and b in samples}}
    print(f"{name} ({len(layers)} layers, batch {B}, T {T}): "
          + "  ".join(f"{k} {v:8.3f}" for k, v in res["ms"].items()) + " ms  "
          + "  ".join(f"{k} {v:5.2f}x" for k, v in res.items() if "/" in k)
          + f"  | ops/step eager {work['eager']['ops']} graph {work['graph']['ops']}, host reads "
          + f"{work['eager']['reads']} / {work['graph']['reads']}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few rounds, depth sweep to 128")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke test of the script, not a measurement")
    ap.add_argument("--only", type=_sections, help="comma-separated sections to run: table, depth, wide, ops "
                    "(default: all)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=OUT, help="results folder (default benchmarks/results)")
    ap.add_argument("--networks", help="comma-separated table networks to run (default: all)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"),
                    help="trainer.precision of the table and depth sweeps (the wide section runs all three)")
    ap.add_argument("--without", default="", help="comma-separated variants not to time (e.g. loop,graph_cl)")
    ap.add_argument("--depths", help="comma-separated hidden-layer counts of the depth sweep (default 4 ... 512)")
    ap.add_argument("--profile", metavar="NETWORK", help="print where the eager PC step of one table network spends "
                    "its device time (torch.profiler, by kernel), then stop")
    args = ap.parse_args()
    if args.tiny and args.out == OUT:  # a smoke test never writes over the results the docs quote
        args.out = OUT / "tiny"
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.backends.cudnn.benchmark = True  # as the service runs (pcdist/service/device.py): cuDNN picks its algorithms
    if not cuda:
        torch.set_num_threads(os.cpu_count() or 1)
    rounds, min_time = (2, 0.01) if args.tiny else (3, 0.2) if args.quick else (7, 0.5)
    want = lambda section: args.only is None or section in args.only  # noqa: E731
    result = {"config": {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
                         "torch": torch.__version__, "dtype": "float32", "precision": args.precision,
                         "quick": args.quick, "tiny": args.tiny,
                         "threads": torch.get_num_threads()}}
    nets = networks(args.tiny)
    if args.profile:
        return profile(nets[args.profile], device)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_{device.type}" + ("" if args.precision == "fp32" else f"_{args.precision}")

    def save(pictures: bool = False) -> None:  # after every network: a run cut short keeps what it measured
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
        if pictures:  # after every section
            plot(result, args.out / stem)

    if want("table"):
        result["table"] = {}
        for name, spec in nets.items():
            if args.networks and name not in args.networks.split(","):
                continue
            if not cuda and not args.tiny and name in ("vgg5", "mupc-512", "mupc-128"):
                continue  # minutes per step on a CPU
            result["table"][name] = measure(name, spec, device, rounds, min_time, loop=len(spec[0]) <= 40,
                                            without=args.without.split(","), precision=args.precision)
            save()
        save(pictures=True)
    if want("depth"):
        result["depth"] = {}
        depths = [2, 4] if args.tiny else [4, 8, 16, 32, 64, 128] + ([256, 512] if cuda and not args.quick else [])
        depths = [int(n) for n in args.depths.split(",")] if args.depths else depths
        for n in depths:
            spec = (make_layers((64 if not args.tiny else 16, [128 if not args.tiny else 16] * n, 10, "mlp"), "tanh"),
                    (64 if not args.tiny else 16,), 64 if not args.tiny else 8, 20 if not args.tiny else 3, "se")
            result["depth"][n] = measure(f"depth {n}", spec, device, rounds, min_time, loop=n <= 64,
                                         precision=args.precision)
            save()
        save(pictures=True)
    if want("wide") and (cuda or args.tiny):
        result["wide"] = {}
        width, B, L = (16, 8, 3) if args.tiny else (1024, 1024, 32)
        spec = (make_layers((width, [width] * L, width, "mlp"), "tanh"), (width,), B, 20 if not args.tiny else 2, "se")
        for precision in ("fp32", "tf32", "bf16"):
            result["wide"][precision] = measure(f"wide {precision}", spec, device, rounds, min_time, loop=False,
                                                precision=precision)
            save()
        save(pictures=True)
    if want("ops"):
        result["ops"] = {}  # host work per step against depth: flat when replayed, linear when eager
        os.environ["PCDIST_NATIVE"] = "0"  # count the ops a GPU runs: no fused CPU kernel
        for n in ([2, 4] if args.tiny else [4, 16, 64, 256]):
            _, work = variants(make_layers((16, [16] * n, 4, "mlp"), "tanh"), (16,), 8, 20, "se", device, False)
            result["ops"][n] = work
            print(f"ops per step, {n} hidden layers: eager {work['eager']['ops']} ({work['eager']['kernels']} "
                  f"kernels), graph {work['graph']['ops']}; host reads {work['eager']['reads']} / "
                  f"{work['graph']['reads']}", flush=True)
    save(pictures=True)
    drawn = any(k in result for k in ("table", "depth", "wide"))  # (the ops section has no picture)
    print(f"wrote {args.out / (stem + '.json')}{' and its pictures' if drawn else ''}")


def _sections(text: str) -> list[str]:
    """--only's value: sections of this script, refused by name otherwise."""
    sections = [s for s in text.split(",") if s]
    bad = [s for s in sections if s not in ("table", "depth", "wide", "ops")]
    if bad or not sections:
        raise argparse.ArgumentTypeError(f"{text!r}: sections are table, depth, wide, ops (comma-separated)")
    return sections


def profile(spec, device, steps: int = 5) -> None:
    """The device time of the eager PC step by kernel (the replayed step runs the same kernels)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    layers, in_shape, B, T, energy = spec
    fns, _ = variants(layers, in_shape, B, T, energy, device, loop=False)
    for _ in range(3):
        fns["eager"]()
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        for _ in range(steps):
            fns["eager"]()
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"per {steps} eager steps:")
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))


def plot(result: dict, stem: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    where = result["config"]["device"]
    if result.get("depth"):
        fig, ax = plt.subplots(figsize=(6, 4))
        depth = result["depth"]
        xs = sorted(depth, key=int)
        for name, style in (("loop", "o-"), ("eager", "x:"), ("graph", "s-"), ("limit", "^--"), ("bp_graph", "d-.")):
            pts = [(int(n), depth[n]["ms"][name]) for n in xs if name in depth[n]["ms"]]
            if pts:
                ax.plot(*zip(*pts), style, label=name.replace("_", " "))
        ax.set(xscale="log", yscale="log", xlabel="hidden layers (width 128)", ylabel="ms per training step (T = 20)",
               title=f"PC step against depth, {where}")
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(f"{stem}_depth.png", dpi=120)
        plt.close(fig)
    if result.get("table"):
        fig, ax = plt.subplots(figsize=(9, 4))
        names = list(result["table"])
        kinds = [k for k in ("eager", "graph", "limit", "bp_eager", "bp_graph") if k in result["table"][names[0]]["ms"]]
        width = 0.8 / len(kinds)
        for i, k in enumerate(kinds):
            ax.bar([j + i * width for j in range(len(names))], [result["table"][n]["ms"].get(k, 0) for n in names],
                   width, label=k.replace("_", " "))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=30)
        ax.set(yscale="log", ylabel="ms per training step", title=f"PC step and backprop, {where}")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(f"{stem}_table.png", dpi=120)
        plt.close(fig)


if __name__ == "__main__":
    main()
