"""The training service's command line: ``pcdist-train``, ``python -m pcdist`` and, in a checkout, ``python train.py``.

    pcdist-train [overrides]                                      # one process
    torchrun --standalone --nproc_per_node=2 -m pcdist parallel.layer=2
    pcdist-train --help                                           # every config group and key

A thin Hydra wrapper over ``pcdist.train``: the configs are the shipped ``conf/``
(``pcdist.config.CONF_DIR``), so an installed wheel runs without a checkout.
"""

import os
import sys

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # CPU results independent of memory alignment (exact resume);
# read by MKL at its first call, so setting it here, before any computation, is early enough.

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import pcdist  # noqa: E402
from pcdist.config import CONF_DIR  # noqa: E402
from pcdist.data import DataError  # noqa: E402
from pcdist.rundir import launch_run_dir  # noqa: E402


def _train(cfg: DictConfig) -> None:
    cfg.run_dir = HydraConfig.get().runtime.output_dir
    try:
        result = pcdist.train(cfg)
    except pcdist.Preempted as e:  # checkpointed; exit status 3 and run_dir/PREEMPTED tell the launcher
        print(f"pre-empted: {e}", flush=True)
        sys.exit(3)
    except (pcdist.ConfigError, DataError) as e:  # the user's input, not a bug: one line, status 2
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if "val/accuracy" in result:
        print(f"step {result['step']}: val/accuracy {result['val/accuracy']:.4f}; run directory: {result['run_dir']}",
              flush=True)


def main() -> None:
    """Parse Hydra overrides from the command line and train."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Under torchrun every rank runs Hydra: none writes Hydra's own files (the logging rank
        # writes the resolved config.yaml itself), and all agree on the run directory (pcdist/rundir.py).
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    if not any(a.startswith(("hydra.run.dir=", "--help", "-h", "--cfg", "-c", "--info", "--multirun", "-m"))
               for a in sys.argv[1:]):
        try:  # the new run directory, named before Hydra resolves it (cached: Hydra gets the same)
            launch_run_dir()
        except pcdist.ConfigError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
    hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")(_train)()


if __name__ == "__main__":
    main()
