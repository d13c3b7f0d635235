"""Where DeepPCR beats the sequential loop: a map over depth, width and batch.

For each (L, width, batch) the forward pass (the chain's states: Newton + parallel
cyclic reduction vs the layer-by-layer loop) and the backward pass (the gradients
with respect to every state: one reduction vs the loop of vector-Jacobian products)
are timed side by side, interleaved, medians of a few repetitions, float32, tanh,
torch threads = cores. Cells whose DeepPCR work exceeds --max-gflop are skipped (on
this CPU they lose by orders of magnitude; the work is O(B D^3 L log L)). Writes
benchmarks/results/deeppcr.json and deeppcr.png (heat maps of the speed-up).

    python benchmarks/deeppcr.py            # the full map (a few minutes on 2 cores)
    python benchmarks/deeppcr.py --quick    # a corner of it
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from pcdist import deeppcr
from pcdist.engine.activations import Activation

OUT = Path(__file__).resolve().parent / "results"
ACT = Activation("tanh")


def loop_forward(w, b, x0):
    xs = [x0]
    for l in range(w.shape[0]):
        xs.append(torch.tanh(torch.addmm(b[l], xs[-1], w[l])))
    return xs


def loop_backward(w, states, g):
    """dLoss/dx_l for all l by the usual reverse loop, from stored states (as autograd would)."""
    grads = [g]
    for l in range(w.shape[0] - 1, -1, -1):
        u = states[l + 1]
        g = (g * (1 - u * u)) @ w[l].T
        grads.append(g)
    return grads


def median_time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def cell(L: int, D: int, B: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(L + D + B)
    w = torch.randn(L, D, D, generator=g) / math.sqrt(D)
    b = torch.randn(L, D, generator=g) * 0.1
    x0 = torch.randn(B, D, generator=g)
    res = deeppcr.solve((w, b, ACT), x0, raise_on_failure=False)
    states = res.states
    gout = torch.randn(B, D, generator=g)
    out = {"newton_iterations": res.iterations, "converged": res.converged}
    for name, seq, par in (
        ("forward", lambda: loop_forward(w, b, x0), lambda: deeppcr.solve((w, b, ACT), x0, raise_on_failure=False)),
        ("backward", lambda: loop_backward(w, states, gout), lambda: deeppcr.chain_vjp((w, b, ACT), states, gout)),
    ):
        t_seq, t_par = [], []
        for _ in range(reps):  # interleaved
            t_seq.append(median_time(seq, 1))
            t_par.append(median_time(par, 1))
        out[name] = {"loop_s": statistics.median(t_seq), "deeppcr_s": statistics.median(t_par),
                     "speedup": statistics.median(t_seq) / statistics.median(t_par)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-gflop", type=float, default=40.0, help="skip cells whose one scan exceeds this")
    ap.add_argument("--replot", action="store_true", help="redraw deeppcr.png from deeppcr.json")
    ap.add_argument("--out", type=Path, default=OUT, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    if args.replot:
        cells = json.loads((args.out / "deeppcr.json").read_text())["cells"]
        axes = [sorted({c[k] for c in cells}) for k in ("L", "width", "batch")]
        plot(cells, *axes, args.out / "deeppcr.png")
        return
    torch.set_num_threads(os.cpu_count() or 1)
    Ls = [64, 256] if args.quick else [64, 256, 1024, 4096]
    Ds = [4, 8] if args.quick else [4, 8, 16, 32, 64]
    Bs = [1, 16]
    results = []
    for B in Bs:
        for D in Ds:
            for L in Ls:
                gflop = 2 * B * D**3 * L * math.ceil(math.log2(L)) / 1e9
                row = {"L": L, "width": D, "batch": B, "scan_gflop": gflop}
                if gflop > args.max_gflop:
                    row["skipped"] = f"one scan is {gflop:.0f} GFLOP > --max-gflop {args.max_gflop:g}"
                else:
                    row.update(cell(L, D, B, args.reps))
                    print(f"B={B:2d} D={D:2d} L={L:4d}: forward {row['forward']['speedup']:6.2f}x "
                          f"({row['newton_iterations']} Newton it.)  backward {row['backward']['speedup']:6.2f}x",
                          flush=True)
                results.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    best = {p: max((r[p]["speedup"], r["L"], r["width"], r["batch"]) for r in results if p in r)
            for p in ("forward", "backward")}
    (args.out / "deeppcr.json").write_text(json.dumps({"threads": torch.get_num_threads(), "cells": results,
                                                       "best": best}, indent=1))
    plot(results, Ls, Ds, Bs, args.out / "deeppcr.png")
    for p, (s, L, D, B) in best.items():
        print(f"best {p}: {s:.2f}x at L={L}, width={D}, batch={B}")
    print(f"wrote {args.out / 'deeppcr.json'} and {args.out / 'deeppcr.png'}")


def plot(results, Ls, Ds, Bs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(len(Bs), 2, figsize=(10, 3.6 * len(Bs)), squeeze=False)
    for i, B in enumerate(Bs):
        for j, p in enumerate(("forward", "backward")):
            grid = np.full((len(Ds), len(Ls)), np.nan)
            for r in results:
                if r["batch"] == B and p in r:
                    grid[Ds.index(r["width"]), Ls.index(r["L"])] = r[p]["speedup"]
            ax = axes[i][j]
            im = ax.imshow(np.log2(grid), cmap="RdBu", vmin=-4, vmax=4, origin="lower", aspect="auto")
            for (a, c), v in np.ndenumerate(grid):
                ax.text(c, a, "skip" if np.isnan(v) else f"{v:.2g}x", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(Ls)), Ls)
            ax.set_yticks(range(len(Ds)), Ds)
            ax.set_xlabel("depth L")
            ax.set_ylabel("width")
            ax.set_title(f"{p}, batch {B}")
    fig.suptitle("DeepPCR speed-up over the sequential loop (float32, tanh)")
    fig.colorbar(im, ax=axes, label="log2 speed-up (blue: DeepPCR wins)")
    fig.savefig(path, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main()
