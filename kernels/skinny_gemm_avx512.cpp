// SkinnyLinear's AVX-512 path (compiled with -mavx512f, called only where the CPU has it:
// skinny_gemm.cpp). Two ways through, chosen by m:
// - m < kRowsInLanes: dot products. The AVX2 copy's tiles at twice the width and with 32
//   registers: 4 rows of x against 6 weight rows, the k tail through a masked load.
// - m >= kRowsInLanes: rows in lanes. x is transposed once per call so that one vector holds k's
//   value for 16 rows; each weight element is broadcast from memory into an FMA against it. A
//   weight element is loaded once for 16 rows (the dot products load a 16-wide piece of x for
//   every 6 weight vectors), and no lanes are added up at the end. On a [4864, 896] weight read
//   from memory, 2 cores: 1.3x the dot products at 16 rows, 1.6x at 32.
#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <vector>

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

// From this many rows of x on, the rows-in-lanes path runs (below it, the dot products win: with
// 8 rows half of every vector would be idle).
constexpr int64_t kRowsInLanes = 12;
// Up to 16 * kMaxVectors rows of x go through the weight together; more take further passes.
constexpr int kMaxVectors = 4;
// How far ahead in each weight row the rows-in-lanes tile prefetches (floats: 8 lines).
constexpr int64_t kAheadFloats = 128;

// Output columns [j, j + NT) for the rows in xt ([k_dim, 16 V], row i in lane i of each k's V
// vectors): acc[n][v] = sum over k of xt[k][v] * w[n][k], one fused multiply-add per k in
// order. Leaves the sums in out [NT][16 V]. `next` is where the rows after these begin (the
// prefetch runs into them as the tile ends).
template <int V, int NT>
inline void LanesTile(const float* xt, int64_t k_dim, const float* w, const float* next, float* out) {
  __m512 acc[NT][V];
#pragma GCC unroll 32
  for (int n = 0; n < NT; ++n) {
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[n][v] = _mm512_setzero_ps();
  }
  for (int64_t kb = 0; kb < k_dim; kb += 16) {
    // One line per weight row per 16 k: the rows are read at the rate this prefetches them.
    const int64_t ahead = kb + kAheadFloats;
#pragma GCC unroll 32
    for (int n = 0; n < NT; ++n) {
      const float* line = ahead < k_dim ? w + n * k_dim + ahead : next + n * k_dim + (ahead - k_dim);
      _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
    }
    const int64_t ke = std::min(k_dim, kb + 16);
    for (int64_t k = kb; k < ke; ++k) {
      __m512 xv[V];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_ps(xt + (k * V + v) * 16);
#pragma GCC unroll 32
      for (int n = 0; n < NT; ++n) {
        const __m512 wv = _mm512_set1_ps(w[n * k_dim + k]);
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) acc[n][v] = _mm512_fmadd_ps(xv[v], wv, acc[n][v]);
      }
    }
  }
#pragma GCC unroll 32
  for (int n = 0; n < NT; ++n) {
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + (n * V + v) * 16, acc[n][v]);
  }
}

// Rows [0, m) of x (m <= 16 V) against weight rows [j0, j1): tiles of NT columns, then the
// remainder in tiles of 16, 8, 4, 2 and 1 (each column's sum is the same in any tile).
template <int V, int NT>
void LanesRows(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y, int64_t ldy,
               int64_t j0, int64_t j1) {
  thread_local std::vector<float> xt;
  xt.assign(static_cast<size_t>(k_dim * 16 * V), 0.0f);
  for (int64_t k = 0; k < k_dim; ++k) {
    float* lanes = xt.data() + k * 16 * V;
    for (int64_t i = 0; i < m; ++i) lanes[i] = x[i * k_dim + k];
  }
  alignas(64) float out[NT * 16 * V];
  int64_t j = j0;
  auto tiles = [&](auto width) {
    constexpr int T = decltype(width)::value;
    if constexpr (T <= NT) {
      for (; j + T <= j1; j += T) {
        // The rows after the last tile are not this call's: it prefetches its own again.
        const float* next = j + 2 * T <= j1 ? w + (j + T) * k_dim : w + j * k_dim;
        LanesTile<V, T>(xt.data(), k_dim, w + j * k_dim, next, out);
        for (int n = 0; n < T; ++n) {
          const float* sums = out + n * 16 * V;
          if (bias) {
            for (int64_t i = 0; i < m; ++i) y[i * ldy + j + n] = sums[i] + bias[j + n];
          } else {
            for (int64_t i = 0; i < m; ++i) y[i * ldy + j + n] = sums[i];
          }
        }
      }
    }
  };
  tiles(std::integral_constant<int, NT>());
  tiles(std::integral_constant<int, 16>());
  tiles(std::integral_constant<int, 8>());
  tiles(std::integral_constant<int, 4>());
  tiles(std::integral_constant<int, 2>());
  tiles(std::integral_constant<int, 1>());
}

}  // namespace

void SkinnyLinearAvx512(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y,
                        int64_t ldy, int64_t j0, int64_t j1) {
  if (m >= kRowsInLanes) {
    // Accumulators and x vectors in the 32 registers: 24 + 1, 14 x 2 + 2, 9 x 3 + 3, 6 x 4 + 4.
    for (int64_t i = 0; i < m; i += 16 * kMaxVectors) {
      const int64_t rows = std::min<int64_t>(16 * kMaxVectors, m - i);
      const float* xi = x + i * k_dim;
      float* yi = y + i * ldy;
      switch ((rows + 15) / 16) {
        case 1: LanesRows<1, 24>(xi, rows, k_dim, w, bias, yi, ldy, j0, j1); break;
        case 2: LanesRows<2, 14>(xi, rows, k_dim, w, bias, yi, ldy, j0, j1); break;
        case 3: LanesRows<3, 9>(xi, rows, k_dim, w, bias, yi, ldy, j0, j1); break;
        default: LanesRows<4, 6>(xi, rows, k_dim, w, bias, yi, ldy, j0, j1); break;
      }
    }
    return;
  }
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
