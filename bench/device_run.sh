#!/usr/bin/env bash
# One H200 device call: kernel tests compiled on the GPU, then the kernel benchmark.
# Usage (device tool, carry .vllm_ops):  bash bench/device_run.sh [kernels|tests|all] [bench args]
# Results land in $OUT (gpu_tests.log, kernels.json, kernels.md, roofline.png); the device
# tool returns at most 8 files, so logs that duplicate the JSON stay on the machine.
set -uo pipefail
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev}
what=${1:-all}; shift || true
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$out/gpu_tests.log"
if [[ $what == all || $what == tests ]]; then
  python3 -m pytest -q -p no:cacheprovider $(ls tests/test_{index_scores,topk_select,sparse_decode,sparse_prefill,msa_attention}.py 2>/dev/null) \
    2>&1 | tail -n 40 | tee -a "$out/gpu_tests.log"
fi
if [[ $what == all || $what == kernels ]]; then
  python3 bench/kernels.py --out "$out" --vllm-ops .vllm_ops "$@" 2>&1 | tee /tmp/kernels.log | grep -v '^{'
fi
