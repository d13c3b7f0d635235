"""What the training service's loop costs on top of the engine's own step, side by side.

The real torchrun starts P ranks (gloo, one thread each); each builds a
``pcdist.service.trainer.ServiceTrainer`` (mesh, synthetic data, model, optimizer) on the service's config with
``logger=none``, no evaluation and no checkpoint within the timed steps, and
instead of training straight through it alternates, round by round, on the same
network and optimizer:

  service  ``ServiceTrainer.train(until=...)`` for N steps: batch assembly, the stop-signal vote, the
           progress marks, logging every ``trainer.log_every`` steps (energy gather,
           metrics.jsonl, progress line), exactly as ``python train.py`` runs them
  engine   N bare ``PCTrainer.step(x, y, log=False)`` on one fixed batch, as
           benchmarks/scaling.py times it

Each variant's time per step is the slowest rank's (all start together after a
barrier); the order alternates between rounds. The ratio is the median over rounds of
service / engine within a round, so drift between rounds cancels out. Writes
service_K{K}_W{W}.json (every round's samples) and .png to --out.

    python benchmarks/service.py                                   # 2 ranks x 8 layers of width 512
    python benchmarks/service.py --layers-per-rank 1 --width 32 --rounds 2 --steps 3   # smoke test
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

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).resolve().parent / "results"


def overrides(args, P: int) -> list[str]:
    """The service config of the timed run: P ranks x K layers of width W (+ an input layer), as in scaling.py."""
    total = args.warmup + args.rounds * args.steps + 1  # never reaches the run's end inside a timed chunk
    return [f"model.dims=[{','.join([str(args.width)] * (P * args.layers_per_rank + 2))}]", "model.activation=tanh",
            "model.energy=se", "data=synthetic", "data.synthetic_train=2048", "data.synthetic_val=64",
            f"trainer.batch_size={args.batch}", f"pc.T={args.T}", f"parallel.micro_batches={args.micro_batches}",
            "logger=none", "trainer.progress=auto", f"trainer.max_steps={total}", f"trainer.eval_every={total}",
            f"trainer.ckpt_every={total}", f"trainer.log_every={args.log_every}", "optim.warmup_steps=0"]


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir

    from pcdist.distributed.parallel import init_distributed
    from pcdist.service.checks import check
    from pcdist.service.config import load_config
    from pcdist.service.trainer import ServiceTrainer

    P = int(os.environ["WORLD_SIZE"])
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        c = load_config(compose("config", overrides=overrides(args, P)))
    c.run_dir = args.run_dir
    check(c, P)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    init_distributed(device, timeout_s=300)
    trainer = ServiceTrainer(c, device, True)  # data, mesh, model, optimizer, logger: as train.py builds them
    try:
        trainer.start()
        x, y = trainer.batch(0)

        def service(n):
            trainer.train(until=trainer.step + n)

        def engine(n):
            for _ in range(n):
                trainer.engine.step(x, y, log=False)

        variants = {"service": service, "engine": engine}
        for run in variants.values():  # warm-up: caches, gloo pairs, the kernel
            run(args.warmup // 2 or 1)
        samples = {k: [] for k in variants}
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                variants[name](args.steps)
                mine = torch.tensor([(time.perf_counter() - t0) / args.steps], dtype=torch.float64)
                dist.all_reduce(mine, op=dist.ReduceOp.MAX)
                samples[name].append(float(mine))
        if dist.get_rank() == 0:
            Path(args.worker_out).write_text(json.dumps(samples))
    finally:
        trainer.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see scaling.py: torch 2.13 sometimes aborts in C++ static destructors at exit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=OUT, help="results folder (default benchmarks/results)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers-per-rank", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--T", type=int, default=20)
    ap.add_argument("--log-every", type=int, default=11, help="trainer.log_every (the service's default)")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=11, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=6)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "samples.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
               __file__, "--worker", "--worker-out", str(out), "--run-dir", str(Path(tmp) / "run"),
               *sys.argv[1:]]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"benchmark workers failed ({proc.returncode}):\n"
                             + "\n".join(proc.stderr.splitlines()[-80:]))
        samples = json.loads(out.read_text())
    ratios = [s / e for s, e in zip(samples["service"], samples["engine"])]
    res = {"config": {k: v for k, v in vars(args).items() if k not in ("worker", "worker_out", "run_dir", "out")},
           "step_s": {k: statistics.median(v) for k, v in samples.items()}, "rounds": samples,
           "ratio_per_round": ratios, "service/engine": statistics.median(ratios)}
    for r, (s, e) in enumerate(zip(samples["service"], samples["engine"])):
        print(f"round {r}: service {s * 1e3:8.1f} ms/step  engine {e * 1e3:8.1f} ms/step  ratio {s / e:6.3f}")
    print(f"service / engine: {res['service/engine']:.3f} (median of per-round ratios; medians "
          f"{res['step_s']['service'] * 1e3:.1f} / {res['step_s']['engine'] * 1e3:.1f} ms per step)")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"service_K{args.layers_per_rank}_W{args.width}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2))
    plot(res, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and {stem}.png")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, rounds = res["config"], res["rounds"]
    fig, (ax, rx) = plt.subplots(1, 2, figsize=(9, 3.6))
    for name, colour in (("engine", "tab:blue"), ("service", "tab:orange")):
        ax.plot([t * 1e3 for t in rounds[name]], "o-", color=colour, label=name)
    ax.set_xlabel("round")
    ax.set_ylabel("ms per training step (slowest rank)")
    ax.legend()
    rx.plot(res["ratio_per_round"], "o-", color="tab:green")
    rx.axhline(res["service/engine"], color="tab:green", ls="--", label=f"median {res['service/engine']:.3f}")
    rx.axhline(1.03, color="grey", ls=":", label="target 1.03")
    rx.set_xlabel("round")
    rx.set_ylabel("service / engine")
    rx.legend()
    fig.suptitle(f"Service loop vs engine step: {cfg['ranks']} ranks x {cfg['layers_per_rank']} layers of width "
                 f"{cfg['width']}, batch {cfg['batch']}, T={cfg['T']}, gloo, 1 thread per rank", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
