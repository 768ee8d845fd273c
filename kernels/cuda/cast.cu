#include "kernels/cuda/cast.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace ferry::kernels::cuda {
namespace {

constexpr int kThreads = 256;

inline unsigned Blocks(size_t n) {
  size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b > 65535 * 32 ? 65535 * 32 : (b == 0 ? 1 : b));
}

__global__ void F16ToF32Kernel(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{blockDim.x} * gridDim.x) {
    __half_raw r;
    r.x = src[i];
    dst[i] = __half2float(__half(r));
  }
}

__global__ void BF16ToF32Kernel(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{blockDim.x} * gridDim.x) {
    dst[i] = __uint_as_float(static_cast<uint32_t>(src[i]) << 16);
  }
}

__global__ void F32ToF16Kernel(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{blockDim.x} * gridDim.x) {
    __half h = __float2half_rn(src[i]);
    dst[i] = __half_raw(h).x;
  }
}

__global__ void F32ToBF16Kernel(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{blockDim.x} * gridDim.x) {
    const uint32_t u = __float_as_uint(src[i]);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    dst[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40u) : rounded);
  }
}

template <typename Kernel, typename S, typename D>
int Launch(Kernel k, const S* src, D* dst, size_t n, void* stream) {
  if (n == 0) return 0;
  k<<<Blocks(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(src, dst, n);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

int CastF16ToF32(const uint16_t* s, float* d, size_t n, void* st) { return Launch(F16ToF32Kernel, s, d, n, st); }
int CastBF16ToF32(const uint16_t* s, float* d, size_t n, void* st) { return Launch(BF16ToF32Kernel, s, d, n, st); }
int CastF32ToF16(const float* s, uint16_t* d, size_t n, void* st) { return Launch(F32ToF16Kernel, s, d, n, st); }
int CastF32ToBF16(const float* s, uint16_t* d, size_t n, void* st) { return Launch(F32ToBF16Kernel, s, d, n, st); }

}  // namespace ferry::kernels::cuda
