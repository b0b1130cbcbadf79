#!/usr/bin/env bash
# Comparison vs vLLM 0.33.0's MiniMax-M3 ops on the GPU: the same seeded cases as the CPU test,
# both sides compiled, with both sides' median times side by side.
# Needs python3 with jax (CUDA), torch and triton, and the op folder built here by
# `make compare-env` (carry ".vllm_ops"). Writes OUT_DIR/compare.json and OUT_DIR/compare.md.
# Usage: bash bench/compare_gpu.sh OUT_DIR   (TIME_ITERS=N to change the timed calls, default 50)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bench/compare_gpu.sh OUT_DIR}"
if [ ! -f .vllm_ops/MANIFEST.json ]; then
  echo "missing .vllm_ops: run 'make compare-env' on the workstation and carry .vllm_ops" >&2
  exit 2
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch (the vLLM side) shares the GPU
python3 - <<'PY'
import jax, torch, triton
print("jax", jax.__version__, jax.devices()[0].device_kind, "| torch", torch.__version__,
      "| triton", triton.__version__)
PY
python3 -m tools.vllm_compare.compare --device gpu --vllm-python python3 --negative-control \
  --time-iters "${TIME_ITERS:-50}" --out-dir "$out"
