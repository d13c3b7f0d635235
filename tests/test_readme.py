"""The README's code runs verbatim: the Python quick start and the torchrun layer-parallel script."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def snippet(first_line: str) -> str:
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if b.startswith(first_line)]
    assert len(blocks) == 1, f"expected one README python block starting with {first_line!r}"
    return blocks[0]


def energies_printed(out: subprocess.CompletedProcess) -> list[float]:
    assert out.returncode == 0, out.stderr[-3000:]
    return [float(line.split()[1]) for line in out.stdout.splitlines()]


def test_layer_parallel_script_runs_under_torchrun_and_as_one_process(tmp_path):
    """The same file as two layer slices (torchrun, 2 gloo ranks) and as a plain process.

    Both train the same network on the same batches, so they print the same energies up to
    float32 round-off (the layers are stacked into differently sized groups on one rank and two).
    """
    script = tmp_path / "my_train.py"
    script.write_text(snippet("# my_train.py"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    mesh = energies_printed(subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300))
    assert len(mesh) == 5, "exactly one rank (the logging rank) prints, every 20 steps"
    assert mesh[-1] < 0.5 * mesh[0], f"training must lower the energy: {mesh}"
    plain_env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    one = energies_printed(subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=plain_env,
                                          capture_output=True, text=True, timeout=300))
    assert one == pytest.approx(mesh, rel=1e-2)


def test_python_quick_start_runs(tmp_path):
    code = snippet("import torch, pcdist\nfrom pcdist.data import load_digits")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    accuracy = float(re.search(r"tensor\(([\d.]+)\)", out.stdout).group(1))
    assert accuracy >= 0.95


def test_layer_kinds_example_runs_and_the_conv_pcn_learns(tmp_path):
    code = snippet("# Layer kinds")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "['conv', 'conv', 'dense']" and lines[-1] == "['dense', 'module', 'dense']"
    assert "126 x (residual 128 -> 128" in out.stdout, "the 126 hidden μPC layers are one stacked group"
    accuracy = float(re.search(r"^accuracy ([\d.]+)$", out.stdout, re.M).group(1))
    assert accuracy >= 0.95
