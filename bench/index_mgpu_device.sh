#!/usr/bin/env bash
# One H200 device call (carry .vllm_ops) for the Mosaic GPU indexer + select: its tests
# compiled, Nsight Compute kernel durations against the Triton indexer and vLLM's
# (kernel_profile.sh), then bench/index_select_mgpu.py. About 6 minutes.
# Usage (device tool): bash bench/index_mgpu_device.sh [profile shapes] [bench shapes] [ppp list]
# $OUT gets idx_tests.log, ncu.csv, kernel_profile.md/.json, idx_mgpu.json/.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"; ppp=${3:-1}
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_index_select_mgpu.py \
  > "$out/idx_tests.log" 2>&1
echo "pytest rc=$? after ${SECONDS}s"; tail -n 5 "$out/idx_tests.log"
NCU_TIMEOUT_S=150 bash bench/kernel_profile.sh "${1:-0,1,2,8}" --mgpu-ppp "${ppp%%,*}" \
  | tail -n 12
echo "profile done after ${SECONDS}s"
timeout ${BENCH_TIMEOUT_S:-200} python3 bench/index_select_mgpu.py --out "$out/idx_mgpu.json" \
  --shapes "${2:-0,1,2,8,9,10}" --ppp "$ppp" --reps 50 --trials 2 > "$out/idx_mgpu.log" 2>&1
echo "bench rc=$? after ${SECONDS}s"
python3 - "$out/idx_mgpu.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["shape"], {k: (v["us"] if isinstance(v, dict) else v) for k, v in r.items()
                       if k != "shape" and not k.endswith("_kernels")})
PY
