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

# Stopping: this script passes Ctrl-C and SIGTERM to the workers (torchrun starts each in a session of its
# own, out of the terminal's reach); they finish their step, checkpoint and stop (exit 0:
# PCDIST_PREEMPTED_STATUS), and this script exits 130 (Ctrl-C) or 3 (SIGTERM), as train.py does. torchrun's
# agent only waits for them: launch/torchrun_agent.py keeps it from handling either signal (it would pass them on
# itself, then end with a traceback) with no-op handlers, so that the workers it starts get the default ones.
export PCDIST_PREEMPTED_STATUS=0
"$PYTHON" launch/torchrun_agent.py --noop INT,TERM --standalone --nproc_per_node="$NPROC" train.py "$@" &
agent=$!
stopped=
pending=
forward() {  # pass SIG$1 to the workers once each has run a second (its Python catches signals by then); till
  # then (none yet, or just started) keep it, and pass it on as soon as they have
  local ages
  ages=$(ps -o etimes= --ppid "$agent" 2>/dev/null || true)
  if [[ -n $ages ]] && ! awk '$1 < 1 { young = 1 } END { exit !young }' <<<"$ages"; then
    pkill "-$1" -P "$agent" || true
    pending=
  else
    pending=$1
  fi
}
trap 'stopped=${stopped:-130}; forward INT' INT
trap 'stopped=${stopped:-3}; forward TERM' TERM
while kill -0 "$agent" 2>/dev/null; do
  sleep 0.2 &
  wait $! || true
  if [[ -n $pending ]]; then
    forward "$pending"
  fi
done
wait "$agent" && status=0 || status=$?
if [[ -n $stopped && $status == 0 ]]; then
  exit "$stopped"
fi
exit "$status"
