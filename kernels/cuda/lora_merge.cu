#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/lora_merge.cuh"

namespace ferry::kernels::cuda {
namespace {

constexpr int kTile = 32;        // W tile is kTile x kTile
constexpr int kRowsPerPass = 8;  // blockDim = (kTile, kRowsPerPass)
constexpr int kChunk = 32;       // k values staged in shared memory at a time
constexpr int kThreads = kTile * kRowsPerPass;
constexpr int kPerThread = kTile / kRowsPerPass;

// The tiled kernel, for ranks above 64: one block updates one kTile x kTile tile of W [nrows, ncols]. Without
// fan_in_fan_out (row, col) = (o, i); with it (row, col) = (i, o). Element (o, i) gets sum_{k ascending} B[o,k] *
// A[k,i], each step rounded as the CPU reference rounds it.
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

// The streaming kernel, for r <= 64 (every LoRA rank in practice): W is read and written once, in
// 16-byte vectors where the rows allow, and nothing else of size W moves.
// Each thread owns kCols adjacent columns of W and keeps, in registers, the r factors of the
// product that belong to those columns (A[k, i] without fan_in_fan_out, B[o, k] with it). The
// block's kStreamRowsPerBlock rows' own r factors (B[o, k], or A[k, i]) are staged once in shared
// memory; each thread then walks down those rows, reading the row's factors from there (one
// address for the whole block: a broadcast) and updating its columns. The sum per element is the
// CPU reference's, k ascending from 0.0f, every product and sum rounded on its own.
constexpr int kStreamThreads = 256;
constexpr int kStreamRowsPerBlock = 32;

template <bool kFanInFanOut, int kR, int kCols>
__global__ void __launch_bounds__(kStreamThreads, 2)
    LoraStreamKernel(const float* __restrict__ A, const float* __restrict__ B, int64_t out, int64_t in, int r,
                     float scaling, float* __restrict__ W) {
  __shared__ float g_sh[kStreamRowsPerBlock][kR];
  const int64_t ncols = kFanInFanOut ? out : in;
  const int64_t nrows = kFanInFanOut ? in : out;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * kStreamRowsPerBlock;
  const int nrow = nrows - row_begin < kStreamRowsPerBlock ? static_cast<int>(nrows - row_begin) : kStreamRowsPerBlock;
  for (int e = threadIdx.x; e < kStreamRowsPerBlock * kR; e += kStreamThreads) {
    // Without fan_in_fan_out, B's rows lie in memory row by row; with it, A's columns do.
    const int rr = kFanInFanOut ? e % kStreamRowsPerBlock : e / kR;
    const int k = kFanInFanOut ? e / kStreamRowsPerBlock : e % kR;
    float v = 0.0f;
    if (rr < nrow && k < r) {
      v = kFanInFanOut ? A[static_cast<int64_t>(k) * in + row_begin + rr] : B[(row_begin + rr) * r + k];
    }
    g_sh[rr][k] = v;
  }
  __syncthreads();
  const int64_t col0 = (static_cast<int64_t>(blockIdx.x) * kStreamThreads + threadIdx.x) * kCols;
  if (col0 >= ncols) return;
  const int ncol = ncols - col0 < kCols ? static_cast<int>(ncols - col0) : kCols;
  // The column factors: f[c][k] = A[k, col0 + c] (o, i) or B[col0 + c, k] (fan_in_fan_out).
  float f[kCols][kR];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
#pragma unroll
    for (int k = 0; k < kR; ++k) {
      float v = 0.0f;
      if (k < r && c < ncol) v = kFanInFanOut ? B[(col0 + c) * r + k] : A[static_cast<int64_t>(k) * in + col0 + c];
      f[c][k] = v;
    }
  }
  const bool vector = kCols == 4 && ncol == 4 && (ncols % 4) == 0 && (reinterpret_cast<uintptr_t>(W) % 16) == 0;
#pragma unroll 2
  for (int rr = 0; rr < nrow; ++rr) {
    float acc[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[c] = 0.0f;
#pragma unroll
    for (int k = 0; k < kR; ++k) {
      if (k < r) {
        const float g = g_sh[rr][k];
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[c] = __fadd_rn(acc[c], __fmul_rn(g, f[c][k]));
      }
    }
    float* w = W + (row_begin + rr) * ncols + col0;
    if (vector) {
      float4 v = *reinterpret_cast<const float4*>(w);
      v.x = __fadd_rn(v.x, __fmul_rn(scaling, acc[0]));
      v.y = __fadd_rn(v.y, __fmul_rn(scaling, acc[kCols > 1 ? 1 : 0]));
      v.z = __fadd_rn(v.z, __fmul_rn(scaling, acc[kCols > 2 ? 2 : 0]));
      v.w = __fadd_rn(v.w, __fmul_rn(scaling, acc[kCols > 3 ? 3 : 0]));
      *reinterpret_cast<float4*>(w) = v;
    } else {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        if (c < ncol) w[c] = __fadd_rn(w[c], __fmul_rn(scaling, acc[c]));
      }
    }
  }
}

template <bool kFanInFanOut, int kR, int kCols>
int LaunchStream(const float* A, const float* B, int64_t out, int64_t in, int64_t r, float scaling, float* W,
                 void* stream) {
  const int64_t nrows = kFanInFanOut ? in : out;
  const int64_t ncols = kFanInFanOut ? out : in;
  const int64_t per_block = static_cast<int64_t>(kStreamThreads) * kCols;
  const int64_t gx = (ncols + per_block - 1) / per_block;
  const int64_t gy = (nrows + kStreamRowsPerBlock - 1) / kStreamRowsPerBlock;
  if (gx > 0x7fffffff || gy > 65535) return -1;  // the tiled kernel's grid may still fit
  LoraStreamKernel<kFanInFanOut, kR, kCols>
      <<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), kStreamThreads, 0,
         static_cast<cudaStream_t>(stream)>>>(A, B, out, in, static_cast<int>(r), scaling, W);
  return static_cast<int>(cudaGetLastError());
}

template <bool kFanInFanOut>
int Launch(const float* A, const float* B, int64_t out, int64_t in, int64_t r, float scaling, float* W, void* stream) {
  if (out < 0 || in < 0 || r < 0) return static_cast<int>(cudaErrorInvalidValue);
  if (out == 0 || in == 0) return 0;
  // Ranks up to 64 stream W once (16 factors by 4 columns, 32 by 2, 64 by 1 a thread: 64 registers).
  int streamed = -1;
  if (r <= 16) {
    streamed = LaunchStream<kFanInFanOut, 16, 4>(A, B, out, in, r, scaling, W, stream);
  } else if (r <= 32) {
    streamed = LaunchStream<kFanInFanOut, 32, 2>(A, B, out, in, r, scaling, W, stream);
  } else if (r <= 64) {
    streamed = LaunchStream<kFanInFanOut, 64, 1>(A, B, out, in, r, scaling, W, stream);
  }
  if (streamed >= 0) return streamed;
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
