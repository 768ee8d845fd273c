#include "kernels/lora_merge.h"

#include "kernels/cast.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <thread>
#include <vector>

// Multi-versioned hot loop: with GCC on x86-64 the loader picks an AVX-512, AVX2 or baseline
// version (function multiversioning). Every version performs the same IEEE operations in the
// same order (no FMA: contraction would change the rounding, see the header; GCC's vector
// extensions compile `acc + c * a` to a separate multiply and add under -ffp-contract=off),
// lane by lane what the scalar UpdateOne does, so the result does not depend on the version.
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__) && defined(__GNUC__) && \
    !defined(__clang__)
#define FERRY_MULTIVERSION 1
#else
#define FERRY_MULTIVERSION 0
#endif
#if defined(__GNUC__)
#define FERRY_VECTOR_EXT 1
#define FERRY_INLINE [[gnu::always_inline]] inline
#else
#define FERRY_VECTOR_EXT 0
#define FERRY_INLINE inline
#endif

namespace ferry::kernels {
namespace {

// Below this many multiply-adds per thread a worker thread is not worth starting.
constexpr int64_t kMinWorkPerThread = int64_t{1} << 20;
// Bytes of the [r, tile] panel of the shared factor kept hot in L2 while all rows pass.
constexpr int64_t kPanelBytes = 512 * 1024;
// Output rows per register block: each load of the shared panel feeds this many rows.
constexpr int kBlockRows = 4;

// Rank-r update of rows [row_begin, row_end) of a [*, ncols] weight:
//   y[i, j] = w[i, j] + s * d[i, j],  d[i, j] = sum_{k=0..r-1} coef(i, k) * M[k, j]
// (d summed from 0.0f in order k = 0..r-1), coef(i, k) = coef[i * coef_row + k * coef_k].
// The base w is read from and y written to either a BF16 matrix (src16 -> dst16, any
// alignment) or an fp32 matrix in place (w32).
//
// BF16 layout trick: 2L consecutive BF16 values loaded as L uint32 lanes hold the even
// columns in their high halves and the odd columns in their low halves, so they decode with
// one AND and one shift and re-pack the same way, without lane shuffles. For this the panel
// holding M is permuted within every full group of 2L columns (L = lanes of the version that
// runs, see VectorLanes): [M[k, j], M[k, j+2], ..., M[k, j+2L-2], M[k, j+1], ..., M[k, j+2L-1]];
// the columns after the last full group keep their places.
struct UpdateJob {
  const float* panel = nullptr;  // M [r, ncols] row-major, permuted as above for BF16
  const float* coef = nullptr;
  int64_t coef_row = 0, coef_k = 0;
  int64_t r = 0, ncols = 0;
  float s = 0.0f;
  const unsigned char* src16 = nullptr;  // BF16 [*, ncols], or null
  unsigned char* dst16 = nullptr;
  float* w32 = nullptr;  // fp32 [*, ncols] updated in place when src16 is null
};

// fp32 rows updated in place; vectors of N consecutive columns.
struct F32Rows {
  static constexpr int kGroup = 1;  // vectors per load/store group
  float* w;
  int64_t ld;
  FERRY_INLINE float LoadOne(int64_t i, int64_t j) const { return w[i * ld + j]; }
  FERRY_INLINE void StoreOne(int64_t i, int64_t j, float y) const { w[i * ld + j] = y; }
  FERRY_INLINE void Prefetch(int64_t i, int64_t j, int64_t n) const {
    for (int64_t b = 0; b < n * 4; b += 64) __builtin_prefetch(w + i * ld + j + b / 4, 1);
  }
};

// BF16 rows in and out (round to nearest even, NaN kept quiet); a group is the even and the
// odd columns of 2N consecutive columns.
struct Bf16Rows {
  static constexpr int kGroup = 2;
  const unsigned char* src;
  unsigned char* dst;
  int64_t ld;
  FERRY_INLINE float LoadOne(int64_t i, int64_t j) const {
    uint16_t v;
    std::memcpy(&v, src + 2 * (i * ld + j), 2);
    return BF16ToF32(v);
  }
  FERRY_INLINE void StoreOne(int64_t i, int64_t j, float y) const {
    const uint16_t v = F32ToBF16(y);
    std::memcpy(dst + 2 * (i * ld + j), &v, 2);
  }
  FERRY_INLINE void Prefetch(int64_t i, int64_t j, int64_t n) const {
    for (int64_t b = 0; b < n * 2; b += 64) __builtin_prefetch(src + 2 * (i * ld + j) + b);
  }
};

// One element: the reference sequence that the vector blocks follow lane by lane. j must be
// a column whose panel entries keep their place (any column for F32Rows).
template <class Rows>
FERRY_INLINE void UpdateOne(const Rows& rows, const UpdateJob& job, int64_t i, int64_t j) {
  float d = 0.0f;
  const float* c = job.coef + i * job.coef_row;
  for (int64_t k = 0; k < job.r; ++k) d += c[k * job.coef_k] * job.panel[k * job.ncols + j];
  rows.StoreOne(i, j, rows.LoadOne(i, j) + job.s * d);
}

#if FERRY_VECTOR_EXT

template <int N>
struct Lanes {
  using F [[gnu::vector_size(4 * N)]] = float;
  using U [[gnu::vector_size(4 * N)]] = uint32_t;
};

template <int N>
FERRY_INLINE void LoadGroup(const F32Rows& rows, int64_t i, int64_t j, typename Lanes<N>::F* w) {
  std::memcpy(w, rows.w + i * rows.ld + j, sizeof *w);
}
template <int N>
FERRY_INLINE void StoreGroup(const F32Rows& rows, int64_t i, int64_t j, const typename Lanes<N>::F* y) {
  std::memcpy(rows.w + i * rows.ld + j, y, sizeof *y);
}

// w[0] = even columns, w[1] = odd columns of [j, j + 2N).
template <int N>
FERRY_INLINE void LoadGroup(const Bf16Rows& rows, int64_t i, int64_t j, typename Lanes<N>::F* w) {
  using U = typename Lanes<N>::U;
  U u;
  std::memcpy(&u, rows.src + 2 * (i * rows.ld + j), sizeof u);
  const U even = u << 16, odd = u & 0xffff0000u;
  std::memcpy(&w[0], &even, sizeof even);
  std::memcpy(&w[1], &odd, sizeof odd);
}

// The bfloat16 of y in the high half of each lane (F32ToBF16, without the final shift).
// (Results through references: vector return values would trip -Wpsabi.)
template <int N>
FERRY_INLINE void RoundHigh(const typename Lanes<N>::F& y, typename Lanes<N>::U& out) {
  using U = typename Lanes<N>::U;
  U u;
  std::memcpy(&u, &y, sizeof u);
  const U rounded = u + 0x7fffu + ((u >> 16) & 1u);
  const U is_nan = (u & 0x7fffffffu) > 0x7f800000u;  // all ones where NaN
  out = (rounded & ~is_nan) | ((u | 0x00400000u) & is_nan);
}

template <int N>
FERRY_INLINE void StoreGroup(const Bf16Rows& rows, int64_t i, int64_t j, const typename Lanes<N>::F* y) {
  using U = typename Lanes<N>::U;
  U even, odd;
  RoundHigh<N>(y[0], even);
  RoundHigh<N>(y[1], odd);
  const U packed = (even >> 16) | (odd & 0xffff0000u);
  std::memcpy(rows.dst + 2 * (i * rows.ld + j), &packed, sizeof packed);
}

// R rows x V vectors of N lanes at (i0, j): every panel load feeds R rows.
template <int N, int R, int V, class Rows>
FERRY_INLINE void Block(const Rows& rows, const UpdateJob& job, int64_t i0, int64_t j) {
  using F = typename Lanes<N>::F;
  static_assert(V % Rows::kGroup == 0);
  F acc[R][V];
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < V; ++v) acc[i][v] = F{};
  }
  const float* c = job.coef + i0 * job.coef_row;
  const float* m = job.panel + j;
  for (int64_t k = 0; k < job.r; ++k) {
    F a[V];
    for (int v = 0; v < V; ++v) std::memcpy(&a[v], m + k * job.ncols + v * N, sizeof(F));
    for (int i = 0; i < R; ++i) {
      const float ck = c[i * job.coef_row + k * job.coef_k];
      for (int v = 0; v < V; ++v) acc[i][v] = acc[i][v] + ck * a[v];
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < V; v += Rows::kGroup) {
      F w[Rows::kGroup], y[Rows::kGroup];
      LoadGroup<N>(rows, i0 + i, j + v * N, w);
      for (int g = 0; g < Rows::kGroup; ++g) y[g] = w[g] + job.s * acc[i][v + g];
      StoreGroup<N>(rows, i0 + i, j + v * N, y);
    }
  }
}

