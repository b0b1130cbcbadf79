#!/usr/bin/env bash
# One H200 device call: the Mosaic GPU indexer's tests compiled, then its two halves on their
# own against the Triton ones (bench/index_select_mgpu.py --parts), bf16 and e4m3.
# Usage (device tool): bash bench/index_parts_device.sh [bf16 shapes] [fp8 shapes]
# $OUT gets idx_tests.log, parts.json/.log, parts_fp8.json/.log. About 5 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_index_select_mgpu.py \
  > "$out/idx_tests.log" 2>&1
echo "pytest rc=$? after ${SECONDS}s"; tail -n 5 "$out/idx_tests.log"
parts() {  # parts NAME SHAPES [flags]
  timeout ${BENCH_TIMEOUT_S:-200} python3 bench/index_select_mgpu.py --out "$out/$1.json" \
    --shapes "$2" --parts --reps 100 --trials 3 "${@:3}" > "$out/$1.log" 2>&1
  echo "$1 rc=$? after ${SECONDS}s"
  python3 - "$out/$1.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["shape"], {k: (v["us"] if isinstance(v, dict) else v) for k, v in r.items()
                       if k != "shape"})
PY
}
parts parts "${1:-0,1,2,3,5,7,9,11}"
parts parts_fp8 "${2:-1,3}" --fp8
