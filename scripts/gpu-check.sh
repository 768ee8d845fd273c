#!/usr/bin/env bash
# The GPU checks of issue 34's GPU-side work, for a session lent a GPU machine, in one device call:
#
#   cp -r ../shared/gpu-kit .gpu-kit && echo /.gpu-kit/ >> .git/info/exclude   # once, on this machine
#   # device tool: command "bash scripts/gpu-check.sh", carry [".gpu-kit"], timeout_s 590
#
# Phases, in this order, each under a timeout cut from one wall-clock budget (BUDGET, default 540 s;
# a phase that would start with less than it needs is skipped and says so):
#   deps      the GPU kit's Debian libraries (.gpu-kit/deps.sh into /opt/ferrydeps) where .gpu-kit exists;
#             else the system's (a machine set up by scripts/setup.sh)
#   build     Release against the python's PyPI torch (Torch_DIR), CUDA arch 90 (CUDA_ARCH), tests on:
#             ferryd, the CUDA kernel tests, daemon_runtime_test, daemon_trainer_test, ferry_bench_cuda_merge,
#             ferry_bench_generate, ferry_bench_make_model
#   kernels   kernels_cuda_test and kernels_cuda_lora_merge_test: the cast, 4-bit and merge kernels
#             against the CPU reference, bit for bit (the streaming merge kernel's first run)
#   runtime   daemon_runtime_test's CUDA cases: every transformers fixture on CUDA (the fused attention
#             kernel there by default, the generator looking every 16 steps), the attention and generator tests
#             (GeneratorTest.CudaGraphStepsGiveTheEagerStepsCompletions: the CUDA graphs' first run)
#   trainer   daemon_trainer_test's CUDA trainer test (the NF4 fixture trained on cuda:0) and NCCL group tests
#   merge     ferry_bench_cuda_merge: 4 GiB F32, r 16, then fan_in_fan_out (target: >= 0.7 of a device copy)
#   decode    ferry_bench_generate on a Qwen2-0.5B-shaped random BF16 model, batch 64, 128 prompt + 256 new
#             tokens: eager steps, static shapes, CUDA graphs (target: >= 20,000 tokens/s)
# Every phase's output is in $OUT (default /tmp/gpu-check)/<phase>.log; summary.txt (one line a phase:
# name, ok | failed rcN | timeout | skipped, seconds) is printed last. Exit 0 when every phase passed.
# Environment: FERRY_PYTHON (the python whose torch to build against; python3), B (build dir;
# /tmp/gpu-check-build), JOBS (nproc), CUDA_ARCH (90), BUDGET, BUILD_CAP (the build's seconds, 330).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/gpu-check}
B=${B:-/tmp/gpu-check-build}
BUDGET=${BUDGET:-540}
JOBS=${JOBS:-$(nproc)}
CUDA_ARCH=${CUDA_ARCH:-90}
PYTHON=${FERRY_PYTHON:-python3}
mkdir -p "$OUT"
: > "$OUT/summary.txt"

# phase NAME CAP MIN -- COMMAND...: COMMAND (a function) for at most CAP seconds, never past the
# budget; skipped when less than MIN is left.
phase() {
  local name=$1 cap=$2 min=$3
  shift 4
  local left=$((BUDGET - SECONDS))
  ((left < cap)) && cap=$left
  if ((cap < min)); then
    echo "$name skipped 0 (${cap}s left, ${min}s needed)" >> "$OUT/summary.txt"
    echo "### $name: skipped"
    return 1
  fi
  echo "### $name (up to ${cap}s) at +${SECONDS}s"
  local t0=$SECONDS st=ok rc
  timeout --kill-after=10 "$cap" bash -c '"$@"' "$name" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  if ((rc == 124 || rc == 137)); then st=timeout; elif ((rc != 0)); then st="failed rc$rc"; fi
  echo "$name $st $((SECONDS - t0))" >> "$OUT/summary.txt"
  echo "### $name: $st after $((SECONDS - t0))s"
  tail -4 "$OUT/$name.log"
  [ "$st" = ok ]
}