// Columns [j0, j1) of R rows from i0: wide blocks, then single groups, then scalars. While
// a wide block runs, the base rows of the next block (rows [i0 + R, i0 + 2R) below
// prefetch_end) at the same columns are prefetched: a block reads R short runs of one row
// each, too short for the hardware prefetchers to start on a weight read from memory
// (merging a 0.5B model's mapped BF16 weights on one thread: 0.40 s without, 0.30 s with).
template <int N, int R, int V, class Rows>
FERRY_INLINE void RowBlock(const Rows& rows, const UpdateJob& job, int64_t i0, int64_t j0, int64_t j1,
                           int64_t prefetch_end) {
  constexpr int kGroupCols = Rows::kGroup * N;
  const int ahead = static_cast<int>(std::clamp<int64_t>(prefetch_end - (i0 + R), 0, R));
  int64_t j = j0;
  for (; j + V * N <= j1; j += V * N) {
    for (int i = 0; i < ahead; ++i) rows.Prefetch(i0 + R + i, j, V * N);
    Block<N, R, V>(rows, job, i0, j);
  }
  for (; j + kGroupCols <= j1; j += kGroupCols) Block<N, R, Rows::kGroup>(rows, job, i0, j);
  for (; j < j1; ++j) {
    for (int i = 0; i < R; ++i) UpdateOne(rows, job, i0 + i, j);
  }
}

