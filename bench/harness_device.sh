#!/usr/bin/env bash
# One H200 device call: the 16/1 B=128 decode timed by `bench/kernels.py` without vLLM's ops,
# by `bench/decode_mgpu.py`, and by `bench/kernels.py` with vLLM's ops (carry .vllm_ops): which
# part of the run of record's process costs the decode its extra time.
# Usage (device tool): bash bench/harness_device.sh   Writes $OUT/harness_{ours,mgpu,vllm}.*
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
common=(--shapes 6,7 --fp8 none --reps 200)
python3 bench/kernels.py "${common[@]}" --vllm-ops '' --out "$out/harness_ours" \
  > "$out/harness_ours.log" 2>&1
echo "ours-only rc=$? after ${SECONDS}s"; grep -E "^  decode|^copy" "$out/harness_ours.log"
python3 bench/decode_mgpu.py --out "$out/harness_mgpu.json" --reps 200 --trials 6 \
  --shapes 16/1/128/8192,16/1/128/65536 --variants mgpu > "$out/harness_mgpu.log" 2>&1
echo "decode_mgpu rc=$? after ${SECONDS}s"; grep "^| 16/1" "$out/harness_mgpu.log"
python3 bench/kernels.py "${common[@]}" --require-vllm --out "$out/harness_vllm" \
  > "$out/harness_vllm.log" 2>&1
echo "with vLLM rc=$? after ${SECONDS}s"; grep -E "^  decode|^copy" "$out/harness_vllm.log"
rm -f "$out"/harness_{ours,vllm}/{kernels.md,roofline.png}  # the device returns 8 files at most
