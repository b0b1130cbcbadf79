#!/usr/bin/env bash
# One H200 device call: where sparse decode's time goes at 16/1 B=128.
# Usage (device tool): bash bench/decode_profile.sh
# $OUT gets decode_profile.json (variant timings), ncu.txt (Nsight Compute sections of the
# decode kernel for NCU_VARIANTS), gpu.log, and tests.log (the decode tests compiled on the GPU).
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.log"
timeout 300 python3 bench/decode_profile.py target 2>&1 | tail -n 5 | tee -a "$out/gpu.log"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 420 ncu --clock-control none --target-processes all -k regex:sparse_decode --launch-count 4 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section SchedulerStats --section Occupancy --section LaunchStats \
  python3 bench/decode_profile.py target > "$out/ncu.txt" 2>&1
echo "ncu rc=$?" | tee -a "$out/gpu.log"; grep -E "Duration|DRAM Throughput|SM Active|Warp Cycles Per Issued|Eligible Warps|Registers Per|Dynamic Shared|Block Limit Shared|Achieved Active" "$out/ncu.txt" | head -n 60
timeout 500 python3 bench/decode_profile.py time --out "$out" 2>&1 | tee -a "$out/gpu.log"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sparse_decode.py tests/attention/test_msa_attention.py 2>&1 | tail -n 15 | tee "$out/tests.log"
