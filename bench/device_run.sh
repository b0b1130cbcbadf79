#!/usr/bin/env bash
# The one device entry: a whole check-and-bench on the GPU machine in one call.
# Usage (device tool, from the repository root): bash bench/device_run.sh [PART ...] [-- FLAGS]
# Parts, run in the order given (default: tests kernels):
#   tests    the kernel tests compiled on the GPU (tests/kernels, tests/attention/test_msa_attention.py,
#            tests/test_moe.py; TEST_FILES="..." names others)
#   kernels  bench/kernels.py: the MSA kernels against vLLM 0.33.0's ops (carry .vllm_ops)
#   compare  tools.vllm_compare.compare compiled: the parity cases with both sides' times (carry .vllm_ops)
#   prefill  bench/prefill.py: sparse prefill against the decode on a long chunk
#   layer    bench/real_layer.py: one real-shaped dense and one MSA+MoE layer per rank
#   fp8      bench/fp8_matmul.py: the weight-only fp8 matmul kernel vs XLA and bf16 (issue 47)
#   dense    bench/dense_attention.py: dense paged attention vs vLLM 0.33.0's unified_attention (carry .vllm_ops)
#   moe      bench/moe.py: the MoE routed experts vs vLLM 0.33.0's fused_moe_kernel and XLA (issue 49; carry .vllm_ops)
#   serve    bench/serve_load.py: the OpenAI server under load (carry .whl with FastAPI/uvicorn wheels)
#   step     bench/step.py: one rank's whole serving step (60 layers, TP4 x EP8 shapes), split by op family
# FLAGS after `--` go to every bench script of the call. $OUT gets one PART.log per part plus each
# script's own files. TEST_TIMEOUT_S bounds the tests (default 200 s), KERNELS_BUDGET_S the
# shapes bench/kernels.py starts (default 380 s less the time already spent), DENSE_BUDGET_S those
# bench/dense_attention.py starts (default 420 s less the time already spent), MOE_BUDGET_S those
# bench/moe.py starts (the same default), STEP_BUDGET_S the points bench/step.py starts (the same
# default; a point started before it may still compile and run: the part's timeout allows 150 s
# more).
set -uo pipefail
cd "$(dirname "$0")/.."
parts=(); flags=()
while (($#)); do
  if [[ $1 == -- ]]; then shift; flags=("$@"); break; fi
  parts+=("$1"); shift
done
((${#parts[@]})) || parts=(tests kernels)
for p in "${parts[@]}"; do
  [[ $p =~ ^(tests|kernels|compare|prefill|layer|fp8|dense|moe|serve|step)$ ]] || {
    echo "device_run.sh: unknown part '$p' (tests kernels compare prefill layer fp8 dense moe serve step)" >&2; exit 2; }
done
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-dev} XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.log"
git rev-parse HEAD 2>/dev/null | tee -a "$out/gpu.log"

need_vllm_ops() {
  [ -f .vllm_ops/MANIFEST.json ] && return 0
  echo "missing .vllm_ops: run 'make compare-env' here and carry .vllm_ops" | tee -a "$out/$1.log"
  return 1
}

for p in "${parts[@]}"; do
  log="$out/$p.log"; start=$SECONDS
  case $p in
    tests)
      xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")  # 4 workers share the GPU
      timeout "${TEST_TIMEOUT_S:-200}" python3 -m pytest -q -p no:cacheprovider $xdist \
        ${TEST_FILES:-tests/kernels tests/attention/test_msa_attention.py tests/test_moe.py} > "$log" 2>&1
      echo "pytest rc=$?" >> "$log" ;;
    kernels)
      need_vllm_ops kernels || continue
      budget=$(( ${KERNELS_BUDGET_S:-380} - SECONDS )); (( budget < 60 )) && budget=60
      timeout $(( budget + 70 )) python3 bench/kernels.py --out "$out" --require-vllm \
        --budget-s "$budget" "${flags[@]}" > "$log" 2>&1
      echo "kernels.py rc=$?" >> "$log"
      sed '/^vLLM timing per op/,$d' "$out/kernels.md" 2>/dev/null ;;
    compare)
      need_vllm_ops compare || continue
      python3 -m tools.vllm_compare.compare --device gpu --vllm-python python3 --negative-control \
        --time-iters "${TIME_ITERS:-50}" --out-dir "$out" > "$log" 2>&1
      echo "compare rc=$?" >> "$log" ;;
    prefill)
      python3 bench/prefill.py --out "$out" "${flags[@]}" > "$log" 2>&1
      echo "prefill.py rc=$?" >> "$log" ;;
    layer)
      python3 bench/real_layer.py --out "$out" "${flags[@]}" > "$log" 2>&1
      echo "real_layer.py rc=$?" >> "$log" ;;
    fp8)
      python3 bench/fp8_matmul.py --out "$out" "${flags[@]}" > "$log" 2>&1
      echo "fp8_matmul.py rc=$?" >> "$log" ;;
    dense)
      need_vllm_ops dense || continue
      budget=$(( ${DENSE_BUDGET_S:-420} - SECONDS )); (( budget < 60 )) && budget=60
      timeout $(( budget + 90 )) python3 bench/dense_attention.py --out "$out" --require-vllm \
        --budget-s "$budget" "${flags[@]}" > "$log" 2>&1
      echo "dense_attention.py rc=$?" >> "$log" ;;
    moe)
      need_vllm_ops moe || continue
      budget=$(( ${MOE_BUDGET_S:-420} - SECONDS )); (( budget < 60 )) && budget=60
      timeout $(( budget + 120 )) python3 bench/moe.py --out "$out" --require-vllm \
        --budget-s "$budget" "${flags[@]}" > "$log" 2>&1
      echo "moe.py rc=$?" >> "$log"
      cat "$out/moe.md" 2>/dev/null ;;
    serve)
      transport=engine; python3 -c 'import fastapi, uvicorn, prometheus_client, httpx' 2>/dev/null \
        && transport=http
      timeout "${SERVE_TIMEOUT_S:-300}" python3 bench/serve_load.py --out "$out" \
        --transport $transport "${flags[@]}" > "$log" 2>&1
      echo "serve_load.py (transport $transport) rc=$?" >> "$log" ;;
    step)
      budget=$(( ${STEP_BUDGET_S:-420} - SECONDS )); (( budget < 60 )) && budget=60
      timeout $(( budget + 150 )) python3 bench/step.py --out "$out" --budget-s "$budget" \
        "${flags[@]}" > "$log" 2>&1
      echo "step.py rc=$?" >> "$log"
      cat "$out/step.md" 2>/dev/null ;;
  esac
  echo "== $p: $(( SECONDS - start )) s"; tail -n 25 "$log"
done