template <int N, int V, class Rows>
FERRY_INLINE void UpdateRowsImpl(const Rows& rows, const UpdateJob& job, int64_t row_begin, int64_t row_end) {
  // Column tiles are whole blocks, so the groups of the permuted panel never straddle one.
  const int64_t per_col = static_cast<int64_t>(sizeof(float)) * std::max<int64_t>(job.r, 1);
  const int64_t tile = std::max<int64_t>(V * N, kPanelBytes / per_col / (V * N) * (V * N));
  for (int64_t j0 = 0; j0 < job.ncols; j0 += tile) {
    const int64_t j1 = std::min(job.ncols, j0 + tile);
    int64_t i = row_begin;
    for (; i + kBlockRows <= row_end; i += kBlockRows) RowBlock<N, kBlockRows, V>(rows, job, i, j0, j1, row_end);
    for (; i < row_end; ++i) RowBlock<N, 1, V>(rows, job, i, j0, j1, row_end);
  }
}

// N lanes per vector, V vectors per row of a block (kBlockRows * V accumulators).
template <int N, int V>
FERRY_INLINE void UpdateRowsLanes(const UpdateJob& job, int64_t row_begin, int64_t row_end) {
  static_assert(V % 2 == 0, "a block holds whole BF16 groups");
  if (job.src16 != nullptr) {
    UpdateRowsImpl<N, V>(Bf16Rows{job.src16, job.dst16, job.ncols}, job, row_begin, row_end);
  } else {
    UpdateRowsImpl<N, V>(F32Rows{job.w32, job.ncols}, job, row_begin, row_end);
  }
}

#endif  // FERRY_VECTOR_EXT

