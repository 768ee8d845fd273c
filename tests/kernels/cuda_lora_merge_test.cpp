// Cross-checks the CUDA merge and 4-bit dequantization kernels against the CPU reference.
// Both sides perform the same fp32 operations in the same order without FMA contraction (see
// kernels/cuda/lora_merge.cuh), so the results must agree bit for bit; a failure message
// also reports the relative difference, which must never exceed 1e-5 even for a kernel
// that sums in another order.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cast.h"
#include "kernels/cuda/cast.cuh"
#include "kernels/cuda/dequant_4bit.cuh"
#include "kernels/cuda/lora_merge.cuh"
#include "kernels/dequant_4bit.h"
#include "kernels/lora_merge.h"
#include "tests/kernels/random_floats.h"

namespace ferry::kernels {
namespace {

using ferry::testing::RandomFloats;

class CudaLoraMerge : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device on this machine (cudaGetDeviceCount is 0); the CPU reference is tested in "
                      "kernels_lora_merge_test and kernels_dequant_4bit_test";
    }
  }
};

template <typename T>
T* ToDevice(const std::vector<T>& v) {
  T* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, v.size() * sizeof(T) + 1), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return p;
}

template <typename T>
std::vector<T> FromDevice(const T* p, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

void ExpectSame(const std::vector<float>& gpu, const std::vector<float>& cpu, const char* what) {
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t i = 0; i < gpu.size(); ++i) {
    ASSERT_EQ(F32Bits(gpu[i]), F32Bits(cpu[i]))
        << what << " element " << i << ": gpu " << gpu[i] << " cpu " << cpu[i] << " relative difference "
        << std::fabs(gpu[i] - cpu[i]) / std::max(std::fabs(cpu[i]), 1e-30f);
  }
}

enum class Variant { kLinear, kFanInFanOut, kEmbedding };

TEST_F(CudaLoraMerge, MergeMatchesCpuReference) {
  struct Case {
    int64_t out, in, r;
  };
  uint32_t seed = 1;
  // The streaming kernel's three register shapes (r <= 16, 32, 64) with full and partial 16-byte
  // vectors and row blocks, and the tiled kernel above r = 64.
  for (const Case& c : {Case{1, 1, 1}, Case{33, 97, 16}, Case{256, 4096, 64}, Case{1000, 77, 33}, Case{5, 5, 0},
                        Case{70, 4100, 16}, Case{70, 4100, 8}, Case{130, 516, 17}, Case{33, 1030, 64}, Case{9, 260, 65},
                        Case{40, 64, 128}, Case{2, 70000, 16}}) {
    for (Variant v : {Variant::kLinear, Variant::kFanInFanOut, Variant::kEmbedding}) {
      const auto A = RandomFloats(c.r * c.in, seed++);
      const auto B = RandomFloats(c.out * c.r, seed++);
      const auto W0 = RandomFloats(c.out * c.in, seed++);
      auto cpu = W0;
      float* dA = ToDevice(A);
      float* dB = ToDevice(B);
      float* dW = ToDevice(W0);
      int rc = 0;
      switch (v) {
        case Variant::kLinear:
          LoraDeltaAccumulate(A.data(), B.data(), c.out, c.in, c.r, 1.5f, cpu.data(), 2);
          rc = cuda::LoraDeltaAccumulate(dA, dB, c.out, c.in, c.r, 1.5f, dW);
          break;
        case Variant::kFanInFanOut:
          LoraDeltaAccumulateFanInFanOut(A.data(), B.data(), c.out, c.in, c.r, 1.5f, cpu.data(), 2);
          rc = cuda::LoraDeltaAccumulateFanInFanOut(dA, dB, c.out, c.in, c.r, 1.5f, dW);
          break;
        case Variant::kEmbedding:  // num_embeddings = in, dim = out
          LoraEmbeddingDeltaAccumulate(A.data(), B.data(), c.in, c.out, c.r, 1.5f, cpu.data(), 2);
          rc = cuda::LoraEmbeddingDeltaAccumulate(dA, dB, c.in, c.out, c.r, 1.5f, dW);
          break;
      }
      ASSERT_EQ(rc, 0);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ExpectSame(FromDevice(dW, W0.size()), cpu, "merge");
      cudaFree(dA);
      cudaFree(dB);
      cudaFree(dW);
    }
  }
}

