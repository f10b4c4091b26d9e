#!/usr/bin/env bash
# A local mixed fleet behind one endpoint: a GPU executor (on the CPU without CUDA), a TPU
# executor (on XLA:CPU without a TPU) and the controller placing requests across both.
# The controller serves as soon as one executor is ready; the TPU executor joins when its
# warm-up (compiling every step shape) is done, about a minute or more on a CPU.
# Environment: MODEL_DIR, HOST, PORT, GPU_PORT, TPU_PORT, TPU_LIMITS, KV_CACHE_BYTES, PY.
set -euo pipefail
PY=${PY:-.venv/bin/python}
MODEL_DIR=${MODEL_DIR:-$HOME/.cache/tandem/models/SmolLM2-135M-Instruct}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
GPU_PORT=${GPU_PORT:-50051}
TPU_PORT=${TPU_PORT:-50052}
TPU_LIMITS=${TPU_LIMITS:-64,8}  # step tokens,requests of the TPU executor: few shapes to compile
KV_CACHE_BYTES=${KV_CACHE_BYTES:-$((512 * 1024 * 1024))}

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM

"$PY" -m executor_gpu --model "$MODEL_DIR" --host 127.0.0.1 --port "$GPU_PORT" \
  --kv-cache-bytes "$KV_CACHE_BYTES" &
pids+=($!)
"$PY" -m executor_tpu --model "$MODEL_DIR" --host 127.0.0.1 --port "$TPU_PORT" \
  --kv-cache-bytes "$KV_CACHE_BYTES" &
pids+=($!)
echo "controller on http://$HOST:$PORT (gpu executor :$GPU_PORT, tpu executor :$TPU_PORT)"
echo "fleet state: curl -s http://$HOST:$PORT/admin/executors"
"$PY" -m controller --model "$MODEL_DIR" --host "$HOST" --port "$PORT" \
  --executor "127.0.0.1:$GPU_PORT" --executor "127.0.0.1:$TPU_PORT" \
  --executor-limits "tpu=$TPU_LIMITS" "$@" &
pids+=($!)
wait "${pids[-1]}"  # until the controller exits (or a signal stops the fleet)
