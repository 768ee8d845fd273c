// The CUDA LoRA merge (kernels/cuda/lora_merge.cuh: W += scaling * B @ A, F32, the CPU reference's
// arithmetic) on a multi-GB W, against a device-to-device copy of the same bytes: the merge reads
// and writes W once, as the copy reads one buffer and writes another, so copy bandwidth is its
// bound and the ratio merge GB/s / copy GB/s is the figure (issue 34's target: >= 0.7). The copy
// is timed before and after the merges (the calibration: the device's speed moves too).
// Before timing, one merge is checked against the CPU reference (kernels/lora_merge.h), every
// element bit for bit (host memory: twice W).
//
// Usage: ferry_bench_cuda_merge [--out 32768] [--in 32768] [--r 16] [--reps 10] [--fan-in-fan-out]
// (default W: 32768 x 32768 F32 = 4 GiB). Prints one JSON line, then the ratio. Exit 2 on bad
// usage, 1 on a CUDA error, a mismatch, or no device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/cast.cuh"
#include "kernels/cuda/lora_merge.cuh"
#include "kernels/lora_merge.h"

namespace {

#define CHECK_CUDA(x)                                                                       \
  do {                                                                                      \
    const cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "ferry_bench_cuda_merge: %s: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

std::vector<float> Random(int64_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = u(rng);
  return v;
}

// Median milliseconds of `reps` calls of fn after 2 warm-ups, by CUDA events.
template <typename Fn>
double MedianMs(int reps, Fn fn) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) fn();
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    fn();
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int Usage() {
  std::fprintf(stderr,
               "usage: ferry_bench_cuda_merge [--out 32768] [--in 32768] [--r 16] [--reps 10] [--fan-in-fan-out]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t out = 32768, in = 32768, r = 16;
  int reps = 10;
  bool fifo = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      Usage();
      return 0;
    }
    if (arg == "--fan-in-fan-out") {
      fifo = true;
      continue;
    }
    if (i + 1 >= argc) return Usage();
    const char* v = argv[++i];
    if (arg == "--out") {
      out = std::atoll(v);
    } else if (arg == "--in") {
      in = std::atoll(v);
    } else if (arg == "--r") {
      r = std::atoll(v);
    } else if (arg == "--reps") {
      reps = std::atoi(v);
    } else {
      return Usage();
    }
  }
  if (out < 1 || in < 1 || r < 1 || reps < 1) return Usage();
  if (ferry::kernels::cuda::DeviceCount() == 0) {
    std::fprintf(stderr, "ferry_bench_cuda_merge: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int64_t n = out * in;
  const double w_bytes = static_cast<double>(n) * sizeof(float);
  auto merge = [&](const float* a, const float* b, float scaling, float* w) {
    return fifo ? ferry::kernels::cuda::LoraDeltaAccumulateFanInFanOut(a, b, out, in, r, scaling, w)
                : ferry::kernels::cuda::LoraDeltaAccumulate(a, b, out, in, r, scaling, w);
  };

  // W, A and B from host values, so that sampled rows can be checked against the CPU reference.
  const std::vector<float> A = Random(r * in, 2, 0.05f), B = Random(out * r, 3, 0.05f);
  const int64_t rows = fifo ? in : out, cols = fifo ? out : in;
  std::vector<float> row_values = Random(cols, 1, 0.05f);  // every row of W starts as this row
  float *dW, *dW2, *dA, *dB;
  CHECK_CUDA(cudaMalloc(&dW, n * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dW2, n * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dA, A.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dB, B.size() * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(dA, A.data(), A.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dB, B.data(), B.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(
      cudaMemcpy2D(dW, cols * sizeof(float), row_values.data(), 0, cols * sizeof(float), rows, cudaMemcpyHostToDevice));

  // One merge, checked: every row against the CPU reference's merge of that row.
  const int rc = merge(dA, dB, 1.5f, dW);
  if (rc != 0) {
    std::fprintf(stderr, "ferry_bench_cuda_merge: the merge returned CUDA error %d\n", rc);
    return 1;
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<float> want(static_cast<size_t>(rows * cols));
  for (int64_t row = 0; row < rows; ++row) {
    std::memcpy(want.data() + row * cols, row_values.data(), static_cast<size_t>(cols) * sizeof(float));
  }
  if (fifo) {
    ferry::kernels::LoraDeltaAccumulateFanInFanOut(A.data(), B.data(), out, in, r, 1.5f, want.data(), threads);
  } else {
    ferry::kernels::LoraDeltaAccumulate(A.data(), B.data(), out, in, r, 1.5f, want.data(), threads);
  }
  std::vector<float> got(want.size());
  CHECK_CUDA(cudaMemcpy(got.data(), dW, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      std::fprintf(stderr, "ferry_bench_cuda_merge: element %zu (row %lld): gpu %.9g, cpu reference %.9g\n", i,
                   static_cast<long long>(static_cast<int64_t>(i) / cols), got[i], want[i]);
      return 1;
    }
  }

  auto copy = [&] { CHECK_CUDA(cudaMemcpyAsync(dW2, dW, n * sizeof(float), cudaMemcpyDeviceToDevice)); };
  const double copy_before = MedianMs(reps, copy);
  // A tiny scaling keeps repeated merges finite; the work is the same.
  const double merge_ms = MedianMs(reps, [&] {
    if (merge(dA, dB, 1e-6f, dW) != 0) std::exit(1);
  });
  const double copy_after = MedianMs(reps, copy);
  const double copy_ms = std::min(copy_before, copy_after);
  auto gbs = [&](double ms) { return 2 * w_bytes / (ms * 1e-3) / 1e9; };
  std::printf(
      "{\"device\": \"%s\", \"out\": %lld, \"in\": %lld, \"r\": %lld, \"fan_in_fan_out\": %s, \"w_gib\": %.3f, "
      "\"reps\": %d, \"copy_before_gb_s\": %.1f, \"merge_gb_s\": %.1f, \"copy_after_gb_s\": %.1f, "
      "\"merge_over_copy\": %.3f, \"checked_elements\": %zu}\n",
      prop.name, static_cast<long long>(out), static_cast<long long>(in), static_cast<long long>(r),
      fifo ? "true" : "false", w_bytes / (1 << 30), reps, gbs(copy_before), gbs(merge_ms), gbs(copy_after),
      gbs(merge_ms) / gbs(copy_ms), got.size());
  std::printf("merge / device copy: %.3f (target >= 0.7)\n", gbs(merge_ms) / gbs(copy_ms));
  CHECK_CUDA(cudaFree(dW));
  CHECK_CUDA(cudaFree(dW2));
  CHECK_CUDA(cudaFree(dA));
  CHECK_CUDA(cudaFree(dB));
  return 0;
}
