"""Does it learn at depth? μPC vs plain PC vs backprop on digits, 8 to 128 layers.

For each depth L (weight layers), on scikit-learn's digits (1437 training, 360 held-out
images, batch 64), one training run per method from the same seed:

  mupc_pc   a μPC network (pcdist.mupc_specs: residual layers of width 128, relu), trained
            with PC: T = L inference steps (from the feed-forward init the output error
            reaches one layer further down per step), value step 0.3 per sample, Adam 1e-2
  mlp_pc    a plain MLP of the same depth and width trained with PC: the service's MLP
            recipe (gelu, cross-entropy, AdamW 2e-3 with warm-up + cosine, value step 0.1)
            with T = L; ``--mlp-init orthogonal`` for orthogonal weights
  mupc_bp   the same μPC network (same initial weights) trained by backprop on the same
            energy (squared error), Adam 1e-2

Reported: held-out accuracy after ``--steps`` training steps and the median wall time of
a training step (the methods run one after another; run nothing else meanwhile). Writes
benchmarks/results/depth.json and depth.png.

    python benchmarks/depth.py                      # depths 8 32 64 128 (about an hour on 2 cores)
    python benchmarks/depth.py --depths 8 32        # a subset
    python benchmarks/depth.py --tiny               # tiny sizes: a smoke test of the script
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import pcdist
from pcdist.service.data import load_digits, one_hot

OUT = Path(__file__).resolve().parent / "results"
METHODS = ("mupc_pc", "mlp_pc", "mupc_bp")


def batches(n: int, B: int, steps: int, seed: int):
    """Index batches of epoch-wise permutations (the last partial batch of an epoch dropped)."""
    g = torch.Generator().manual_seed(seed)
    perm, i = torch.randperm(n, generator=g), 0
    for _ in range(steps):
        if i + B > n:
            perm, i = torch.randperm(n, generator=g), 0
        yield perm[i : i + B]
        i += B


def run(method: str, depth: int, args, data) -> dict:
    d = data.flat()
    x_tr, l_tr, x_va, l_va = d.x_train, d.y_train, d.x_val, d.y_val
    torch.manual_seed(args.seed)
    W = args.width
    if method == "mlp_pc":
        net = pcdist.PCNetwork.from_dims([64] + [W] * (depth - 1) + [10], activation="gelu", energy="ce",
                                         init=args.mlp_init, seed=args.seed)
        opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-4)
        sched = pcdist.warmup_cosine(opt, min(22, args.steps), args.steps)
        trainer = pcdist.PCTrainer(net, opt, T=depth, x_lr=0.1, scheduler=sched)
        step = lambda x, y: trainer.step(x, y, log=False)  # noqa: E731
        model = net
    else:
        net = pcdist.PCNetwork(pcdist.mupc_specs(64, W, depth, 10, "relu"), energy="se", seed=args.seed)
        if method == "mupc_pc":
            trainer = pcdist.PCTrainer(net, torch.optim.Adam(net.parameters(), lr=1e-2), T=depth, x_lr=0.3)
            step = lambda x, y: trainer.step(x, y, log=False)  # noqa: E731
            model = net
        else:
            model = nn.Sequential(*net.to_layers())  # the same initial weights, as plain modules
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)

            def step(x, y):
                loss = 0.5 * (y - model(x)).square().sum(1).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

    times = []
    for idx in batches(len(x_tr), args.batch, args.steps, args.seed):
        x, y = x_tr[idx], one_hot(l_tr[idx], 10)
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
    with torch.no_grad():
        out = model(x_va)
    acc = float((out.argmax(1) == l_va).float().mean()) if torch.isfinite(out).all() else float("nan")
    return {"accuracy": acc, "step_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", type=int, nargs="+", default=[8, 32, 64, 128])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--steps", type=int, default=400, help="training steps of batch --batch")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mlp-init", choices=["default", "orthogonal"], default="default")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--tiny", action="store_true", help="depths 3 and 4, width 8, 3 steps: a smoke test")
    ap.add_argument("--out", type=Path, default=OUT, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    if args.tiny and args.out == OUT:  # a smoke test never writes over the results the docs quote
        args.out = OUT / "tiny"
    if args.tiny:
        args.depths, args.width, args.steps = [3, 4], 8, 3
    torch.set_num_threads(1 if args.tiny else os.cpu_count() or 1)
    data = load_digits()
    rows = {}
    for depth in args.depths:
        rows[depth] = {}
        for method in args.methods:
            rows[depth][method] = r = run(method, depth, args, data)
            print(f"depth {depth:4d}  {method:8s}  accuracy {r['accuracy']:.4f}  {r['step_s'] * 1e3:9.1f} ms/step",
                  flush=True)
        if "mupc_pc" in rows[depth] and "mupc_bp" in rows[depth]:
            gap = rows[depth]["mupc_bp"]["accuracy"] - rows[depth]["mupc_pc"]["accuracy"]
            rows[depth]["bp_minus_pc_points"] = 100 * gap
            print(f"depth {depth:4d}  backprop - μPC: {100 * gap:+.2f} points", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "depth" if args.mlp_init == "default" else f"depth_{args.mlp_init}"
    result = {"config": {"width": args.width, "steps": args.steps, "batch": args.batch, "seed": args.seed,
                         "mlp_init": args.mlp_init, "threads": torch.get_num_threads(), "torch": torch.__version__,
                         "machine": platform.machine(), "tiny": args.tiny},
              "depths": {str(d): r for d, r in rows.items()}}
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    plot(rows, args, args.out / f"{stem}.png")
    print(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.png')}")


def plot(rows: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted(rows)
    labels = {"mupc_pc": "μPC, PC", "mlp_pc": f"plain MLP, PC ({args.mlp_init} init)", "mupc_bp": "μPC, backprop"}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for m, style in zip(METHODS, ("s-", "o--", "^:")):
        ms = [d for d in depths if m in rows[d]]
        if not ms:
            continue
        a1.plot(ms, [rows[d][m]["accuracy"] for d in ms], style, label=labels[m])
        a2.plot(ms, [rows[d][m]["step_s"] * 1e3 for d in ms], style, label=labels[m])
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("depth L (weight layers)")
        ax.grid(True, which="both", alpha=0.3)
    a1.set_ylim(0, 1)
    a1.set_ylabel("held-out accuracy")
    a1.set_title(f"digits, width {args.width}, {args.steps} steps of batch {args.batch}")
    a1.legend()
    a2.set_yscale("log")
    a2.set_ylabel("ms per training step")
    a2.set_title("time per step (PC: T = L inference steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
