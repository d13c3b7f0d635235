#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in one run, for a machine with a CUDA device and PyTorch (no checkout install
# needed): the CUDA tests, the capture tests, the fused-chain tests, then benchmarks/gpu.py. Results go to
# ${OUT:-benchmarks/results} (gpu_cuda.json, its pictures, the pytest log).
#   bash benchmarks/gpu_check.sh            # everything (the tests took 7 minutes in one process on an H200,
#                                           # 2026-11-27, test_chain's compiled checks about 3: now 4 processes)
#   QUICK=1 bash benchmarks/gpu_check.sh    # the tests and gpu.py --quick (its table alone: about 2 minutes)
#   GPU_ARGS="--depths 4,128,512 --only table,depth,wide" QUICK=1 bash benchmarks/gpu_check.sh   # gpu.py's
#                                           # arguments (ops: host work, which a CPU measures as well)
#   TEST_TIMEOUT=230 BENCH_TIMEOUT=300 ... bash benchmarks/gpu_check.sh   # seconds for each part (0: no limit),
#                                           # so that one lease's 10-minute command always reaches gpu.py, whose
#                                           # JSON is written after every network (a run cut short keeps them)
# Where hydra-core / omegaconf are missing, install them first (or put their wheels on PYTHONPATH).
# Exit status: 1 if the tests or gpu.py failed (or ran out of their time).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=$(realpath -m "${OUT:-benchmarks/results}")
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
python -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' | tee "$out/gpu_check.log"
# Every test module and gpu.py import pcdist, and pcdist hydra-core and omegaconf: say so once, before anything.
if ! err=$(python -c 'import pcdist' 2>&1); then
  echo "gpu_check: pcdist does not import (hydra-core and omegaconf installed?): ${err##*$'\n'}" |
    tee -a "$out/gpu_check.log"
  exit 1
fi
# The tests in 4 processes where pytest-xdist is installed (they share the GPU; none is timed): most of their
# time is Triton compiling kernel variants on the CPU, 7 minutes in one process on an H200.
workers=()
python -c 'import xdist' 2>/dev/null && workers=(-n 4)
# test_chain.py first: its compiled checks (about 3 of those 7 minutes, each compiling in a process of its own)
# then overlap the rest. -v: one line per test as it ends, so a run cut short by TEST_TIMEOUT still names each
# result (-q prints the failures only at the end).
timeout -k 10 "${TEST_TIMEOUT:-0}" python -m pytest -v --durations=15 "${workers[@]}" -p no:cacheprovider \
  tests/test_chain.py tests/test_cuda.py tests/test_capture.py 2>&1 | tee -a "$out/gpu_check.log"
tests=${PIPESTATUS[0]}
[[ $tests == 124 ]] && echo "gpu_check: the tests ran out of TEST_TIMEOUT=${TEST_TIMEOUT}s" | tee -a "$out/gpu_check.log"
args=()
[[ -n "${QUICK:-}" ]] && args+=(--quick)
read -ra extra <<< "${GPU_ARGS:-}"
args+=("${extra[@]}")
(cd benchmarks && timeout -k 10 "${BENCH_TIMEOUT:-0}" python gpu.py "${args[@]}" --out "$out") 2>&1 |
  tee -a "$out/gpu_check.log"
bench=${PIPESTATUS[0]}
[[ $bench == 124 ]] && echo "gpu_check: gpu.py ran out of BENCH_TIMEOUT=${BENCH_TIMEOUT}s" | tee -a "$out/gpu_check.log"
echo "gpu_check: tests exit $tests, gpu.py exit $bench" | tee -a "$out/gpu_check.log"
(( tests == 0 && bench == 0 ))
