#!/usr/bin/env bash
# Serve the default model locally: the executor(s) EXECUTOR names and the controller.
#   EXECUTOR=gpu   one GPU executor (CUDA, else the CPU) on EXECUTOR_PORT (default)
#   EXECUTOR=tpu   one TPU executor (a TPU, else XLA:CPU) on EXECUTOR_PORT
#   EXECUTOR=both  the GPU executor on EXECUTOR_PORT and the TPU one on EXECUTOR_PORT+1
# Environment: MODEL_DIR, HOST, PORT, EXECUTOR_PORT, EXECUTOR, TPU_ARGS, PY (set by `make run`).
set -euo pipefail
PY=${PY:-.venv/bin/python}
EXECUTOR=${EXECUTOR:-gpu}
EXECUTOR_PORT=${EXECUTOR_PORT:-50051}
read -r -a tpu_args <<< "${TPU_ARGS:-}"
pids=()
addresses=()

start() {  # start <module> <port> [flags...]
  local module=$1 port=$2
  shift 2
  "$PY" -m "$module" --model "$MODEL_DIR" --host 127.0.0.1 --port "$port" "$@" &
  pids+=($!)
  addresses+=(--executor "127.0.0.1:$port")
  echo "$module on :$port"
}

case "$EXECUTOR" in
  gpu) start executor_gpu "$EXECUTOR_PORT" ;;
  tpu) start executor_tpu "$EXECUTOR_PORT" "${tpu_args[@]}" ;;
  both)
    start executor_gpu "$EXECUTOR_PORT"
    start executor_tpu "$((EXECUTOR_PORT + 1))" "${tpu_args[@]}"
    ;;
  *) echo "EXECUTOR must be gpu, tpu or both (got '$EXECUTOR')" >&2; exit 2 ;;
esac
trap 'kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null' EXIT INT TERM
echo "controller on http://${HOST:-127.0.0.1}:${PORT:-8000}"
"$PY" -m controller --model "$MODEL_DIR" "${addresses[@]}" \
  --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}"
