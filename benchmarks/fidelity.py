"""PC against backprop on the same network, data, seeds and budget: the old defaults, the shipped recipe
and the backprop twin, per network (issue 22; docs/fidelity.md). Also the recipe search that chose the recipes.

Networks (``NETWORKS``): the digits MLP (the default run), the digits CNN (``model=cnn``), a 1-D CNN of
three Conv1d layers on the generated signals (``experiment=signals_cnn``) beside an MLP on the same
signals (to show that the task needs the convolutions), and the 64-layer μPC at T = 8
(``experiment=mupc_digits pc.T=8`` with its recipe). Each row is three service runs per seed
(``pcdist.train``, one process, one torch thread): PC with the settings pcdist shipped before the
recipes (``old``), PC as shipped now (``recipe``: the preset or default), and backprop
(``pc.algorithm=bp``: the same network, data, optimizer, schedule, seed and steps). Backprop runs with
both optimizer settings (the old one's and the recipe's) and the better is reported, so the recipe is
never compared with a handicapped backprop.

    python benchmarks/fidelity.py                       # the table (about 30 minutes on 2 cores)
    python benchmarks/fidelity.py --networks signals_cnn --seeds 0 1 2
    python benchmarks/fidelity.py --tiny                # a smoke test of the script (seconds)
    python benchmarks/fidelity.py --search signals_cnn --trials 40   # the recipe search (Optuna TPE)
    python benchmarks/fidelity.py --pictures signals_cnn             # diagnosed runs, old and recipe: pictures

The search never sees the validation set the table reports: it trains on 80% of the training set and
scores on the other 20% (the signals: on a second draw of the generator, seed 1), seed 0. Every trial
is recorded in benchmarks/results/fidelity_search_<network>.json.

Writes benchmarks/results/fidelity.json and fidelity.png.
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

import pcdist
from pcdist.service.config import make_config
from pcdist.service.data import Dataset, load_dataset
from pcdist.service.signals import make_signals

OUT = Path(__file__).resolve().parent / "results"
OLD_PC = ["pc.T=20", "pc.x_lr=0.1", "pc.x_momentum=0.0", "pc.algorithm=pc", "optim.lr=2e-3"]
"""pcdist's defaults before issue 22 (conf/pc/default.yaml, conf/optim/adamw.yaml)."""
SIGNALS_CNN = ["data=signals", "model=cnn", "model.channels=[25,25,25]", "model.kernel_size=5",
               "model.pool=[max,max,max]", "trainer.max_steps=1000", "trainer.eval_every=250"]

NETWORKS = {
    "digits_mlp": {"title": "digits, MLP 64-128-128-10", "base": [], "old": OLD_PC, "recipe": []},
    "digits_cnn": {"title": "digits 1x8x8, CNN conv32-conv64-dense", "base": ["model=cnn"], "old": OLD_PC,
                   "recipe": []},
    "signals_cnn": {"title": "signals 1x64, 1-D CNN 3 x Conv1d(25, k5)", "base": SIGNALS_CNN, "old": OLD_PC,
                    "recipe": ["experiment=signals_cnn"]},
    "signals_mlp": {"title": "signals 1x64, MLP 64-128-128-10",
                    "base": ["data=signals", "trainer.max_steps=1000", "trainer.eval_every=250"],
                    "old": OLD_PC, "recipe": ["experiment=signals_mlp"]},
    "mupc64_t8": {"title": "digits, μPC 64 layers x 128, T=8", "base": ["experiment=mupc_digits", "pc.T=8"],
                  "old": ["experiment=mupc_digits", "pc.T=8"], "recipe": ["experiment=mupc_digits_t8"]},
}
QUIET = ["logger=none", "trainer.progress=off", "trainer.threads=1", "trainer.ckpt_every=100000"]


def overrides(net: str, which: str, seed: int, tiny: bool, extra: list[str] = ()) -> list[str]:
    """The service overrides of one run: the network's base, then old / recipe, the seed, the budget."""
    n = NETWORKS[net]
    over = [*n["base"], *(n["old"] if which == "old" else n["recipe"]), f"trainer.seed={seed}", *QUIET, *extra]
    if tiny:
        over += ["trainer.max_steps=4", "trainer.eval_every=4", "trainer.log_every=2", "pc.T=3"]
    return over


