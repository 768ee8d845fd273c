// SkinnyLinear's AVX-512 path (compiled with -mavx512f, called only where the CPU has it:
// skinny_gemm.cpp). The AVX2 copy's tiles at twice the width and with 32 registers: 4 rows of x
// against 6 weight rows, the k tail through a masked load instead of a scalar loop.
#include <immintrin.h>

#include <algorithm>

#include "kernels/skinny_gemm.h"

namespace ferry::kernels::detail {
namespace {

// The sum of the 16 lanes of v, in a fixed order. (Through memory: GCC 12's 512-bit extracts,
// casts and _mm512_reduce_add_ps trip -Wuninitialized inside its own header.)
inline float Sum16(__m512 v) {
  alignas(64) float lane[16];
  _mm512_store_ps(lane, v);
  const __m256 s8 = _mm256_add_ps(_mm256_load_ps(lane), _mm256_load_ps(lane + 8));  // 8 pairs
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));  // 4
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                           // 2
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));                                    // 1
  return _mm_cvtss_f32(s);
}

// Brings the next NR weight rows into L1 while the current NR are used. A tile's k loop calls
// Step() once per vector step; each call asks for `per_step` more lines, taken across the rows in
// turn (row 0's line 0, row 1's line 0, ...). One pass over x (m <= 4) fetches the next rows as
// fast as it reads the current ones; the ceil(m / 4) passes of a larger m share the work, so
// memory stays busy while the passes after the first find their weight rows in L1. (Prefetching
// the next rows only during the first pass, as the AVX2 copy does, left memory idle through the
// others: 1.5 against 1.15 ms for 16 rows on a [4864, 896] weight, 2 cores.)
template <int NR>
struct NextRowsPrefetcher {
  const char* rows;    // the first of the next NR rows
  int64_t row_bytes;   // k_dim * 4
  int64_t per_step;    // lines per Step()
  int64_t row = 0;     // where the next line is: this row,
  int64_t offset = 0;  // at this byte

  // For rows `next` [NR, k_dim], read by `passes` passes of `steps` Step() calls each.
  NextRowsPrefetcher(const float* next, int64_t k_dim, int64_t passes, int64_t steps)
      : rows(reinterpret_cast<const char*>(next)), row_bytes(k_dim * int64_t{sizeof(float)}) {
    const int64_t lines = NR * ((row_bytes + 63) / 64);
    const int64_t calls = std::max<int64_t>(1, passes * steps);
    per_step = (lines + calls - 1) / calls;
  }

  inline void Step() {
    for (int64_t l = 0; l < per_step; ++l) {
      _mm_prefetch(rows + row * row_bytes + offset, _MM_HINT_T0);
      if (++row == NR) row = 0, offset += 64;
    }
  }
};

// MR rows of x against NR rows of w: MR * NR dot products of length k_dim in 16 lanes, the last
// partial chunk of k read through a mask, the lanes added up in a fixed order.
template <int MR, int NR>
inline void Tile(const float* x, int64_t k_dim, const float* w, const float* bias, float* y, int64_t ldy, int64_t j,
                 NextRowsPrefetcher<NR>& ahead) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i) {
    for (int n = 0; n < NR; ++n) acc[i][n] = _mm512_setzero_ps();
  }
  const int64_t k16 = k_dim - k_dim % 16;
  for (int64_t k = 0; k < k16; k += 16) {
    __m512 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = _mm512_loadu_ps(w + n * k_dim + k);
    ahead.Step();
    for (int i = 0; i < MR; ++i) {
      __m512 xv = _mm512_loadu_ps(x + i * k_dim + k);
      // Keeps x in a register for its NR products (a memory operand per FMA would load it NR times).
      asm("" : "+v"(xv));
      for (int n = 0; n < NR; ++n) acc[i][n] = _mm512_fmadd_ps(xv, wv[n], acc[i][n]);
    }
  }
  if (k16 < k_dim) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (k_dim - k16)) - 1);
    __m512 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = _mm512_maskz_loadu_ps(mask, w + n * k_dim + k16);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * k_dim + k16);
      for (int n = 0; n < NR; ++n) acc[i][n] = _mm512_fmadd_ps(xv, wv[n], acc[i][n]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int n = 0; n < NR; ++n) {
      const float sum = Sum16(acc[i][n]);
      y[i * ldy + j + n] = bias ? sum + bias[j + n] : sum;
    }
  }
}

template <int NR>
inline void Rows(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y, int64_t ldy,
                 int64_t j) {
  NextRowsPrefetcher<NR> ahead(w + NR * k_dim, k_dim, (m + 3) / 4, k_dim / 16);
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) Tile<4, NR>(x + i * k_dim, k_dim, w, bias, y + i * ldy, ldy, j, ahead);
  switch (m - i) {
    case 3: Tile<3, NR>(x + i * k_dim, k_dim, w, bias, y + i * ldy, ldy, j, ahead); break;
    case 2: Tile<2, NR>(x + i * k_dim, k_dim, w, bias, y + i * ldy, ldy, j, ahead); break;
    case 1: Tile<1, NR>(x + i * k_dim, k_dim, w, bias, y + i * ldy, ldy, j, ahead); break;
    default: break;
  }
}

}  // namespace

void SkinnyLinearAvx512(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y,
                        int64_t ldy, int64_t j0, int64_t j1) {
  constexpr int64_t kNr = 6;
  int64_t j = j0;
  // 4 x 6 accumulators, 6 w vectors and one x vector: 31 of the 32 registers.
  for (; j + kNr <= j1; j += kNr) Rows<kNr>(x, m, k_dim, w + j * k_dim, bias, y, ldy, j);
  switch (j1 - j) {
    case 5: Rows<5>(x, m, k_dim, w + j * k_dim, bias, y, ldy, j); break;
    case 4: Rows<4>(x, m, k_dim, w + j * k_dim, bias, y, ldy, j); break;
    case 3: Rows<3>(x, m, k_dim, w + j * k_dim, bias, y, ldy, j); break;
    case 2: Rows<2>(x, m, k_dim, w + j * k_dim, bias, y, ldy, j); break;
    case 1: Rows<1>(x, m, k_dim, w + j * k_dim, bias, y, ldy, j); break;
    default: break;
  }
}

}  // namespace ferry::kernels::detail