// UpdateRows runs the update; VectorLanes returns the L of the BF16 panel layout that
// UpdateRows expects (0: unpermuted). Both are resolved the same way, so they agree.
#if FERRY_MULTIVERSION
[[gnu::target("avx512f")]] int VectorLanes() { return 16; }
[[gnu::target("avx512f")]] void UpdateRows(const UpdateJob& job, int64_t row_begin, int64_t row_end) {
  UpdateRowsLanes<16, 4>(job, row_begin, row_end);  // 16 zmm accumulators
}
[[gnu::target("avx2")]] int VectorLanes() { return 8; }
[[gnu::target("avx2")]] void UpdateRows(const UpdateJob& job, int64_t row_begin, int64_t row_end) {
  UpdateRowsLanes<8, 2>(job, row_begin, row_end);  // 8 ymm accumulators
}
[[gnu::target("default")]] int VectorLanes() { return 4; }
[[gnu::target("default")]] void UpdateRows(const UpdateJob& job, int64_t row_begin, int64_t row_end) {
  UpdateRowsLanes<4, 2>(job, row_begin, row_end);  // 8 xmm accumulators
}
#elif FERRY_VECTOR_EXT
int VectorLanes() { return 4; }
void UpdateRows(const UpdateJob& job, int64_t row_begin, int64_t row_end) {
  UpdateRowsLanes<4, 2>(job, row_begin, row_end);
}
#else
int VectorLanes() { return 0; }
void UpdateRows(const UpdateJob& job, int64_t row_begin, int64_t row_end) {
  for (int64_t i = row_begin; i < row_end; ++i) {
    for (int64_t j = 0; j < job.ncols; ++j) {
      if (job.src16 != nullptr) {
        UpdateOne(Bf16Rows{job.src16, job.dst16, job.ncols}, job, i, j);
      } else {
        UpdateOne(F32Rows{job.w32, job.ncols}, job, i, j);
      }
    }
  }
}
#endif

// M [r, ncols] with the columns of every full group of 2 * lanes split into evens, then odds
// (the BF16 panel layout above); lanes == 0 copies M unchanged.
std::vector<float> PermuteBf16Panel(const float* M, int64_t r, int64_t ncols, int64_t lanes) {
  std::vector<float> panel(static_cast<size_t>(r * ncols));
  const int64_t group = 2 * lanes;
  const int64_t full = group > 0 ? ncols / group * group : 0;
  for (int64_t k = 0; k < r; ++k) {
    const float* src = M + k * ncols;
    float* dst = panel.data() + k * ncols;
    for (int64_t j = 0; j < full; j += group) {
      for (int64_t l = 0; l < lanes; ++l) {
        dst[j + l] = src[j + 2 * l];
        dst[j + lanes + l] = src[j + 2 * l + 1];
      }
    }
    std::copy(src + full, src + ncols, dst + full);
  }
  return panel;
}

// Splits [0, nrows) into contiguous ranges and runs fn(begin, end) on each, one per thread
// (the calling thread takes the last range). A thread that cannot be started runs inline.
template <typename Fn>
void ParallelRows(int64_t nrows, int64_t work_per_row, int num_threads, Fn fn) {
  int64_t threads = std::max(1, num_threads);
  const int64_t total = nrows * std::max<int64_t>(work_per_row, 1);
  threads = std::min(threads, std::max<int64_t>(1, total / kMinWorkPerThread));
  threads = std::min(threads, std::max<int64_t>(nrows, 1));
  if (threads <= 1) {
    fn(int64_t{0}, nrows);
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(threads - 1));
  const int64_t base = nrows / threads, extra = nrows % threads;
  int64_t begin = 0;
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t end = begin + base + (t < extra ? 1 : 0);
    if (t == threads - 1) {
      fn(begin, end);
    } else {
      try {
        workers.emplace_back(fn, begin, end);
      } catch (...) {  // no thread available: do the range here
        fn(begin, end);
      }
    }
    begin = end;
  }
  for (auto& w : workers) w.join();
}

}  // namespace

