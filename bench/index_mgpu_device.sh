#!/usr/bin/env bash
# One H200 device call (carry .vllm_ops) for the Mosaic GPU indexer + select: its tests and
# the default indexer's compiled, Nsight Compute kernel durations against the Triton indexer
# and vLLM's (kernel_profile.sh), then bench/index_select_mgpu.py in bf16 and in e4m3.
# Usage (device tool): bash bench/index_mgpu_device.sh [profile shapes] [bench shapes]
#   [ppp list] [fp8 bench shapes]; a shape list "-" skips that step. About 8 minutes.
# $OUT gets idx_tests.log, ncu.csv, kernel_profile.md/.json, idx_mgpu.json/.log,
# idx_mgpu_fp8.json/.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"; ppp=${3:-1}
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_index_select_mgpu.py \
  tests/kernels/test_index_select_default.py tests/attention/test_msa_attention.py \
  > "$out/idx_tests.log" 2>&1
echo "pytest rc=$? after ${SECONDS}s"; tail -n 5 "$out/idx_tests.log"
if [[ ${1:-0,8} != - ]]; then
  NCU_TIMEOUT_S=120 bash bench/kernel_profile.sh "${1:-0,8}" --mgpu-ppp "${ppp%%,*}" | tail -n 12
  echo "profile done after ${SECONDS}s"
fi
bench() {  # bench NAME SHAPES [flags]
  [[ $2 == - ]] && return
  timeout ${BENCH_TIMEOUT_S:-150} python3 bench/index_select_mgpu.py --out "$out/$1.json" \
    --shapes "$2" --ppp "$ppp" --reps 50 --trials 2 "${@:3}" > "$out/$1.log" 2>&1
  echo "$1 rc=$? after ${SECONDS}s"
  python3 - "$out/$1.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["shape"], {k: (v["us"] if isinstance(v, dict) else v) for k, v in r.items()
                       if k != "shape" and not k.endswith("_kernels")})
PY
}
bench idx_mgpu "${2:-0,1,2,3,8,9,10}"
bench idx_mgpu_fp8 "${4:-1,3,9,11}" --fp8
