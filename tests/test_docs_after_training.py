"""docs/after-training.md runs as written: its ``bash`` and ``python`` blocks, in order, in one empty folder,
once for the module (``page``); the tests below check what it leaves. The page's sweeps are the sweep tests'
runs too (Optuna maximised what train.py returned; compare's mean and standard deviation over seeds), so
each sweep trains once in the suite.

``sh`` blocks are shown, not run (the benchmark, an error example).
"""

import csv
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import pcdist
from pcdist.service.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "after-training.md"


def blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"```(bash|python)\n(.*?)```", text, re.S)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """(the folder the page ran in, each block's output)."""
    folder = tmp_path_factory.mktemp("after_training")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    found = blocks(PAGE.read_text())
    assert [lang for lang, _ in found] == ["bash", "python", "python", "python", "bash", "bash", "bash", "bash"]
    outputs = []
    for lang, code in found:
        cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        out = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"{lang} block failed:\n{code}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        outputs.append(out.stdout)
    return folder, outputs


def jobs(sweep: Path) -> list[Path]:
    return sorted((p for p in sweep.iterdir() if (p / "config.yaml").is_file()), key=lambda p: int(p.name))


def final_accuracy(run: Path) -> float:
    return [r["val/accuracy"] for r in read_metrics(run / "metrics.jsonl") if "val/accuracy" in r][-1]


def test_after_training_page_runs_in_order(page):
    tmp_path, outputs = page
    demo = tmp_path / "runs" / "demo"
    assert (demo / "eval.json").is_file() and (demo / "confusion.png").is_file()
    assert (tmp_path / "predictions.npz").is_file() and (tmp_path / "demo.pt2").is_file()
    assert "accuracy" in outputs[1] and "'Sequential', 'Sequential', 'Linear'" in outputs[3]
    assert "pc.algorithm" in outputs[4] and (tmp_path / "pc_vs_bp.png").is_file()
    assert len([p for p in (tmp_path / "sweeps" / "lr").iterdir() if p.name.isdigit()]) == 2
    assert (tmp_path / "sweeps" / "lr" / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "over seeds (mean ± sample standard deviation):" in outputs[7]
    assert (tmp_path / "seeds.csv").is_file() and (tmp_path / "seeds_seeds.csv").is_file()


def test_the_optuna_sweep_maximised_what_train_py_returned_and_compare_tabulates_it(page):
    """The page's two Optuna trials over PC's sensitive settings: train.py returns the objective
    (val/accuracy), each trial is its own run directory, and compare's table (printed by the page) holds the
    differing settings and each trial's final accuracy."""
    tmp_path, outputs = page
    sweep = tmp_path / "sweeps" / "optuna"
    runs = jobs(sweep)
    accuracies = [final_accuracy(p) for p in runs]
    assert len(runs) == 2
    assert yaml.safe_load((sweep / "optimization_results.yaml").read_text())["best_value"] == max(accuracies)
    lines = outputs[6].splitlines()
    header = next(line for line in lines if line.startswith("run ")).split()
    assert "pc.x_lr" in header and "pc.T" in header and "optim.lr" in header and "val/accuracy" in header
    rows = [line.split() for line in lines if line.startswith("sweeps/optuna/")]  # the page's relative paths
    assert [float(r[header.index("val/accuracy")]) for r in rows] == [float(f"{a:.4g}") for a in accuracies]
    assert (sweep / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"pc.x_lr", "pc.T", "optim.lr"} <= set(pcdist.compare([sweep], plot=tmp_path / "c.png")["settings"])


def test_compare_gives_mean_and_std_over_seeds_and_writes_csv_and_json(page):
    """The page's three seeds at each of two pc.T: compare groups the runs of equal pc.T and gives each
    metric's mean and sample standard deviation over the seeds, equal to those computed here from each run's
    metrics.jsonl; the CSV and JSON it writes hold the same figures."""
    tmp_path, outputs = page
    final = {}
    for run in jobs(tmp_path / "sweeps" / "seeds"):
        c = yaml.safe_load((run / "config.yaml").read_text())
        final.setdefault(c["pc"]["T"], {})[c["trainer"]["seed"]] = final_accuracy(run)
    assert sorted(final) == [10, 20] and all(sorted(v) == [0, 1, 2] for v in final.values())
    result = json.loads((tmp_path / "seeds.json").read_text())
    assert result["settings"] == ["pc.T", "trainer.seed"] and len(result["rows"]) == 6
    groups = {g["pc.T"]: g for g in result["groups"]}
    with open(tmp_path / "seeds_seeds.csv") as f:
        rows = {int(r["pc.T"]): r for r in csv.DictReader(f)}
    lines = outputs[7].split("over seeds (mean ± sample standard deviation):\n")[1].splitlines()
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
    with open(tmp_path / "seeds.csv") as f:
        per_run = list(csv.DictReader(f))
    assert len(per_run) == 6 and {(int(r["pc.T"]), int(r["trainer.seed"])) for r in per_run} == \
        {(T, s) for T in (10, 20) for s in (0, 1, 2)}
    # pc.x_lr=auto: each run's chosen step is a result of it (seeds may choose other ones), with its group's mean
    chosen = {r["run"]: json.loads((tmp_path / r["run"] / "x_lr.json").read_text())["x_lr"] for r in result["rows"]}
    assert [r["x_lr(auto)"] for r in result["rows"]] == list(chosen.values()) and all(chosen.values())
    for T, g in groups.items():
        steps = [r["x_lr(auto)"] for r in result["rows"] if r["pc.T"] == T]
        assert g["x_lr(auto) mean"] == pytest.approx(statistics.fmean(steps), abs=1e-15)


def test_compare_reads_the_runs_without_importing_torch(page):
    """`python -m pcdist compare` reads the runs' files (config.yaml, metrics.jsonl) and draws their curves: it
    never imports torch (about 1.5 of its 2.5 CPU-s), and says what it said on the page (the lr sweep's table)."""
    tmp_path, outputs = page
    code = ("import atexit, runpy, sys\n"
            "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
            "sys.argv = ['pcdist', *sys.argv[1:]]\n"
            "runpy.run_module('pcdist', run_name='__main__', alter_sys=True)")

    def compare(sweep: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code, "compare", sweep], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))

    out = compare("sweeps/lr")
    assert out.returncode == 0, out.stderr[-3000:]
    said, last = out.stdout.rsplit("torch imported: ", 1)
    assert last == "False\n"
    assert "sweeps/lr/0" in said and outputs[5].endswith(said), (said, outputs[5][-1500:])
    gone = compare("sweeps/none")
    assert (gone.returncode, gone.stdout) == (2, "torch imported: False\n"), gone.stderr[-3000:]
    assert gone.stderr == "error: sweeps/none is not a directory; give run directories or a sweep directory\n"
