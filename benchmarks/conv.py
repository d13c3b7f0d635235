"""Conv PC training step vs the per-layer autograd loop vs the convolutions alone.

Per training step (float32, AdamW, torch threads = cores):
  loop    the usual PyTorch PC code: a Python loop over layers (nn.Conv2d + activation + pooling,
          then nn.Flatten + nn.Linear), gradients from autograd (fusion.py's LoopPC)
  pcdist  pcdist.PCTrainer.step on the same layers (conv kind + dense head)
  limit   the convolutions and matmuls pcdist's step performs, alone: the feed-forward init,
          T further predictions, T back-projections and one weight gradient per layer, into
          preallocated buffers where aten allows; no activation, pooling, error or optimizer work
  pcdist_cl, limit_cl  the same with channels-last image nodes (PCDIST_CHANNELS_LAST=1,
          pcdist/engine/layers/conv.py) and convolutions

Networks:
  vgg5    PCX's VGG-5 on CIFAR-10-sized inputs (3 x 32 x 32; 128, 256, 512, 512 channels, 3 x 3,
          max pooling), batch 128, T = 7 as in PCX's VGG5_PCN_SE.yaml
  stack   a deep stack of equal conv layers: 3 -> 32 channels, then 15 x (32 -> 32), 3 x 3 "same"
          on 16 x 16 images, relu, a linear head; batch 64, T = 10
  digits  the service's model=cnn on digits: 1 x 8 x 8, conv 32 and 64 channels each with max pooling,
          gelu; batch 64, T = 5 (the squared-error output here, the service's is ce)

The variants run interleaved (round-robin) in one process; each ratio is the median over
rounds of the ratio within a round. A third section times the fusion choice of the conv kind
for K stacked equal layers: one aten convolution per layer (what the kind does) against one
grouped convolution over all K layers (the K inputs moved into channels, groups = K; this is
also what torch.func.vmap of a convolution lowers to), for the prediction, the input gradient
and the weight gradient of the stack's 15 equal layers.

Writes benchmarks/results/conv.json and conv.png.

    python benchmarks/conv.py           # full run (several minutes on 2 cores: VGG-5 is ~25 GMAC per pass)
    python benchmarks/conv.py --quick   # fewer rounds
    python benchmarks/conv.py --tiny    # tiny sizes, a smoke test of the script (not a measurement)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
from pathlib import Path

import torch
from torch import nn

import pcdist
from fusion import LoopPC, ratio, time_interleaved
from pcdist.engine.layers import Conv
from pcdist.engine.models import conv_specs, vgg_specs

OUT = Path(__file__).resolve().parent / "results"
_aten = torch.ops.aten


def networks(tiny: bool) -> dict:
    """name: (layer kinds, input shape, batch, T)."""
    if tiny:
        return {"vgg5": (conv_specs((3, 8, 8), [(8, 3, 1, "max"), (16, 3, 1, "max")], [], 10, "gelu"), (3, 8, 8), 8, 2),
                "stack": (conv_specs((3, 8, 8), [(8, 3, 1, None)] * 4, [], 10, "relu"), (3, 8, 8), 8, 2),
                "digits": (conv_specs((1, 8, 8), [(8, 3, 1, "max")] * 2, [], 10, "gelu"), (1, 8, 8), 8, 2)}
    return {"vgg5": (vgg_specs("vgg5", (3, 32, 32), 10, "gelu"), (3, 32, 32), 128, 7),
            "stack": (conv_specs((3, 16, 16), [(32, 3, 1, None)] * 16, [], 10, "relu"), (3, 16, 16), 64, 10),
            "digits": (conv_specs((1, 8, 8), [(32, 3, 1, "max"), (64, 3, 1, "max")], [], 10, "gelu"), (1, 8, 8), 64, 5)}


class ConvLimit:
    """The convolutions and matmuls of one pcdist step, alone (see the module docstring)."""

    def __init__(self, net: pcdist.PCNetwork, B: int, T: int, device=None, dtype=torch.float32,
                 channels_last: bool = False):
        """``channels_last``: 2-D convolutions on channels-last images and weights (PCDIST_CHANNELS_LAST)."""
        self.T, self.layers = T, []
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        kw = dict(dtype=dtype, device=device)
        for g in net.groups:
            for k in range(g.K):
                s = g.kind
                w = g.weight[k].detach().to(**kw).clone()
                x = torch.randn(B, *s.in_shape, **kw)
                if isinstance(s, Conv):
                    if x.dim() == 4:
                        x, w = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)
                    conv = (list(s.stride), list(s.padding), list(s.dilation), False, [0, 0], s.groups)
                    a = _aten.convolution(x, w, None, *conv)
                    self.layers.append(("conv", x, w, conv, torch.empty_like(a), torch.randn_like(a)))
                else:
                    x = x.reshape(B, -1)
                    self.layers.append(("mm", x, w, None, torch.empty(B, w.shape[1], **kw),
                                        torch.randn(B, w.shape[1], **kw), torch.empty_like(x), torch.empty_like(w)))

    def _predict(self, layer) -> None:
        kind, x, w, conv, a = layer[:5]
        if kind == "conv":
            _aten.convolution.out(x, w, None, *conv, out=a)
        else:
            torch.mm(x, w, out=a)

    def _grads(self, layer, want_input: bool, want_weight: bool) -> None:
        kind, x, w, conv, a, d = layer[:6]
        if kind == "conv":
            _aten.convolution_backward(d, x, w, None, *conv, [want_input, want_weight, False])
        else:
            if want_input:
                torch.mm(d, w.T, out=layer[6])
            if want_weight:
                torch.mm(x.T, d, out=layer[7])

    def step(self) -> None:
        for layer in self.layers:  # feed-forward init
            self._predict(layer)
        for t in range(self.T + 1):  # T inference steps + the final evaluation; layer 1's input is clamped
            for layer in self.layers[1:]:
                if t > 0:
                    self._predict(layer)
                if t < self.T:
                    self._grads(layer, True, False)
        for layer in self.layers:
            self._grads(layer, False, True)


def make_variants(specs, in_shape, B: int, T: int, x_lr: float = 0.05) -> dict:
    torch.manual_seed(0)
    net = pcdist.PCNetwork(specs)
    layers = list(net.to_layers())
    x = torch.randn(B, *in_shape)
    y = nn.functional.one_hot(torch.randint(0, 10, (B,)), 10).float()
    loop = LoopPC(copy.deepcopy(layers), T, x_lr)

    def trainer(channels_last: str):
        n = copy.deepcopy(net)
        tr = pcdist.PCTrainer(n, torch.optim.AdamW(n.parameters(), lr=1e-4, fused=True), T=T, x_lr=x_lr)
        before = os.environ.get("PCDIST_CHANNELS_LAST")
        os.environ["PCDIST_CHANNELS_LAST"] = channels_last  # read when the stage is built
        try:
            tr.stage(B)
        finally:
            os.environ.pop("PCDIST_CHANNELS_LAST") if before is None else os.environ.update(PCDIST_CHANNELS_LAST=before)
        return tr

    rows, nhwc = trainer("0"), trainer("1")
    return {"loop": lambda: loop.step(x, y), "pcdist": lambda: rows.step(x, y), "pcdist_cl": lambda: nhwc.step(x, y),
            "limit": ConvLimit(net, B, T).step, "limit_cl": ConvLimit(net, B, T, channels_last=True).step}


def stacked_variants(K: int, B: int, C: int, HW: int) -> dict:
    """Prediction + input gradient + weight gradient of K equal 3 x 3 conv layers, per layer or grouped."""
    torch.manual_seed(0)
    conv = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    gconv = conv[:-1] + (K,)
    x, d = torch.randn(K, B, C, HW, HW), torch.randn(K, B, C, HW, HW)
    w = torch.randn(K, C, C, 3, 3) / (3 * C ** 0.5)
    a = torch.empty_like(x)
    wg = w.reshape(K * C, C, 3, 3)

    def per_layer():
        for k in range(K):
            _aten.convolution.out(x[k], w[k], None, *conv, out=a[k])
            _aten.convolution_backward(d[k], x[k], w[k], None, *conv, [True, True, False])

    def to_channels(t):  # [K, B, C, H, W] -> [B, K * C, H, W]
        return t.transpose(0, 1).reshape(B, K * C, HW, HW)

    def grouped():
        xg, dg = to_channels(x), to_channels(d)
        ag = _aten.convolution(xg, wg, None, *gconv)
        a.copy_(ag.reshape(B, K, C, HW, HW).transpose(0, 1))
        gi, _, _ = _aten.convolution_backward(dg, xg, wg, None, *gconv, [True, True, False])
        gi.reshape(B, K, C, HW, HW).transpose(0, 1).contiguous()

    # the two must compute the same thing
    per_layer()
    ref = a.clone()
    grouped()
    torch.testing.assert_close(a, ref, rtol=1e-4, atol=1e-4)
    return {"per_layer": per_layer, "grouped": grouped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few rounds")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes and two rounds: a smoke test, not a measurement")
    ap.add_argument("--out", type=Path, default=OUT, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    if args.tiny and args.out == OUT:  # a smoke test never writes over the results the docs quote
        args.out = OUT / "tiny"
    torch.set_num_threads(os.cpu_count() or 1)
    rounds, min_time = (2, 0.01) if args.tiny else (3, 0.5) if args.quick else (7, 1.0)

    nets = {}
    for name, (specs, in_shape, B, T) in networks(args.tiny).items():
        samples = time_interleaved(make_variants(specs, in_shape, B, T), rounds, min_time)
        med = {k: statistics.median(v) for k, v in samples.items()}
        nets[name] = {"layers": [str(s) for s in specs], "batch": B, "T": T, "seconds": med,
                      **{f"{a}/{b}": ratio(samples, a, b) for a, b in (("loop", "pcdist"), ("pcdist", "limit"),
                                                                       ("pcdist", "pcdist_cl"), ("limit", "limit_cl"))},
                      "rounds": samples}
        r = nets[name]
        print(f"{name} ({len(specs)} layers, batch {B}, T {T}): "
              + "  ".join(f"{k} {v * 1e3:9.2f} ms" for k, v in med.items()) + "  "
              + "  ".join(f"{k} {v:5.3f}x" for k, v in r.items() if "/" in k), flush=True)

    K, B, C, HW = (3, 8, 8, 8) if args.tiny else (15, 64, 32, 16)
    samples = time_interleaved(stacked_variants(K, B, C, HW), rounds, min_time)
    stacked = {"K": K, "batch": B, "channels": C, "size": HW,
               "seconds": {k: statistics.median(v) for k, v in samples.items()},
               "grouped/per_layer": ratio(samples, "grouped", "per_layer"), "rounds": samples}
    print(f"{K} stacked {C}-channel 3x3 layers on {HW}x{HW}, batch {B} (predict + input grad + weight grad): "
          + "  ".join(f"{k} {v * 1e3:8.2f} ms" for k, v in stacked["seconds"].items())
          + f"  grouped/per_layer {stacked['grouped/per_layer']:5.3f}x", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    result = {"config": {"dtype": "float32", "threads": torch.get_num_threads(), "torch": torch.__version__,
                         "machine": platform.machine(), "quick": args.quick, "tiny": args.tiny},
              "networks": nets, "stacked": stacked}
    (args.out / "conv.json").write_text(json.dumps(result, indent=2))
    plot(nets, args.out / "conv.png")
    print(f"wrote {args.out / 'conv.json'} and {args.out / 'conv.png'}")


def plot(nets: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names, variants = list(nets), ("loop", "pcdist", "pcdist_cl", "limit", "limit_cl")
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        ax.bar([j + i * width for j in range(len(names))], [nets[n]["seconds"][v] * 1e3 for n in names], width,
               label=v)
    ax.set_xticks([j + 2 * width for j in range(len(names))],
                  [f"{n}\nbatch {nets[n]['batch']}, T {nets[n]['T']}" for n in names])
    ax.set_yscale("log")
    ax.set_ylabel("ms per training step")
    ax.set_title("Conv PC training step, float32")
    ax.legend()
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
