#!/usr/bin/env bash
# One H200 device call for the Mosaic GPU decode's diagnosis (steps as arguments, default all):
#   tests    its compiled tests;
#   trace    the per-CTA trace of its named regions (decode_trace.py, TRACE_SHAPES);
#   decode   its variants against the Triton decode (decode_mgpu.py, DECODE_SHAPES,
#            DECODE_VARIANTS; JSON decode_mgpu$TAG.json);
#   prefill  the prefill chunk bench (prefill.py).
# $OUT gets diag.log and each script's JSON. Usage: bash bench/decode_diag_device.sh [steps]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
log="$out/diag.log"
steps=${*:-tests trace decode prefill}
small=16/1/1/8192,16/1/1/65536,16/1/16/8192,16/1/16/65536,64/4/1/8192,64/4/1/65536,64/4/16/8192,64/4/16/65536
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee -a "$log"
for step in $steps; do
  echo "== $step (after ${SECONDS}s)" | tee -a "$log"
  case $step in
    tests) timeout 150 python3 -m pytest -q -p no:cacheprovider \
             tests/kernels/test_sparse_decode_mgpu.py 2>&1 | tail -n 5 ;;
    trace) timeout 150 python3 bench/decode_trace.py --out "$out/decode_trace.json" \
             ${TRACE_SHAPES:+--shapes "$TRACE_SHAPES"} 2>&1 | grep -v -i warn ;;
    decode) timeout 240 python3 bench/decode_mgpu.py --out "$out/decode_mgpu${TAG:-}.json" \
              --shapes "${DECODE_SHAPES:-$small}" --variants "${DECODE_VARIANTS:-mgpu,mgpu_precise,triton}" \
              --reps 50 --trials 3 2>&1 | sed -n '/^| Hq/,$p' ;;
    prefill) timeout 170 python3 bench/prefill.py --out "$out" --trials 3 2>&1 \
               | grep -v -i warn | tail -n 40 ;;
    *) echo "unknown step $step" ;;
  esac 2>&1 | tee -a "$log"
done
echo "done after ${SECONDS}s" | tee -a "$log"
