#!/usr/bin/env bash
# One H200 device call: where sparse decode's time goes at 16/1 B=128.
# Usage (device tool): bash bench/decode_profile.sh
# $OUT gets decode_profile.json (variant timings), decode_ptx.txt (PTX counts, ptxas -v),
# ncu.txt (Nsight Compute sections of the decode kernel, select vs load) and gpu.log.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.log"
XLA_FLAGS="--xla_dump_to=/tmp/xdump" timeout 300 python3 bench/decode_profile.py target 2>&1 | tail -n 5 | tee -a "$out/gpu.log"
timeout 200 python3 bench/decode_profile.py ptx --dump /tmp/xdump --out "$out" 2>&1 | tail -n 30
cp "$(grep -l 'msa_sparse_decode' /tmp/xdump/*.ptx 2>/dev/null | head -n 1)" "$out/decode.ptx" 2>/dev/null
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 420 ncu --clock-control none --target-processes all -k regex:sparse_decode --launch-count 2 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section SchedulerStats --section Occupancy --section LaunchStats \
  python3 bench/decode_profile.py target > "$out/ncu.txt" 2>&1
echo "ncu rc=$?" | tee -a "$out/gpu.log"; grep -E "Throughput|Duration|Stall|Warp Cycles|Eligible|Registers|Shared Memory Config|Achieved Occ" "$out/ncu.txt" | head -n 60
timeout 500 python3 bench/decode_profile.py time --out "$out" 2>&1 | tee -a "$out/gpu.log"
