#!/usr/bin/env bash
# One H200 device call: `bench/decode_mgpu.py` variants timed at a few shapes, twice, the
# second run in reverse variant order (same-run comparisons; the two runs bound the drift).
# Optionally first the compiled kernel tests matching TESTS (a pytest -k expression).
# Usage (device tool, any directory): NAME=x VARIANTS=mgpu,mgpu_st3 SHAPES=16/1/64/8192,...
#   [TESTS=sparse_decode_mgpu] [REPS=100 TRIALS=4] bash bench/variants_device.sh
# Writes $OUT/NAME_{a,b}.{json,log} (and $OUT/NAME_tests.log).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
name=${NAME:?NAME} variants=${VARIANTS:?VARIANTS} shapes=${SHAPES:?SHAPES}
if [[ -n ${TESTS:-} ]]; then
  timeout ${TEST_TIMEOUT_S:-150} python3 -m pytest -q -p no:cacheprovider tests/kernels \
    -k "$TESTS" > "$out/${name}_tests.log" 2>&1
  echo "tests rc=$? after ${SECONDS}s"; tail -n 3 "$out/${name}_tests.log"
fi
reversed=$(tr ',' '\n' <<< "$variants" | tac | paste -sd, -)
for run in "a:$variants" "b:$reversed"; do
  tag=${run%%:*}
  timeout ${RUN_TIMEOUT_S:-240} python3 bench/decode_mgpu.py --out "$out/${name}_$tag.json" \
    --reps ${REPS:-100} --trials ${TRIALS:-4} --shapes "$shapes" --variants "${run#*:}" \
    > "$out/${name}_$tag.log" 2>&1
  echo "run $tag rc=$? after ${SECONDS}s"
  grep -v '^{' "$out/${name}_$tag.log" | tail -n 14
done
