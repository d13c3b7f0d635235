"""The kernels one training step launches on a GPU, with pcdist's Triton kernels and without, counted on any machine.

A step replayed as a CUDA graph costs about its kernel count times a few microseconds where its tensors are small
(docs/gpu.md), so what the Triton kernels (the fused feed-forward chain, pcdist/engine/chain.py; the dense error
pass and the residual kind's passes, pcdist/engine/errorpass.py) save shows up as kernels per step. This counts
them without a GPU (and the conv kind's bias, activation and pooling passes, errorpass.ConvKernel): the step runs
on the CPU with its own C kernel off (PCDIST_NATIVE=0, the GPU's code path), under Triton's interpreter
(TRITON_INTERPRET=1, which this script sets for itself), each aten op that launches a kernel counted
(``pcdist.engine.capture.HostReads``, views excluded) and each Triton launch counted once (the interpreter's own
work inside it is not a GPU kernel, so it is not run while counting: the counted step is the fourth, whose
kernels do not depend on the values). Per network: with the Triton kernels (``triton``; the products on the Triton
GEMM, PCDIST_GEMM=triton: on a GPU each product runs it or cuBLAS, one kernel either way, except under
precision="bf16", where cuBLAS needs a cast of the nodes first) and with PCDIST_TRITON=0 (``torch``). An aten op
counts once: the torch ops' ``convolution.out`` is one here but on a GPU three kernels
(cuDNN's convolution, its bias add, the copy into the preallocated buffer), which the conv kernels' path does
without (it adds the bias as it reads the convolution's own output), so for conv nets the saving counted is
a lower bound.

    python benchmarks/kernels.py               # A, B, C (MLPs, T = 20), a 32-layer μPC (T = 8), the small CNN,
                                               # VGG-5 of benchmarks/gpu.py and B under bf16: ~10 min
    python benchmarks/kernels.py --shapes C    # one of them

Writes benchmarks/results/kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results"
SHAPES = {"A": (64, [128] * 32, 10), "B": (784, [512] * 16, 10), "C": (784, [128] * 2, 10),
          "mupc32": (64, [128] * 31, 10),  # μPC of width 128, 32 layers, T = 8, as in the GPU table
          "cnn": ((1, 8, 8), [(32, 3, 1, "max"), (64, 3, 1, "max")], 10),  # its small CNN, T = 10, ce
          "vgg5": ((3, 32, 32), "vgg5", 10),  # PCX's VGG-5, T = 7, ce (counted at batch 8: counts do not depend on it)
          "B_bf16": (784, [512] * 16, 10)}  # B under precision="bf16" (the Triton GEMM rounds as it reads)


def count(shape: str) -> dict:
    """Kernels per step of shape ``shape``, in this process (started with TRITON_INTERPRET=1 and PCDIST_TRITON)."""
    import torch

    import pcdist
    from pcdist.engine import chain, errorpass, gemm
    from pcdist.engine.capture import HostReads

    from pcdist.engine.models import conv_specs, vgg_specs

    d_in, hidden, d_out = SHAPES[shape]
    B, T = 64, {"mupc32": 8, "cnn": 10, "vgg5": 7}.get(shape, 20)
    if shape.startswith("mupc"):
        net = pcdist.PCNetwork(pcdist.mupc_specs(d_in, hidden[0], len(hidden) + 1, d_out, "relu"), seed=0)
    elif shape == "cnn":
        net = pcdist.PCNetwork(conv_specs(d_in, hidden, [], d_out, "relu"), energy="ce", seed=0)
    elif shape == "vgg5":
        net, B = pcdist.PCNetwork(vgg_specs(hidden, d_in, d_out, "relu"), energy="ce", seed=0), 8
    else:
        net = pcdist.PCNetwork.from_dims([d_in, *hidden, d_out], "tanh", seed=0)
    tr = pcdist.PCTrainer(net, torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True), T=T, x_lr=0.05,
                          precision="bf16" if shape.endswith("bf16") else "fp32")
    g = torch.Generator().manual_seed(0)
    shape_in = d_in if isinstance(d_in, tuple) else (d_in,)
    x, y = torch.randn(B, *shape_in, generator=g), torch.eye(d_out)[torch.randint(0, d_out, (B,), generator=g)]
    launches, counting = [], []

    def product(cfg, inp, a, b, beta, alpha, out):
        """The Triton GEMM's launch, counted; its values from torch (the interpreter would take minutes)."""
        if counting:  # the counted step's values do not matter
            launches.append("gemm")
            return
        out.copy_(gemm.reference(inp, a, b, beta, alpha))  # the kernel's arithmetic

    gemm._choose = lambda *a, **k: gemm.INTERPRETED_CONFIG
    gemm._launch = product
    for _ in range(3):
        tr.step(x, y, log=False)
    counting.append(True)
    errorpass.Kernel._call = lambda self, *a, **k: launches.append("errors")
    errorpass.ConvKernel._launch = lambda self, *a, **k: launches.append("conv")
    for name in ("activate", "errors", "backproject"):
        setattr(errorpass.ResidualKernel, name, lambda self, *a, **k: launches.append("residual"))
    chain.dense_chain = chain.residual_chain = lambda *a, **k: launches.append("chain")
    with HostReads(strict=False) as reads:
        tr.step(x, y, log=False)
    return {"aten": reads.kernels, "triton": len(launches), "total": reads.kernels + len(launches),
            "launches": dict(Counter(launches)), "products": reads.by_op["baddbmm"] + reads.by_op["bmm"]}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--count":  # a child: one shape, one setting
        print(json.dumps(count(sys.argv[2])))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rows = {}
    for shape in args.shapes:
        rows[shape] = {}
        for name, on in (("torch", "0"), ("triton", "1")):
            env = dict(os.environ, TRITON_INTERPRET="1", PCDIST_TRITON=on, PCDIST_NATIVE="0", OMP_NUM_THREADS="1",
                       PCDIST_GEMM="triton",  # every product the Triton GEMM can run counted as one launch
                       PCDIST_CHANNELS_LAST="0")  # a GPU's default layout (a CPU's is channels-last)
            out = subprocess.run([sys.executable, __file__, "--count", shape], env=env, capture_output=True,
                                 text=True, check=True)
            rows[shape][name] = json.loads(out.stdout.strip().splitlines()[-1])
        t, f = rows[shape]["torch"], rows[shape]["triton"]
        print(f"shape {shape}: kernels per step {t['total']} with torch ops, {f['total']} with pcdist's Triton kernels "
              f"({f['triton']} of them Triton): {f['total'] / t['total']:.2f}x", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "kernels.json"  # the shapes counted now replace theirs; the others' rows are kept
    kept = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(kept | rows, indent=2))
    print(f"wrote {args.out / 'kernels.json'}")


if __name__ == "__main__":
    main()
