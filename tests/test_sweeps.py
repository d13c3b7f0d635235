"""Sweeps: Hydra's --multirun and the Optuna sweeper plugin, each job its own run directory, and
``python -m pcdist compare`` over the result (real Hydra, real Optuna, real subprocesses)."""

import os
import subprocess
import sys
from pathlib import Path

import yaml

import pcdist
from pcdist.service.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["trainer.max_steps=12", "trainer.eval_every=6", "trainer.log_every=6", "trainer.ckpt_every=12",
         "logger=none", "trainer.progress=off"]


def train_py(*args, cwd) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def jobs(sweep: Path) -> list[Path]:
    return sorted((p for p in sweep.iterdir() if (p / "config.yaml").is_file()), key=lambda p: int(p.name))


def test_multirun_over_two_values_gives_two_run_directories(tmp_path):
    """`--multirun optim.lr=1e-3,2e-3` (sweep syntax the pre-check must let through) launches two jobs,
    each a complete run directory with its own value."""
    sweep = tmp_path / "sweep"
    out = train_py("--multirun", "optim.lr=1e-3,2e-3", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    runs = jobs(sweep)
    assert [p.name for p in runs] == ["0", "1"]
    assert [yaml.safe_load((p / "config.yaml").read_text())["optim"]["lr"] for p in runs] == [1e-3, 2e-3]
    for p in runs:
        assert (p / "checkpoints" / "step-00000012").is_dir() and f"run directory: {p}" in out.stdout
        assert [r["step"] for r in read_metrics(p / "metrics.jsonl") if "val/accuracy" in r] == [6, 12]


def test_multirun_still_names_a_mistyped_key_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "--multirun", "optim.lrr=1e-3,2e-3"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "unknown config key optim.lrr; did you mean optim.lr?" in out.stderr


def test_optuna_sweep_on_digits_then_compare(tmp_path):
    """Two Optuna trials over PC's sensitive settings: train.py returns the objective (val/accuracy), each
    trial is its own run directory, and compare prints one table of the differing settings and final
    metrics and draws the validation curves."""
    sweep = tmp_path / "optuna"
    train_py("--multirun", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.direction=maximize",
                   "hydra.sweeper.sampler.seed=0", "pc.x_lr=tag(log, interval(0.02, 0.5))", "pc.T=range(4, 12, step=4)",
                   "optim.lr=tag(log, interval(5e-4, 5e-3))", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    runs = jobs(sweep)
    assert len(runs) == 2
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    accuracies = [[r["val/accuracy"] for r in read_metrics(p / "metrics.jsonl") if "val/accuracy" in r][-1]
                  for p in runs]
    assert best["best_value"] == max(accuracies), "Optuna maximised what train.py returned"
    table = subprocess.run([sys.executable, "-m", "pcdist", "compare", str(sweep)], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    header = lines[0].split()
    assert header[0] == "run" and "pc.x_lr" in header and "optim.lr" in header and "val/accuracy" in header
    rows = [line for line in lines[2:] if line.startswith(str(sweep))]
    assert len(rows) == 2
    col = header.index("val/accuracy")
    assert [float(r.split()[col]) for r in rows] == [float(f"{a:.4g}") for a in accuracies]
    assert (sweep / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert pcdist.compare([sweep], plot=tmp_path / "c.png")["settings"][:1] != []
