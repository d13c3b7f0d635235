#!/usr/bin/env bash
# Train on this machine with torchrun: all GPUs if there are any, else NPROC CPU processes (gloo).
#   launch/local.sh parallel.layer=2                 # extra arguments are Hydra overrides
#   NPROC=4 launch/local.sh parallel.layer=2 parallel.data=2
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
if [[ -z "${NPROC:-}" ]]; then
  NPROC=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
# Workers keep their own store: a shared one hands restarted workers stale addresses.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train.py "$@"
