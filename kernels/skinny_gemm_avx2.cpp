// SkinnyLinear's AVX2 + FMA path (compiled with -mavx2 -mfma, called only where the CPU has
// both: skinny_gemm.cpp).
#include <immintrin.h>

#include "kernels/skinny_gemm.h"

namespace ferry::kernels::detail {
namespace {

// The sum of the 8 lanes of v, in a fixed order.
inline float Sum8(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v);
  const __m128 hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                  // 4 pairs
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));         // 2
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));  // 1
  return _mm_cvtss_f32(s);
}

// MR rows of x against NR rows of w: MR * NR dot products of length k_dim, 8 lanes each, the
// tail (k_dim % 8) added after the lanes.
template <int MR, int NR>
inline void Tile(const float* x, int64_t k_dim, const float* w, const float* bias, float* y, int64_t ldy, int64_t j) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i) {
    for (int n = 0; n < NR; ++n) acc[i][n] = _mm256_setzero_ps();
  }
  const int64_t k8 = k_dim - k_dim % 8;
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = _mm256_loadu_ps(w + n * k_dim + k);
    // The next weight rows, on their way from memory while these are used.
    if (k % 16 == 0) {
      for (int n = 0; n < NR; ++n) _mm_prefetch(reinterpret_cast<const char*>(w + (NR + n) * k_dim + k), _MM_HINT_T0);
    }
    for (int i = 0; i < MR; ++i) {
      __m256 xv = _mm256_loadu_ps(x + i * k_dim + k);
      // Keeps x in a register for its NR products (a memory operand per FMA would load it NR times).
      asm("" : "+x"(xv));
      for (int n = 0; n < NR; ++n) acc[i][n] = _mm256_fmadd_ps(xv, wv[n], acc[i][n]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int n = 0; n < NR; ++n) {
      float sum = Sum8(acc[i][n]);
      for (int64_t k = k8; k < k_dim; ++k) sum += x[i * k_dim + k] * w[n * k_dim + k];
      y[i * ldy + j + n] = bias ? sum + bias[j + n] : sum;
    }
  }
}

template <int NR>
inline void Rows(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y, int64_t ldy,
                 int64_t j) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) Tile<4, NR>(x + i * k_dim, k_dim, w, bias, y + i * ldy, ldy, j);
  switch (m - i) {
    case 3: Tile<3, NR>(x + i * k_dim, k_dim, w, bias, y + i * ldy, ldy, j); break;
    case 2: Tile<2, NR>(x + i * k_dim, k_dim, w, bias, y + i * ldy, ldy, j); break;
    case 1: Tile<1, NR>(x + i * k_dim, k_dim, w, bias, y + i * ldy, ldy, j); break;
    default: break;
  }
}

}  // namespace

void SkinnyLinearAvx2(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y,
                      int64_t ldy, int64_t j0, int64_t j1) {
  int64_t j = j0;
  // Three weight rows at a time: 4 x 3 accumulators, 3 w vectors and one x vector fill the 16
  // registers; x is reused 3 times and w 4 times per load.
  for (; j + 3 <= j1; j += 3) Rows<3>(x, m, k_dim, w + j * k_dim, bias, y, ldy, j);
  if (j1 - j == 2) Rows<2>(x, m, k_dim, w + j * k_dim, bias, y, ldy, j);
  if (j1 - j == 1) Rows<1>(x, m, k_dim, w + j * k_dim, bias, y, ldy, j);
}

}  // namespace ferry::kernels::detail
