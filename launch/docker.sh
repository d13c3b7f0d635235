#!/usr/bin/env bash
# Build the image and train in it on all GPUs; runs/ is mounted so the run directory survives.
#   launch/docker.sh parallel.layer=2          # extra arguments are Hydra overrides
#   NPROC=2 GPUS= launch/docker.sh parallel.layer=2   # CPU only (gloo)
# The container runs as your uid and gid, so everything it writes under runs/ is yours to remove.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-pcdist:latest}
NPROC=${NPROC:-8}
GPUS=${GPUS-all}
docker build -t "$IMAGE" .
mkdir -p runs data
gpu_args=()
if [[ -n "$GPUS" ]]; then
  gpu_args=(--gpus "$GPUS")
fi
exec docker run --rm "${gpu_args[@]}" --ipc=host --shm-size=8g --user "$(id -u):$(id -g)" \
  -v "$PWD/runs:/app/runs" -v "$PWD/data:/app/data:ro" -e WANDB_API_KEY \
  "$IMAGE" --standalone --nproc_per_node="$NPROC" -m pcdist "$@"
