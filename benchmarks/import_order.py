"""The README's Python quick start, run as a file, whatever the order of its imports: wall-clock seconds of

  torch first     ``import torch, pcdist`` (OpenMP's own wait policy: threads spin, then sleep)
  pcdist first    ``import pcdist, torch`` (pcdist sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP)
  torch first + OMP_WAIT_POLICY=PASSIVE in the environment

each on the machine as it is and with one more process holding a core (a busy loop). Conditions and
variants interleave round by round; every run is a process of its own (OpenMP reads its wait policy
once, when torch loads it). The snippet is read from README.md, so the measurement is of the text a
reader copies. Writes benchmarks/results/import_order.json (every run) and prints medians.

    python benchmarks/import_order.py             # 2 rounds
    python benchmarks/import_order.py --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "import_order.json"
CONDITIONS = ("as is", "one core held")


def quick_start() -> str:
    """The README's Python quick start (the first python block under "Quick start: the Python API")."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start: the Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def variants(snippet: str) -> dict[str, tuple[str, dict]]:
    """Each variant's program and extra environment: the snippet with its first import line in each order."""
    body = "\n".join(line for line in snippet.splitlines() if not re.match(r"import (torch|pcdist)\b", line))
    return {"torch first": ("import torch, pcdist\n" + body, {}),
            "pcdist first": ("import pcdist, torch\n" + body, {}),
            "torch first + OMP_WAIT_POLICY=PASSIVE": ("import torch, pcdist\n" + body, {"OMP_WAIT_POLICY": "PASSIVE"})}


def run_once(program: str, env: dict) -> float:
    """Wall-clock seconds of ``program`` as a file of its own, in a new process."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "quick_start.py"
        path.write_text(program)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, str(path)], env={**base, **env}, cwd=d, capture_output=True, text=True,
                             timeout=1800)
        took = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return took


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    runs = []
    for r in range(a.rounds):
        for condition in CONDITIONS:
            hog = None
            if condition == "one core held":
                hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                for name, (program, env) in variants(quick_start()).items():
                    s = run_once(program, env)
                    runs.append({"round": r, "condition": condition, "variant": name, "seconds": s,
                                 "load_average": os.getloadavg()[0]})
                    print(f"round {r} {condition:14s} {name:40s} {s:7.1f} s", flush=True)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    OUT.write_text(json.dumps({"cores": len(os.sched_getaffinity(0)), "runs": runs}, indent=1))
    for condition in CONDITIONS:
        for name in variants(quick_start()):
            got = [x["seconds"] for x in runs if x["condition"] == condition and x["variant"] == name]
            print(f"{condition:14s} {name:40s} median {statistics.median(got):7.1f} s  "
                  f"({min(got):.1f}-{max(got):.1f})")


if __name__ == "__main__":
    main()
