#!/usr/bin/env bash
# One H200 device call for the sparse decode variants: the decode tests compiled on the GPU,
# then bench/decode_mgpu.py (Mosaic GPU with and without PDL against Triton at the 16 decode
# shapes), then the small shapes again under XLA's PDL flags. Under 9 minutes.
# Usage (device tool, repository root):  bash bench/mgpu_device.sh [bench args]
# Writes $OUT/mgpu_env.log, mgpu_tests.log, decode_mgpu.{log,json}, decode_mgpu_xla_pdl.{log,json}.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
{ nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
  python3 -c "import jax; print(jax.__version__, jax.devices())"; } > "$out/mgpu_env.log" 2>&1
timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 \
  tests/kernels/test_sparse_decode_mgpu.py tests/kernels/test_sparse_decode.py \
  > "$out/mgpu_tests.log" 2>&1
echo "pytest exit $?" >> "$out/mgpu_tests.log"
tail -n 25 "$out/mgpu_tests.log"
timeout 240 python3 bench/decode_mgpu.py --out "$out/decode_mgpu.json" --reps 100 "$@" \
  > "$out/decode_mgpu.log" 2>&1
echo "bench exit $?" >> "$out/decode_mgpu.log"
grep -v '^{' "$out/decode_mgpu.log" | tail -n 30
small=16/1/1/8192,16/1/1/65536,16/1/16/8192,64/4/1/65536
XLA_FLAGS="--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true" timeout 90 \
  python3 bench/decode_mgpu.py --out "$out/decode_mgpu_xla_pdl.json" --reps 100 --shapes $small \
  > "$out/decode_mgpu_xla_pdl.log" 2>&1
echo "bench (XLA PDL flags) exit $?" >> "$out/decode_mgpu_xla_pdl.log"
grep -v '^{' "$out/decode_mgpu_xla_pdl.log" | tail -n 10
