#!/usr/bin/env bash
# Train on this machine with torchrun: all GPUs if there are any, else NPROC CPU processes (gloo).
#   launch/local.sh                                  # every process a layer slice (parallel.layer = NPROC / parallel.data)
#   NPROC=4 launch/local.sh parallel.data=2          # 2 replicas x 2 layer slices; extra arguments are Hydra overrides
# OMP_NUM_THREADS (torch threads per process) defaults to the cores / NPROC. PYTHON defaults to the checkout's
# .venv/bin/python. Relative paths (runs/, data.path, PYTHON) are relative to the directory you run it from, as
# for train.py.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)  # the checkout
PYTHON=${PYTHON:-$here/.venv/bin/python}
RESEND_S=${RESEND_S:-1}
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
if ! [[ $OMP_NUM_THREADS =~ ^[0-9]+$ ]] || ((10#$OMP_NUM_THREADS < 1)); then
  echo "launch/local.sh: error: OMP_NUM_THREADS=$OMP_NUM_THREADS is not a whole number >= 1" >&2
  exit 2
fi

# Stopping: this script passes Ctrl-C and SIGTERM to the workers (torchrun starts each in a session of its
# own, out of the terminal's reach); they finish their step, checkpoint and stop (exit 0:
# PCDIST_PREEMPTED_STATUS), and this script exits 130 (Ctrl-C) or 3 (SIGTERM), as train.py does. torchrun's
# agent only waits for them: launch/torchrun_agent.py keeps it from handling either signal (it would pass them on
# itself, then end with a traceback). The workers start with Ctrl-C's default (KeyboardInterrupt: one line while
# they start) and SIGTERM ignored until their training catches it, so that one still starting is not killed by
# it: SIGTERM is sent again every RESEND_S seconds until they have stopped, as launch/slurm_node.sh does.
stopped=
agent=
pending=
forward() {  # pass SIG$1 to the workers once each has run a second (its Python catches Ctrl-C by then); till
  # then (none yet, or just started) keep it, and pass it on as soon as they have; SIGTERM again every RESEND_S s
  local ages
  ages=$(ps -o etimes= --ppid "$agent" 2>/dev/null || true)
  if [[ -n $ages ]] && ! awk '$1 < 1 { young = 1 } END { exit !young }' <<<"$ages"; then
    pkill "-$1" -P "$agent" || true
    pending=
    if [[ $1 == TERM ]]; then
      pending=TERM resend_at=$((SECONDS + RESEND_S))
    fi
  else
    pending=$1 resend_at=0
  fi
}
trap 'stopped=${stopped:-130}; pending=INT' INT
trap 'stopped=${stopped:-3}; pending=TERM' TERM
# One process checks the overrides for NPROC ranks first: a mistake is one line and exit status 2.
WORLD_SIZE="$NPROC" "$PYTHON" "$here/train.py" --check "$@" >/dev/null
if [[ -n $stopped ]]; then  # stopped during the check: nothing started
  exit "$stopped"
fi

export PCDIST_PREEMPTED_STATUS=0
export PCDIST_LAUNCHER=local PCDIST_LOCAL_SCRIPT=$here/launch/local.sh  # (how the workers' lines say to resume)
(trap '' TERM; exec "$PYTHON" "$here/launch/torchrun_agent.py" --noop INT TERM --standalone \
  --nproc_per_node="$NPROC" "$here/train.py" "$@") &
agent=$!
resend_at=0
while kill -0 "$agent" 2>/dev/null; do
  sleep 0.2 &
  wait $! || true
  if [[ -n $pending ]] && ((SECONDS >= resend_at)); then
    forward "$pending"
  fi
done
wait "$agent" && status=0 || status=$?
if [[ -n $stopped && $status == 0 ]]; then
  exit "$stopped"
fi
exit "$status"