def data_for(over: list[str], search: bool) -> Dataset | None:
    """None (the configured data) for the table; for the search, data it never reports on: the training set
    split 80 / 20 (digits), or the signal generator's second draw (signals)."""
    if not search:
        return None
    c = make_config([o for o in over if o.split("=")[0] in ("data", "experiment")])
    if c.data.name == "signals":
        a = make_signals(seed=1)
        return Dataset(*(torch.from_numpy(a[k]) for k in ("x_train", "y_train", "x_val", "y_val")), num_classes=10)
    d = load_dataset(c.data.name)
    g = torch.Generator().manual_seed(123)
    perm = torch.randperm(len(d.x_train), generator=g)
    cut = int(0.8 * len(perm))
    tr, va = perm[:cut], perm[cut:]
    return Dataset(d.x_train[tr], d.y_train[tr], d.x_train[va], d.y_train[va], d.num_classes)


def train(over: list[str], tmp: Path, data: Dataset | None = None) -> tuple[float, float]:
    """(held-out accuracy, seconds) of one service run."""
    t0 = time.perf_counter()
    r = pcdist.train([*over, f"run_dir={tmp / str(time.perf_counter_ns())}"], data=data)
    return float(r["val/accuracy"]), time.perf_counter() - t0


def row(net: str, seeds: list[int], tmp: Path, tiny: bool) -> dict:
    """PC old, PC recipe and backprop (better of the two optimizer settings) per seed; their means."""
    out = {"network": net, "title": NETWORKS[net]["title"], "seeds": seeds, "old": [], "recipe": [], "bp": [],
           "bp_old_optim": [], "bp_recipe_optim": [], "seconds": {}}
    for seed in seeds:
        for which in ("old", "recipe"):
            acc, s = train(overrides(net, which, seed, tiny), tmp)
            out[which].append(acc)
            out["seconds"][which] = out["seconds"].get(which, 0.0) + s
            bp, s = train(overrides(net, which, seed, tiny, ["pc.algorithm=bp"]), tmp)
            out[f"bp_{which}_optim"].append(bp)
            out["seconds"]["bp"] = out["seconds"].get("bp", 0.0) + s
        out["bp"].append(max(out["bp_old_optim"][-1], out["bp_recipe_optim"][-1]))
    for k in ("old", "recipe", "bp"):
        out[f"{k}_mean"] = statistics.fmean(out[k])
    out["gap_points"] = 100 * (out["bp_mean"] - out["recipe_mean"])
    c = make_config(overrides(net, "recipe", seeds[0], tiny))
    out["recipe_settings"] = {"T": c.pc.T, "x_lr": c.pc.x_lr, "x_momentum": c.pc.x_momentum,
                              "algorithm": c.pc.algorithm, "lr": c.optim.lr, "energy": c.model.energy,
                              "steps": c.trainer.max_steps, "batch": c.trainer.batch_size}
    return out


SPACE = {  # the search space: candidate -> (kind, choices or bounds)
    "pc.x_lr": ("log", 0.003, 0.5),
    "pc.T": ("choice", [5, 10, 20]),
    "pc.x_momentum": ("choice", [0.0, 0.5, 0.8]),
    "pc.algorithm": ("choice", ["pc", "ipc"]),
    "optim.lr": ("log", 3e-4, 3e-2),
    "model.energy": ("choice", ["ce", "se"]),
}


