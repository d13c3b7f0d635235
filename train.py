"""pcdist's training entry point in a checkout: the same as ``pcdist-train`` and ``python -m pcdist``.

    python train.py [overrides]                                   # one process
    torchrun --standalone --nproc_per_node=2 train.py             # two layer-parallel processes
    python train.py --help                                        # every config group and key, documented

The logic lives in pcdist/service/cli.py (a thin Hydra wrapper over ``pcdist.train``).
"""

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # CPU results independent of memory alignment (exact resume)

PCDIST_COMMAND_LINE = True  # a Ctrl-C while pcdist imports is one line, not a traceback (pcdist/__init__.py)

from pcdist.service.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
