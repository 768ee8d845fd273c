#include <cuda_runtime.h>

#include "kernels/cuda/lora_merge.cuh"

namespace ferry::kernels::cuda {
namespace {

constexpr int kTile = 32;        // W tile is kTile x kTile
constexpr int kRowsPerPass = 8;  // blockDim = (kTile, kRowsPerPass)
constexpr int kChunk = 32;       // k values staged in shared memory at a time
constexpr int kThreads = kTile * kRowsPerPass;
constexpr int kPerThread = kTile / kRowsPerPass;

// One block updates one kTile x kTile tile of W [nrows, ncols]. Without fan_in_fan_out
// (row, col) = (o, i); with it (row, col) = (i, o). Element (o, i) gets
// sum_{k ascending} B[o,k] * A[k,i], each step rounded as the CPU reference rounds it.
template <bool kFanInFanOut>
__global__ void LoraKernel(const float* __restrict__ A, const float* __restrict__ B, int64_t out, int64_t in, int64_t r,
                           float scaling, float* __restrict__ W) {
  __shared__ float a_sh[kChunk][kTile + 1];  // A[k0 + kk, i0 + t]
  __shared__ float b_sh[kTile][kChunk + 1];  // B[o0 + t, k0 + kk]
  const int64_t ncols = kFanInFanOut ? out : in;
  const int64_t nrows = kFanInFanOut ? in : out;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t o0 = kFanInFanOut ? col0 : row0;
  const int64_t i0 = kFanInFanOut ? row0 : col0;
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * kTile + tx;

  float acc[kPerThread];
  for (int p = 0; p < kPerThread; ++p) acc[p] = 0.0f;

  for (int64_t k0 = 0; k0 < r; k0 += kChunk) {
    for (int e = tid; e < kChunk * kTile; e += kThreads) {
      const int kk = e / kTile, t = e % kTile;
      a_sh[kk][t] = (k0 + kk < r && i0 + t < in) ? A[(k0 + kk) * in + i0 + t] : 0.0f;
      const int bt = e / kChunk, bk = e % kChunk;
      b_sh[bt][bk] = (o0 + bt < out && k0 + bk < r) ? B[(o0 + bt) * r + k0 + bk] : 0.0f;
    }
    __syncthreads();
    const int kmax = static_cast<int>(r - k0 < kChunk ? r - k0 : kChunk);
    for (int p = 0; p < kPerThread; ++p) {
      const int row = ty + p * kRowsPerPass, col = tx;
      const int ot = kFanInFanOut ? col : row;
      const int it = kFanInFanOut ? row : col;
      float a = acc[p];
      for (int kk = 0; kk < kmax; ++kk) a = __fadd_rn(a, __fmul_rn(b_sh[ot][kk], a_sh[kk][it]));
      acc[p] = a;
    }
    __syncthreads();
  }

  for (int p = 0; p < kPerThread; ++p) {
    const int64_t row = row0 + ty + p * kRowsPerPass, col = col0 + tx;
    if (row < nrows && col < ncols) {
      float* w = W + row * ncols + col;
      *w = __fadd_rn(*w, __fmul_rn(scaling, acc[p]));
    }
  }
}

template <bool kFanInFanOut>
int Launch(const float* A, const float* B, int64_t out, int64_t in, int64_t r, float scaling, float* W, void* stream) {
  if (out < 0 || in < 0 || r < 0) return static_cast<int>(cudaErrorInvalidValue);
  if (out == 0 || in == 0) return 0;
  const int64_t nrows = kFanInFanOut ? in : out;
  const int64_t ncols = kFanInFanOut ? out : in;
  const int64_t gx = (ncols + kTile - 1) / kTile, gy = (nrows + kTile - 1) / kTile;
  if (gx > 0x7fffffff || gy > 65535) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  const dim3 block(kTile, kRowsPerPass);
  LoraKernel<kFanInFanOut><<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(A, B, out, in, r, scaling, W);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int LoraDeltaAccumulate(const float* A, const float* B, int64_t out, int64_t in, int64_t r, float scaling, float* W,
                        void* stream) {
  return Launch<false>(A, B, out, in, r, scaling, W, stream);
}

int LoraDeltaAccumulateFanInFanOut(const float* A, const float* B, int64_t out, int64_t in, int64_t r, float scaling,
                                   float* W, void* stream) {
  return Launch<true>(A, B, out, in, r, scaling, W, stream);
}

int LoraEmbeddingDeltaAccumulate(const float* A, const float* B, int64_t num_embeddings, int64_t dim, int64_t r,
                                 float scaling, float* W, void* stream) {
  return Launch<true>(A, B, /*out=*/dim, /*in=*/num_embeddings, r, scaling, W, stream);
}

}  // namespace ferry::kernels::cuda
