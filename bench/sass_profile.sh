#!/usr/bin/env bash
# One H200 device call: per-instruction (SASS) stall samples of one kernel's first launch.
# Usage (device tool): bash bench/sass_profile.sh [KERNEL_REGEX [COMMAND...]]
#   default: the sparse-decode kernel under `bench/decode_profile.py target` (16/1 B=128);
#   e.g. bash bench/sass_profile.sh msa_topk_select_mgpu python3 bench/index_mgpu_target.py 1
# $OUT gets details.txt (ncu sections) and sass.csv (the source page: one row per SASS
# instruction with its warp-stall samples), summarised by `python3 bench/sass_stalls.py`.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
kernel=${1:-sparse_decode}; shift || true
(( $# )) || set -- python3 bench/decode_profile.py target
timeout ${NCU_TIMEOUT_S:-400} ncu --clock-control none --target-processes all -k "regex:$kernel" \
  --launch-count 1 --section WarpStateStats --section SourceCounters --section SpeedOfLight \
  --section LaunchStats --section MemoryWorkloadAnalysis --import-source no -o /tmp/sass_rep -f \
  "$@" > "$out/ncu_run.log" 2>&1
echo "ncu rc=$?"; tail -n 3 "$out/ncu_run.log"
ncu -i /tmp/sass_rep.ncu-rep --page details > "$out/details.txt" 2>&1
ncu -i /tmp/sass_rep.ncu-rep --page source --csv --print-source sass > "$out/sass.csv" 2>&1
wc -l "$out/sass.csv"
grep -E "Duration|Stall|Warp Cycles|Registers|Local|Spill" "$out/details.txt" | head -n 30
python3 bench/sass_stalls.py "$out/sass.csv" --top 30
