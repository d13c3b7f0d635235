"""Inference in fewer steps (issue 30; docs/solvers.md): value optimizers, ODE solvers and inits near equilibrium
against today's Euler step, on the digits MLP, the digits CNN, a 1-D CNN on the signals and the 64-layer μPC
(plain pc).

Two parts, both written to benchmarks/results/solvers.json (cells already there are kept unless --fresh):

* ``trace``: on one batch of 64 at the initial weights (seed 0), the energy after each inference step (up to
  T = 20) of every method, and the time of a training step at T = 1, 5 and 20 per method (SGD at lr 0, one
  torch thread, methods interleaved over rounds, median). Times are CPU seconds of the process: on a machine
  shared with other jobs they measure the work where wall-clock measures the queue (wall-clock is recorded
  beside). They place each step on a time axis: the step's fixed part (init, weight gradients) plus t times
  its per-step slope. Plots: energy against inference steps and against time per network
  (solvers_energy.png) and the μPC's energy against time alone (solvers_time.png, the README's picture).
  The adaptive solver (test-time inference only) is a point per tolerance: the energy it reaches at
  t = 20 x_lr and its time.
* ``accuracy``: held-out accuracy of full service runs (pcdist.train, one process, one thread, seed 0) at
  T = 2, 4, 8, 20 (and 5 for the digits networks) for Euler (today's step: each network's own x_lr), Heun and
  the inits newton and backward, and the step times of the T = 5 runs against Euler's at T = 20 (from the
  trace part's timing, same machine, same run).

    python benchmarks/solvers.py                         # both parts (about two hours on 2 busy cores)
    python benchmarks/solvers.py --part trace            # the energy traces and timings only (minutes)
    python benchmarks/solvers.py --part accuracy --networks digits_mlp --Ts 2 5
    python benchmarks/solvers.py --tiny                  # a smoke test (seconds)
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
from pcdist.service.data import load_dataset, one_hot
from pcdist.service.models import model_specs

OUT = Path(__file__).resolve().parent / "results"
QUIET = ["logger=none", "trainer.progress=off", "trainer.threads=1", "trainer.ckpt_every=100000"]

NETWORKS = {  # name: (title, service overrides of today's recipe with an explicit value step)
    "digits_mlp": ("digits, MLP 64-128-128-10", ["pc.x_lr=0.1"]),
    "digits_cnn": ("digits, CNN conv32-conv64-dense", ["model=cnn"]),
    "signals_cnn": ("signals 1x64, 1-D CNN 3 x Conv1d(25, k5)", ["experiment=signals_cnn"]),
    "mupc64": ("digits, μPC 64 layers x 128 (plain pc)", ["experiment=mupc_digits", "pc.algorithm=pc"]),
}
METHODS = {  # name: service overrides on top of the network's recipe
    "euler": [],
    "heun": ["pc.solver=heun"],
    "rk4": ["pc.solver=rk4"],
    "nesterov": ["pc.value_optimizer=nesterov", "pc.x_momentum=0.5"],
    "adam": ["pc.value_optimizer=adam"],  # x_lr: ADAM_LR (Adam's step is x_lr per entry, whatever the scale)
    "newton": ["pc.init=newton"],
    "newton_cr": ["pc.init=newton_cr"],
    "backward": ["pc.init=backward"],
}
ADAM_LR = 0.02
REPEAT = 5  # training steps per timed sample (1 with --tiny)
ACCURACY_METHODS = ("euler", "heun", "newton", "backward")
TOLS = (1e-1, 1e-2, 1e-3)


def settings(net: str, method: str, T: int | None = None) -> list[str]:
    over = [*NETWORKS[net][1], *METHODS[method]]
    if method == "adam":
        over.append(f"pc.x_lr={ADAM_LR}")
    if T is not None:
        over.append(f"pc.T={T}")
    return over


def build(net: str, method: str, T: int, tiny: bool):
    """(trainer, x, y, config) of one network and method at its initial weights (seed 0), on one batch of 64."""
    tiny_mupc = ["model.width=32"] if tiny and net == "mupc64" else []  # Newton's O(B D^3) solves: seconds at 128
    c = make_config(settings(net, method, T) + QUIET + tiny_mupc)
    ds = load_dataset(c.data.name, c.data.root)
    flat = c.model.name not in ("cnn", "vgg")
    x = ds.x_train[:64].flatten(1) if flat else ds.x_train[:64]
    specs = model_specs(c, tuple(x.shape[1:]) if not flat else tuple(ds.sample_shape), ds.num_classes)
    if tiny and c.model.name == "mupc":
        specs = specs[:3] + specs[-1:]
    y = one_hot(ds.y_train[:64], ds.num_classes)
    net_ = pcdist.PCNetwork(specs, energy=c.model.energy, seed=0)
    x_lr = float(c.pc.x_lr) if c.pc.x_lr != "auto" else 0.1
    tr = pcdist.PCTrainer(net_, torch.optim.SGD(net_.parameters(), lr=0.0), T=T, x_lr=x_lr,
                          x_momentum=c.pc.x_momentum, value_optimizer=c.pc.value_optimizer, solver=c.pc.solver,
                          init=c.pc.init, compile="none")
    return tr, x, y, c


def trace_part(nets: list[str], methods: list[str], rounds: int, tiny: bool) -> dict:
    """Energy per inference step and the step's time at T = 1 and T = 20, per network and method."""
    T_max = 3 if tiny else 20
    repeat = 1 if tiny else REPEAT  # --tiny: one training step per timed sample (newton_cr's take 0.1 s each)
    out = {}
    for net in nets:
        row = {"title": NETWORKS[net][0], "methods": {}}
        trainers = {}
        for m in methods:
            if m == "newton_cr" and net in ("digits_cnn", "signals_cnn"):
                continue  # per-sample Jacobians of conv nodes (thousands of entries) are too large to compare with
            tr, x, y, c = build(net, m, T_max, tiny)
            trainers[m] = (tr, x, y)
            tr.T = T_max
            energies = [sum(r) for r in tr.trace(x, y)]
            row["methods"][m] = {"energy": energies, "x_lr": tr.x_lr, "settings": settings(net, m)}
        Ts = sorted({1, min(5, T_max), T_max})
        times = {(m, T): [] for m in trainers for T in Ts}
        walls = {(m, T): [] for m in trainers for T in Ts}
        for r in range(rounds + 1):  # round 0: warm-up (caches, traced graphs)
            order = list(trainers) if r % 2 == 0 else list(reversed(trainers))
            for m in order:
                tr, x, y = trainers[m]
                for T in Ts:
                    tr.T = T
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(repeat):
                        tr.step(x, y, log=False)
                    if r:
                        times[(m, T)].append((time.process_time() - c0) / repeat)
                        walls[(m, T)].append((time.perf_counter() - t0) / repeat)
        for m in trainers:  # CPU seconds of the one thread (median of the rounds): the work, whatever else runs
            best = {T: statistics.median(times[(m, T)]) for T in Ts}
            per = (best[T_max] - best[1]) / (T_max - 1)
            row["methods"][m].update({**{f"step_s_T{T}": best[T] for T in Ts}, "per_step_s": per,
                                      "fixed_s": max(0.0, best[1] - per),
                                      **{f"wall_s_T{T}": statistics.median(walls[(m, T)]) for T in Ts}})
        tr, x, y = trainers["euler"]
        row["adaptive"] = []
        for tol in TOLS:  # test-time inference only: the energy it reaches at t = T_max x_lr, and its time
            tr.T = T_max
            t0 = time.process_time()
            nodes = tr.infer(x, y, solver="adaptive", tol=tol)
            secs = time.process_time() - t0
            row["adaptive"].append({"tol": tol, "seconds": secs, "evaluations": tr.last_infer["evaluations"],
                                    "energy": energy_at(tr, nodes, x, y)})
        out[net] = row
        print(f"{net}: " + ", ".join(f"{m} E_{T_max} {v['energy'][-1]:.4g} ({v['per_step_s'] * 1e3:.2f} ms/step)"
                                     for m, v in row["methods"].items()), flush=True)
    return out


