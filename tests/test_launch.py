"""The launch scripts, the Dockerfile and the Python: linted, and consistent with the package."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPTS = [ROOT / "launch/local.sh", ROOT / "launch/docker.sh", ROOT / "launch/slurm.sbatch",
           ROOT / "launch/slurm_node.sh", ROOT / ".ci/run", ROOT / "benchmarks/gpu_check.sh"]


def tool(name):
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; `pip install -e .[test]` brings it")
    return str(path)


def test_shell_scripts_pass_shellcheck():
    out = subprocess.run([tool("shellcheck"), *map(str, SCRIPTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_the_python_passes_ruff():
    """pcdist, the tests and the benchmarks pass ruff (pyproject.toml: line length 120, pycodestyle and
    pyflakes), as `make lint` checks."""
    out = subprocess.run([tool("ruff"), "check", "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:]


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


def test_the_repository_tracks_no_wheel_and_nothing_it_ignores():
    """No build artefact (the ruff wheel once was) is committed, and .gitignore ignores no file git tracks
    (conf/config.yaml was once listed)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert not [f for f in tracked if f.endswith(".whl")]
    ignored = subprocess.run(["git", "ls-files", "--cached", "--ignored", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert ignored == []


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
    where = subprocess.run([str(venv / "bin/python"), "-c",
                            "import pcdist.service.config as c; print(c.__file__, c.CONF_DIR)"],
                           cwd=work, capture_output=True, text=True, check=True).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), f"not the installed copy: {where}"
    out = subprocess.run([str(venv / "bin/python"), "-m", "pcdist", "--cfg", "job", "optim=sgd"], cwd=work,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "name: sgd" in out.stdout, out.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# The README and the docs pages, command by command, in a fresh copy of the repository

NOT_RUN_HERE = {  # a part of a command -> why a test on a CPU box cannot run it
    "make test": "it runs the suite this test belongs to",
    "sbatch ": "needs a SLURM cluster",
    "scancel ": "needs a SLURM cluster and a job",
    "launch/docker.sh": "needs a Docker engine",
    "/path/to/": "needs a data set pcdist does not download",
    "trainer.device=cuda": "needs a CUDA device (tests/test_cuda.py runs the GPU path where one is present)",
}
PROGRESS = re.compile(r"^step \d+/\d+ ", re.M)


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory):
    """The repository's files (tracked, and new ones git does not ignore) in a new folder, with a fresh .venv as
    `make install` leaves it (a venv holding pcdist editable from the copy, byte-compiled, and the commands of its
    dependencies; torch and the other dependencies are this environment's, read through a .pth file), stamped as
    installed so that the README's own `make install` finds it done. Returns (folder, the environment after the
    README's install block)."""
    import importlib.metadata
    import sysconfig

    clone = tmp_path_factory.mktemp("clone")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    for f in files:
        if (ROOT / f).is_file():
            (clone / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, clone / f)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(clone / ".venv")], check=True, timeout=120)
    site = subprocess.run([str(clone / ".venv/bin/python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "_pcdist_editable.pth").write_text(f"{clone}\n")  # pcdist from the copy, as pip install -e puts it
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for ep in importlib.metadata.entry_points(group="console_scripts"):  # torchrun, pytest, pcdist-train, ...
        module, _, attr = ep.value.partition(":")
        script = clone / ".venv/bin" / ep.name
        script.write_text(f"#!{clone / '.venv/bin/python'}\nimport sys\nfrom {module} import {attr.split('.')[0]}\n"
                          f"sys.exit({attr}())\n")
        script.chmod(0o755)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(clone / "pcdist")], check=True, timeout=300)
    (clone / ".venv/.installed").touch()
    # A shell as a reader's: no virtual environment active, no python with torch on the PATH.
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                  if not Path(p, "python").is_file()
                                  or Path(p).resolve() != Path(sys.prefix, "bin").resolve())
    env["OMP_NUM_THREADS"] = "1"  # a shared CI box: one thread per process keeps the many launches below calm
    from doc_blocks import blocks, commands

    (readme, install), = [(p, c) for p, c in blocks("bash") if p.name == "README.md" and "make install" in c]
    script = "set -e\n" + "\n".join(commands(install)) + "\nenv -0\n"
    out = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    after = dict(kv.split("=", 1) for kv in out.stdout.decode().split("\0") if "=" in kv)
    return clone, after


def _run_command(cmd: str, cwd: Path, env: dict) -> tuple[bool, str]:
    """Run one command as a reader would (bash, in the copy). A command that trains is stopped with SIGTERM
    (pcdist checkpoints and exits) once it has shown a progress line; any other must end with status 0."""
    proc = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines, stopped = [], False
    deadline = time.monotonic() + 600
    for line in proc.stdout:
        lines.append(line)
        if not stopped and PROGRESS.match(line):
            os.killpg(proc.pid, signal.SIGTERM)
            stopped = True
        if time.monotonic() > deadline:
            break
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return stopped or proc.returncode == 0, "".join(lines)


STEP_ENERGY = re.compile(r"^\d+ (\S+)$", re.M)


def _layer_parallel_script(outputs: list[tuple[str, str]]) -> None:
    """README's my_train.py, as two layer slices (torchrun, 2 gloo ranks) and as a plain process: exactly one rank
    prints, every 20 steps, training lowers the energy, and the plain process prints the same energies (up to
    float32 round-off: the layers are stacked into differently sized groups on one rank and two)."""
    def energies(command: str) -> list[float]:
        (out,) = [out for cmd, out in outputs if cmd.startswith(command)]
        return [float(e) for e in STEP_ENERGY.findall(out)]

    mesh, one = energies("torchrun --standalone --nproc_per_node=2 my_train.py"), energies("python my_train.py")
    assert len(mesh) == 5, f"exactly one rank (the logging rank) prints, every 20 steps: {mesh}"
    assert mesh[-1] < 0.5 * mesh[0], f"training must lower the energy: {mesh}"
    assert one == pytest.approx(mesh, rel=1e-2), "one process: the same energies, as the README says"


PAGE_CHECKS = {"README.md": [_layer_parallel_script]}
"""What a page's commands must print beyond their exit status, checked on their output."""


def _pages():
    from doc_blocks import pages

    return [p.relative_to(ROOT) for p in pages()]


@pytest.mark.parametrize("page", _pages(), ids=str)
def test_every_command_of_the_docs_runs_in_a_fresh_clone(page, fresh_clone):
    """Every command of the page's ```bash blocks, verbatim and in order, in the copy and the environment the
    README's install block leaves (`make install`, then `source .venv/bin/activate`): each ends with status 0,
    or trains (shows a progress line) until stopped. The commands that need what no test machine has are named
    in NOT_RUN_HERE with the reason. A python block that names its file (`# my_train.py`) is saved under that
    name first, as the page asks the reader to. PAGE_CHECKS checks what some commands print."""
    from doc_blocks import blocks, commands

    clone, env = fresh_clone
    for _, code in blocks("python", ROOT / page):
        name = re.match(r"# (\w+\.py) ", code)
        if name:
            (clone / name.group(1)).write_text(code)
    failed, outputs = [], []
    for _, code in blocks("bash", ROOT / page):
        if "make install" in code:
            continue  # the install block: run by the fixture
        for cmd in commands(code):
            if any(part in cmd for part in NOT_RUN_HERE):
                continue
            ok, out = _run_command(cmd, clone, env)
            outputs.append((cmd, out))
            if not ok:
                failed.append(f"$ {cmd}\n{out[-2500:]}")
    assert not failed, "\n\n".join(failed)
    for check in PAGE_CHECKS.get(str(page), []):
        check(outputs)
