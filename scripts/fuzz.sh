#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and runs each one for SECONDS
# (default 30), FERRY_FUZZ_JOBS of them at once, over a scratch copy of its seed corpus in
# fuzz/corpus/<name>/. New inputs the fuzzer finds stay in the scratch copy; the repository
# is never written to.
# Exits non-zero when a build fails or any fuzzer finds a crash, leak, timeout or
# sanitizer report; the reproducer is kept under $FERRY_FUZZ_OUT (default build-fuzz/findings).
#
# Usage: scripts/fuzz.sh [SECONDS]
#   FERRY_FUZZ_BUILD  build directory (default <repo>/build-fuzz)
#   FERRY_FUZZ_JOBS   ninja -j, and how many fuzzers run at once (default 2)
set -euo pipefail

seconds="${1:-30}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [[ "$seconds" -eq 0 ]]; then
  echo "usage: $0 [SECONDS]   (a positive whole number, default 30)" >&2
  exit 2
fi

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${FERRY_FUZZ_BUILD:-$repo/build-fuzz}"
jobs="${FERRY_FUZZ_JOBS:-2}"
findings="${FERRY_FUZZ_OUT:-$build/findings}"

for tool in clang clang++ cmake ninja; do
  command -v "$tool" >/dev/null || { echo "fuzz.sh: $tool not found" >&2; exit 2; }
done

CC=clang CXX=clang++ cmake -S "$repo" -B "$build" -G Ninja \
  -DFERRY_FUZZ=ON -DFERRY_BUILD_TESTS=OFF -DFERRY_BUILD_BENCH=OFF -DFERRY_WITH_CUDA=OFF \
  -DFERRY_WITH_TORCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null

targets=(fuzz_safetensors_header fuzz_sync_message fuzz_run_config fuzz_tokenizer fuzz_tokenizer_json fuzz_tokenizer_config
  fuzz_control_message fuzz_checkpoint_state fuzz_model_config)
[[ -f "$repo/fuzz/adapter_config_fuzz.cpp" ]] && targets+=(fuzz_adapter_config)
ninja -C "$build" -j"$jobs" "${targets[@]}"

scratch="$(mktemp -d "${TMPDIR:-/tmp}/ferry-fuzz.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$findings"

# Runs one fuzzer over a scratch copy of its seeds; its report goes to $scratch/<target>.out.
fuzz_one() {
  local target="$1" seeds="$repo/fuzz/corpus/${1#fuzz_}" work="$scratch/${1#fuzz_}"
  mkdir -p "$work"
  [[ -d "$seeds" ]] && cp -R "$seeds/." "$work/"
  {
    echo "== $target: ${seconds}s over $(ls "$work" | wc -l) seeds"
    if ! UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
        "$build/fuzz/$target" -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$findings/$target-" -print_final_stats=1 "$work" 2>"$scratch/$target.log"; then
      echo "!! $target FAILED; reproducer(s) under $findings/, log tail:"
      tail -n 60 "$scratch/$target.log"
      return 1
    fi
    grep -E "^stat::(number_of_executed_units|new_units_added|peak_rss_mb)" "$scratch/$target.log" || true
  } >"$scratch/$target.out" 2>&1
}

# `jobs` fuzzers at a time, each on a core of its own; reports printed in target order.
status=0
pids=()
for target in "${targets[@]}"; do
  if [[ ${#pids[@]} -ge $jobs ]]; then
    wait "${pids[0]}" || status=1
    pids=("${pids[@]:1}")
  fi
  fuzz_one "$target" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for target in "${targets[@]}"; do
  if grep -q "^!! " "$scratch/$target.out"; then cat "$scratch/$target.out" >&2; else cat "$scratch/$target.out"; fi
done
exit "$status"
