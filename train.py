"""pcdist's training entry point (a thin Hydra wrapper over ``pcdist.train``).

    python train.py [overrides]                                   # one process
    torchrun --standalone --nproc_per_node=2 train.py             # two layer-parallel processes
    python train.py --help                                        # every config group and key, documented
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # CPU results independent of memory alignment (exact resume)

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import pcdist
from pcdist.checkpoint import CheckpointError
from pcdist.cli import before_hydra, fail
from pcdist.data import DataError

if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # Under torchrun every rank runs Hydra: none writes Hydra's own files (the logging rank
    # writes the resolved config.yaml itself), and all agree on the run directory (conf/config.yaml).
    sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    cfg.run_dir = HydraConfig.get().runtime.output_dir
    try:
        result = pcdist.train(cfg)
    except pcdist.Preempted as e:  # checkpointed; exit status 3 and run_dir/PREEMPTED tell the launcher
        print(f"pre-empted: {e}", flush=True)
        sys.exit(3)
    except (pcdist.ConfigError, DataError, CheckpointError) as e:  # the user's input, not a bug: one line, status 2
        fail(str(e))
    if "val/accuracy" in result:
        print(f"step {result['step']}: val/accuracy {result['val/accuracy']:.4f}; run directory: {result['run_dir']}",
              flush=True)


if __name__ == "__main__":
    before_hydra(Path(__file__).resolve().parent / "conf", sys.argv[1:])  # --help, --check, mistyped keys
    main()
