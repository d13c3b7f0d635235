"""The PC modes: what they cost against the supervised step, and what they learn on the bundled digits.

speed (side by side, interleaved rounds, float32, batch 64, T = 20, one process):
  supervised    step(x, y): both ends clamped (today's path)
  generative    step(onehot, data) on the same network: both ends clamped, so the same work
  unsupervised  step(None, data): h_0 free under its prior (layer 1 back-projects, its prediction moves)
  precision     supervised with every layer's precision != 1 (weighted in each kind's error pass)
on shape A (an MLP 64 -> 32 x 128 -> 10, tanh) and M (μPC of the same shape, relu). Each ratio is the
median over rounds of the ratio within a round, so machine drift between rounds cancels out.

learning (digits, the service's split; figures with the settings of the presets and tests):
  unsupervised  held-out reconstruction error per pixel against PCA with k = 10 components: a linear
                decoder, a decoder with a hidden layer of value nodes (precisions [1, 0.01], the preset
                unsupervised_digits) and an MLP decoder in one PC layer (the module kind)
  generative    held-out accuracy of classification by inference (h_0 free, argmax) for a linear decoder
                and a hidden-layer decoder (the preset generative_digits), beside the nearest class mean
                and LDA on the same split
Writes benchmarks/results/modes.json, modes_samples.png and modes_reconstructions.png.

    python benchmarks/modes.py                 # both (about 10 minutes on 2 cores)
    python benchmarks/modes.py --only speed    # or --only learning (the other part's figures are kept)
    python benchmarks/modes.py --tiny          # a smoke test of the script (not a measurement)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import pcdist
from pcdist.data import load_digits
from pcdist.engine.modes import classify, generate, reconstruct
from pcdist.service.validate import draw_grid

OUT = Path(__file__).resolve().parent / "results"
SHAPES = {"A": (64, 128, 32, 10, "mlp"), "M": (64, 128, 32, 10, "mupc")}  # (input, width, hidden layers, output)
TINY = {"A": (16, 16, 3, 4, "mlp"), "M": (16, 16, 3, 4, "mupc")}


def network(shape, precision=None, prior=None):
    d_in, width, hidden, d_out, model = shape
    specs = pcdist.mlp_specs([d_in, *[width] * hidden, d_out], "tanh") if model == "mlp" else \
        pcdist.mupc_specs(d_in, width, hidden + 1, d_out, "relu")
    return pcdist.PCNetwork(specs, energy="se", seed=0, precision=precision, prior=prior)


def speed(shapes, rounds: int, steps: int, B: int = 64, T: int = 20) -> dict:
    """Seconds per step of each variant, interleaved; ratios to the supervised step per round."""
    out = {}
    for name, shape in shapes.items():
        L = shape[2] + 1
        d_in, d_out = shape[0], shape[3]
        nets = {"supervised": network(shape), "generative": network(shape),
                "unsupervised": network(shape, prior=pcdist.Prior(1.0)),
                "precision": network(shape, precision=[0.5 + 0.01 * l for l in range(L)])}
        trainers = {k: pcdist.PCTrainer(n, torch.optim.AdamW(n.parameters(), lr=1e-4, fused=True), T=T, x_lr=0.1)
                    for k, n in nets.items()}
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(B, d_in, generator=g), torch.randn(B, d_out, generator=g)
        onehot = torch.eye(d_in)[torch.randint(0, d_in, (B,), generator=g)]
        calls = {"supervised": (x, y), "generative": (onehot, y), "unsupervised": (None, y), "precision": (x, y)}
        for k, tr in trainers.items():  # warm up: build stages, the kernel, caches
            for _ in range(3):
                tr.step(*calls[k], log=False)
        samples = {k: [] for k in trainers}
        for _ in range(rounds):
            for k, tr in trainers.items():
                t0 = time.perf_counter()
                for _ in range(steps):
                    tr.step(*calls[k], log=False)
                samples[k].append((time.perf_counter() - t0) / steps)
        ratios = {f"{k}/supervised": statistics.median(a / b for a, b in zip(samples[k], samples["supervised"]))
                  for k in trainers if k != "supervised"}
        out[name] = {"step_s": {k: statistics.median(v) for k, v in samples.items()}, "ratios": ratios,
                     "samples": samples}
        print(f"shape {name}: " + ", ".join(f"{k} {1e3 * statistics.median(v):.2f} ms" for k, v in samples.items())
              + " | " + ", ".join(f"{k} {r:.3f}" for k, r in ratios.items()), flush=True)
    return out


def pca_error(x_tr, x_va, k):
    mean = x_tr.mean(0)
    _, _, vt = torch.linalg.svd(x_tr - mean, full_matrices=False)
    p = vt[:k]
    return float((((x_va - mean) @ p.T @ p + mean - x_va) ** 2).mean())


def fit(net, data, mode, steps, T, x_lr, lr, x_momentum=0.0, wd=0.0):
    x_tr, l_tr = data
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=wd)
    tr = pcdist.PCTrainer(net, opt, T=T, x_lr=x_lr, x_momentum=x_momentum,
                          scheduler=pcdist.warmup_cosine(opt, min(20, steps), steps))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(x_tr), (64,), generator=g)
        tr.step(torch.eye(10)[l_tr[idx]] if mode == "generative" else None, x_tr[idx], log=False)
    return tr


def learning(scale: float, out_dir: Path, tag: str = "") -> dict:
    torch.manual_seed(0)
    d = load_digits().flat()
    x_tr, l_tr, x_va, l_va = d.x_train, d.y_train, d.x_val, d.y_val
    data = (x_tr, l_tr)
    n = lambda steps: max(2, int(steps * scale))  # noqa: E731  (training steps and inference steps alike)
    out: dict = {"pca_k10": pca_error(x_tr, x_va, 10)}
    means = torch.stack([x_tr[l_tr == c].mean(0) for c in range(10)])
    out["nearest_class_mean"] = float((((x_va[:, None] - means[None]) ** 2).sum(-1).argmin(1) == l_va).float().mean())
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

    out["lda"] = float(LinearDiscriminantAnalysis().fit(x_tr.numpy(), l_tr.numpy()).score(x_va.numpy(), l_va.numpy()))

    def recon(tr, T):
        return float(((reconstruct(tr, x_va, T=T) - x_va) ** 2).mean())

    t0 = time.perf_counter()
    linear = fit(pcdist.PCNetwork(pcdist.mlp_specs([10, 64], "identity"), prior=pcdist.Prior(0.1), seed=0), data,
                 "unsupervised", n(1000), 20, 0.1, 1e-2)
    out["unsupervised_linear"] = {"mse": recon(linear, n(200)), "seconds": time.perf_counter() - t0}
    t0 = time.perf_counter()
    hidden = fit(pcdist.PCNetwork(pcdist.mlp_specs([10, 128, 64], "tanh"), prior=pcdist.Prior(1e-3), seed=0,
                                  precision=[1.0, 0.01]), data, "unsupervised", n(3000), n(100), 0.3, 3e-3,
                 x_momentum=0.9)
    out["unsupervised_hidden_value_nodes"] = {"mse": recon(hidden, n(1000)), "seconds": time.perf_counter() - t0}
    t0 = time.perf_counter()
    mlp = pcdist.AnyModule(nn.Sequential(nn.Linear(10, 128), nn.Tanh(), nn.Linear(128, 64)))
    module = fit(pcdist.PCNetwork.from_layers([mlp], input_shape=(10,), prior=pcdist.Prior(0.01)), data,
                 "unsupervised", n(1000), n(50), 0.2, 3e-3, x_momentum=0.5)
    out["unsupervised_mlp_in_one_layer"] = {"mse": recon(module, n(400)), "seconds": time.perf_counter() - t0}
    for k in ("unsupervised_linear", "unsupervised_hidden_value_nodes", "unsupervised_mlp_in_one_layer"):
        out[k]["ratio_to_pca"] = out[k]["mse"] / out["pca_k10"]

    def accuracy(tr, T):
        return float((classify(tr, x_va, T=T) == l_va).float().mean())

    t0 = time.perf_counter()
    glin = fit(pcdist.PCNetwork(pcdist.mlp_specs([10, 64], "identity"), prior=pcdist.Prior(1.0, "uniform"), seed=0),
               data, "generative", n(1000), 1, 0.1, 1e-2)
    glin.x_lr = 0.01
    out["generative_linear"] = {"accuracy": accuracy(glin, n(500)), "seconds": time.perf_counter() - t0}
    t0 = time.perf_counter()
    ghid = fit(pcdist.PCNetwork(pcdist.mlp_specs([10, 128, 64], "tanh"), prior=pcdist.Prior(1.0, "uniform"), seed=0),
               data, "generative", n(1500), n(20), 0.05, 3e-3)
    out["generative_hidden"] = {"accuracy": accuracy(ghid, n(200)), "seconds": time.perf_counter() - t0}
    out_dir.mkdir(parents=True, exist_ok=True)
    draw_grid([generate(ghid, torch.eye(10)).reshape(-1, 1, 8, 8)], ["generated"],
              "generative_digits: the image generated for each class (0..9)", out_dir / f"modes{tag}_samples.png")
    draw_grid([x_va[:10].reshape(-1, 1, 8, 8), reconstruct(hidden, x_va[:10], T=n(1000)).reshape(-1, 1, 8, 8),
               reconstruct(module, x_va[:10], T=n(400)).reshape(-1, 1, 8, 8)],
              ["held-out", "value-node decoder", "MLP in one layer"],
              "unsupervised, latent k = 10: held-out digits and their reconstructions",
              out_dir / f"modes{tag}_reconstructions.png")
    for k, v in out.items():
        print(k, v, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["speed", "learning"])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and budgets: a smoke test, not a measurement")
    ap.add_argument("--out", type=Path, default=OUT, help="results folder")
    args = ap.parse_args()
    if args.tiny and args.out == OUT:  # a smoke test never writes over the results the docs quote
        args.out = OUT / "tiny"
    result = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    if args.only != "learning":
        result["speed"] = speed(TINY if args.tiny else SHAPES, 2 if args.tiny else args.rounds, 2 if args.tiny else 10)
    if args.only != "speed":
        result["learning"] = learning(0.01 if args.tiny else 1.0, args.out, "_tiny" if args.tiny else "")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("modes_tiny.json" if args.tiny else "modes.json")
    if args.only and path.exists():  # keep the other part's figures
        result = {**json.loads(path.read_text()), **result}
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