deps() {
  nvidia-smi -L || true
  if [ -d "$ROOT/.gpu-kit" ]; then
    bash "$ROOT/.gpu-kit/deps.sh" /opt/ferrydeps > "$OUT/deps.env" || return 1
  else
    echo "no .gpu-kit: the system's libraries" && : > "$OUT/deps.env"
  fi
  "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
}

build() {
  local torch_cmake
  torch_cmake=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)') || return 1
  cmake -S "$ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFERRY_BUILD_TESTS=ON -DFERRY_BUILD_BENCH=ON \
    -DFERRY_WITH_TORCH=ON -DFERRY_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" \
    -DTorch_DIR="$torch_cmake/Torch" -DCMAKE_PREFIX_PATH="$torch_cmake${CMAKE_PREFIX_PATH:+;$CMAKE_PREFIX_PATH}" \
    -DCMAKE_POLICY_VERSION_MINIMUM=3.5 | tee "$OUT/configure.txt" || return 1
  grep -q "Ferry: torch=ON cuda=ON" "$OUT/configure.txt" || { echo "configured without torch or CUDA"; return 1; }
  cmake --build "$B" -j "$JOBS" --target ferryd kernels_cuda_test kernels_cuda_lora_merge_test daemon_runtime_test \
    daemon_trainer_test ferry_bench_cuda_merge ferry_bench_generate ferry_bench_make_model -- -k 0
}

# A test program with LD_LIBRARY_PATH for the kit's libraries, one gtest filter.
gtest() {
  local prog=$1 filter=$2
  LD_LIBRARY_PATH=${FERRY_LD_LIBRARY_PATH:-}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} OMP_NUM_THREADS=4 \
    "$B/$prog" --gtest_filter="$filter" --gtest_brief=1
}
kernels() {
  gtest tests/kernels/kernels_cuda_test '*' && gtest tests/kernels/kernels_cuda_lora_merge_test '*'
}
runtime() {
  gtest tests/daemon/daemon_runtime_test 'Cuda/*:FusedAttention/*:AttentionTest.*:GeneratorTest.*:RuntimeModel.Fused*'
}
trainer() {
  gtest tests/daemon/daemon_trainer_test '*Cuda*:ProcessGroupTest.Nccl*'
}
decode() {
  local m=$OUT/decode-model
  rm -rf "$m"
  "$B/bench/ferry_bench_make_model" --base "$m/base" --adapter "$m/adapter" --hidden 896 --intermediate 4864 \
    --layers 24 --vocab 151936 --heads 14 --kv-heads 2 >/dev/null || return 1
  local flags
  for flags in "" "--static-shapes" "--cuda-graphs"; do
    # shellcheck disable=SC2086
    LD_LIBRARY_PATH=${FERRY_LD_LIBRARY_PATH:-} "$B/bench/ferry_bench_generate" --model "$m/base" --device cuda \
      --dtype bf16 --batch 64 --prompt-len 128 --new-tokens 256 $flags || return 1
  done
  rm -rf "$m"
}
merge() {
  local bench=$B/bench/ferry_bench_cuda_merge
  LD_LIBRARY_PATH=${FERRY_LD_LIBRARY_PATH:-} "$bench" --out 32768 --in 32768 --r 16 &&
    LD_LIBRARY_PATH=${FERRY_LD_LIBRARY_PATH:-} "$bench" --out 8192 --in 32768 --r 16 --fan-in-fan-out
}
export -f deps build gtest kernels runtime trainer decode merge
export ROOT OUT B JOBS CUDA_ARCH PYTHON

if phase deps 120 10 -- deps; then
  # shellcheck disable=SC1091
  source "$OUT/deps.env"  # export lines (deps.sh), or nothing
  if phase build "${BUILD_CAP:-330}" 60 -- build; then
    phase kernels 40 10 -- kernels
    phase runtime 120 20 -- runtime
    phase trainer 60 15 -- trainer
    phase merge 60 15 -- merge
    phase decode 90 30 -- decode
  fi
fi
echo "### summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
! grep -qv " ok " "$OUT/summary.txt"
