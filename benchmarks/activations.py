"""Where the native kernel pays, per activation: pcdist's training step with the fused CPU kernel against the
same trainer with the kernel off (PCDIST_NATIVE=0: the elementwise pass as separate torch ops), for every
activation, on fusion.py's shape A (64 -> 32 hidden x 128 -> 10, dense kind) and M (the same as μPC
residual layers); float32, batch 64, T = 20, fused AdamW.

All variants run interleaved, round by round, in one process (fusion.py's timer); the gain is the median
over rounds of torch ops / kernel within a round. Writes benchmarks/results/activations.json.

    python benchmarks/activations.py --threads 1     # 9 rounds
    python benchmarks/activations.py --tiny          # tiny shapes, 2 rounds: a smoke test, not a measurement
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
from pathlib import Path

import torch

import pcdist
from fusion import ACTIVATIONS, OUT, SHAPES, TINY_SHAPES, make_layers, ratio, time_interleaved


def trainers(shape, activation: str, B: int, T: int) -> dict:
    """The step of one network with the kernel ("kernel") and without it ("torch_ops")."""
    torch.manual_seed(0)
    layers = make_layers(shape, activation)
    d_in, _, d_out, _ = shape
    x = torch.randn(B, d_in)
    y = torch.nn.functional.one_hot(torch.randint(0, d_out, (B,)), d_out).float()
    steps = {}
    for name in ("kernel", "torch_ops"):
        net = pcdist.PCNetwork.from_layers(copy.deepcopy(layers))
        trainer = pcdist.PCTrainer(net, torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True), T=T, x_lr=0.1)
        if name == "torch_ops":
            os.environ["PCDIST_NATIVE"] = "0"
        try:
            trainer.stage(B)  # the kernel choice is made when the buffers are built
        finally:
            os.environ.pop("PCDIST_NATIVE", None)
        steps[name] = lambda trainer=trainer: trainer.step(x, y)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and two rounds: a smoke test")
    ap.add_argument("--out", type=Path, default=OUT, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    if args.tiny and args.out == OUT:  # a smoke test never writes over the results the docs quote
        args.out = OUT / "tiny"
    torch.set_num_threads(args.threads)
    shapes = {k: v for k, v in (TINY_SHAPES if args.tiny else SHAPES).items() if k in ("A", "M")}
    rounds, min_time = (2, 0.01) if args.tiny else (args.rounds, 0.3)
    result = {"config": {"threads": args.threads, "rounds": rounds, "tiny": args.tiny, "torch": torch.__version__},
              "shapes": {}}
    for shape_name, shape in shapes.items():
        variants = {f"{act}/{name}": step for act in ACTIVATIONS
                    for name, step in trainers(shape, act, 64, 20).items()}
        samples = time_interleaved(variants, rounds, min_time)
        for act in ACTIVATIONS:
            gain = ratio(samples, f"{act}/torch_ops", f"{act}/kernel")
            result["shapes"].setdefault(shape_name, {})[act] = {
                "seconds": {v: statistics.median(samples[f"{act}/{v}"]) for v in ("kernel", "torch_ops")},
                "gain": gain, "rounds": {v: samples[f"{act}/{v}"] for v in ("kernel", "torch_ops")}}
            med = result["shapes"][shape_name][act]["seconds"]
            print(f"shape {shape_name}  {act:9s}  kernel {med['kernel'] * 1e3:8.2f} ms  torch ops "
                  f"{med['torch_ops'] * 1e3:8.2f} ms  gain {gain:5.3f}x", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "activations.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'activations.json'}")


if __name__ == "__main__":
    main()
