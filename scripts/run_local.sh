#!/usr/bin/env bash
# Serve the default model locally: one GPU executor (CPU without CUDA) and the controller.
# Environment: MODEL_DIR, HOST, PORT, EXECUTOR_PORT, PY (set by `make run`).
set -euo pipefail
PY=${PY:-.venv/bin/python}
EXECUTOR_PORT=${EXECUTOR_PORT:-50051}
"$PY" -m executor_gpu --model "$MODEL_DIR" --host 127.0.0.1 --port "$EXECUTOR_PORT" &
executor=$!
trap 'kill $executor 2>/dev/null; wait $executor 2>/dev/null' EXIT INT TERM
echo "controller on http://${HOST:-127.0.0.1}:${PORT:-8000} (executor on :$EXECUTOR_PORT)"
"$PY" -m controller --model "$MODEL_DIR" --executor "127.0.0.1:$EXECUTOR_PORT" \
  --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}"
