"""The README's and the docs pages' Python code runs verbatim: every ```python block, the quick start
and the layer-kinds example learn, and the layer-parallel script gives the same energies under torchrun
as one process. (Their shell commands run in a fresh copy of the repository: tests/test_launch.py.)"""

import functools
import json
import os
import re
import subprocess
import sys

import pytest

from doc_blocks import ROOT, blocks, python_block

QUICK_START = "import pcdist, torch  # pcdist first, so that idle CPU threads sleep: docs/service.md#threads-on-cpu\n" \
              "from pcdist.data import load_digits"
CHECKED_BELOW = (QUICK_START, "# Layer kinds", "# my_train.py")
"""Blocks that the tests below run and check in detail (my_train.py: tests/test_launch.py, which runs the README's
two commands for it, checks what they print)."""


def run_python(code: str, cwd, timeout=600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


OTHERS = [(page, code) for page, code in blocks("python") if not code.startswith(CHECKED_BELOW)]


@pytest.mark.parametrize("page, code", OTHERS,
                         ids=[f"{p.relative_to(ROOT)}:{c.splitlines()[0][:40]}" for p, c in OTHERS])
def test_every_python_block_runs(page, code, tmp_path):
    """A block a reader copies must run as printed (in a fresh folder, the repository's pcdist installed)."""
    out = run_python(code, tmp_path)
    assert out.returncode == 0, f"{page.relative_to(ROOT)}:\n{code}\n{out.stderr[-3000:]}"


def test_the_pages_have_the_blocks_the_tests_check():
    for first in CHECKED_BELOW:
        python_block(first)
    assert len(OTHERS) >= 3, "the service, fuse and DeepPCR examples"


def test_python_quick_start_runs(tmp_path):
    out = run_python(python_block(QUICK_START), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    accuracy = float(re.search(r"tensor\(([\d.]+)\)", out.stdout).group(1))
    assert accuracy >= 0.95


def test_layer_kinds_example_runs_and_the_conv_pcn_learns(tmp_path):
    out = run_python(python_block("# Layer kinds"), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "['conv', 'conv', 'dense']" and lines[-1] == "['dense', 'module', 'dense']"
    assert "126 x (residual 128 -> 128" in out.stdout, "the 126 hidden μPC layers are one stacked group"
    accuracy = float(re.search(r"^accuracy ([\d.]+)$", out.stdout, re.M).group(1))
    assert accuracy >= 0.95


def leading_imports(code: str) -> str:
    """The import statements a block starts with, up to the first that imports pcdist or torch (libgomp, loaded
    with torch, reads its wait policy then, once: the later lines cannot change it), comments left out."""
    head = []
    for line in code.splitlines():
        statement = line.split("#")[0].rstrip()
        if not statement:
            continue
        if not statement.startswith(("import ", "from ")):
            break
        head.append(statement)
        if re.search(r"\b(pcdist|torch)\b", statement):
            break
    return "\n".join(head)


EVERY_BLOCK = [(page, code) for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
               for _, code in blocks("python", page) if "pcdist" in code and "torch" in code]


@functools.cache
def wait_policy_report(imports: str) -> subprocess.CompletedProcess:
    """libgomp's report (OMP_DISPLAY_ENV=verbose) after ``imports``, in a process whose environment does not set
    the wait policy; once per distinct import head (most blocks start alike)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return subprocess.run([sys.executable, "-c", imports], env={**env, "OMP_DISPLAY_ENV": "verbose"},
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("page, code", EVERY_BLOCK,
                         ids=[f"{p.relative_to(ROOT)}:{c.splitlines()[0][:30]}" for p, c in EVERY_BLOCK])
def test_every_snippet_imports_pcdist_first_so_that_idle_cpu_threads_sleep(page, code):
    """OpenMP (torch's libgomp) reads its wait policy once, when torch is first imported; left unset, its idle
    threads spin ~3 ms after every parallel region, and a snippet saved as a file ran 4-8x slower on a busy
    machine (docs/service.md, "Threads on CPU"). pcdist sets the policy on import, so every block that uses
    pcdist and torch must import pcdist first. Checked as libgomp itself reports it (OMP_DISPLAY_ENV=verbose),
    running the block's leading imports in a process whose environment does not set the policy."""
    imports = leading_imports(code)
    assert re.search(r"\b(pcdist|torch)\b", imports), f"{page.relative_to(ROOT)}: no import of pcdist or torch first"
    out = wait_policy_report(imports)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "GOMP_SPINCOUNT = '0'" in out.stderr, f"{page.relative_to(ROOT)}: {code.splitlines()[:3]}"


def test_a_folder_named_pcdist_beside_a_script_fails_as_the_install_section_says(tmp_path):
    """A clone of the repository named pcdist/ beside one's script shadows the installed (editable) package: the
    install section must name the error a newcomer then sees, exactly, and the way out must work."""
    (tmp_path / "pcdist" / "pcdist").mkdir(parents=True)  # a clone: its package is one level down
    (tmp_path / "pcdist" / "pcdist" / "__init__.py").write_text("")
    script = "from pcdist.data import load_digits\nprint(len(load_digits().x_train))\n"
    (tmp_path / "mine.py").write_text(script)
    beside = subprocess.run([sys.executable, "mine.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    install = (ROOT / "README.md").read_text().split("## Install")[1].split("\n## ")[0]
    said = " ".join(re.search(r"fail with `(ModuleNotFoundError: [^`]+)`", install, re.S).group(1).split())
    assert beside.returncode != 0 and beside.stderr.strip().splitlines()[-1] == said, beside.stderr[-2000:]
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "mine.py").write_text(script)
    moved = subprocess.run([sys.executable, "mine.py"], cwd=tmp_path / "elsewhere", capture_output=True, text=True,
                           timeout=300)
    assert moved.returncode == 0 and moved.stdout.strip() == "1437", moved.stderr[-2000:]


def test_citation_cff_holds_what_citation_tools_need_and_this_version():
    """CITATION.cff (Citation File Format 1.2.0): the keys a citation needs, read as YAML, for the version the
    package declares; the README points to it."""
    import yaml

    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["message"] and cff["title"].startswith("pcdist")
    assert cff["authors"] and all("name" in a or "family-names" in a for a in cff["authors"])
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert cff["version"] == declared and cff["license"] == "MIT"
    assert "CITATION.cff" in (ROOT / "README.md").read_text()


DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PRESET_FIGURES = json.loads((ROOT / "benchmarks" / "results" / "presets.json").read_text())


def shown_with(command: str) -> list[str]:
    """The comments beside ``command`` (exactly that command line) in the pages' bash blocks."""
    found = []
    for page in DOC_PAGES:
        for _, code in blocks("bash", page):
            for line in code.splitlines():
                cmd, _, comment = line.partition("#")
                if " ".join(cmd.split()) == command and comment.strip():
                    found.append(comment)
    return found


@pytest.mark.parametrize("name", sorted(PRESET_FIGURES))
def test_figures_beside_a_training_command_are_what_that_command_gave(name):
    """A figure the docs print beside a command must be what running that command gives
    (benchmarks/presets.py runs each as typed and records its last line and wall-clock time): the
    accuracy (or reconstruction error) and the seconds."""
    got = PRESET_FIGURES[name]
    comments = shown_with(got["command"])
    assert comments, f"no page shows {got['command']!r} with a comment"
    for comment in comments:
        figures = re.findall(r"\d+\.\d+", comment)
        if "val/accuracy" in got and "experiment=unsupervised" not in got["command"]:
            assert f"{got['val/accuracy']:.3f}" in figures, (got, comment)
        else:
            assert f"{got['val/reconstruction_mse']:.4g}" in figures, (got, comment)
        assert re.search(rf"\bin {round(got['seconds'])} s\b", comment), (got, comment)


def test_the_networks_the_docs_give_for_a_preset_are_the_presets():
    """A network shape a table cell gives for a preset (`[10, 128, 64]` ... `experiment=NAME`) is its model.dims."""
    import pcdist

    for page in DOC_PAGES:
        for line in page.read_text().splitlines():
            cells = line.split("|") if line.startswith("|") else []
            for dims, name in (m for cell in cells for m in re.findall(r"`\[([\d, ]+)\]`.*`experiment=(\w+)`", cell)):
                want = list(pcdist.compose([f"experiment={name}"]).model.dims)
                assert [int(d) for d in dims.split(",")] == want, f"{page.name}: {line.strip()}"


def test_the_readme_is_a_front_page_that_links_every_docs_page():
    """At most ~300 lines; install with the step that makes `python` the one with pcdist in it; how to run
    all tests and one file; a link to every docs page (and to those other branches add)."""
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= 300
    install = readme[readme.index("## Install"):readme.index("## Quick start")]
    assert "make install" in install and "source .venv/bin/activate" in install
    assert "make test" in readme and re.search(r"python -m pytest tests/test_\w+\.py -q\s", readme)
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in readme, f"the README does not link docs/{page.name}"
    for page in ("slurm.md", "after-training.md", "modes.md"):
        assert f"(docs/{page})" in readme
