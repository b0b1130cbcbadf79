#!/usr/bin/env bash
# One H200 device call for the server's load benchmark (bench/serve_load.py over HTTP).
# The image has no FastAPI/uvicorn: carry `.whl` with their wheels (README, "Running on the
# GPU"). Writes $OUT/serve_load.json, $OUT/server.log and $OUT/serve_load.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
export PYTHONUNBUFFERED=1
T=engine; python3 -c 'import fastapi, uvicorn, prometheus_client, httpx' && T=http
echo "transport=$T" | tee "$out/serve_load.log"
timeout ${SERVE_TIMEOUT_S:-300} python3 bench/serve_load.py --out "$out" --transport $T "$@" \
  >> "$out/serve_load.log" 2>&1
echo "serve_load rc=$?" >> "$out/serve_load.log"
tail -n 25 "$out/serve_load.log"
