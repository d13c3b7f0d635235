"""docs/after-training.md runs as written: its ``bash`` and ``python`` blocks, in order, in one empty folder.

``sh`` blocks are shown, not run (the benchmark, an error example).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "after-training.md"


def blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"```(bash|python)\n(.*?)```", text, re.S)


def test_after_training_page_runs_in_order(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    found = blocks(PAGE.read_text())
    assert [lang for lang, _ in found] == ["bash", "python", "python", "python", "bash", "bash", "bash", "bash"]
    outputs = []
    for lang, code in found:
        cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"{lang} block failed:\n{code}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        outputs.append(out.stdout)
    demo = tmp_path / "runs" / "demo"
    assert (demo / "eval.json").is_file() and (demo / "confusion.png").is_file()
    assert (tmp_path / "predictions.npz").is_file() and (tmp_path / "demo.pt2").is_file()
    assert "accuracy" in outputs[1] and "'Sequential', 'Sequential', 'Linear'" in outputs[3]
    assert "pc.algorithm" in outputs[4] and (tmp_path / "pc_vs_bp.png").is_file()
    assert len([p for p in (tmp_path / "sweeps" / "lr").iterdir() if p.name.isdigit()]) == 2
    optuna = tmp_path / "sweeps" / "optuna"
    assert len([p for p in optuna.iterdir() if p.name.isdigit()]) == 2
    assert "best_value" in yaml.safe_load((optuna / "optimization_results.yaml").read_text())
    assert "over seeds (mean ± sample standard deviation):" in outputs[7]
    assert (tmp_path / "seeds.csv").is_file() and (tmp_path / "seeds_seeds.csv").is_file()
