"""Held-out accuracy in fp32 against bf16 (and tf32) through the service, per network and seed.

``trainer.precision=bf16`` runs the value nodes, errors and matmuls in bfloat16 on float32 master
weights (docs/gpu.md). The issue's bar: on the digits MLP, the digits CNN and the 64-layer μPC the
accuracy stays within 0.5 points of float32. Each row is two service runs from the same seed that
differ only in trainer.precision (tf32 too on a GPU; on a CPU tf32 is float32). bfloat16 runs on
CPUs as well, so this is measurable anywhere (slowly: a CPU's bfloat16 GEMMs are emulated on many).

    python benchmarks/precision.py                    # the three networks, seeds 0 to 7
    python benchmarks/precision.py --networks mlp --seeds 0
    python benchmarks/precision.py --tiny             # a smoke test of the script (not a measurement)

Writes benchmarks/results/precision.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path

import torch

import pcdist

OUT = Path(__file__).resolve().parent / "results"
NETWORKS = {"mlp": {}, "cnn": {"model": "cnn"}, "mupc64": {"experiment": "mupc_digits"}}


def run(cfg: dict, precision: str, seed: int, root: Path, tiny: bool) -> float:
    trainer = {"precision": precision, "seed": seed, "progress": "off", **({"max_steps": 12, "eval_every": 12,
                                                                            "ckpt_every": 12} if tiny else {})}
    out = pcdist.train({**cfg, "logger": "none", "run_dir": str(root / f"{precision}-{seed}"),
                        "trainer": {**cfg.get("trainer", {}), **trainer}})
    return float(out["val/accuracy"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--networks", nargs="+", choices=list(NETWORKS), default=list(NETWORKS))
    ap.add_argument("--seeds", nargs="+", type=int, default=list(range(8)))
    ap.add_argument("--tiny", action="store_true", help="12 steps each: a smoke test, not a measurement")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.tiny and args.out == OUT:  # a smoke test never writes over the results the docs quote
        args.out = OUT / "tiny"
    precisions = ["fp32", "bf16"] + (["tf32"] if torch.cuda.is_available() else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.networks:
            cfg = dict(NETWORKS[name])
            if args.tiny and name == "mupc64":
                cfg["model"] = {"name": "mupc", "depth": 6}
                cfg.pop("experiment")
            for seed in args.seeds:
                acc = {p: run(cfg, p, seed, Path(tmp) / name, args.tiny) for p in precisions}
                rows.append({"network": name, "seed": seed, **acc,
                             **{f"{p}-fp32": acc[p] - acc["fp32"] for p in precisions[1:]}})
                print(f"{name} seed {seed}: " + "  ".join(f"{p} {acc[p]:.4f}" for p in precisions)
                      + "  " + "  ".join(f"{p} - fp32 {acc[p] - acc['fp32']:+.4f}" for p in precisions[1:]),
                      flush=True)
    summary = []
    for name in args.networks:
        for p in precisions[1:]:
            d = [100 * r[f"{p}-fp32"] for r in rows if r["network"] == name]
            mean = statistics.fmean(d)
            se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else None  # (one seed: none; NaN is no JSON)
            summary.append({"network": name, "precision": p, "seeds": len(d), "mean_points": mean, "se_points": se,
                            "min_points": min(d), "max_points": max(d)})
            print(f"{name}: {p} - fp32 over {len(d)} seeds: {mean:+.2f} points (standard error "
                  f"{'-' if se is None else f'{se:.2f}'}; "
                  f"{min(d):+.2f} to {max(d):+.2f})", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "precision_tiny" if args.tiny else "precision"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    result = {"device": device, "torch": torch.__version__, "rows": rows, "summary": summary}
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / (stem + '.json')}")


if __name__ == "__main__":
    main()
