"""docs/modes.md: every Python block runs as written, and prints what the page says it prints."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "modes.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE, re.S)


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_page_has_its_examples():
    assert len(BLOCKS) == 4


def test_generative_example_classifies_by_inference():
    accuracy = float(re.search(r"accuracy by inference ([\d.]+)", run(BLOCKS[0])).group(1))
    assert accuracy >= 0.91, accuracy


def test_unsupervised_example_comes_within_5_percent_of_pca():
    mse = float(re.search(r"reconstruction error per pixel ([\d.]+)", run(BLOCKS[1])).group(1))
    assert mse <= 1.05 * 0.01977, mse  # PCA with 10 components on this split: 0.019766


@pytest.mark.parametrize("i, pattern", [(2, r"^[\d.e-]+ \[[\d.e, -]+\]$"), (3, r"^torch.Size\(\[10, 64\]\)$")])
def test_energy_and_sampling_examples_run(i, pattern):
    assert re.match(pattern, run(BLOCKS[i]).strip()), run(BLOCKS[i])
