#!/usr/bin/env bash
# Train on this machine with torchrun: all GPUs if there are any, else NPROC CPU processes (gloo).
#   launch/local.sh                                  # every process a layer slice (parallel.layer = NPROC / parallel.data)
#   NPROC=4 launch/local.sh parallel.data=2          # 2 replicas x 2 layer slices; extra arguments are Hydra overrides
# OMP_NUM_THREADS (torch threads per process) defaults to the cores / NPROC.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
if [[ -z "${NPROC:-}" ]]; then
  if compgen -G "/dev/nvidia[0-9]*" >/dev/null || [[ -e /dev/kfd || -e /dev/dxg ]]; then
    NPROC=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 2)')
  else
    NPROC=2  # no GPU device file (NVIDIA, ROCm, WSL): torch would find no GPU, and its import costs seconds
  fi
fi
if ! [[ $NPROC =~ ^[0-9]+$ ]] || ((10#$NPROC < 1)); then
  echo "launch/local.sh: error: NPROC=$NPROC is not a whole number >= 1" >&2
  exit 2
fi
NPROC=$((10#$NPROC))
CORES=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES > NPROC ? CORES / NPROC : 1 ))}
# One process checks the overrides for NPROC ranks first: a mistake is one line and exit status 2.
WORLD_SIZE="$NPROC" "$PYTHON" train.py --check "$@" >/dev/null
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train.py "$@"
