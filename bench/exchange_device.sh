#!/usr/bin/env bash
# One H200 device call for the decode's split exchange: the Mosaic decode tests compiled, then
# bench/decode_mgpu.py (cluster against global exchange, one process) and bench/decode_trace.py
# on the shapes that split. About 4 minutes (2026-12-03: 237 s). $OUT gets tests.log, ab.{json,log}, trace.{json,log}.
# Usage (device tool): bash bench/exchange_device.sh [SHAPES]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
splitting=16/1/1/8192,16/1/1/65536,16/1/16/8192,16/1/16/65536,64/4/1/8192,64/4/1/65536
splitting+=,64/4/16/8192,64/4/16/65536,16/1/64/8192,16/1/64/65536  # the shapes with S > 1
shapes=${1:-$splitting}
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sparse_decode_mgpu.py \
  > "$out/tests.log" 2>&1
echo "tests rc=$? after ${SECONDS}s"; tail -n 5 "$out/tests.log"
timeout 280 python3 bench/decode_mgpu.py --shapes "$shapes" --variants mgpu,mgpu_global \
  --reps 200 --out "$out/ab.json" > "$out/ab.log" 2>&1
echo "decode_mgpu rc=$? after ${SECONDS}s"; sed -n '/^| Hq/,$p' "$out/ab.log"
timeout 120 python3 bench/decode_trace.py --shapes 16/1/1/8192,64/4/1/65536,16/1/16/8192 \
  --variants default,global_exchange --out "$out/trace.json" > "$out/trace.log" 2>&1
echo "trace rc=$? after ${SECONDS}s"; cat "$out/trace.log" | cut -c1-400
