"""The figures the README and docs give beside a training command, from that command: each runs as a reader
types it (``python train.py <overrides> logger=none``, in a fresh folder), and its last line's validation
figure and its wall-clock time are recorded.

    python benchmarks/presets.py                    # every command in COMMANDS
    python benchmarks/presets.py generative_digits  # some of them

Writes benchmarks/results/presets.json ({name: {"command", "val/accuracy" or "val/reconstruction_mse",
"seconds", "load_average"}}); tests/test_readme.py checks that the docs quote these figures.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "presets.json"
COMMANDS = {
    "default": [],
    "cnn": ["model=cnn"],
    "mupc_digits": ["experiment=mupc_digits"],
    "generative_digits": ["experiment=generative_digits"],
    "unsupervised_digits": ["experiment=unsupervised_digits"],
}
"""name -> the overrides of ``python train.py`` that the docs show."""


def run(overrides: list[str]) -> dict:
    """One command in a fresh folder: its last line's figure and its wall-clock seconds."""
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides, "logger=none",
                              "trainer.progress=off"], cwd=d, capture_output=True, text=True, timeout=7200)
        took = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    last = out.stdout.strip().splitlines()[-1]
    got = {k: float(v) for k, v in re.findall(r"(val/accuracy|val/reconstruction_mse) ([\d.e-]+);", last)}
    return {"command": " ".join(["python train.py", *overrides]), **got, "seconds": round(took, 1),
            "load_average": round(os.getloadavg()[0], 1)}


def main(names: list[str]) -> None:
    results = json.loads(OUT.read_text()) if OUT.is_file() else {}
    for name in names or list(COMMANDS):
        results[name] = run(COMMANDS[name])
        print(name, results[name], flush=True)
        OUT.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