void LoraDeltaAccumulate(const float* A, const float* B, int64_t out, int64_t in, int64_t r, float scaling, float* W,
                         int num_threads) {
  if (out <= 0 || in <= 0) return;
  if (r <= 0) {
    // An empty sum is +0: W += s * 0.
    for (int64_t i = 0; i < out * in; ++i) W[i] += scaling * 0.0f;
    return;
  }
  UpdateJob job;
  job.panel = A;
  job.coef = B;
  job.coef_row = r;
  job.coef_k = 1;
  job.r = r;
  job.ncols = in;
  job.s = scaling;
  job.w32 = W;
  ParallelRows(out, in * r, num_threads, [&job](int64_t begin, int64_t end) { UpdateRows(job, begin, end); });
}

namespace {

// Rows per block of the F16 path: decoded to fp32, updated, encoded while in L1/L2.
constexpr int64_t kFusedRows = 8;

void DecodeRowF16(const unsigned char* src, int64_t n, float* dst) {
  // Through an aligned scratch row, like EncodeRowF16: the vectorised cast reads uint16_t.
  thread_local std::vector<uint16_t> tmp;
  if (static_cast<int64_t>(tmp.size()) < n) tmp.resize(static_cast<size_t>(n));
  std::memcpy(tmp.data(), src, static_cast<size_t>(n) * 2);
  CastF16ToF32(tmp.data(), dst, static_cast<size_t>(n));
}

void EncodeRowF16(const float* src, int64_t n, unsigned char* dst) {
  // Through an aligned scratch row: the vectorised casts need aligned uint16_t output.
  thread_local std::vector<uint16_t> tmp;
  if (static_cast<int64_t>(tmp.size()) < n) tmp.resize(static_cast<size_t>(n));
  CastF32ToF16(src, tmp.data(), static_cast<size_t>(n));
  std::memcpy(dst, tmp.data(), static_cast<size_t>(n) * 2);
}

}  // namespace

void LoraMergeRows16(const uint16_t* W, Float16Kind kind, const float* A, const float* B, int64_t out, int64_t in,
                     int64_t r, float scaling, uint16_t* dst, int num_threads) {
  LoraRowMerger16(kind, A, B, out, in, r, scaling).Merge(W, dst, 0, out, num_threads);
}

LoraRowMerger16::LoraRowMerger16(Float16Kind kind, const float* A, const float* B, int64_t out, int64_t in, int64_t r,
                                 float scaling)
    : kind_(kind), a_(A), b_(B), out_(out), in_(in), r_(std::max<int64_t>(r, 0)), scaling_(scaling) {
  // BF16 is decoded, updated and rounded in registers, against A permuted once here.
  if (kind == Float16Kind::kBF16 && out > 0 && in > 0) panel_ = PermuteBf16Panel(A, r_, in, VectorLanes());
}

void LoraRowMerger16::Merge(const uint16_t* W, uint16_t* dst_rows, int64_t row_begin, int64_t row_end,
                            int num_threads) const {
  row_begin = std::max<int64_t>(row_begin, 0);
  row_end = std::min(row_end, out_);
  if (row_end <= row_begin || in_ <= 0) return;
  const int64_t in = in_;
  // Every pointer starts at row_begin: row i of the job is row row_begin + i of the matrix.
  const auto* wbytes = reinterpret_cast<const unsigned char*>(W + row_begin * in);
  auto* dbytes = reinterpret_cast<unsigned char*>(dst_rows);
  UpdateJob job;  // r <= 0: the empty sum, y = w + s * 0.0f
  job.panel = a_;
  job.coef = b_ + row_begin * r_;
  job.coef_row = r_;
  job.coef_k = 1;
  job.r = r_;
  job.ncols = in;
  job.s = scaling_;
  const int64_t work_per_row = in * std::max<int64_t>(r_, 1);
  const int64_t rows = row_end - row_begin;
  if (kind_ == Float16Kind::kBF16) {
    job.panel = panel_.data();
    job.src16 = wbytes;
    job.dst16 = dbytes;
    ParallelRows(rows, work_per_row, num_threads, [&job](int64_t begin, int64_t end) { UpdateRows(job, begin, end); });
    return;
  }
  const int64_t blocks = (rows + kFusedRows - 1) / kFusedRows;
  ParallelRows(blocks, kFusedRows * work_per_row, num_threads, [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch(static_cast<size_t>(kFusedRows * in));
    UpdateJob block = job;
    block.w32 = scratch.data();
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t row0 = b * kFusedRows;
      const int64_t nrows = std::min(kFusedRows, rows - row0);
      for (int64_t k = 0; k < nrows; ++k) DecodeRowF16(wbytes + (row0 + k) * in * 2, in, scratch.data() + k * in);
      block.coef = job.coef + row0 * job.coef_row;
      UpdateRows(block, 0, nrows);
      for (int64_t k = 0; k < nrows; ++k) EncodeRowF16(scratch.data() + k * in, in, dbytes + (row0 + k) * in * 2);
    }
  });
}

