"""Sweeps: Hydra's --multirun and the Optuna sweeper plugin, each job its own run directory, and
``python -m pcdist compare`` over the result (real Hydra, real Optuna, real subprocesses)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
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


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def refused(*args, cwd) -> str:
    """The one line of a refused launch (exit status 2)."""
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert "new run in" not in out.stdout, "no job started"
    return out.stderr


def test_a_sweep_into_an_earlier_sweeps_folder_refuses_and_changes_nothing(tmp_path):
    """A sweep run again into the hydra.sweep.dir of an earlier one must never resume or report the earlier runs as
    its own: other values (pc.T=12,16), other fixed settings (a new LR and length), more runs than the folder's, or
    another sweeper: each refused before any job starts, in one line naming the folder and the way out, and the
    folder stays as it was. The same sweep again is the same runs: it resumes them (here: nothing left to train)."""
    sweep = tmp_path / "sweep"
    train_py("--multirun", "pc.T=4,8", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    before = snapshot(sweep)
    said = refused("--multirun", "pc.T=12,16", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert said == (f"error: sweep job 0 (pc.T=12): {sweep}/0 holds another run, made with pc.T=4 (this job: 12); a "
                    f"sweep never continues a run of other settings: give the sweep a new hydra.sweep.dir, or resume "
                    f"that run on its own: python train.py hydra.run.dir={sweep}/0 [the settings to change]; no job "
                    f"was started\n")
    said = refused("--multirun", "optim.lr=1e-2,2e-2", *QUICK, "trainer.max_steps=24", f"hydra.sweep.dir={sweep}",
                   cwd=tmp_path)
    assert said.startswith(f"error: sweep job 0 (optim.lr=0.01): {sweep}/0 holds another run, made with ") and \
        "optim.lr=0.002 (this job: 0.01)" in said and "trainer.max_steps=12 (this job: 24)" in said, said
    said = refused("--multirun", "pc.T=4", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert said == (f"error: sweep directory {sweep}: it holds runs that are no job of this sweep (1), which this "
                    f"sweep would mix with its own; give the sweep a new hydra.sweep.dir (no job was started)\n")
    said = refused("--multirun", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "pc.T=range(4, 12, step=4)",
                   *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert said.startswith(f"error: sweep directory {sweep}: it holds the runs of an earlier sweep (0, 1)"), said
    assert snapshot(sweep) == before, "a refused sweep changes nothing in the folder"
    again = train_py("--multirun", "pc.T=4,8", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert again.stdout.count("is already finished") == 2 and "new run in" not in again.stdout, again.stdout


def test_every_job_of_a_sweep_is_checked_before_the_first_starts(tmp_path):
    """A bad value anywhere in a --multirun list: one line naming the job and the key, exit status 2, and nothing
    run or left behind (no job directory, no multirun.yaml)."""
    sweep = tmp_path / "badT"
    said = refused("--multirun", "pc.T=4,0", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert said == ("error: sweep job 1 (pc.T=0): config pc.T=0 is invalid: allowed an integer >= 1; no job was "
                    "started\n")
    said = refused("--multirun", "pc.T=4,8", "model.dims=[64,10],[40,10]", *QUICK, f"hydra.sweep.dir={sweep}",
                   cwd=tmp_path)
    assert said.startswith("error: sweep job 1 (pc.T=4 model.dims=[40,10]): data digits has 64 input features"), said
    assert not sweep.exists() and sorted(tmp_path.iterdir()) == []


def test_compare_gives_mean_and_std_over_seeds_and_writes_csv_and_json(tmp_path):
    """Three seeds at each of two pc.T: compare groups the runs of equal pc.T and gives each metric's mean and
    sample standard deviation over the seeds, equal to those computed here from each run's metrics.jsonl; the
    CSV and JSON it writes hold the same figures."""
    import csv
    import json
    import statistics

    sweep = tmp_path / "seeds"
    train_py("--multirun", "trainer.seed=0,1,2", "pc.T=4,8", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    out = subprocess.run([sys.executable, "-m", "pcdist", "compare", str(sweep), "--csv", str(tmp_path / "c.csv"),
                          "--json", str(tmp_path / "c.json")], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    final = {}
    for run in jobs(sweep):
        c = yaml.safe_load((run / "config.yaml").read_text())
        acc = [r["val/accuracy"] for r in read_metrics(run / "metrics.jsonl") if "val/accuracy" in r][-1]
        final.setdefault(c["pc"]["T"], {})[c["trainer"]["seed"]] = acc
    assert sorted(final) == [4, 8] and all(sorted(v) == [0, 1, 2] for v in final.values())
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["settings"] == ["pc.T", "trainer.seed"] and len(result["rows"]) == 6
    groups = {g["pc.T"]: g for g in result["groups"]}
    with open(tmp_path / "c_seeds.csv") as f:
        rows = {int(r["pc.T"]): r for r in csv.DictReader(f)}
    lines = out.stdout.split("over seeds (mean ± sample standard deviation):\n")[1].splitlines()
    for T, by_seed in final.items():
        mean, std = statistics.fmean(by_seed.values()), statistics.stdev(by_seed.values())
        g = groups[T]
        assert g["seeds"] == [0, 1, 2] and g["n"] == 3
        assert g["val/accuracy mean"] == pytest.approx(mean, abs=1e-12)
        assert g["val/accuracy std"] == pytest.approx(std, abs=1e-12)
        assert float(rows[T]["val/accuracy mean"]) == pytest.approx(mean, abs=1e-12)
        assert float(rows[T]["val/accuracy std"]) == pytest.approx(std, abs=1e-12)
        shown = [line for line in lines if line.split()[:2] == [str(T), "0,1,2"]]
        assert len(shown) == 1 and f"{mean:.4g} ± {std:.2g}" in shown[0], lines
    with open(tmp_path / "c.csv") as f:
        per_run = list(csv.DictReader(f))
    assert len(per_run) == 6 and {(int(r["pc.T"]), int(r["trainer.seed"])) for r in per_run} == \
        {(T, s) for T in (4, 8) for s in (0, 1, 2)}