def energy_at(tr, nodes, x, y) -> float:
    """The energy of the trainer's network at value nodes ``nodes`` (the adaptive solver's end point)."""
    net = tr.net
    with torch.no_grad():
        st = tr.stage(x.shape[0])
        for n, h in enumerate(nodes):
            st.node(n).copy_(h)
        st.weights_changed()
        st.errors(need_all_deltas=True)
        return float(st.layer_energies().sum()) if net is not None else float("nan")


def accuracy_part(nets: list[str], Ts: list[int], methods: list[str], tiny: bool, tmp: Path, done: dict) -> dict:
    """Held-out accuracy of service runs per (network, method, T); cells in ``done`` are kept."""
    out = {k: dict(v) for k, v in done.items()}
    warm = False  # the process's first run pays its one-time costs (imports, allocator): an untimed one first
    for net in nets:
        cells = out.setdefault(net, {})
        for T in Ts + ([5] if net.startswith("digits") and 5 not in Ts and not tiny else []):
            for m in methods:
                key = f"{m}@{T}"
                if key in cells:
                    print(f"{net} {key}: kept from the JSON ({cells[key]}; --fresh measures every cell again)",
                          flush=True)
                    continue
                over = settings(net, m, T) + QUIET + ["trainer.seed=0"]
                if tiny:
                    over += ["trainer.max_steps=4", "trainer.eval_every=4", "trainer.log_every=2",
                             "logger.plots=false"]  # each run's metric plots: half its time, not looked at
                    if net == "mupc64":
                        over += ["model.depth=4", "model.width=32"]
                if not warm:
                    pcdist.train([*over, "trainer.max_steps=2", "trainer.eval_every=2", "logger.plots=false",
                                  f"run_dir={tmp / 'warm-up'}"])
                    warm = True
                t0 = time.perf_counter()
                try:
                    r = pcdist.train([*over, f"run_dir={tmp / str(time.perf_counter_ns())}"])
                    acc = float(r["val/accuracy"])
                except Exception as e:  # a diverged run is a result, not a crash of the benchmark
                    acc = float("nan")
                    print(f"{net} {key}: {str(e).splitlines()[0][:160]}", flush=True)
                cells[key] = {"accuracy": acc, "seconds": time.perf_counter() - t0, "overrides": over}
                print(f"{net} {key}: {acc:.4f} ({cells[key]['seconds']:.0f} s)", flush=True)
                yield out


