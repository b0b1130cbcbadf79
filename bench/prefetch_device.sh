#!/usr/bin/env bash
# One H200 device call: the Mosaic GPU decode asking the L2 for pages ahead of its TMA ring
# (l2_prefetch 1/2/4/16) against the default, at the 16/1 and 64/4 decode shapes, twice in
# alternating order. Usage (device tool, repository root): bash bench/prefetch_device.sh
# Writes $OUT/prefetch_{a,b}.{json,log}.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
shapes=${SHAPES:-16/1/1/8192,16/1/16/8192,16/1/64/8192,16/1/128/8192,64/4/1/65536,64/4/16/8192,64/4/64/8192}
for run in a:mgpu,mgpu_pf1,mgpu_pf2,mgpu_pf4,mgpu_pf16 b:mgpu_pf16,mgpu_pf4,mgpu_pf2,mgpu_pf1,mgpu; do
  name=${run%%:*}
  timeout ${RUN_TIMEOUT_S:-240} python3 bench/decode_mgpu.py --out "$out/prefetch_$name.json" \
    --reps 100 --trials 4 --shapes "$shapes" --variants "${run#*:}" > "$out/prefetch_$name.log" 2>&1
  echo "run $name exit $?" >> "$out/prefetch_$name.log"
  grep -v '^{' "$out/prefetch_$name.log" | tail -n 12
done
