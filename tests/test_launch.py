"""The launch scripts and the Dockerfile: linted, and consistent with the package."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPTS = [ROOT / "launch/local.sh", ROOT / "launch/docker.sh", ROOT / "launch/slurm.sbatch", ROOT / ".ci/run"]


def tool(name):
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; `pip install -e .[test]` brings it")
    return str(path)


def test_shell_scripts_pass_shellcheck():
    out = subprocess.run([tool("shellcheck"), *map(str, SCRIPTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_dockerfile_passes_hadolint():
    out = subprocess.run([tool("hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_dockerfile_matches_the_package():
    """The image's torch satisfies pyproject's pin, it copies everything train.py needs, and runs torchrun."""
    docker = (ROOT / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_base = re.search(r"FROM pytorch/pytorch:(\d+)\.(\d+)", docker)
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', pyproject)
    assert torch_base and floor and tuple(map(int, torch_base.groups())) >= tuple(map(int, floor.groups()))
    for needed in ("COPY pcdist ./pcdist", "COPY conf ./conf", "COPY train.py ./", 'ENTRYPOINT ["torchrun"]'):
        assert needed in docker
    assert "USER 1000" in docker, "the image must not run as root"
    assert docker.index("COPY pyproject.toml") < docker.index("COPY pcdist"), "dependencies before the source"


def test_wheel_ships_the_kernel_source(tmp_path):
    """A non-editable install must carry pcdist/_native.c, or the fused CPU kernel can never build."""
    import zipfile

    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("pcdist-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "pcdist/_native.c" in names and "pcdist/native.py" in names
