"""pcdist's training entry point in a checkout: the same as ``pcdist-train`` and ``python -m pcdist``.

    python train.py [overrides]                                   # one process
    torchrun --standalone --nproc_per_node=2 train.py             # two layer-parallel processes
    python train.py --help                                        # every config group and key, documented

The logic lives in pcdist/service/cli.py (a thin Hydra wrapper over ``pcdist.train``).
"""

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # CPU results independent of memory alignment (exact resume)

PCDIST_COMMAND_LINE = True  # a Ctrl-C while pcdist imports is one line, not a traceback (pcdist/__init__.py)

try:
    from pcdist.service.cli import main  # noqa: E402
except ModuleNotFoundError as e:  # a python without pcdist's requirements (PYTHON=... in launch/*.sh): one line
    import sys

    if e.name is None or e.name.split(".")[0] == "pcdist":
        raise
    print(f"train.py: error: {sys.executable} cannot import {e.name}, which pcdist needs: install pcdist into it "
          f"(make install in the checkout, or pip install -e <checkout>), or run a python that has it", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    main()
