#!/usr/bin/env bash
# Configures and builds Ferry against the LibTorch inside a PyPI `torch` package (the CUDA LibTorch
# on a GPU machine) into build-pytorch/, with Debian's other libraries. The programs run as built,
# nothing preloaded: each lists libstdc++ before LibTorch (cmake/ferry_torch.cmake).
#
# Usage: scripts/build-pytorch.sh [TARGET...]   (no TARGET: everything the configuration builds)
# Environment:
#   FERRY_PYTHON      the python whose torch to build against (default: python3)
#   FERRY_BUILD_DIR   the build directory (default: build-pytorch); one that was configured against
#                     another LibTorch is refused
#   FERRY_BUILD_TYPE  CMAKE_BUILD_TYPE (default: RelWithDebInfo)
#   FERRY_JOBS        parallel jobs (default: nproc)
#   FERRY_CMAKE_ARGS  more cmake arguments, split on spaces, e.g.
#                     "-DFERRY_BUILD_TESTS=OFF -DCMAKE_CUDA_ARCHITECTURES=90"
# CMAKE_PREFIX_PATH in the environment finds Debian's libraries where they were unpacked elsewhere
# than /usr; LibTorch's parts are searched in the torch package first (cmake/ferry_torch.cmake).
# At the end the build is checked: no object read a header of another LibTorch (Debian's in
# /usr/include), and ferryd binds libstdc++'s symbols to libstdc++ (tests/daemon/libstdcxx_first_test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${FERRY_PYTHON:-python3}
BUILD_DIR=${FERRY_BUILD_DIR:-build-pytorch}
BUILD_TYPE=${FERRY_BUILD_TYPE:-RelWithDebInfo}
JOBS=${FERRY_JOBS:-$(nproc)}
read -r -a extra <<<"${FERRY_CMAKE_ARGS:-}"

if ! torch_cmake=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)'); then
  echo "build-pytorch.sh: $PYTHON cannot import torch (FERRY_PYTHON names the python to use)" >&2
  exit 1
fi
torch_include=$(cd "$torch_cmake/../../include" && pwd)
echo "build-pytorch.sh: torch $("$PYTHON" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')" \
  "from $torch_cmake, into $BUILD_DIR"

cached=$(sed -n 's/^Torch_DIR:PATH=//p' "$BUILD_DIR/CMakeCache.txt" 2>/dev/null || true)
if [ -n "$cached" ] && [ "$(realpath -m "$cached")" != "$(realpath -m "$torch_cmake/Torch")" ]; then
  echo "build-pytorch.sh: $BUILD_DIR was configured against the LibTorch in $cached;" \
    "remove it or name another FERRY_BUILD_DIR" >&2
  exit 1
fi

configure_log=$(mktemp)
trap 'rm -f "$configure_log"' EXIT
if ! cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" -DFERRY_WITH_TORCH=ON \
  -DTorch_DIR="$torch_cmake/Torch" "${extra[@]}" >"$configure_log" 2>&1; then
  cat "$configure_log" >&2
  exit 1
fi
grep -E "^-- (LibTorch|Ferry:)" "$configure_log"
if ! grep -q "^-- Ferry: torch=ON" "$configure_log"; then
  echo "build-pytorch.sh: the configuration did not take LibTorch from $torch_cmake:" >&2
  cat "$configure_log" >&2
  exit 1
fi

targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$BUILD_DIR" -j "$JOBS" "${targets[@]}"

# Headers of another LibTorch (/usr/include/ATen, ... from libtorch-dev) would be found where the
# torch package lacks one: the compilers' dependency lists must name none.
torch_include_real=$(realpath "$torch_include")
foreign=$(ninja -C "$BUILD_DIR" -t deps | sed -n 's/^ *\(\/.*\/include\/\(ATen\|c10\|caffe2\|torch\)\/.*\)/\1/p' |
  sort -u | xargs -r realpath -m | grep -v -F "$torch_include_real/" | head -5 || true)
if [ -n "$foreign" ]; then
  echo "build-pytorch.sh: objects in $BUILD_DIR read headers of another LibTorch, e.g.:"$'\n'"$foreign" >&2
  exit 1
fi
if [ -x "$BUILD_DIR/cli/ferryd" ]; then
  bash tests/daemon/libstdcxx_first_test.sh "$BUILD_DIR/cli/ferryd"
fi
echo "build-pytorch.sh: built in $BUILD_DIR (ferry and ferryd in $BUILD_DIR/cli)"
