#include <cuda_runtime.h>

#include "kernels/cuda/dequant_4bit.cuh"

namespace ferry::kernels::cuda {
namespace {

constexpr int kThreads = 256;

inline unsigned Blocks(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b > 65535 * 32 ? 65535 * 32 : (b == 0 ? 1 : b));
}

// One thread per packed byte; blocksize is even, so both nibbles share one absmax.
__global__ void Dequant4bitKernel(const uint8_t* __restrict__ packed, int64_t n, const float* __restrict__ absmax,
                                  int log2_blocksize, const float* __restrict__ code, float* __restrict__ out) {
  __shared__ float code_sh[16];
  if (threadIdx.x < 16) code_sh[threadIdx.x] = code[threadIdx.x];
  __syncthreads();
  const int64_t nbytes = n / 2 + (n % 2);
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < nbytes; t += int64_t{blockDim.x} * gridDim.x) {
    const int64_t e = 2 * t;
    const uint8_t b = packed[t];
    const float a = absmax[e >> log2_blocksize];
    out[e] = __fmul_rn(code_sh[b >> 4], a);
    if (e + 1 < n) out[e + 1] = __fmul_rn(code_sh[b & 0x0f], a);
  }
}

__global__ void NestedAbsmaxKernel(const uint8_t* __restrict__ q, int64_t nblocks, const float* __restrict__ code,
                                   const float* __restrict__ nested_absmax, int64_t nested_blocksize, float offset,
                                   float* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < nblocks; i += int64_t{blockDim.x} * gridDim.x) {
    out[i] = __fadd_rn(__fmul_rn(code[q[i]], nested_absmax[i / nested_blocksize]), offset);
  }
}

}  // namespace

int Dequantize4bit(const uint8_t* packed, int64_t n, const float* absmax, int64_t blocksize, const float* code,
                   float* out, void* stream) {
  if (blocksize < 32 || blocksize > 4096 || (blocksize & (blocksize - 1)) != 0 || n < 0) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (n == 0) return 0;
  int log2_blocksize = 0;
  while ((int64_t{1} << log2_blocksize) < blocksize) ++log2_blocksize;
  const int64_t nbytes = n / 2 + (n % 2);
  Dequant4bitKernel<<<Blocks(nbytes), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(packed, n, absmax,
                                                                                        log2_blocksize, code, out);
  return static_cast<int>(cudaGetLastError());
}

int DequantizeAbsmaxNested(const uint8_t* absmax_q, int64_t nblocks, const float* nested_code,
                           const float* nested_absmax, int64_t nested_blocksize, float offset, float* absmax_out,
                           void* stream) {
  if (nblocks < 0 || nested_blocksize < 1) return static_cast<int>(cudaErrorInvalidValue);
  if (nblocks == 0) return 0;
  NestedAbsmaxKernel<<<Blocks(nblocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      absmax_q, nblocks, nested_code, nested_absmax, nested_blocksize, offset, absmax_out);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace ferry::kernels::cuda
