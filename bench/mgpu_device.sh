#!/usr/bin/env bash
# One H200 device call for the Mosaic GPU sparse decode: its tests compiled on the GPU, then
# bench/decode_mgpu.py (Mosaic GPU vs Triton at the 16 decode shapes). Under 6 minutes.
# Usage (device tool, repository root):  bash bench/mgpu_device.sh [bench args]
# Writes $OUT/mgpu_env.log, $OUT/mgpu_tests.log, $OUT/decode_mgpu.log, $OUT/decode_mgpu.json.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
{ nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
  python3 -c "import jax; print(jax.__version__, jax.devices())"; } > "$out/mgpu_env.log" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 \
  tests/kernels/test_sparse_decode_mgpu.py > "$out/mgpu_tests.log" 2>&1
echo "pytest exit $?" >> "$out/mgpu_tests.log"
tail -n 25 "$out/mgpu_tests.log"
timeout 190 python3 bench/decode_mgpu.py --out "$out/decode_mgpu.json" "$@" \
  > "$out/decode_mgpu.log" 2>&1
echo "bench exit $?" >> "$out/decode_mgpu.log"
grep -v '^{' "$out/decode_mgpu.log" | tail -n 30
