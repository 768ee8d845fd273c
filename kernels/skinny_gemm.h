// Linear layers over a few rows: y = x w^T (+ bias) in F32 where x has few rows (the tokens of
// a decoding step) and w is a large weight. BLAS GEMMs pack w before multiplying, a pass over
// the whole weight that a handful of rows cannot amortise; these kernels read each weight row
// once, straight from its storage, and keep it in L1 while every row of x meets it.
// Figures against OpenBLAS's sgemm: docs/daemon.md, "Generation speed against transformers".
//
// Sums run in a fixed order, so the result does not depend on the thread split, but it rounds
// differently from a BLAS (a few ulps), and the copies round differently from each other:
// - below 12 rows (and in the AVX2 and portable copies at any m), over k in vector lanes with
//   FMA, the lanes added up at the end: a row's result does not depend on m;
// - from 12 rows on in the AVX-512 copy, one FMA per k in order for each output (the rows sit
//   in the lanes): a row's result is the same for every m >= 12.
#pragma once

#include <cstdint>

namespace ferry::kernels {

// True when a fast path (AVX-512, or AVX2 + FMA) runs on this CPU; otherwise SkinnyLinear uses
// plain loops (correct, not fast: callers should prefer a BLAS then).
bool SkinnyLinearFast();

// Up to how many rows of x SkinnyLinear is faster than a BLAS GEMM on this CPU (measured against
// OpenBLAS on a [4864, 896] weight read from memory, bench/skinny_bench.cpp): 64 with AVX-512
// (1.3x there, level at 128), 8 with AVX2 + FMA (level at 16), 0 with neither.
int64_t SkinnyLinearRowsThatPay();

// y[i * ldy + j] = sum_k x[i * k_dim + k] * w[j * k_dim + k] (+ bias[j]) for i in [0, m) and
// j in [j0, j1): x [m, k_dim] and w [n, k_dim] row-major and contiguous; bias [n] or null.
// Callers split [0, n) across threads. REQUIRES: m >= 1, k_dim >= 1, 0 <= j0 <= j1.
void SkinnyLinear(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y, int64_t ldy,
                  int64_t j0, int64_t j1);

namespace detail {
// What the CPU (and the OS, for the wider registers) supports.
bool HasAvx2Fma();
bool HasAvx512();

// The implementations SkinnyLinear chooses between, same contract (public for tests).
// Plain loops (LaneDot), for any CPU:
void SkinnyLinearPortable(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y,
                          int64_t ldy, int64_t j0, int64_t j1);
// AVX2 + FMA (skinny_gemm_avx2.cpp). REQUIRES: HasAvx2Fma().
void SkinnyLinearAvx2(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y,
                      int64_t ldy, int64_t j0, int64_t j1);
// AVX-512F (skinny_gemm_avx512.cpp). REQUIRES: HasAvx512().
void SkinnyLinearAvx512(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y,
                        int64_t ldy, int64_t j0, int64_t j1);
}  // namespace detail

}  // namespace ferry::kernels
