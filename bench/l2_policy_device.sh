#!/usr/bin/env bash
# One H200 device call: the decode and the indexer with their TMA loads tagged with an L2
# eviction policy (`bench/l2_policy_probe.py`) against untagged, same run.
# Usage (device tool, any directory): MODE=floor|select bash bench/l2_policy_device.sh
# MODE=floor:
#   1. the PTX of a tagged decode (MOSAIC_GPU_DUMP_PTX): its loads carry `.L2::cache_hint`;
#   2. `bench/read_floor.py` at SHAPES, untagged / tagged / untagged / tagged;
#   3. `bench/decode_mgpu.py` tagged at SHAPES (its relative L2 against the reference);
#   4. `bench/index_select_mgpu.py` at INDEX_SHAPES, untagged and tagged.
# MODE=select:
#   1. the ranks of the indexer's TMA loads (its PTX);
#   2. `bench/decode_mgpu.py` at SHAPES under each of CONFIGS (probe flags, | separated);
#   3. `bench/kernels.py --shapes KERNEL_SHAPES --fp8 none` untagged and with the page loads
#      (rank 5) tagged evict-first (needs `.vllm_ops` carried).
# Writes $OUT/l2_*.{json,log} and $OUT/l2_kernels_*/ (the device tool returns at most 8 files
# of a call; the console output has every table).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
probe="python3 bench/l2_policy_probe.py"
if [[ ${MODE:?MODE} == floor ]]; then
  shapes=${SHAPES:-16/1/1/8192,16/1/16/8192,16/1/64/8192,64/4/16/8192,16/1/128/8192,64/4/64/8192}
  MOSAIC_GPU_DUMP_PTX=1 timeout 120 $probe --policy evict_first decode_mgpu --out /tmp/ptx.json \
    --shapes 16/1/1/8192 --variants mgpu --reps 2 --trials 1 > /tmp/ptx.log 2>&1
  echo "ptx rc=$? after ${SECONDS}s: $(grep -c 'L2::cache_hint' /tmp/ptx.log) hinted lines"
  grep -m 3 -E 'createpolicy|cp\.async\.bulk\.tensor' /tmp/ptx.log | tee "$out/l2_ptx_excerpt.log"
  for run in none_a evict_first_a none_b evict_first_b; do
    timeout ${RUN_TIMEOUT_S:-150} $probe --policy "${run%_*}" read_floor \
      --out "$out/l2_floor_$run.json" --shapes "$shapes" --reps ${REPS:-100} \
      --trials ${TRIALS:-4} > "$out/l2_floor_$run.log" 2>&1
    echo "read_floor $run rc=$? after ${SECONDS}s"; grep '^|' "$out/l2_floor_$run.log"
  done
  timeout 150 $probe --policy evict_first decode_mgpu --out "$out/l2_decode_evict_first.json" \
    --shapes "$shapes" --variants mgpu --reps 50 --trials 3 \
    > "$out/l2_decode_evict_first.log" 2>&1
  echo "decode_mgpu rc=$? after ${SECONDS}s"
  grep -v '^{' "$out/l2_decode_evict_first.log" | tail -n 9
  for pol in none evict_first; do
    timeout 150 $probe --policy $pol index_select_mgpu --out "$out/l2_index_$pol.json" \
      --shapes ${INDEX_SHAPES:-3,5,7} --reps 100 --trials 3 > "$out/l2_index_$pol.log" 2>&1
    echo "index $pol rc=$? after ${SECONDS}s"; grep -v '^{' "$out/l2_index_$pol.log" | tail -n 8
  done
else
  default_shapes=16/1/16/8192,16/1/64/8192,16/1/128/8192,16/1/128/65536,64/4/64/8192,64/4/128/8192
  shapes=${SHAPES:-$default_shapes}
  MOSAIC_GPU_DUMP_PTX=1 timeout 120 $probe --policy evict_first index_select_mgpu \
    --out /tmp/iptx.json --shapes 0 --reps 2 --trials 1 > /tmp/iptx.log 2>&1
  rc=$?
  ranks=$(grep -o 'cp\.async\.bulk\.tensor\.[0-9]d' /tmp/iptx.log | sort | uniq -c | paste -sd' ')
  echo "indexer ptx rc=$rc: $ranks"
  default_configs="none|evict_first --ranks 5|evict_first|evict_first --ranks 5 --fraction 0.5|none"
  IFS='|' read -ra configs <<< "${CONFIGS:-$default_configs}"
  i=0
  for cfg in "${configs[@]}"; do
    i=$((i + 1))
    timeout 150 $probe --policy $cfg decode_mgpu --out "$out/l2_sel_$i.json" --shapes "$shapes" \
      --variants mgpu --reps ${REPS:-100} --trials ${TRIALS:-4} > "$out/l2_sel_$i.log" 2>&1
    echo "decode_mgpu [$cfg] rc=$? after ${SECONDS}s"
    grep '^| [0-9]' "$out/l2_sel_$i.log" | cut -d'|' -f2-5,9-10
  done
  for cfg in none "evict_first --ranks 5"; do
    tag=${cfg%% *}
    timeout 200 $probe --policy $cfg kernels --out "$out/l2_kernels_$tag" --require-vllm \
      --shapes ${KERNEL_SHAPES:-6,7} --fp8 none --reps 200 > "$out/l2_kernels_$tag.log" 2>&1
    echo "kernels [$cfg] rc=$? after ${SECONDS}s"; tail -n 14 "$out/l2_kernels_$tag.log"
  done
fi
