#!/usr/bin/env bash
# One H200 device call (temporary): compiled Mosaic GPU decode tests, the exchange A/B, a trace.
set -uo pipefail
cd "$(dirname "$0")/.."
NAME=relaxed TESTS="sparse_decode_mgpu and (reference or exchange)" TEST_TIMEOUT_S=150 \
  VARIANTS=mgpu,mgpu_cst \
  SHAPES=16/1/1/8192,64/4/1/65536,16/1/16/8192,16/1/16/65536,16/1/64/8192,64/4/16/8192 \
  RUN_TIMEOUT_S=130 bash bench/variants_device.sh
cd bench && python3 decode_trace.py --out $OUT/trace_relaxed.json --calls 3 \
  --shapes 16/1/1/8192,16/1/16/8192 2>&1 | grep -v -i warn | tail -3