def plot(trace: dict, path: Path, time_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nets = list(trace)
    fig, axes = plt.subplots(2, len(nets), figsize=(4.2 * len(nets), 7), squeeze=False)
    for j, net in enumerate(nets):
        row = trace[net]
        for m, v in row["methods"].items():
            E = v["energy"]
            t = [1e3 * (v["fixed_s"] + k * v["per_step_s"]) for k in range(len(E))]
            style = "--" if m in ("newton", "newton_cr", "backward") else "-"
            axes[0][j].plot(range(len(E)), E, style, label=m)
            axes[1][j].plot(t, E, style, label=m)
        for a in row.get("adaptive", []):
            axes[1][j].plot(1e3 * a["seconds"], a["energy"], "k*", ms=7)
        axes[0][j].set_title(row["title"], fontsize=9)
        axes[0][j].set_xlabel("inference steps (solver steps)")
        axes[1][j].set_xlabel("CPU time of a training step, one thread (ms); ★ adaptive (infer)")
        for a in axes[:, j]:
            a.set_yscale("log")
            a.set_ylabel("energy F")
        axes[1][j].set_xscale("log")  # newton_cr's dense solves take 100x the others' time
        axes[0][j].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    net = "mupc64" if "mupc64" in trace else nets[-1]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m, v in trace[net]["methods"].items():
        E = v["energy"]
        ax.plot([1e3 * (v["fixed_s"] + k * v["per_step_s"]) for k in range(len(E))], E,
                "--" if m in ("newton", "newton_cr", "backward") else "-", marker=".", label=m)
    ax.set_yscale("log")
    ax.set_xscale("log")
    ax.set_xlabel("CPU time of the training step so far, one thread (ms, log scale)")
    ax.set_ylabel("energy F of one batch")
    ax.set_title(f"{trace[net]['title']}: energy against time, one curve per method", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(time_path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["trace", "accuracy", "both"], default="both")
    ap.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    ap.add_argument("--methods", nargs="+", default=None, choices=list(METHODS))
    ap.add_argument("--Ts", nargs="+", type=int, default=[2, 4, 8, 20])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--fresh", action="store_true", help="drop the accuracy cells already in the JSON")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None, help="the JSON to write (default benchmarks/results/solvers.json; with "
                    "--tiny, benchmarks/results/tiny/: a smoke test never writes over the docs' results)")
    args = ap.parse_args()
    args.out = args.out or str((OUT / "tiny" if args.tiny else OUT) / "solvers.json")
    torch.set_num_threads(1)
    out_path = Path(args.out)
    result = json.loads(out_path.read_text()) if out_path.is_file() else {}
    if args.fresh:  # the accuracy cells alone (the trace part, the docs' first table, stays)
        result.pop("accuracy", None)
    result["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                         "load_at_start": os.getloadavg()[0]}
    if args.part in ("trace", "both"):
        methods = args.methods or list(METHODS)
        result["trace"] = {**result.get("trace", {}), **trace_part(args.networks, methods, args.rounds, args.tiny)}
        result["machine"]["load_after_trace"] = os.getloadavg()[0]
        out_path.write_text(json.dumps(result, indent=1))
        plot(result["trace"], out_path.with_name("solvers_energy.png"), out_path.with_name("solvers_time.png"))
    if args.part in ("accuracy", "both"):
        methods = args.methods or list(ACCURACY_METHODS)
        with tempfile.TemporaryDirectory() as tmp:
            for acc in accuracy_part(args.networks, args.Ts, methods, args.tiny, Path(tmp),
                                     result.get("accuracy", {})):
                result["accuracy"] = acc
                result["machine"]["load_now"] = os.getloadavg()[0]
                out_path.write_text(json.dumps(result, indent=1))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
