#!/usr/bin/env bash
# One H200 device call: kernel tests compiled on the GPU, then the kernel benchmark.
# Usage (device tool, carry .vllm_ops):  bash bench/device_run.sh [kernels|tests|all] [bench args]
# Results land in $OUT (gpu_tests.log, kernels.json, kernels.md, roofline.png).
set -uo pipefail
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev}
what=${1:-all}; shift || true
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
if [[ $what == all || $what == tests ]]; then
  python3 -m pytest -q -p no:cacheprovider $(ls tests/test_{index_scores,topk_select,sparse_decode,sparse_prefill,msa_attention}.py 2>/dev/null) \
    2>&1 | tail -n 40 | tee "$out/gpu_tests.log"
fi
if [[ $what == all || $what == kernels ]]; then
  python3 bench/kernels.py --out "$out" --vllm-ops .vllm_ops "$@" 2>&1 | tee "$out/kernels.log" | grep -v '^{'
fi
