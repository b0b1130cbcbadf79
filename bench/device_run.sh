#!/usr/bin/env bash
# One H200 device call (carry .vllm_ops, and .whl if packages must travel): the kernel tests
# compiled on the GPU, then bench/kernels.py against vLLM's ops (it fails without them).
# About 7 minutes at most.
# $OUT gets gpu_tests.log, kernels.log, kernels.json, kernels.md and roofline.png.
# Usage: bash bench/device_run.sh [all|tests|kernels] [more bench/kernels.py flags]
# (TEST_TIMEOUT_S bounds the tests, KERNELS_TIMEOUT_S the bench, e.g. with --sweep)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} XLA_PYTHON_CLIENT_PREALLOCATE=false
what=all; [[ ${1:-} =~ ^(all|tests|kernels)$ ]] && { what=$1; shift; }
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu_tests.log"
if [[ $what != kernels ]]; then
  xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")  # 4 workers share the GPU
  timeout ${TEST_TIMEOUT_S:-200} python3 -m pytest -q -p no:cacheprovider $xdist tests/kernels \
    tests/attention/test_msa_attention.py 2>&1 | tail -n 30 | tee -a "$out/gpu_tests.log"
  echo "pytest rc=${PIPESTATUS[0]} after ${SECONDS}s" | tee -a "$out/gpu_tests.log"
fi
[[ $what == tests ]] && exit 0
budget=$(( 380 - SECONDS )); (( budget < 60 )) && budget=60  # start no shape after this
timeout ${KERNELS_TIMEOUT_S:-$(( budget + 70 ))} python3 bench/kernels.py --out "$out" \
  --require-vllm --budget-s "$budget" "$@" > "$out/kernels.log" 2>&1
echo "kernels.py rc=$? after ${SECONDS}s"
grep -v '^|' "$out/kernels.log" | tail -n 15  # errors, if any
sed '/^vLLM timing per op/,$d' "$out/kernels.md" 2>/dev/null  # the main table
