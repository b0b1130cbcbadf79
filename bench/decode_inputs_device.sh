#!/usr/bin/env bash
# One H200 device call (carry .vllm_ops): the Mosaic GPU decode at 16/1 B=64 and B=128 on
# bench/decode_mgpu.py's random selections and on bench/kernels.py's inputs (our indexer's
# selection), in the order random, indexer, random; then bench/kernels.py at the same shapes.
# Tells whether the inputs or the process make kernels.py read the decode slower. About 5 min.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
shapes=16/1/64/8192,16/1/128/8192,16/1/128/65536
for run in random_1:random indexer:indexer random_2:random; do
  timeout 150 python3 bench/decode_mgpu.py --out "$out/decode_inputs_${run%%:*}.json" \
    --shapes "$shapes" --variants mgpu --reps 200 --trials 6 --inputs "${run##*:}" \
    2>&1 | grep '^|' | tee "$out/decode_inputs_${run%%:*}.md"
done
timeout 200 python3 bench/kernels.py --out "$out/kernels" --require-vllm --shapes 4,6,7 \
  --fp8 none --reps 200 > "$out/kernels.log" 2>&1
echo "kernels.py rc=$?"; grep '^| 16/1' "$out/kernels/kernels.md"
