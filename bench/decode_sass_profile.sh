#!/usr/bin/env bash
# One H200 device call: per-instruction (SASS) stall samples of the default sparse-decode
# kernel at 16/1 B=128 (the first launch of `decode_profile.py target`).
# Usage (device tool): bash bench/decode_sass_profile.sh
# $OUT gets details.txt (ncu sections) and sass.csv (the source page: one row per SASS
# instruction with its warp-stall samples), summarised by `python3 bench/sass_stalls.py`.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
timeout 400 ncu --clock-control none --target-processes all -k regex:sparse_decode \
  --launch-count 1 --section WarpStateStats --section SourceCounters --section SpeedOfLight \
  --import-source no -o /tmp/decode_rep -f python3 bench/decode_profile.py target > "$out/ncu_run.log" 2>&1
echo "ncu rc=$?"; tail -n 3 "$out/ncu_run.log"
ncu -i /tmp/decode_rep.ncu-rep --page details > "$out/details.txt" 2>&1
ncu -i /tmp/decode_rep.ncu-rep --page source --csv --print-source sass > "$out/sass.csv" 2>&1
wc -l "$out/sass.csv"; head -c 600 "$out/sass.csv"; echo
grep -E "Duration|Stall|Warp Cycles" "$out/details.txt" | head -n 30