// A W that does not start on a 16-byte boundary (a tensor's view at an odd offset) takes the
// streaming kernel's element-wise path, with the same results.
TEST_F(CudaLoraMerge, UnalignedWeightMatchesCpuReference) {
  const int64_t out = 37, in = 1024, r = 16;
  const auto A = RandomFloats(r * in, 91);
  const auto B = RandomFloats(out * r, 92);
  auto W0 = RandomFloats(out * in + 1, 93);
  std::vector<float> cpu(W0.begin() + 1, W0.end());
  LoraDeltaAccumulate(A.data(), B.data(), out, in, r, 0.75f, cpu.data(), 1);
  float* dA = ToDevice(A);
  float* dB = ToDevice(B);
  float* dW = ToDevice(W0);
  ASSERT_EQ(cuda::LoraDeltaAccumulate(dA, dB, out, in, r, 0.75f, dW + 1), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ExpectSame(FromDevice(dW + 1, cpu.size()), cpu, "unaligned merge");
  EXPECT_EQ(F32Bits(FromDevice(dW, 1)[0]), F32Bits(W0[0])) << "the float before W was written";
  cudaFree(dA);
  cudaFree(dB);
  cudaFree(dW);
}

// Argument checks happen before any CUDA call, so they need no device.
TEST(CudaKernelArguments, InvalidArgumentsAreRejectedBeforeLaunch) {
  const int invalid = static_cast<int>(cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LoraDeltaAccumulate(nullptr, nullptr, -1, 4, 4, 1.0f, nullptr), invalid);
  EXPECT_EQ(cuda::LoraDeltaAccumulateFanInFanOut(nullptr, nullptr, 4, 4, -2, 1.0f, nullptr), invalid);
  EXPECT_EQ(cuda::LoraEmbeddingDeltaAccumulate(nullptr, nullptr, 4, -4, 4, 1.0f, nullptr), invalid);
  EXPECT_EQ(cuda::LoraDeltaAccumulate(nullptr, nullptr, 0, 4, 4, 1.0f, nullptr), 0) << "empty W is a no-op";
  for (int64_t bs : {0, 16, 48, 8192}) {
    EXPECT_EQ(cuda::Dequantize4bit(nullptr, 2, nullptr, bs, nullptr, nullptr), invalid) << bs;
  }
  EXPECT_EQ(cuda::Dequantize4bit(nullptr, -1, nullptr, 64, nullptr, nullptr), invalid);
  EXPECT_EQ(cuda::DequantizeAbsmaxNested(nullptr, 4, nullptr, nullptr, 0, 0.0f, nullptr), invalid);
  EXPECT_EQ(cuda::DequantizeAbsmaxNested(nullptr, -4, nullptr, nullptr, 256, 0.0f, nullptr), invalid);
}

TEST_F(CudaLoraMerge, Dequant4bitMatchesCpuBitForBit) {
  std::mt19937 rng(5);
  for (int64_t n : {int64_t{1}, int64_t{63}, int64_t{4097}, int64_t{1} << 20}) {
    for (int64_t bs : {int64_t{32}, int64_t{64}, int64_t{4096}}) {
      std::vector<uint8_t> packed(Packed4bitBytes(n));
      for (auto& b : packed) b = static_cast<uint8_t>(rng());
      const int64_t nblocks = Num4bitBlocks(n, bs);
      const auto absmax = RandomFloats(nblocks, static_cast<uint32_t>(n + bs));
      const std::vector<float> code(kNf4Code, kNf4Code + 16);
      std::vector<float> cpu(n);
      ASSERT_EQ(Dequantize4bit(packed.data(), n, absmax.data(), bs, code.data(), cpu.data()), Dequant4bitStatus::kOk);
      uint8_t* dp = ToDevice(packed);
      float* da = ToDevice(absmax);
      float* dc = ToDevice(code);
      float* dout = nullptr;
      ASSERT_EQ(cudaMalloc(&dout, n * sizeof(float)), cudaSuccess);
      ASSERT_EQ(cuda::Dequantize4bit(dp, n, da, bs, dc, dout), 0);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ExpectSame(FromDevice(dout, n), cpu, "dequant");
      cudaFree(dp);
      cudaFree(da);
      cudaFree(dc);
      cudaFree(dout);
    }
  }
}

TEST_F(CudaLoraMerge, NestedAbsmaxMatchesCpuBitForBit) {
  const int64_t nblocks = 1000, nbs = 256;
  std::mt19937 rng(9);
  std::vector<uint8_t> q(nblocks);
  for (auto& b : q) b = static_cast<uint8_t>(rng());
  const auto nested_code = RandomFloats(256, 10);
  const auto nested_absmax = RandomFloats((nblocks + nbs - 1) / nbs, 11);
  std::vector<float> cpu(nblocks);
  ASSERT_EQ(
      DequantizeAbsmaxNested(q.data(), nblocks, nested_code.data(), nested_absmax.data(), nbs, 0.0508f, cpu.data()),
      Dequant4bitStatus::kOk);
  uint8_t* dq = ToDevice(q);
  float* dc = ToDevice(nested_code);
  float* da = ToDevice(nested_absmax);
  float* dout = nullptr;
  ASSERT_EQ(cudaMalloc(&dout, nblocks * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cuda::DequantizeAbsmaxNested(dq, nblocks, dc, da, nbs, 0.0508f, dout), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ExpectSame(FromDevice(dout, nblocks), cpu, "nested absmax");
  cudaFree(dq);
  cudaFree(dc);
  cudaFree(da);
  cudaFree(dout);
}

}  // namespace
}  // namespace ferry::kernels
