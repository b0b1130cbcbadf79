#!/usr/bin/env bash
# One H200 device call (carry .vllm_ops): where bench/kernels.py's slower reading of the Mosaic
# GPU decode at 16/1 B=64 and B=128 comes from. Parts (default: inputs kernels):
#   inputs:  bench/decode_mgpu.py on its random selections, on bench/kernels.py's inputs (our
#            indexer's selection), and on random selections again;
#   torch:   bench/decode_mgpu.py alone, then in a process where torch holds a CUDA context
#            and 1 GiB first (as vLLM's side does in bench/kernels.py), then alone again;
#   kernels: bench/kernels.py at the same three shapes.
# About 2 min per part. Usage: bash bench/decode_inputs_device.sh [inputs] [torch] [kernels]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
shapes=16/1/64/8192,16/1/128/8192,16/1/128/65536
decode() {  # NAME [--inputs KIND | --torch]
  local name=$1 pre=""; shift
  if [[ ${1:-} == --torch ]]; then  # torch's CUDA context and 1 GiB, before jax starts
    pre="import torch; _held = torch.empty(1 << 28, device='cuda'); "; shift
  fi
  timeout 150 python3 -c "${pre}import runpy, sys; sys.path.insert(0, 'bench'); \
sys.argv = ['decode_mgpu.py'] + sys.argv[1:]; runpy.run_path('bench/decode_mgpu.py', run_name='__main__')" \
    --out "$out/decode_$name.json" --shapes "$shapes" --variants mgpu --reps 200 --trials 6 "$@" \
    2>&1 | grep '^| 16/1' | sed "s/^/$name /" | tee "$out/decode_$name.md"
}
for part in ${*:-inputs kernels}; do
  case $part in
    inputs) decode inputs_random_1 --inputs random; decode inputs_indexer --inputs indexer
            decode inputs_random_2 --inputs random ;;
    torch) decode torch_alone_1; decode torch_held --torch; decode torch_alone_2 ;;
    kernels) timeout 200 python3 bench/kernels.py --out "$out/kernels" --require-vllm \
               --shapes 4,6,7 --fp8 none --reps 200 > "$out/kernels.log" 2>&1
             echo "kernels.py rc=$?"; grep '^| 16/1' "$out/kernels/kernels.md" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
