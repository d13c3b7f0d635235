"""An analytic model of layer-parallel PC training on 8 to 512 GPUs.

Prints (and writes benchmarks/results/scaling_model.json) the modelled time per
training step and the weak-scaling efficiency for a (data x layer) mesh, from the
message sizes the schedule actually sends. Assumptions, all overridable:

* GPU: H100 SXM, dense bf16 GEMMs at --tflops (default 400) effective.
* Per inference step a rank runs, for each of its K layers, one predict and one
  back-projection GEMM of 2*B*d^2 FLOPs each, plus elementwise work at --hbm GB/s
  (about 6 passes over B*d values per layer).
* Layer axis innermost: ranks r and r+1 sit in the same 8-GPU node (NVLink,
  --nvlink GB/s per direction, --nvlink-lat us) except every 8th boundary, which
  crosses InfiniBand (--ib GB/s per GPU, --ib-lat us).
* Per inference step each boundary carries two messages of B*d*bytes, one each way
  (the error of the upstream rank's last node down, the back-projection of the
  downstream rank's first layer up), posted together in one exchange once the
  boundary layers are done; the exchange overlaps the other 2K-3 GEMMs of the step
  (interior predictions and back-projections); only the excess shows.
* The feed-forward init is a pipeline over M = max(--micro-batches, P) micro-batches:
  (M + P - 1)/M times the one-slice time; GEMM efficiency is taken as constant.
* The data axis all-reduces the rank's K*d^2 weights once per batch (ring: 2(D-1)/D of
  the bytes over InfiniBand when D spans nodes), in one bucket per fused group, largest
  first: the K-1 interior layers' bucket overlaps the boundary layer's weight-gradient
  GEMM, the last one-layer bucket is exposed.

    python benchmarks/scaling_model.py --width 4096 --batch 256 --layers-per-rank 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results"


def step_time(P: int, D: int, a) -> dict:
    """Modelled seconds per training step of one (D x P) configuration."""
    B, d, K, T, by = a.batch, a.width, a.layers_per_rank, a.T, a.bytes
    M = max(a.micro_batches, P)  # at least one micro-batch per slice in flight
    gemm = 2 * B * d * d / (a.tflops * 1e12)  # one predict or back-projection GEMM of one layer
    elem = 6 * B * d * by / (a.hbm * 1e9)  # elementwise passes of one layer
    layer_eval = 2 * gemm + elem
    crosses_node = P > 8
    bw, lat = (a.ib, a.ib_lat) if crosses_node else (a.nvlink, a.nvlink_lat)
    msg = B * d * by
    t_msg = lat * 1e-6 + msg / (bw * 1e9) if P > 1 else 0.0
    hidden = max(0, 2 * K - 3) * gemm  # the step's GEMMs after the exchange is posted
    exposed = max(0.0, t_msg - hidden) + (a.launch_us * 1e-6 if P > 1 else 0.0)
    evals = (T + 1) * (K * layer_eval + exposed)
    t_micro = (lat * 1e-6 + msg / M / (bw * 1e9)) if P > 1 else 0.0  # one micro-batch hop
    init = (M + P - 1) / M * K * (gemm + elem / 3) + (P - 1) * t_micro  # one predict GEMM + activation per layer
    wbytes = K * d * d * by
    def ring(nbytes: float) -> float:
        return 2 * (D - 1) / D * nbytes / (a.ib * 1e9) + 2 * (D - 1) * a.ib_lat * 1e-6

    wgrad = 2 * B * d * d / (a.tflops * 1e12)  # one layer's weight-gradient GEMM
    allreduce = 0.0 if D == 1 else max(0.0, ring(wbytes * (K - 1) / K) - wgrad) + ring(wbytes / K)
    total = evals + init + allreduce
    return {"P": P, "D": D, "gpus": P * D, "layers": P * K, "message_MB": msg / 1e6,
            "exposed_comm_us_per_eval": exposed * 1e6, "exposed_allreduce_ms": allreduce * 1e3, "step_ms": total * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1024, help="samples per data replica")
    ap.add_argument("--layers-per-rank", type=int, default=8)
    ap.add_argument("--T", type=int, default=20)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--bytes", type=int, default=2, help="bytes per value (bf16: 2)")
    ap.add_argument("--tflops", type=float, default=400.0)
    ap.add_argument("--hbm", type=float, default=2500.0, help="effective HBM GB/s for elementwise passes")
    ap.add_argument("--nvlink", type=float, default=400.0, help="GB/s per direction")
    ap.add_argument("--nvlink-lat", type=float, default=5.0, help="us per NCCL p2p message")
    ap.add_argument("--ib", type=float, default=45.0, help="GB/s per GPU (400 Gb/s NDR)")
    ap.add_argument("--ib-lat", type=float, default=10.0)
    ap.add_argument("--launch-us", type=float, default=10.0, help="host cost of posting one exchange")
    ap.add_argument("--out", type=Path, default=OUT, help="results folder (default benchmarks/results)")
    a = ap.parse_args()
    base = step_time(1, 1, a)["step_ms"]
    rows = []
    for gpus in (8, 16, 32, 64, 128, 256, 512):
        for P in (8, 32, 128, 512):
            if P <= gpus and gpus % P == 0:
                r = step_time(P, gpus // P, a)
                r["weak_scaling_efficiency"] = base / r["step_ms"]
                rows.append(r)
    print(f"model: width {a.width}, {a.batch} samples per replica, {a.layers_per_rank} layers per rank, T={a.T}, "
          f"bf16; one GPU, {a.layers_per_rank} layers: {base:.2f} ms/step")
    print(f"{'GPUs':>5} {'data':>5} {'layer':>5} {'layers':>6} {'msg MB':>7} {'exposed us/eval':>15} "
          f"{'all-reduce ms':>13} {'step ms':>8} {'efficiency':>10}")
    for r in rows:
        print(f"{r['gpus']:5d} {r['D']:5d} {r['P']:5d} {r['layers']:6d} {r['message_MB']:7.2f} "
              f"{r['exposed_comm_us_per_eval']:15.1f} {r['exposed_allreduce_ms']:13.2f} {r['step_ms']:8.2f} "
              f"{r['weak_scaling_efficiency']:10.3f}")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "scaling_model.json").write_text(json.dumps({"assumptions": {k: v for k, v in vars(a).items()
                                                                          if k != "out"},
                                                          "one_gpu_ms": base, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
