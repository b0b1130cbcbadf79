#!/usr/bin/env bash
# One H200 device call (carry .vllm_ops): bench/process_state.py on 16/1 B=128 L=8K, in stage
# order and with torch first, and on L=64K in stage order. Writes $OUT/process_state_*.{json,log}
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
for run in "8k 6" "8k_torch_first 6 --torch-first" "64k 7"; do
  set -- $run; name=$1; shift; shape=$1; shift
  timeout 200 python3 bench/process_state.py --out "$out/ps_$name" --shape "$shape" "$@" \
    > "$out/process_state_$name.log" 2>&1
  echo "$name rc=$? after ${SECONDS}s"; grep -v Warning "$out/process_state_$name.log" | tail -n 9
  mv "$out/ps_$name/process_state.json" "$out/process_state_$name.json"; rmdir "$out/ps_$name"
done
