#!/usr/bin/env bash
# Configures and builds Ferry in build/ (warnings as errors).
# Usage: scripts/build.sh [TARGET...]   Environment: FERRY_BUILD_DIR (build), FERRY_JOBS (nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${FERRY_BUILD_DIR:-build}
JOBS=${FERRY_JOBS:-$(nproc)}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFERRY_WERROR=ON >/dev/null
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$BUILD_DIR" -j "$JOBS" "${targets[@]}"
