// CUDA versions of kernels/lora_merge.h. Pointers are device pointers; each call is
// asynchronous on `stream` (nullptr: the default stream) and returns a CUDA error code
// (0 = success; cudaErrorInvalidValue = 1 for negative sizes or a grid too large to launch).
//
// Arithmetic is the CPU reference's, operation for operation: for every element an fp32 sum
// over k = 0..r-1 in natural order starting from 0.0f, products and sums each rounded
// separately (__fmul_rn / __fadd_rn, never contracted into FMA), then W += scaling * sum.
// The result is therefore bit-identical to the CPU kernels (tests/kernels/
// cuda_lora_merge_test.cpp checks that), as long as denormals are not flushed (do not build
// with --use_fast_math / -ftz=true).
#pragma once

#include <cstdint>

namespace ferry::kernels::cuda {

// W [out, in] += scaling * (B [out, r] @ A [r, in]). See ferry::kernels::LoraDeltaAccumulate.
// REQUIRES: W does not overlap A or B.
int LoraDeltaAccumulate(const float* A, const float* B, int64_t out, int64_t in, int64_t r, float scaling, float* W,
                        void* stream = nullptr);

// W [in, out] += scaling * (B @ A)^T. See ferry::kernels::LoraDeltaAccumulateFanInFanOut.
int LoraDeltaAccumulateFanInFanOut(const float* A, const float* B, int64_t out, int64_t in, int64_t r, float scaling,
                                   float* W, void* stream = nullptr);

// W [num_embeddings, dim] += scaling * (B [dim, r] @ A [r, num_embeddings])^T.
// See ferry::kernels::LoraEmbeddingDeltaAccumulate.
int LoraEmbeddingDeltaAccumulate(const float* A, const float* B, int64_t num_embeddings, int64_t dim, int64_t r,
                                 float scaling, float* W, void* stream = nullptr);

}  // namespace ferry::kernels::cuda
