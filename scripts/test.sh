#!/usr/bin/env bash
# Sets up and runs Ferry's whole test suite:
#   1. installs dependencies (scripts/setup.sh),
#   2. builds everything with warnings as errors and runs every test with ctest,
#   3. rebuilds the core and parser tests under AddressSanitizer + UndefinedBehaviorSanitizer
#      and runs them,
#   4. runs each libFuzzer target briefly (FERRY_FUZZ_SECONDS, default 20).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${FERRY_JOBS:-$(nproc)}
FUZZ_SECONDS=${FERRY_FUZZ_SECONDS:-20}

bash scripts/setup.sh

echo "== build (warnings are errors)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFERRY_WERROR=ON >/dev/null
cmake --build build -j "$JOBS"

echo "== tests"
ctest --test-dir build --output-on-failure -j "$JOBS" --timeout 600

echo "== tests under ASan + UBSan (core, kernels, convert parsers)"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFERRY_WERROR=ON -DFERRY_SANITIZE=ON \
  -DFERRY_WITH_TORCH=OFF -DFERRY_WITH_CUDA=OFF -DFERRY_BUILD_BENCH=OFF >/dev/null
cmake --build build-asan -j "$JOBS"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$JOBS" --timeout 900 -R '^(core|kernels|convert)_'

if [ "$FUZZ_SECONDS" -gt 0 ] && [ -f scripts/fuzz.sh ]; then
  echo "== fuzzing (${FUZZ_SECONDS}s per target)"
  bash scripts/fuzz.sh "$FUZZ_SECONDS"
fi
echo "== all tests passed"
