#include "kernels/lora_merge.h"

#include "kernels/cast.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <thread>
#include <vector>

// Multi-versioned hot loop: GCC emits AVX-512, AVX2 and baseline clones and picks one at load
// time. All perform the same IEEE operations (no FMA: contraction would change the rounding,
// see the header), so the result does not depend on the clone.
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && defined(__GNUC__) && !defined(__clang__)
#define FERRY_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FERRY_MULTIVERSION
#endif

namespace ferry::kernels {
namespace {

// Columns handled per register-resident accumulator block.
constexpr int64_t kSub = 64;
// Bytes of the [r, tile] panel of the shared factor kept hot in cache while all rows pass.
constexpr int64_t kPanelBytes = 128 * 1024;
// Below this many multiply-adds per thread a worker thread is not worth starting.
constexpr int64_t kMinWorkPerThread = int64_t{1} << 20;

// w[j] += s * sum_k c[k] * m[k*ld + j] for j in [j0, j1), k summed in order 0..r-1.
FERRY_MULTIVERSION
void RowSpan(const float* c, const float* m, int64_t r, int64_t ld, int64_t j0, int64_t j1, float s, float* w) {
  int64_t j = j0;
  for (; j + kSub <= j1; j += kSub) {
    float acc[kSub] = {};
    for (int64_t k = 0; k < r; ++k) {
      const float ck = c[k];
      const float* mk = m + k * ld + j;
      for (int64_t t = 0; t < kSub; ++t) acc[t] += ck * mk[t];
    }
    for (int64_t t = 0; t < kSub; ++t) w[j + t] += s * acc[t];
  }
  for (; j < j1; ++j) {
    float acc = 0.0f;
    for (int64_t k = 0; k < r; ++k) acc += c[k] * m[k * ld + j];
    w[j] += s * acc;
  }
}

int64_t ColumnTile(int64_t r, int64_t ncols) {
  const int64_t per_row_bytes = std::max<int64_t>(r, 1) * static_cast<int64_t>(sizeof(float));
  int64_t tile = kPanelBytes / per_row_bytes;
  tile = std::max<int64_t>(kSub, tile / kSub * kSub);
  return std::min(tile, std::max<int64_t>(ncols, 1));
}

// Rank-r update of rows [row_begin, row_end) of W [*, ncols]:
//   W[row, j] += s * sum_k coef(row)[k] * M[k, j].
// get_coef(row, scratch) returns the r coefficients of that row (may fill scratch[0..r)).
template <typename CoefFn>
void UpdateRows(const float* M, int64_t r, int64_t ncols, float s, float* W, int64_t row_begin, int64_t row_end,
                CoefFn get_coef) {
  std::vector<float> scratch(static_cast<size_t>(r));
  const int64_t tile = ColumnTile(r, ncols);
  for (int64_t j0 = 0; j0 < ncols; j0 += tile) {
    const int64_t j1 = std::min(ncols, j0 + tile);
    for (int64_t row = row_begin; row < row_end; ++row) {
      const float* c = get_coef(row, scratch.data());
      RowSpan(c, M, r, ncols, j0, j1, s, W + row * ncols);
    }
  }
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
  ParallelRows(out, in * r, num_threads, [=](int64_t begin, int64_t end) {
    UpdateRows(A, r, in, scaling, W, begin, end, [=](int64_t row, float*) { return B + row * r; });
  });
}

namespace {

// Rows per fused block: the block's fp32 rows stay in L2 while every column tile passes.
constexpr int64_t kFusedRows = 8;

FERRY_MULTIVERSION
void DecodeRow16(const unsigned char* src, Float16Kind kind, int64_t n, float* dst) {
  if (kind == Float16Kind::kBF16) {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, src + 2 * i, 2);
      const uint32_t u = static_cast<uint32_t>(v) << 16;
      std::memcpy(&dst[i], &u, 4);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t v;
      std::memcpy(&v, src + 2 * i, 2);
      dst[i] = F16ToF32(v);
    }
  }
}

void EncodeRow16(const float* src, Float16Kind kind, int64_t n, unsigned char* dst) {
  // Through an aligned scratch row: the vectorised casts need aligned uint16_t output.
  thread_local std::vector<uint16_t> tmp;
  if (static_cast<int64_t>(tmp.size()) < n) tmp.resize(static_cast<size_t>(n));
  if (kind == Float16Kind::kBF16) {
    CastF32ToBF16(src, tmp.data(), static_cast<size_t>(n));
  } else {
    CastF32ToF16(src, tmp.data(), static_cast<size_t>(n));
  }
  std::memcpy(dst, tmp.data(), static_cast<size_t>(n) * 2);
}

}  // namespace

void LoraMergeRows16(const uint16_t* W, Float16Kind kind, const float* A, const float* B, int64_t out, int64_t in,
                     int64_t r, float scaling, uint16_t* dst, int num_threads) {
  if (out <= 0 || in <= 0) return;
  const auto* wbytes = reinterpret_cast<const unsigned char*>(W);
  auto* dbytes = reinterpret_cast<unsigned char*>(dst);
  const int64_t blocks = (out + kFusedRows - 1) / kFusedRows;
  ParallelRows(blocks, kFusedRows * in * std::max<int64_t>(r, 1), num_threads, [=](int64_t b0, int64_t b1) {
    std::vector<float> rows(static_cast<size_t>(kFusedRows * in));
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t row0 = b * kFusedRows;
      const int64_t nrows = std::min(kFusedRows, out - row0);
      for (int64_t k = 0; k < nrows; ++k) {
        DecodeRow16(wbytes + (row0 + k) * in * 2, kind, in, rows.data() + k * in);
      }
      if (r <= 0) {
        for (int64_t i = 0; i < nrows * in; ++i) rows[static_cast<size_t>(i)] += scaling * 0.0f;
      } else {
        UpdateRows(A, r, in, scaling, rows.data(), 0, nrows, [=](int64_t row, float*) { return B + (row0 + row) * r; });
      }
      for (int64_t k = 0; k < nrows; ++k) {
        EncodeRow16(rows.data() + k * in, kind, in, dbytes + (row0 + k) * in * 2);
      }
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
  const float* bt_data = bt.data();
  ParallelRows(in, out * r, num_threads, [=](int64_t begin, int64_t end) {
    // Coefficients of W row i are column i of A. The product B[o,k]*A[k,i] is the same
    // rounded value either way round, so the sum matches LoraDeltaAccumulate bit for bit.
    UpdateRows(bt_data, r, out, scaling, W, begin, end, [=](int64_t i, float* scratch) {
      for (int64_t k = 0; k < r; ++k) scratch[k] = A[k * in + i];
      return static_cast<const float*>(scratch);
    });
  });
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
