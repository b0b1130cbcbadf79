#!/usr/bin/env bash
# A/B/A of one module on the GPU, in one device call: runs a bench command with the working
# tree's module (A), with an older copy swapped in (B), then A again (the spread between the
# two A runs bounds the drift). The older copy is a file in the tree, e.g. made with
#   git show HEAD:pallas_kernels/index_select_mgpu.py > bench/_ab_old.py   (not committed)
# Usage (device tool): bash bench/ab_device.sh MODULE OLD_COPY NAME COMMAND...
#   COMMAND gets "--out $OUT/NAME_{A1,B,A2}.json" appended; its output goes to the .log beside.
set -uo pipefail
cd "$(dirname "$0")/.."
module=$1 old=$2 name=$3; shift 3
out=${OUT:-/tmp/out}; mkdir -p "$out"; cp "$module" /tmp/ab_new.py
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
for run in A1 B A2; do
  if [[ $run == B ]]; then cp "$old" "$module"; else cp /tmp/ab_new.py "$module"; fi
  timeout ${AB_TIMEOUT_S:-200} "$@" --out "$out/${name}_$run.json" > "$out/${name}_$run.log" 2>&1
  echo "$name $run rc=$? after ${SECONDS}s"
  grep -E '^[0-9]+/[0-9]+ B=' "$out/${name}_$run.log" || tail -n 5 "$out/${name}_$run.log"
done
cp /tmp/ab_new.py "$module"
