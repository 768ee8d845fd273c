#!/usr/bin/env bash
# Sets up and runs Ferry's whole test suite:
#   1. installs dependencies (scripts/setup.sh) and checks the C++ formatting
#      (scripts/format.sh --check: seconds, so it fails before any build),
#   2. builds everything with warnings as errors and runs every test with ctest,
#   3. rebuilds the core and parser tests under AddressSanitizer + UndefinedBehaviorSanitizer
#      and runs them,
#   4. builds the tests of a Store shared by threads, of the receiver's multi-threaded
#      activation and of its writer thread under ThreadSanitizer and runs them,
#   5. runs each libFuzzer target briefly (FERRY_FUZZ_SECONDS, default 20), two at a time.
# The engine tests run a real vLLM server from the venv scripts/vllm.sh creates (PyPI, about
# 6 GB, a few minutes the first time; cached in ~/.cache/ferry).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${FERRY_JOBS:-$(nproc)}
FUZZ_SECONDS=${FERRY_FUZZ_SECONDS:-20}

# Each phase's header says how long the run has taken so far (where CI's minutes go).
start=$SECONDS
phase() { printf '== %s [%dm%02ds]\n' "$1" $(((SECONDS - start) / 60)) $(((SECONDS - start) % 60)); }

bash scripts/setup.sh

# ccache, when installed, serves the four builds below (a CI cache of ~/.ccache, or a developer's,
# turns most of their compiles into hits). A launcher already chosen in the environment is kept.
if command -v ccache >/dev/null; then
  export CMAKE_C_COMPILER_LAUNCHER="${CMAKE_C_COMPILER_LAUNCHER:-ccache}"
  export CMAKE_CXX_COMPILER_LAUNCHER="${CMAKE_CXX_COMPILER_LAUNCHER:-ccache}"
fi

phase "a real vLLM for the engine tests (scripts/vllm.sh setup: a cached venv, created once)"
bash scripts/vllm.sh setup >/dev/null

phase "format (scripts/format.sh --check)"
bash scripts/format.sh --check

phase "build (warnings are errors)"
# Each test's OpenMP threads (tests/CMakeLists.txt): OMP_NUM_THREADS when set, else 1 (ctest
# runs a test per core).
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFERRY_WERROR=ON \
  -DFERRY_TEST_OMP_THREADS="${OMP_NUM_THREADS:-1}" >/dev/null
cmake --build build -j "$JOBS"

phase "tests"
ctest --test-dir build --output-on-failure -j "$JOBS" --timeout 600

phase "tests under ASan + UBSan (core, kernels, convert, the tokenizer and the run config parsers)"
# Only the test executables this regex runs are built (ferry_matching_tests, tests/CMakeLists.txt).
ASAN_TESTS='^(core|kernels|convert|daemon_text|daemon_run)_'
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFERRY_WERROR=ON -DFERRY_SANITIZE=ON \
  -DFERRY_WITH_TORCH=OFF -DFERRY_WITH_CUDA=OFF -DFERRY_BUILD_BENCH=OFF "-DFERRY_TESTS_MATCHING=$ASAN_TESTS" >/dev/null
cmake --build build-asan -j "$JOBS" --target ferry_matching_tests
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$JOBS" --timeout 900 -R "$ASAN_TESTS"

phase "tests under ThreadSanitizer (one Store shared by threads; sync tests sharing one; the activation's workers; the receiver's writer)"
# sync_protocol_test runs whole receivers (their writer threads); sync_fault_test is left out:
# it forks receivers from a threaded process, which ThreadSanitizer does not support.
TSAN_TESTS=(store_concurrency_test sync_handoff_test sync_watch_test sync_limits_test sync_activate_test
  sync_write_behind_test sync_protocol_test)
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DFERRY_WERROR=ON -DFERRY_TSAN=ON \
  -DFERRY_BUILD_BENCH=OFF >/dev/null
targets=()
for t in "${TSAN_TESTS[@]}"; do targets+=(--target "$t"); done
cmake --build build-tsan -j "$JOBS" "${targets[@]}"
# RocksDB and libzmq are not instrumented: their interceptor calls are ignored, and libzmq's
# hand-offs to its I/O threads are suppressed (scripts/tsan.supp says why).
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ignore_noninstrumented_modules=1 suppressions=$PWD/scripts/tsan.supp" \
  ctest --test-dir build-tsan --output-on-failure -j "$JOBS" --timeout 900 \
  -R "^($(IFS='|'; echo "${TSAN_TESTS[*]}"))\."

if [ "$FUZZ_SECONDS" -gt 0 ] && [ -f scripts/fuzz.sh ]; then
  phase "fuzzing (${FUZZ_SECONDS}s per target)"
  bash scripts/fuzz.sh "$FUZZ_SECONDS"
fi
phase "all tests passed"
