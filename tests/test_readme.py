"""The README's code runs verbatim: the Python quick start and the torchrun layer-parallel script."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def snippet(first_line: str) -> str:
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if b.startswith(first_line)]
    assert len(blocks) == 1, f"expected one README python block starting with {first_line!r}"
    return blocks[0]


def test_layer_parallel_script_runs_under_torchrun_on_a_2x2_mesh(tmp_path):
    script = tmp_path / "my_train.py"
    script.write_text(snippet("# my_train.py"))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                          str(script)], cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    energies = [float(line.split()[1]) for line in out.stdout.splitlines()]
    assert len(energies) == 5, "exactly one rank (the logging rank) prints, every 20 steps"
    assert energies[-1] < 0.5 * energies[0], f"training must lower the energy: {energies}"


def test_python_quick_start_runs(tmp_path):
    code = snippet("import torch, pcdist\nfrom pcdist.data import load_digits")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    accuracy = float(re.search(r"tensor\(([\d.]+)\)", out.stdout).group(1))
    assert accuracy >= 0.95
