#!/usr/bin/env bash
# One H200 device call (carry .vllm_ops): kernel durations of ours and vLLM's indexer and
# decode under Nsight Compute at small and large shapes (bench/kernel_profile.py).
# Usage (device tool): bash bench/kernel_profile.sh [shape indices, default 0,1,2,5,7,9]
#   [more `kernel_profile.py target` flags, e.g. --mgpu-ctas 264]
# $OUT gets ncu.csv (raw metrics), ncu_run.log, kernel_profile.md/.json (the table).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
filter=$(python3 -c "import sys; sys.path.insert(0, 'bench'); import kernel_profile as k; print(k.NCU_FILTER)" 2>/dev/null | tail -n 1)
timeout ${NCU_TIMEOUT_S:-300} ncu --clock-control none --target-processes all -k "$filter" \
  --metrics gpu__time_duration.sum,dram__bytes.sum,launch__grid_size,launch__registers_per_thread \
  --csv --page raw --print-units base --log-file "$out/ncu.csv" \
  python3 bench/kernel_profile.py target --shapes "${1:-0,1,2,5,7,9}" --out "$out" "${@:2}" \
  > "$out/ncu_run.log" 2>&1
echo "ncu rc=$?"; tail -n 3 "$out/ncu_run.log"
python3 bench/kernel_profile.py table --csv "$out/ncu.csv" --plan "$out/plan.json" \
  --md "$out/kernel_profile.md"
