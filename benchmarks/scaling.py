"""Weak scaling of layer parallelism on CPU with gloo, through the real torchrun.

Each rank owns K layers of width W (one torch thread per rank). The single rank runs
an input layer + K layers, P ranks an input layer + P*K layers (the input layer's
input is clamped, so it costs almost nothing during inference); ideal weak scaling
keeps the step time constant:
    efficiency = time(1 rank, K layers) / time(P ranks, P*K layers).
Ranks on one host also slow each other down through shared caches and memory
bandwidth, whatever they compute; "load-adjusted" efficiency therefore compares
against P independent 1-rank jobs running at the same time:
    adjusted = time(P independent ranks, K layers each) / time(P ranks, P*K layers).
Also reported: the fraction of the step each rank spends blocked on boundary
messages, and the same P-rank run with the exchange as one batch_isend_irecv per
step (NCCL's schedule) instead of gloo's receives posted a step ahead. Variants
alternate round by round; medians are compared. Writes
benchmarks/results/scaling_K{K}_W{W}.json and .png.

    python benchmarks/scaling.py                  # P = 1, 2 on a 2-core machine
    python benchmarks/scaling.py --ranks 1 2 4    # more cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results"


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import pcdist
    from pcdist.distributed.parallel import Parallel, ParallelDims, init_distributed

    torch.set_num_threads(1)
    init_distributed(timeout_s=120)
    P = dist.get_world_size()
    L = (1 if args.independent else P) * args.layers_per_rank + 1
    specs = pcdist.mlp_specs([args.width] * (L + 1), "tanh")
    if args.independent:  # every rank trains its own K-layer network: the same load, no messages
        par = Parallel.single(L)
    else:
        par = Parallel.from_mesh(ParallelDims(1, P), specs, micro_batches=args.micro_batches)
        par.prepost = not args.one_batch
    net = pcdist.PCNetwork(specs, layers=par.layers, seed=0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    tr = pcdist.PCTrainer(net, opt, T=args.T, x_lr=0.1, parallel=par)
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    for _ in range(2):
        tr.step(x, y, log=False)
    dist.barrier()
    par.comm_seconds = 0.0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        tr.step(x, y, log=False)
    dist.barrier()
    total = time.perf_counter() - t0
    res = torch.tensor([total / args.steps, par.comm_seconds / total], dtype=torch.float64)
    gathered = [torch.zeros_like(res) for _ in range(P)]
    dist.all_gather(gathered, res)
    if dist.get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps({
            "step_s": max(float(g[0]) for g in gathered),
            "comm_fraction_per_rank": [float(g[1]) for g in gathered],
            "layers": L,
        }))
    dist.destroy_process_group()
    # The results are written; leave without running C++ static destructors, where torch
    # 2.13 sometimes aborts ("terminate called without an active exception", ~1 exit in
    # 8 for tiny runs on this VM, before or after this project's changes).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(P: int, args, out: str, independent: bool = False, one_batch: bool = False) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={P}", __file__,
           "--worker", "--worker-out", out, *(["--independent"] if independent else []),
           *(["--one-batch"] if one_batch else []), "--layers-per-rank", str(args.layers_per_rank),
           "--width", str(args.width), "--batch", str(args.batch), "--T", str(args.T), "--steps", str(args.steps),
           "--micro-batches", str(args.micro_batches)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    for attempt in (1, 2):
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode == 0:
            return json.loads(Path(out).read_text())
        # Should a worker still fail (e.g. a gloo abort), one retry, said out loud.
        print(f"warning: {'independent ' if independent else ''}P={P} run failed (exit {proc.returncode}, "
              f"attempt {attempt}); last stderr lines:\n" + "\n".join(proc.stderr.splitlines()[-15:]),
              file=sys.stderr, flush=True)
    raise RuntimeError(f"benchmark worker failed twice: {' '.join(cmd)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--independent", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--one-batch", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=OUT, help="results folder (default benchmarks/results)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers-per-rank", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--T", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, default=4)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    runs: dict[int, list[dict]] = {P: [] for P in args.ranks}
    loaded: dict[int, list[dict]] = {P: [] for P in args.ranks}
    one_batch: dict[int, list[dict]] = {P: [] for P in args.ranks}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for P in args.ranks:
                runs[P].append(launch(P, args, f"{tmp}/P{P}_{r}.json"))
                if P > 1:
                    loaded[P].append(launch(P, args, f"{tmp}/I{P}_{r}.json", independent=True))
                    one_batch[P].append(launch(P, args, f"{tmp}/B{P}_{r}.json", one_batch=True))
                print(f"round {r} P={P}: {runs[P][-1]['step_s'] * 1e3:8.1f} ms/step" + (
                      f"  (one-batch exchange {one_batch[P][-1]['step_s'] * 1e3:8.1f} ms/step, "
                      f"{P} independent 1-rank jobs: {loaded[P][-1]['step_s'] * 1e3:8.1f} ms/step)" if P > 1 else ""),
                      flush=True)
    base = statistics.median(x["step_s"] for x in runs[args.ranks[0]])
    table = {}
    for P in args.ranks:
        t = statistics.median(x["step_s"] for x in runs[P])
        t_loaded = statistics.median(x["step_s"] for x in loaded[P]) if P > 1 else base
        comm = statistics.median(max(x["comm_fraction_per_rank"]) for x in runs[P])
        t_one = statistics.median(x["step_s"] for x in one_batch[P]) if P > 1 else base
        table[P] = {"layers": runs[P][0]["layers"], "step_s": t, "efficiency": base / t,
                    "independent_step_s": t_loaded, "load_adjusted_efficiency": t_loaded / t, "max_comm_fraction": comm,
                    "one_batch_step_s": t_one, "one_batch_efficiency": base / t_one}
        print(f"P={P}: {table[P]['layers']:4d} layers x {args.width}  {t * 1e3:8.1f} ms/step  "
              f"efficiency {base / t:5.3f}  load-adjusted {t_loaded / t:5.3f}  "
              f"blocked on messages {comm * 100:5.1f}% of the step  "
              f"(one-batch exchange: {t_one * 1e3:8.1f} ms/step, efficiency {base / t_one:5.3f})")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"scaling_K{args.layers_per_rank}_W{args.width}"
    config = {k: v for k, v in vars(args).items()
              if k not in ("worker", "independent", "one_batch", "worker_out", "out")}
    stem.with_suffix(".json").write_text(json.dumps({"config": config, "ranks": table}, indent=2))
    plot(table, args, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and {stem}.png")


def plot(table: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ps = sorted(table)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([str(P) for P in Ps], [table[P]["step_s"] * 1e3 for P in Ps], color="tab:orange", label="step")
    ax.bar([str(P) for P in Ps], [table[P]["step_s"] * table[P]["max_comm_fraction"] * 1e3 for P in Ps],
           color="tab:blue", label="blocked on messages")
    for i, P in enumerate(Ps):
        ax.text(i, table[P]["step_s"] * 1e3, f"eff {table[P]['efficiency']:.2f}", ha="center", va="bottom")
    ax.set_xlabel(f"ranks (each owns {args.layers_per_rank} layers of width {args.width})")
    ax.set_ylabel("ms per training step")
    ax.set_title("Weak scaling, gloo on CPU, 1 thread per rank")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
