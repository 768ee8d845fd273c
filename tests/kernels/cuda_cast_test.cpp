// Cross-checks the CUDA cast kernels against the CPU reference, bit for bit.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kernels/cast.h"
#include "kernels/cuda/cast.cuh"

namespace ferry::kernels {
namespace {

class CudaCast : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0)
      GTEST_SKIP() << "no CUDA device on this machine; the CPU reference is tested elsewhere";
  }
};

template <typename T>
T* ToDevice(const std::vector<T>& v) {
  T* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, v.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return p;
}

template <typename T>
std::vector<T> FromDevice(const T* p, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

TEST_F(CudaCast, MatchesCpuReferenceBitForBit) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> bits;
  const size_t n = 1 << 20;
  std::vector<float> f(n);
  for (auto& x : f) do {
      x = F32FromBits(bits(rng));
    } while (x != x);
  std::vector<uint16_t> h(n);
  for (auto& x : h) x = static_cast<uint16_t>(bits(rng));

  float* df = ToDevice(f);
  uint16_t* dh = ToDevice(h);
  uint16_t* d16 = nullptr;
  float* d32 = nullptr;
  ASSERT_EQ(cudaMalloc(&d16, n * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d32, n * 4), cudaSuccess);

  std::vector<uint16_t> cpu16(n);
  std::vector<float> cpu32(n);

  ASSERT_EQ(cuda::CastF32ToF16(df, d16, n), 0);
  CastF32ToF16(f.data(), cpu16.data(), n);
  EXPECT_EQ(FromDevice(d16, n), cpu16);

  ASSERT_EQ(cuda::CastF32ToBF16(df, d16, n), 0);
  CastF32ToBF16(f.data(), cpu16.data(), n);
  EXPECT_EQ(FromDevice(d16, n), cpu16);

  ASSERT_EQ(cuda::CastBF16ToF32(dh, d32, n), 0);
  CastBF16ToF32(h.data(), cpu32.data(), n);
  auto g = FromDevice(d32, n);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(F32Bits(g[i]), F32Bits(cpu32[i])) << i;

  ASSERT_EQ(cuda::CastF16ToF32(dh, d32, n), 0);
  CastF16ToF32(h.data(), cpu32.data(), n);
  g = FromDevice(d32, n);
  for (size_t i = 0; i < n; ++i) {
    if (cpu32[i] != cpu32[i]) ASSERT_NE(g[i], g[i]) << i;
    else ASSERT_EQ(F32Bits(g[i]), F32Bits(cpu32[i])) << i;
  }
  cudaFree(df);
  cudaFree(dh);
  cudaFree(d16);
  cudaFree(d32);
}

}  // namespace
}  // namespace ferry::kernels
