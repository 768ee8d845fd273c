#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and runs each one for SECONDS
# (default 30) over a scratch copy of its seed corpus in fuzz/corpus/<name>/. New inputs
# the fuzzer finds stay in the scratch copy; the repository is never written to.
# Exits non-zero when a build fails or any fuzzer finds a crash, leak, timeout or
# sanitizer report; the reproducer is kept under $FERRY_FUZZ_OUT (default build-fuzz/findings).
#
# Usage: scripts/fuzz.sh [SECONDS]
#   FERRY_FUZZ_BUILD  build directory (default <repo>/build-fuzz)
#   FERRY_FUZZ_JOBS   ninja -j (default 2)
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

targets=(fuzz_safetensors_header fuzz_sync_message fuzz_run_config fuzz_tokenizer fuzz_tokenizer_json fuzz_control_message)
[[ -f "$repo/fuzz/adapter_config_fuzz.cpp" ]] && targets+=(fuzz_adapter_config)
ninja -C "$build" -j"$jobs" "${targets[@]}"

scratch="$(mktemp -d "${TMPDIR:-/tmp}/ferry-fuzz.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$findings"

status=0
for target in "${targets[@]}"; do
  seeds="$repo/fuzz/corpus/${target#fuzz_}"
  work="$scratch/${target#fuzz_}"
  mkdir -p "$work"
  [[ -d "$seeds" ]] && cp -R "$seeds/." "$work/"
  echo "== $target: ${seconds}s over $(ls "$work" | wc -l) seeds"
  if ! UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
      "$build/fuzz/$target" -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="$findings/$target-" -print_final_stats=1 "$work" 2>"$scratch/$target.log"; then
    echo "!! $target FAILED; reproducer(s) under $findings/, log tail:" >&2
    tail -n 60 "$scratch/$target.log" >&2
    status=1
  else
    grep -E "^stat::(number_of_executed_units|new_units_added|peak_rss_mb)" "$scratch/$target.log" || true
  fi
done
exit "$status"
