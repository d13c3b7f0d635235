#!/usr/bin/env bash
# One node's share of a launch/slurm.sbatch job (srun starts it once per node): torchrun's agent, which
# starts this node's training processes, and SLURM's stop signals passed on to those processes.
#   launch/slurm_node.sh python launch/torchrun_agent.py USR1,TERM ... train.py ...
#
# SLURM sends USR1 (scancel --signal=USR1, the --signal warning before the time limit) and TERM (its own
# pre-emption, scancel, the time limit) to this shell only: proctrack/cgroup signals the processes a step
# started, not their children (SIGKILL excepted). proctrack/linuxproc signals every process of the step.
# Either way the agent ignores both (an agent killed by a signal takes its workers down with it, before
# they checkpoint; launch/torchrun_agent.py keeps torchrun's own handlers off them), and this shell passes
# each signal to the agent's workers: at once, then every RESEND_S seconds until the agent exits, so that a
# worker still starting up (it ignores them until its training loop catches them) or restarted after a crash
# stops as well.
set -uo pipefail
RESEND_S=${RESEND_S:-5}
# The traps come first: a signal that srun passes on before they are set ends this shell, and the job with it.
agent=
stop=
resend_at=0
forward() {
  if [[ -z $stop ]]; then
    echo "$(hostname -s): got SIG$1; the workers finish their step, checkpoint and stop"
  fi
  stop=$1
  resend_at=$((SECONDS + RESEND_S))
  [[ -z $agent ]] || pkill "-$1" -P "$agent" || true
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
(trap '' USR1 TERM; exec "$@") &
agent=$!
while kill -0 "$agent" 2>/dev/null; do
  sleep 1 &
  wait $! || true
  if [[ -n $stop ]] && ((SECONDS >= resend_at)); then
    resend_at=$((SECONDS + RESEND_S))
    pkill "-$stop" -P "$agent" || true
  fi
done
wait "$agent"