def search(net: str, trials: int, tmp: Path, tiny: bool, out: Path) -> dict:
    """Optuna TPE over ``SPACE`` (μPC at T = 8: T fixed) on data the table never reports on; every trial kept."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    base = overrides(net, "old", 0, tiny)
    data = data_for(base, search=True)
    fixed_T = net.startswith("mupc")
    records = []

    def objective(trial):
        over = []
        for key, (kind, *spec) in SPACE.items():
            if key == "pc.T" and fixed_T:
                continue
            if kind == "log":
                v = trial.suggest_float(key, spec[0], spec[1], log=True)
            else:
                v = trial.suggest_categorical(key, spec[0])
            over.append(f"{key}={v}")
        try:
            acc, s = train([*base, *over], tmp, data)
        except Exception as e:  # a diverged run is a result of the search, not a crash of it
            acc, s = 0.0, 0.0
            trial.set_user_attr("error", str(e).split("\n")[0][:200])
        records.append({"trial": trial.number, "overrides": over, "accuracy": acc, "seconds": s,
                        **({"error": trial.user_attrs["error"]} if "error" in trial.user_attrs else {})})
        out.write_text(json.dumps({"network": net, "base": base, "space": {k: list(v) for k, v in SPACE.items()},
                                   "trials": records}, indent=1))
        print(f"{net} trial {trial.number}: {acc:.4f} {' '.join(over)} ({s:.0f} s)", flush=True)
        return acc

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0))
    c = make_config(base)  # the old defaults first (TPE then fills in from there)
    old = {"pc.x_lr": c.pc.x_lr, "pc.T": c.pc.T, "pc.x_momentum": c.pc.x_momentum, "pc.algorithm": c.pc.algorithm,
           "optim.lr": c.optim.lr, "model.energy": c.model.energy}
    study.enqueue_trial({k: v for k, v in old.items() if not (k == "pc.T" and fixed_T)})
    study.optimize(objective, n_trials=trials)
    best = max(records, key=lambda r: r["accuracy"])
    print(f"{net}: best {best['accuracy']:.4f} with {' '.join(best['overrides'])}")
    return best


def pictures(net: str, steps: int, every: int, tmp: Path, folder: Path = OUT) -> dict:
    """Short runs of the old defaults and the recipe with pc.diagnostics=true; their diagnostics pictures
    copied to ``folder``/fidelity_<network>_<old|recipe>_{energy,cosine}.png (default benchmarks/results/), their
    records returned (and written beside them)."""
    import shutil

    from pcdist.service.diagnostics import read_diagnostics

    out = {}
    for which in ("old", "recipe"):
        run_dir = tmp / f"{net}-{which}"
        over = overrides(net, which, 0, False, [f"trainer.max_steps={steps}", f"trainer.eval_every={steps}",
                                               "pc.diagnostics=true", f"pc.diagnostics_every={every}"])
        r = pcdist.train([*over, f"run_dir={run_dir}"])
        for kind in ("energy", "cosine"):
            shutil.copy(run_dir / f"diagnostics_{kind}.png", folder / f"fidelity_{net}_{which}_{kind}.png")
        out[which] = {"accuracy": r["val/accuracy"], "overrides": over,
                      "diagnostics": read_diagnostics(run_dir / "diagnostics.jsonl")}
        print(f"{net} {which}: accuracy {r['val/accuracy']:.4f} after {steps} steps; pictures in {folder}", flush=True)
    (folder / f"fidelity_{net}_diagnostics.json").write_text(json.dumps(out, indent=1))
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    idx = range(len(rows))
    for off, key, label in ((-0.27, "old_mean", "PC, old defaults"), (0.0, "recipe_mean", "PC, shipped recipe"),
                            (0.27, "bp_mean", "backprop")):
        ax.bar([i + off for i in idx], [r[key] for r in rows], 0.27, label=label)
    ax.set_xticks(list(idx), [r["title"] for r in rows], rotation=20, ha="right", fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out accuracy (mean over seeds)")
    ax.legend(fontsize=8)
    ax.set_title("PC against backprop on the same network, data, seeds and budget (benchmarks/fidelity.py)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--networks", nargs="*", default=list(NETWORKS), choices=list(NETWORKS))
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1])
    ap.add_argument("--tiny", action="store_true", help="4 steps per run: a smoke test of the script")
    ap.add_argument("--search", choices=list(NETWORKS), help="run the recipe search for this network instead")
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--pictures", choices=list(NETWORKS), help="diagnosed short runs (old, recipe) of this network")
    ap.add_argument("--steps", type=int, default=250, help="--pictures: training steps")
    ap.add_argument("--out", default=None, help="the JSON to write (default under benchmarks/results/); with "
                    "--pictures, the folder for the pictures and their JSON")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        if args.pictures:
            folder = Path(args.out) if args.out else OUT
            folder.mkdir(parents=True, exist_ok=True)
            pictures(args.pictures, args.steps, max(1, args.steps // 10), Path(tmp), folder)
            return
        if args.search:
            out = Path(args.out or OUT / f"fidelity_search_{args.search}.json")
            search(args.search, args.trials, Path(tmp), args.tiny, out)
            return
        rows = []
        for net in args.networks:
            r = row(net, args.seeds, Path(tmp), args.tiny)
            rows.append(r)
            print(f"{r['title']:<44} PC old {r['old_mean']:.4f}  PC recipe {r['recipe_mean']:.4f}  backprop "
                  f"{r['bp_mean']:.4f}  (gap {r['gap_points']:+.2f} points; seeds {args.seeds})", flush=True)
    out = Path(args.out or (OUT / "tiny" if args.tiny else OUT) / "fidelity.json")  # (a smoke test never writes
    # over the results the docs quote)
    out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    out.write_text(json.dumps({
        "what": "held-out accuracy of PC (old defaults, shipped recipe) and backprop on the same network, data, "
                "seeds and steps; backprop: the better of the old and the recipe's optimizer settings",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
                   + (f", load average {load:.1f} at the end" if load is not None else ""),
        "command": "python benchmarks/fidelity.py " + " ".join(f"--networks {' '.join(args.networks)}".split())
                   + f" --seeds {' '.join(map(str, args.seeds))}" + (" --tiny" if args.tiny else ""),
        "tiny": args.tiny, "rows": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
