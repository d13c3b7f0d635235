#!/usr/bin/env bash
# Build the image and train in it on all GPUs; runs/ (of the checkout) is mounted so the run directory survives.
#   launch/docker.sh parallel.layer=2          # extra arguments are Hydra overrides
#   GPUS= launch/docker.sh parallel.layer=2    # CPU only (gloo): NPROC processes, default 2
#   GPUS='"device=0,1"' launch/docker.sh       # two of the GPUs (docker run --gpus's syntax)
# NPROC (processes) defaults to one per GPU given to the container, counted with nvidia-smi. The overrides are
# checked for NPROC processes in the container first: a mistake is one line and exit status 2. The container
# runs as your uid and gid, so everything it writes under runs/ is yours to remove.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-pcdist:latest}
GPUS=${GPUS-all}
die() {
  echo "launch/docker.sh: error: $*" >&2
  exit 2
}
if [[ -z ${NPROC:-} ]]; then
  if [[ -z $GPUS ]]; then
    NPROC=2
  elif [[ $GPUS =~ ^[0-9]+$ ]]; then  # --gpus 2: the first two
    NPROC=$GPUS
  elif [[ $GPUS =~ device=([0-9,]+) ]]; then  # --gpus '"device=0,2"'
    ids=${BASH_REMATCH[1]//,/ }
    read -ra ids <<<"$ids"
    NPROC=${#ids[@]}
  else  # all
    command -v nvidia-smi >/dev/null || die "GPUS=$GPUS but this host has no nvidia-smi (no NVIDIA driver): for" \
      "the CPU run GPUS= launch/docker.sh (NPROC CPU processes, default 2)"
    NPROC=$(nvidia-smi -L | grep -c '^GPU ' || true)
  fi
fi
if ! [[ $NPROC =~ ^[0-9]+$ ]] || ((10#$NPROC < 1)); then
  die "NPROC=$NPROC is not a whole number >= 1 (with GPUS=$GPUS); set NPROC, or GPUS= for the CPU"
fi
NPROC=$((10#$NPROC))
docker build -t "$IMAGE" .
mkdir -p runs data
gpu_args=()
if [[ -n "$GPUS" ]]; then
  gpu_args=(--gpus "$GPUS")
fi
args=(--rm "${gpu_args[@]}" --ipc=host --shm-size=8g --user "$(id -u):$(id -g)" -v "$PWD/runs:/app/runs"
  -v "$PWD/data:/app/data:ro" -e WANDB_API_KEY)
docker run "${args[@]}" -e WORLD_SIZE="$NPROC" --entrypoint python "$IMAGE" -m pcdist --check "$@" >/dev/null
exec docker run "${args[@]}" "$IMAGE" --standalone --nproc_per_node="$NPROC" -m pcdist "$@"
