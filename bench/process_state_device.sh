#!/usr/bin/env bash
# One H200 device call (carry .vllm_ops): bench/process_state.py on 16/1 B=128 L=8K under load
# alone (--sequence stress), then in vLLM's stage order. Writes $OUT/process_state_*.{json,log}
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
for run in "stress 6 --sequence stress" "vllm 6"; do
  set -- $run; name=$1; shift; shape=$1; shift
  timeout 200 python3 bench/process_state.py --out "$out/ps_$name" --shape "$shape" "$@" \
    > "$out/process_state_$name.log" 2>&1
  echo "$name rc=$? after ${SECONDS}s"; grep -v Warning "$out/process_state_$name.log" | tail -n 9
  mv "$out/ps_$name/process_state.json" "$out/process_state_$name.json"; rmdir "$out/ps_$name"
done
