"""CPU threads and contention, side by side: seconds per training step of the README quick start's network
(64-128-128-10 MLP, gelu, T = 20) and of the μPC preset (experiment=mupc_digits: 64 layers of width 128,
T = 64), with

  default   2 threads (the service's default here: cores / ranks), OpenMP's own wait policy (spin, then sleep)
  1 thread  trainer.threads=1
  passive   2 threads, OMP_WAIT_POLICY=PASSIVE (waiting threads sleep; what pcdist sets unless you do)

each on the machine as it is and with one more process holding a core (a busy loop). Conditions and
variants interleave round by round; every measurement is a process of its own, since OpenMP reads its
wait policy when torch loads it. Writes benchmarks/results/threads.json (every round) and prints medians.

    python benchmarks/threads.py            # 3 rounds
    python benchmarks/threads.py --tiny     # the quick start as is, 1 round, short: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results"
VARIANTS = {"default": ("2", {}), "1 thread": ("1", {}), "passive": ("2", {"OMP_WAIT_POLICY": "PASSIVE"})}
CONDITIONS = ("as is", "one core held")

CHILD = r'''
import statistics, sys, time
import torch, pcdist  # torch first: OpenMP keeps the wait policy of the environment this process was given
work, threads, budget = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
torch.set_num_threads(threads)
torch.manual_seed(0)
if work == "quickstart":
    specs, T, x_lr, energy, lr = pcdist.mlp_specs([64, 128, 128, 10], "gelu"), 20, 0.1, "ce", 2e-3
else:
    specs, T, x_lr, energy, lr = pcdist.mupc_specs(64, 128, 64, 10, "relu"), 64, 0.3, "se", 1e-2
net = pcdist.PCNetwork(specs, energy=energy, seed=0)
trainer = pcdist.PCTrainer(net, torch.optim.AdamW(net.parameters(), lr=lr, fused=True), T=T, x_lr=x_lr)
x, y = torch.rand(64, 64), torch.nn.functional.one_hot(torch.randint(0, 10, (64,)), 10).float()
for _ in range(2):
    trainer.step(x, y)
times, end = [], time.perf_counter() + budget
while len(times) < 3 or (time.perf_counter() < end and len(times) < 200):
    t0 = time.perf_counter()
    trainer.step(x, y)
    times.append(time.perf_counter() - t0)
print(statistics.median(times))
'''


def measure(work: str, threads: str, env: dict, budget: float) -> float:
    """Median seconds per step of ``work`` in a new process with ``threads`` torch threads and ``env``."""
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", CHILD, work, threads, str(budget)], env={**full, **env},
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="the quick start as is, one round: a smoke test")
    ap.add_argument("--out", type=Path, default=OUT, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    if args.tiny and args.out == OUT:  # a smoke test never writes over the results the docs quote
        args.out = OUT / "tiny"
    works, rounds, budget = (["quickstart"], 1, 0.2) if args.tiny else (["quickstart", "mupc"], args.rounds, 2.0)
    conditions = CONDITIONS[:1] if args.tiny else CONDITIONS  # --tiny holds no core: a smoke test of the plumbing
    samples: dict[str, list[float]] = {}
    for r in range(rounds):
        for condition in conditions:
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if condition != "as is" else None
            try:
                time.sleep(0.5)
                for work in works:
                    for name, (threads, env) in VARIANTS.items():
                        s = measure(work, threads, env, budget)
                        samples.setdefault(f"{work} | {condition} | {name}", []).append(s)
                        print(f"round {r}  {work:10s}  {condition:13s}  {name:8s}  {s * 1e3:10.2f} ms/step "
                              f"(load average {os.getloadavg()[0]:.1f})", flush=True)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    medians = {k: statistics.median(v) for k, v in samples.items()}
    print("medians, ms per step:")
    for k, v in medians.items():
        print(f"  {k:40s} {v * 1e3:10.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"config": {"cores": os.cpu_count(), "rounds": rounds, "tiny": args.tiny}, "seconds": medians,
              "rounds": samples}
    (args.out / "threads.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'threads.json'}")


if __name__ == "__main__":
    main()
