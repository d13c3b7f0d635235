"""The launch scripts and the Dockerfile: linted, and consistent with the package."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPTS = [ROOT / "launch/local.sh", ROOT / "launch/docker.sh", ROOT / "launch/slurm.sbatch",
           ROOT / "launch/slurm_node.sh", ROOT / ".ci/run"]


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
    """The image installs the torch CI tests (the Makefile's pin, within pyproject's range), installs pcdist
    as a package (configs inside) and runs its entry point under torchrun, as a non-root user."""
    docker = (ROOT / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    make_pin = re.search(r"^TORCH_PIN \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    image_pin = re.search(r"^ARG TORCH_PIN=torch==(\S+)$", docker, re.M)
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', pyproject)
    assert make_pin and image_pin and floor and image_pin.group(1) == make_pin.group(1)
    assert tuple(map(int, image_pin.group(1).split(".")[:2])) >= tuple(map(int, floor.groups()))
    assert 'RUN pip install "${TORCH_PIN}"' in docker and "FROM pytorch/" not in docker, "torch comes from the pin"
    for needed in ("COPY pcdist ./pcdist", "COPY conf ./conf", "pip install --no-deps .", 'ENTRYPOINT ["torchrun"]',
                   '"-m", "pcdist"]'):
        assert needed in docker
    assert "USER 1000" in docker, "the image must not run as root"
    assert docker.index("COPY pyproject.toml") < docker.index("COPY pcdist"), "dependencies before the source"
    docker_sh = (ROOT / "launch/docker.sh").read_text()
    assert '--user "$(id -u):$(id -g)"' in docker_sh and "-m pcdist" in docker_sh, "files in runs/ stay the user's"


def test_slurm_log_goes_where_a_fresh_clone_can_write():
    """SLURM opens --output before the script runs: it must not be under runs/ (absent in a fresh clone)."""
    (output,) = re.findall(r"^#SBATCH --output=(\S+)$", (ROOT / "launch/slurm.sbatch").read_text(), re.M)
    assert "/" not in output


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("wheel")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out_dir), str(ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    (whl,) = out_dir.glob("pcdist-*.whl")
    return whl


def test_wheel_ships_the_kernel_source_the_configs_and_the_entry_point(wheel):
    """A non-editable install must carry pcdist/engine/_native.c (or the fused CPU kernel can never build), every
    file of conf/ (as pcdist/conf) and the pcdist-train command."""
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "pcdist/engine/_native.c" in names and "pcdist/engine/native.py" in names and "pcdist/__main__.py" in names
    conf = {f"pcdist/conf/{p.relative_to(ROOT / 'conf')}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert conf <= set(names), conf - set(names)
    entry = zipfile.ZipFile(wheel).read("pcdist-0.1.0.dist-info/entry_points.txt").decode()
    assert "pcdist-train = pcdist.service.cli:main" in entry


def test_the_installed_wheel_trains_without_a_checkout(wheel, tmp_path):
    """pip install of the wheel alone (into a fresh venv; its dependencies are this environment's) gives a
    working service: pcdist-train trains from a folder with no conf/ and no source, and python -m pcdist is
    the same command."""
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "-q",
                          "--no-deps", str(wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    site = subprocess.run([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch, hydra, ...: no download
    work = tmp_path / "work"
    work.mkdir()
    out = subprocess.run([str(venv / "bin/pcdist-train"), "trainer.max_steps=2", "trainer.eval_every=2",
                          "logger=none", "trainer.progress=off"], cwd=work, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = [p.parent for p in work.glob("runs/*/*/config.yaml")]
    assert (run_dir / "checkpoints/step-00000002/manifest.json").is_file()
    where = subprocess.run([str(venv / "bin/python"), "-c", "import pcdist.service.config as c; print(c.__file__, c.CONF_DIR)"],
                           cwd=work, capture_output=True, text=True, check=True).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), f"not the installed copy: {where}"
    out = subprocess.run([str(venv / "bin/python"), "-m", "pcdist", "--cfg", "job", "optim=sgd"], cwd=work,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "name: sgd" in out.stdout, out.stderr[-2000:]
