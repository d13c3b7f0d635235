"""PC against its backprop twin for every shipped supervised preset: held-out accuracy and time per training step.

For each preset (the default digits MLP and every supervised conf/experiment/ file; the twin trains the
supervised feed-forward map, so the generative and unsupervised presets have none) two service runs from
the same seed, one with the preset's ``pc.algorithm=pc`` and one with ``pc.algorithm=bp`` (the
same network, data, optimizer, schedule and seed trained by autograd; pcdist/service/backprop.py),
each for a step budget that fits a 2-core CPU (``BUDGET``: steps and batch size; the warm-up is
scaled with the steps), one torch thread. Presets whose data files are not in ``--data-root`` run on a stand-in:
the bundled digits resized to the preset's input shape (1 x 28 x 28 for MNIST / FashionMNIST,
3 x 32 x 32 for CIFAR), keeping the preset's network (100 outputs for CIFAR-100). Accuracy is
then a statement about the method on the stand-in, not the published number.

Time per step: after the runs, the PC step (PCTrainer) and the backprop step (BackpropTrainer)
of the preset's network on one batch are timed side by side in this process, in interleaved
rounds (PC then BP, then BP then PC), and the medians reported with their ratio.

    python benchmarks/backprop.py                          # every supervised preset (about 20 minutes on 2 cores)
    python benchmarks/backprop.py --presets default pcx_mnist
    python benchmarks/backprop.py --tiny                   # a smoke test of the script (seconds)

Writes benchmarks/results/backprop.json and backprop.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import pcdist
from pcdist.service.autostep import method_options, resolve_x_lr
from pcdist.service.backprop import BackpropTrainer
from pcdist.service.config import CONF_DIR, make_config, network_options
from pcdist.service.data import DataError, Dataset, check_files, load_dataset, one_hot
from pcdist.service.models import model_specs

OUT = Path(__file__).resolve().parent / "results"
PRESETS = ["default"] + sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
# preset -> (training steps, batch size) of both runs; None keeps the preset's batch size
BUDGET = {"default": (660, None), "mupc_digits": (100, None), "deep_narrow": (30, None),
          "pcx_mnist": (300, None), "pcx_fashion_mnist": (300, None),
          "pcx_vgg5_cifar10": (8, 16), "pcx_vgg5_cifar100": (8, 16), "pcx_vgg7_cifar10": (8, 16),
          "pcx_vgg7_cifar100": (8, 16)}
SHAPES = {"mnist": (1, 28, 28), "fashion_mnist": (1, 28, 28), "cifar10": (3, 32, 32), "cifar100": (3, 32, 32)}
CLASSES = {"cifar100": 100}


def preset_config(name: str, extra: dict | None = None):
    return make_config({**({} if name == "default" else {"experiment": name}), **(extra or {})})


def stand_in(shape: tuple[int, ...], classes: int) -> Dataset:
    """The bundled digits resized (bilinear) to ``shape`` [C, H, W], channels repeated; labels 0..9 of ``classes``."""
    d = load_dataset("digits")

    def resize(x):
        x = F.interpolate(x, size=shape[1:], mode="bilinear", align_corners=False)
        return x.repeat(1, shape[0], 1, 1).contiguous()

    return Dataset(resize(d.x_train), d.y_train, resize(d.x_val), d.y_val, classes)


def preset_data(c, root: str | None) -> tuple[Dataset | None, str]:
    """(data to pass, a description): the preset's own files if present, else the stand-in."""
    name = c.data.name
    if name not in SHAPES:
        return None, name
    try:
        check_files(name, root or c.data.root)
        return load_dataset(name, root or c.data.root), name
    except (DataError, ValueError, TypeError):
        shape = SHAPES[name]
        where = f"digits resized to {'x'.join(map(str, shape))} (no {name} files)"
        return stand_in(shape, CLASSES.get(name, 10)), where


