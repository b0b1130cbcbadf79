#!/usr/bin/env bash
# One H200 device call: Nsight Compute's DRAM and L2 counters of the Mosaic GPU decode's kernel
# (default 2-deep ring and the 3-deep one) and of the Triton decode, at the shapes given.
# Usage (device tool, any directory): bash bench/decode_dram_counters.sh [shapes]
# Each op runs twice per shape (mgpu, mgpu_st3, triton in that order; ncu flushes the caches
# before each profiled launch). Writes $OUT/dram_counters.csv (raw page), dram_counters_run.log
# and prints one line per profiled launch (duration, DRAM bytes read, read rate, % of peak).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct
metrics+=,launch__grid_size,sm__cycles_active.avg
driver='
import sys
sys.path.insert(0, "bench")
import jax
import decode_mgpu as dm
for sh in dm.parse_shapes(sys.argv[1]):
    args = dm.make_inputs(sh, 0)
    for name in ("mgpu", "mgpu_st3", "triton"):
        f = jax.jit(dm.VARIANTS[name])
        for _ in range(2):
            jax.block_until_ready(f(*args))
        print(dm.shape_id(sh), name, "done", flush=True)
'
timeout "${NCU_TIMEOUT_S:-420}" ncu --clock-control none --target-processes all \
  -k "regex:msa_sparse_decode" --metrics "$metrics" \
  --csv --page raw --print-units base --log-file "$out/dram_counters.csv" \
  python3 -c "$driver" "${1:-16/1/64/8192,16/1/128/8192,64/4/128/8192}" \
  > "$out/dram_counters_run.log" 2>&1
echo "ncu rc=$?"; tail -n 5 "$out/dram_counters_run.log"
table='
import sys
sys.path.insert(0, "bench")
from kernel_profile import _num, _rows
with open(sys.argv[1]) as f:
    rows = _rows(f.read())
for r in rows:
    name, grid = r["Kernel Name"][:32], r["Grid Size"]
    us, read = _num(r["gpu__time_duration.sum"]) / 1e3, _num(r["dram__bytes_read.sum"])
    pct = _num(r["dram__throughput.avg.pct_of_peak_sustained_elapsed"])
    hit = _num(r["lts__t_sector_hit_rate.pct"])
    print(f"{name:32} grid {grid:12} {us:7.1f} us read {read / 2**20:7.1f} MiB "
          f"{read / us / 1e6:5.2f} TB/s DRAM {pct:4.1f}% L2 hit {hit:4.1f}%")
'
python3 -c "$table" "$out/dram_counters.csv"