void LoraDeltaAccumulateFanInFanOut(const float* A, const float* B, int64_t out, int64_t in, int64_t r, float scaling,
                                    float* W, int num_threads) {
  if (out <= 0 || in <= 0) return;
  if (r <= 0) {
    for (int64_t i = 0; i < out * in; ++i) W[i] += scaling * 0.0f;
    return;
  }
  // Bt [r, out] so that the rows of W [in, out] are updated with contiguous panels.
  std::vector<float> bt(static_cast<size_t>(r * out));
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t k = 0; k < r; ++k) bt[static_cast<size_t>(k * out + o)] = B[o * r + k];
  }
  // Coefficients of W row i are column i of A. The product B[o,k]*A[k,i] is the same
  // rounded value either way round, so the sum matches LoraDeltaAccumulate bit for bit.
  UpdateJob job;
  job.panel = bt.data();
  job.coef = A;
  job.coef_row = 1;
  job.coef_k = in;
  job.r = r;
  job.ncols = out;
  job.s = scaling;
  job.w32 = W;
  ParallelRows(in, out * r, num_threads, [&job](int64_t begin, int64_t end) { UpdateRows(job, begin, end); });
}

void LoraEmbeddingDeltaAccumulate(const float* A, const float* B, int64_t num_embeddings, int64_t dim, int64_t r,
                                  float scaling, float* W, int num_threads) {
  LoraDeltaAccumulateFanInFanOut(A, B, /*out=*/dim, /*in=*/num_embeddings, r, scaling, W, num_threads);
}

void DoraApply(float* W_merged, const float* magnitude, int64_t out, int64_t in, bool fan_in_fan_out) {
  if (out <= 0 || in <= 0) return;
  std::vector<double> sumsq(static_cast<size_t>(out), 0.0);
  if (!fan_in_fan_out) {
    for (int64_t o = 0; o < out; ++o) {
      const float* row = W_merged + o * in;
      double acc = 0.0;
      for (int64_t i = 0; i < in; ++i) acc += static_cast<double>(row[i]) * static_cast<double>(row[i]);
      sumsq[static_cast<size_t>(o)] = acc;
    }
  } else {
    for (int64_t i = 0; i < in; ++i) {
      const float* row = W_merged + i * out;
      for (int64_t o = 0; o < out; ++o) {
        sumsq[static_cast<size_t>(o)] += static_cast<double>(row[o]) * static_cast<double>(row[o]);
      }
    }
  }
  std::vector<float> factor(static_cast<size_t>(out));
  for (int64_t o = 0; o < out; ++o) {
    const double norm = std::sqrt(sumsq[static_cast<size_t>(o)]);
    factor[static_cast<size_t>(o)] = norm > 0.0 ? static_cast<float>(static_cast<double>(magnitude[o]) / norm) : 0.0f;
  }
  if (!fan_in_fan_out) {
    for (int64_t o = 0; o < out; ++o) {
      const float f = factor[static_cast<size_t>(o)];
      float* row = W_merged + o * in;
      for (int64_t i = 0; i < in; ++i) row[i] *= f;
    }
  } else {
    for (int64_t i = 0; i < in; ++i) {
      float* row = W_merged + i * out;
      for (int64_t o = 0; o < out; ++o) row[o] *= factor[static_cast<size_t>(o)];
    }
  }
}

}  // namespace ferry::kernels