def run_pair(name: str, steps: int, batch: int | None, data, tmp: Path, tiny: bool) -> dict:
    """One PC and one BP service run of the preset with the budget; their final accuracies."""
    c = preset_config(name)
    B = batch or c.trainer.batch_size
    frac = c.optim.warmup_steps / c.trainer.max_steps if c.trainer.epochs is None else 0.1  # VGG presets: 10%
    warm = round(frac * steps)
    extra = {"trainer.max_steps": steps, "trainer.epochs": None, "trainer.batch_size": B,
             "trainer.eval_every": max(1, steps // 4), "trainer.log_every": max(1, steps // 12),
             "trainer.ckpt_every": steps, "trainer.progress": "off", "optim.warmup_steps": min(warm, steps),
             "logger": "none", "trainer.threads": 1}
    if tiny:
        extra.update({"pc.T": min(c.pc.T, 3), "logger.plots": False})  # each run's metric plots: not looked at
    out = {"steps": steps, "batch": B}
    for algo in ("pc", "bp"):
        cfg = {**({} if name == "default" else {"experiment": name}), **extra, "pc.algorithm": algo if algo == "bp"
               else c.pc.algorithm, "run_dir": str(tmp / f"{name}-{algo}")}
        t0 = time.perf_counter()
        r = pcdist.train(cfg, data=data)
        out[f"{algo}_accuracy"] = r["val/accuracy"]
        out[f"{algo}_run_s"] = time.perf_counter() - t0
    out["T"] = (c.pc.T if not tiny else min(c.pc.T, 3))
    return out


def time_steps(name: str, batch: int | None, data, rounds: int, per_round: int, tiny: bool) -> dict:
    """Median seconds per step of PC and BP on one batch, in interleaved rounds."""
    c = preset_config(name)
    B = batch or c.trainer.batch_size
    ds = data if data is not None else load_dataset(c.data.name, c.data.root)
    flat = c.model.name not in ("cnn", "vgg")
    x = ds.x_train[:B].flatten(1) if flat else ds.x_train[:B]
    specs = model_specs(c, tuple(x.shape[1:]) if not flat else tuple(ds.sample_shape), ds.num_classes)
    y = one_hot(ds.y_train[:B], ds.num_classes)
    T = min(c.pc.T, 3) if tiny else c.pc.T
    trainers = {}
    for algo in ("pc", "bp"):
        net = pcdist.PCNetwork(specs, energy=c.model.energy, seed=c.trainer.seed, **network_options(c))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-6)
        # the preset's own PC step, as the service builds it: its algorithm, init, solver and value optimizer (a
        # plain feed-forward-init step had stood for mupc_digits_t8's Newton-init one, 1.56x cheaper)
        trainers[algo] = (BackpropTrainer(net, opt) if algo == "bp" else
                          pcdist.PCTrainer(net, opt, T=T, algorithm=c.pc.algorithm,
                                           **method_options(c, resolve_x_lr(c, None))))
    for tr in trainers.values():  # warm-up: caches, traced graphs
        tr.step(x, y, log=False)
    samples = {k: [] for k in trainers}
    for r in range(rounds):
        for algo in (("pc", "bp") if r % 2 == 0 else ("bp", "pc")):
            t0 = time.perf_counter()
            for _ in range(per_round):
                trainers[algo].step(x, y, log=False)
            samples[algo].append((time.perf_counter() - t0) / per_round)
    pc_s, bp_s = statistics.median(samples["pc"]), statistics.median(samples["bp"])
    return {"pc_step_s": pc_s, "bp_step_s": bp_s, "pc_over_bp": pc_s / bp_s, "timing_batch": B,
            "pc_samples_s": samples["pc"], "bp_samples_s": samples["bp"],
            "timing_rounds": rounds, "timing_steps_per_round": per_round}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["preset"] for r in rows]
    idx = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.bar([i - 0.2 for i in idx], [r["pc_accuracy"] for r in rows], 0.4, label="PC")
    a.bar([i + 0.2 for i in idx], [r["bp_accuracy"] for r in rows], 0.4, label="backprop twin")
    a.set_xticks(list(idx), names, rotation=40, ha="right", fontsize=8)
    a.set_ylim(0, 1)
    a.set_ylabel("held-out accuracy after the step budget")
    a.legend()
    b.bar(list(idx), [r["pc_over_bp"] for r in rows], color="tab:purple")
    b.set_xticks(list(idx), names, rotation=40, ha="right", fontsize=8)
    b.set_yscale("log")
    b.set_ylabel("PC step time / backprop step time")
    fig.suptitle("PC against its backprop twin, every preset (2-core shared CPU; budgets in backprop.json)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="*", default=None, choices=PRESETS,
                    help="default: every supervised preset (the twin trains the supervised feed-forward map)")
    ap.add_argument("--data-root", default=os.environ.get("PCDIST_DATA"), help="folder holding mnist/, cifar10/, ...")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per preset")
    ap.add_argument("--tiny", action="store_true", help="a few steps per preset: a smoke test of the script")
    ap.add_argument("--out", default=None, help="the JSON to write (default benchmarks/results/backprop.json; with "
                    "--tiny, benchmarks/results/tiny/: a smoke test never writes over the docs' results)")
    args = ap.parse_args()
    args.out = args.out or str((OUT / "tiny" if args.tiny else OUT) / "backprop.json")
    if args.presets is None:
        args.presets = [name for name in PRESETS if preset_config(name).pc.mode == "supervised"]
    torch.set_num_threads(1)  # one thread: on a shared 2-core machine a second one waits for a busy core
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.presets:
            c = preset_config(name)
            data, where = preset_data(c, None if args.data_root is None else
                                      str(Path(args.data_root) / c.data.name))
            steps, batch = BUDGET.get(name, (100, None))
            if args.tiny:
                steps, batch = 4, min(batch or c.trainer.batch_size, 16)
            row = {"preset": name, "model": c.model.name, "data": where,
                   **run_pair(name, steps, batch, data, Path(tmp), args.tiny)}
            heavy = c.model.name == "vgg" or c.model.depth >= 64 and c.model.name == "mupc"
            row.update(time_steps(name, batch, data, 3 if (args.tiny or heavy) else args.rounds,
                                  1 if (heavy or args.tiny) else 10, args.tiny))
            rows.append(row)
            print(f"{name:<20} {where[:44]:<44} steps {row['steps']:>4} x {row['batch']:>3}: accuracy PC "
                  f"{row['pc_accuracy']:.4f} BP {row['bp_accuracy']:.4f}; step PC {row['pc_step_s'] * 1e3:8.1f} ms "
                  f"BP {row['bp_step_s'] * 1e3:7.1f} ms ({row['pc_over_bp']:.1f}x)", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    out.write_text(json.dumps({
        "what": "PC vs its backprop twin per preset: accuracy after the step budget, median step time (interleaved)",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
                   f"{torch.__version__}, {torch.get_num_threads()} threads; shared with other jobs "
                   f"(load average {load:.1f} at the end)" if load is not None else "",
        "tiny": args.tiny, "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
