// Linear layers over a few rows: y = x w^T (+ bias) in F32 where x has few rows (the tokens of
// a decoding step) and w is a large weight. BLAS GEMMs pack w before multiplying, a pass over
// the whole weight that a handful of rows cannot amortise; these kernels read each weight row
// once, straight from its storage, and keep it in L1 while every row of x meets it.
// Measured on 2 cores (AVX2), x [m, 896] against a [4864, 896] weight read from memory: 1.7-2.3x
// faster than OpenBLAS's sgemm for m = 1..8, level at m = 16 (docs/daemon.md, "Generation speed").
//
// Sums run over k in 8 lanes with FMA and are added up in a fixed order: the result does not
// depend on the thread split or on m, but it rounds differently from a BLAS (a few ulps).
#pragma once

#include <cstdint>

namespace ferry::kernels {

// True when the fast path (AVX2 + FMA) runs on this CPU; otherwise SkinnyLinear uses plain
// loops (correct, not fast: callers should prefer a BLAS then).
bool SkinnyLinearFast();

// y[i * ldy + j] = sum_k x[i * k_dim + k] * w[j * k_dim + k] (+ bias[j]) for i in [0, m) and
// j in [j0, j1): x [m, k_dim] and w [n, k_dim] row-major and contiguous; bias [n] or null.
// Callers split [0, n) across threads. REQUIRES: m >= 1, k_dim >= 1, 0 <= j0 <= j1.
void SkinnyLinear(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y, int64_t ldy,
                  int64_t j0, int64_t j1);

namespace detail {
// The two implementations SkinnyLinear chooses between, same contract (public for tests).
// Plain loops (LaneDot), for any CPU:
void SkinnyLinearPortable(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y,
                          int64_t ldy, int64_t j0, int64_t j1);
// AVX2 + FMA (skinny_gemm_avx2.cpp). REQUIRES: SkinnyLinearFast().
void SkinnyLinearAvx2(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y,
                      int64_t ldy, int64_t j0, int64_t j1);
}  // namespace detail

}  // namespace ferry::kernels
