"""Import pcdist as it was at another git commit, beside the current one, in one process.

    from baseline import import_ref
    old = import_ref("860de00")          # a module named pcdist_860de00, from `git archive`
    old.PCNetwork.from_sequential(seq)   # the old engine, side by side with `import pcdist`

The package uses only relative imports, so the commit's ``pcdist/`` folder imports under
another name. Used by ``fusion.py --baseline REF`` (speed, side by side) and
``baseline_identity.py`` (the same trajectories, bit for bit).
"""

from __future__ import annotations

import importlib
import io
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_ref(ref: str):
    """pcdist at git ``ref`` as a module ``pcdist_<ref>`` (extracted into a temporary folder)."""
    name = "pcdist_" + re.sub(r"\W", "_", ref)
    if name in sys.modules:
        return sys.modules[name]
    tar = subprocess.run(["git", "archive", "--format=tar", ref, "pcdist"], cwd=ROOT, capture_output=True, check=True)
    folder = Path(tempfile.mkdtemp(prefix="pcdist-baseline-"))
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        t.extractall(folder, filter="data")
    (folder / "pcdist").rename(folder / name)
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))
