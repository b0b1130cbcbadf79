#!/usr/bin/env bash
# One H200 device call (carry .vllm_ops) for the Mosaic GPU indexer + select: its tests and
# the default indexer's compiled, Nsight Compute kernel durations against the Triton indexer
# and vLLM's (kernel_profile.sh), then bench/index_select_mgpu.py: bf16, e4m3, and the scores
# and select alone (--parts).
# Usage (device tool): bash bench/index_mgpu_device.sh [profile shapes] [bench shapes]
#   [grid] [fp8 bench shapes] [parts shapes]; a shape list "-" skips that step (parts is
#   skipped unless given); grid: index_select_mgpu.py's --grid (default "ns=2,3"). About 8
#   minutes with the defaults.
# $OUT gets idx_tests.log, ncu.csv, kernel_profile.md/.json, and a .json/.log per bench step
# (idx_mgpu, idx_mgpu_fp8, parts, parts_fp8).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"; grid=${3:-ns=2,3}
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_index_select_mgpu.py \
  tests/kernels/test_index_select_default.py tests/attention/test_msa_attention.py \
  > "$out/idx_tests.log" 2>&1
echo "pytest rc=$? after ${SECONDS}s"; tail -n 5 "$out/idx_tests.log"
if [[ ${1:-0,8} != - ]]; then
  NCU_TIMEOUT_S=120 bash bench/kernel_profile.sh "${1:-0,8}" | tail -n 12
  echo "profile done after ${SECONDS}s"
fi
bench() {  # bench NAME SHAPES [flags]: one summary line per shape
  [[ $2 == - ]] && return
  timeout ${BENCH_TIMEOUT_S:-150} python3 bench/index_select_mgpu.py --out "$out/$1.json" \
    --shapes "$2" --reps 50 --trials 2 "${@:3}" > "$out/$1.log" 2>&1
  echo "$1 rc=$? after ${SECONDS}s"
  grep -E '^[0-9]+/[0-9]+ B=' "$out/$1.log" || tail -n 5 "$out/$1.log"
}
bench idx_mgpu "${2:-0,1,2,3,8,9,10}" --grid "$grid"
bench idx_mgpu_fp8 "${4:-1,3,9,11}" --grid "$grid" --fp8
bench parts "${5:--}" --parts --reps 100 --trials 3
bench parts_fp8 "${5:--}" --parts --reps 100 --trials 3 --fp8
