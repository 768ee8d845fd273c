// LoRA / DoRA merge kernels against hand-computed values and independent naive references.
#include "kernels/lora_merge.h"

#include "kernels/cast.h"
#include "tests/kernels/random_floats.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

namespace ferry::kernels {
namespace {

using ferry::testing::RandomFloats;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

void ExpectBitEqual(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(Bits(got[i]), Bits(want[i])) << what << " at " << i;
}

struct Shape {
  int64_t out, in, r;
};

// Sizes: non-square, odd, r = 1, shapes not a multiple of the 32-column accumulator block,
// and one wide enough to need several column panels.
const Shape kShapes[] = {{1, 1, 1},    {2, 3, 1},    {7, 13, 1},   {13, 7, 5},   {64, 48, 4},
                         {33, 97, 16}, {5, 200, 64}, {130, 70, 3}, {3, 9000, 8}, {40, 33, 33}};

// Double-precision reference of W[o,i] + s * sum_k B[o,k] A[k,i] and the error bound of the
// fp32 computation: |err| <= gamma_{r+2} * (|W| + |s| * sum_k |B[o,k] A[k,i]|) (Higham).
struct Reference {
  double value;
  double bound;
};

Reference Ref(const std::vector<float>& A, const std::vector<float>& B, const std::vector<float>& W0, int64_t in,
              int64_t r, float s, int64_t o, int64_t i, size_t w_index) {
  double sum = 0.0, abs_sum = 0.0;
  for (int64_t k = 0; k < r; ++k) {
    const double p = static_cast<double>(B[o * r + k]) * static_cast<double>(A[k * in + i]);
    sum += p;
    abs_sum += std::fabs(p);
  }
  const double w = W0[w_index];
  const double u = std::numeric_limits<float>::epsilon() / 2;
  const double n = static_cast<double>(r + 2);
  const double gamma = n * u / (1 - n * u);
  return {w + static_cast<double>(s) * sum, gamma * (std::fabs(w) + std::fabs(s) * abs_sum) + 1e-30};
}

TEST(LoraMerge, HandComputed2x2) {
  // A [r=2, in=2], B [out=2, r=2]; B @ A = [[1, 2], [5, 8]].
  const std::vector<float> A = {1, 2, 3, 4};
  const std::vector<float> B = {1, 0, 2, 1};
  std::vector<float> W = {1, -1, 0.5f, 0};
  LoraDeltaAccumulate(A.data(), B.data(), 2, 2, 2, 2.0f, W.data());
  EXPECT_EQ(W, (std::vector<float>{3, 3, 10.5f, 16}));

  std::vector<float> Wt = {0, 0, 0, 0};  // fan_in_fan_out: W [in, out] += 2 * (B @ A)^T
  LoraDeltaAccumulateFanInFanOut(A.data(), B.data(), 2, 2, 2, 2.0f, Wt.data());
  EXPECT_EQ(Wt, (std::vector<float>{2, 10, 4, 16}));
}

TEST(LoraMerge, HandComputedRank1) {
  // A [1, 2] = [1, 2], B [2, 1] = [3, 4], scaling 0.5: W += 0.5 * [[3, 6], [4, 8]].
  const std::vector<float> A = {1, 2};
  const std::vector<float> B = {3, 4};
  std::vector<float> W = {1, 1, 1, 1};
  LoraDeltaAccumulate(A.data(), B.data(), 2, 2, 1, 0.5f, W.data());
  EXPECT_EQ(W, (std::vector<float>{2.5f, 4, 3, 5}));
}

TEST(LoraMerge, HandComputedEmbedding) {
  // lora_embedding_A [r=1, num_embeddings=3] = [1, 2, 3]; lora_embedding_B [dim=2, r=1] = [1, -1].
  // (B @ A)^T = [[1, -1], [2, -2], [3, -3]], W [3, 2].
  const std::vector<float> A = {1, 2, 3};
  const std::vector<float> B = {1, -1};
  std::vector<float> W = {0, 0, 10, 10, 0, 1};
  LoraEmbeddingDeltaAccumulate(A.data(), B.data(), /*num_embeddings=*/3, /*dim=*/2, /*r=*/1, 1.0f, W.data());
  EXPECT_EQ(W, (std::vector<float>{1, -1, 12, 8, 3, -2}));
}

TEST(LoraMerge, LinearMatchesDoubleReference) {
  uint32_t seed = 1;
  for (const Shape& sh : kShapes) {
    const auto A = RandomFloats(sh.r * sh.in, seed++);
    const auto B = RandomFloats(sh.out * sh.r, seed++);
    const auto W0 = RandomFloats(sh.out * sh.in, seed++, -2.0f, 2.0f);
    const float s = 1.75f;
    auto W = W0;
    LoraDeltaAccumulate(A.data(), B.data(), sh.out, sh.in, sh.r, s, W.data());
    for (int64_t o = 0; o < sh.out; ++o) {
      for (int64_t i = 0; i < sh.in; ++i) {
        const size_t idx = static_cast<size_t>(o * sh.in + i);
        const Reference ref = Ref(A, B, W0, sh.in, sh.r, s, o, i, idx);
        ASSERT_NEAR(W[idx], ref.value, ref.bound)
            << "out=" << sh.out << " in=" << sh.in << " r=" << sh.r << " at (" << o << "," << i << ")";
      }
    }
  }
}

TEST(LoraMerge, FanInFanOutMatchesDoubleReference) {
  uint32_t seed = 100;
  for (const Shape& sh : kShapes) {
    const auto A = RandomFloats(sh.r * sh.in, seed++);
    const auto B = RandomFloats(sh.out * sh.r, seed++);
    const auto W0 = RandomFloats(sh.in * sh.out, seed++, -2.0f, 2.0f);  // [in, out]
    const float s = -0.5f;
    auto W = W0;
    LoraDeltaAccumulateFanInFanOut(A.data(), B.data(), sh.out, sh.in, sh.r, s, W.data());
    for (int64_t i = 0; i < sh.in; ++i) {
      for (int64_t o = 0; o < sh.out; ++o) {
        const size_t idx = static_cast<size_t>(i * sh.out + o);
        const Reference ref = Ref(A, B, W0, sh.in, sh.r, s, o, i, idx);
        ASSERT_NEAR(W[idx], ref.value, ref.bound)
            << "out=" << sh.out << " in=" << sh.in << " r=" << sh.r << " at (" << i << "," << o << ")";
      }
    }
  }
}

TEST(LoraMerge, EmbeddingMatchesDoubleReference) {
  const int64_t num_embeddings = 301, dim = 37, r = 8;
  const auto A = RandomFloats(r * num_embeddings, 7);     // lora_embedding_A [r, num_embeddings]
  const auto B = RandomFloats(dim * r, 8);                // lora_embedding_B [dim, r]
  const auto W0 = RandomFloats(num_embeddings * dim, 9);  // [num_embeddings, dim]
  const float s = 2.0f;
  auto W = W0;
  LoraEmbeddingDeltaAccumulate(A.data(), B.data(), num_embeddings, dim, r, s, W.data());
  for (int64_t e = 0; e < num_embeddings; ++e) {
    for (int64_t d = 0; d < dim; ++d) {
      double sum = 0.0, abs_sum = 0.0;
      for (int64_t k = 0; k < r; ++k) {
        const double p = static_cast<double>(B[d * r + k]) * A[k * num_embeddings + e];
        sum += p;
        abs_sum += std::fabs(p);
      }
      const size_t idx = static_cast<size_t>(e * dim + d);
      const double want = W0[idx] + s * sum;
      ASSERT_NEAR(W[idx], want, 1e-6 * (std::fabs(W0[idx]) + s * abs_sum)) << "(" << e << "," << d << ")";
    }
  }
}

// The header documents the exact fp32 rounding sequence; reproduce it here with a plain loop
// (volatile temporaries so the compiler cannot contract into FMA).
TEST(LoraMerge, FollowsDocumentedRoundingSequence) {
  for (const Shape& sh : {Shape{33, 97, 16}, Shape{5, 200, 64}, Shape{9, 70, 1}}) {
    const auto A = RandomFloats(sh.r * sh.in, 21, -3.0f, 3.0f);
    const auto B = RandomFloats(sh.out * sh.r, 22, -3.0f, 3.0f);
    const auto W0 = RandomFloats(sh.out * sh.in, 23);
    const float s = 0.3f;
    auto want = W0;
    for (int64_t o = 0; o < sh.out; ++o) {
      for (int64_t i = 0; i < sh.in; ++i) {
        float d = 0.0f;
        for (int64_t k = 0; k < sh.r; ++k) {
          volatile float p = B[o * sh.r + k] * A[k * sh.in + i];
          d = d + p;
        }
        volatile float delta = s * d;
        want[o * sh.in + i] = want[o * sh.in + i] + delta;
      }
    }
    auto W = W0;
    LoraDeltaAccumulate(A.data(), B.data(), sh.out, sh.in, sh.r, s, W.data());
    ExpectBitEqual(W, want, "linear");

    // fan_in_fan_out on the transposed weight gives the transposed result, bit for bit.
    std::vector<float> Wt(W0.size()), want_t(W0.size());
    for (int64_t o = 0; o < sh.out; ++o) {
      for (int64_t i = 0; i < sh.in; ++i) {
        Wt[i * sh.out + o] = W0[o * sh.in + i];
        want_t[i * sh.out + o] = want[o * sh.in + i];
      }
    }
    LoraDeltaAccumulateFanInFanOut(A.data(), B.data(), sh.out, sh.in, sh.r, s, Wt.data());
    ExpectBitEqual(Wt, want_t, "fan_in_fan_out");
  }
}

TEST(LoraMerge, ThreadedEqualsSingleThreadBitForBit) {
  // 301 * 997 * 16 multiply-adds: enough work for several threads.
  const int64_t out = 301, in = 997, r = 16;
  const auto A = RandomFloats(r * in, 31);
  const auto B = RandomFloats(out * r, 32);
  const auto W0 = RandomFloats(out * in, 33);
  auto single = W0;
  LoraDeltaAccumulate(A.data(), B.data(), out, in, r, 1.25f, single.data(), 1);
  for (int threads : {2, 3, 4, 7, 64}) {
    auto W = W0;
    LoraDeltaAccumulate(A.data(), B.data(), out, in, r, 1.25f, W.data(), threads);
    ExpectBitEqual(W, single, "linear threaded");
  }
  auto single_t = W0;  // read as W [in, out]
  LoraDeltaAccumulateFanInFanOut(A.data(), B.data(), out, in, r, 1.25f, single_t.data(), 1);
  for (int threads : {2, 5}) {
    auto W = W0;
    LoraDeltaAccumulateFanInFanOut(A.data(), B.data(), out, in, r, 1.25f, W.data(), threads);
    ExpectBitEqual(W, single_t, "fan_in_fan_out threaded");
  }
}

TEST(LoraMerge, ZeroSizesAreNoOps) {
  std::vector<float> W = {1, 2, 3};
  const float a = 1, b = 1;
  LoraDeltaAccumulate(&a, &b, 0, 3, 1, 1.0f, W.data());
  LoraDeltaAccumulate(&a, &b, 3, 0, 1, 1.0f, W.data());
  LoraDeltaAccumulateFanInFanOut(&a, &b, 0, 3, 1, 1.0f, W.data());
  DoraApply(W.data(), &a, 0, 3, false);
  EXPECT_EQ(W, (std::vector<float>{1, 2, 3}));
  // r = 0: an empty delta, W unchanged.
  LoraDeltaAccumulate(&a, &b, 1, 3, 0, 1.0f, W.data(), 4);
  EXPECT_EQ(W, (std::vector<float>{1, 2, 3}));
}

TEST(Dora, HandComputed2x3) {
  // Rows [3, 0, 4] and [1, 2, 2] have norms 5 and 3; m = [10, 1.5] gives factors 2 and 0.5.
  std::vector<float> W = {3, 0, 4, 1, 2, 2};
  const std::vector<float> m = {10, 1.5f};
  DoraApply(W.data(), m.data(), /*out=*/2, /*in=*/3, /*fan_in_fan_out=*/false);
  EXPECT_EQ(W, (std::vector<float>{6, 0, 8, 0.5f, 1, 1}));

  // The same weight stored [in=3, out=2]: norms per output column.
  std::vector<float> Wt = {3, 1, 0, 2, 4, 2};
  DoraApply(Wt.data(), m.data(), /*out=*/2, /*in=*/3, /*fan_in_fan_out=*/true);
  EXPECT_EQ(Wt, (std::vector<float>{6, 0.5f, 0, 1, 8, 1}));
}

TEST(Dora, ZeroRowStaysZero) {
  std::vector<float> W = {0, 0, 0, 1, 0, 0};
  const std::vector<float> m = {3, 2};
  DoraApply(W.data(), m.data(), 2, 3, false);
  EXPECT_EQ(W, (std::vector<float>{0, 0, 0, 2, 0, 0}));
}

TEST(Dora, MatchesDoubleReferenceBothLayouts) {
  for (const Shape& sh : {Shape{17, 33, 0}, Shape{1, 500, 0}, Shape{64, 7, 0}}) {
    const auto W0 = RandomFloats(sh.out * sh.in, 41, -2.0f, 2.0f);  // [out, in]
    const auto m = RandomFloats(sh.out, 42, 0.1f, 3.0f);
    auto W = W0;
    DoraApply(W.data(), m.data(), sh.out, sh.in, false);
    std::vector<float> Wt(W0.size());
    for (int64_t o = 0; o < sh.out; ++o) {
      for (int64_t i = 0; i < sh.in; ++i) Wt[i * sh.out + o] = W0[o * sh.in + i];
    }
    DoraApply(Wt.data(), m.data(), sh.out, sh.in, true);
    for (int64_t o = 0; o < sh.out; ++o) {
      long double ss = 0;
      for (int64_t i = 0; i < sh.in; ++i) ss += static_cast<long double>(W0[o * sh.in + i]) * W0[o * sh.in + i];
      const double f = static_cast<double>(m[o] / std::sqrt(ss));
      for (int64_t i = 0; i < sh.in; ++i) {
        const double want = f * W0[o * sh.in + i];
        const double tol = 2.5 * std::numeric_limits<float>::epsilon() * std::fabs(want);
        ASSERT_NEAR(W[o * sh.in + i], want, tol) << "row layout (" << o << "," << i << ")";
        ASSERT_NEAR(Wt[i * sh.out + o], want, tol) << "fan_in_fan_out layout (" << i << "," << o << ")";
      }
    }
  }
}

}  // namespace
}  // namespace ferry::kernels

namespace ferry::kernels {
namespace {

// The fused 16-bit merge equals cast -> LoraDeltaAccumulate -> cast, bit for bit, for both
// 16-bit types, odd sizes, misaligned input and output, and any thread count.
TEST(LoraMergeRows16, BitIdenticalToUnfusedPath) {
  std::mt19937 rng(123);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  for (Float16Kind kind : {Float16Kind::kBF16, Float16Kind::kF16}) {
    for (auto [out, in, r] :
         std::vector<std::tuple<int64_t, int64_t, int64_t>>{{37, 129, 16}, {8, 64, 1}, {130, 70, 7}}) {
      const size_t n = static_cast<size_t>(out * in);
      std::vector<float> wf(n), a(static_cast<size_t>(r * in)), b(static_cast<size_t>(out * r));
      for (auto& x : wf) x = dist(rng);
      for (auto& x : a) x = dist(rng);
      for (auto& x : b) x = dist(rng);
      std::vector<uint16_t> w16(n);
      if (kind == Float16Kind::kBF16) CastF32ToBF16(wf.data(), w16.data(), n);
      else CastF32ToF16(wf.data(), w16.data(), n);
      // Reference: decode, accumulate in fp32, encode.
      std::vector<float> ref(n);
      if (kind == Float16Kind::kBF16) CastBF16ToF32(w16.data(), ref.data(), n);
      else CastF16ToF32(w16.data(), ref.data(), n);
      LoraDeltaAccumulate(a.data(), b.data(), out, in, r, 1.75f, ref.data(), 1);
      std::vector<uint16_t> want(n);
      if (kind == Float16Kind::kBF16) CastF32ToBF16(ref.data(), want.data(), n);
      else CastF32ToF16(ref.data(), want.data(), n);
      // Fused, from and to odd addresses.
      std::vector<unsigned char> src(2 * n + 1), dst(2 * n + 1);
      std::memcpy(src.data() + 1, w16.data(), 2 * n);
      for (int threads : {1, 3}) {
        LoraMergeRows16(reinterpret_cast<const uint16_t*>(src.data() + 1), kind, a.data(), b.data(), out, in, r, 1.75f,
                        reinterpret_cast<uint16_t*>(dst.data() + 1), threads);
        ASSERT_EQ(std::memcmp(dst.data() + 1, want.data(), 2 * n), 0)
            << (kind == Float16Kind::kBF16 ? "bf16 " : "f16 ") << out << "x" << in << " r=" << r
            << " threads=" << threads;
      }
    }
  }
}

}  // namespace
}  // namespace ferry::kernels

namespace ferry::kernels {
namespace {

// The fused 16-bit merge against a plain scalar loop of the documented rounding sequence, over
// ragged shapes (column counts around every vector width and block size, row counts around
// the register block), r = 0..64, unusual scalings and special base values (NaN, +-inf, +-0,
// subnormals, the largest finite value) — bit for bit, for 1 and 2 threads.
TEST(LoraMergeRows16, MatchesScalarSequenceOnManyShapes) {
  std::mt19937 rng(2024);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  std::uniform_int_distribution<int> pick(0, 40);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            0.0f,
                            -0.0f,
                            1e-40f,
                            -3e-39f,
                            3.3e38f,
                            -3.3e38f,
                            6e-8f,
                            65504.0f};
  const int64_t outs[] = {1, 3, 4, 5, 9, 17};
  const int64_t ins[] = {1, 5, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 200, 1031};
  const int64_t ranks[] = {0, 1, 2, 8, 16, 64};
  const float scalings[] = {2.0f, -0.37f, 0.0f, 1e-3f};
  int case_index = 0;
  for (Float16Kind kind : {Float16Kind::kBF16, Float16Kind::kF16}) {
    const bool bf16 = kind == Float16Kind::kBF16;
    for (int64_t out : outs) {
      for (int64_t in : ins) {
        for (int64_t r : ranks) {
          const float s = scalings[case_index++ % 4];
          const size_t n = static_cast<size_t>(out * in);
          std::vector<float> a(static_cast<size_t>(r * in)), b(static_cast<size_t>(out * r));
          for (auto& x : a) x = pick(rng) == 0 ? -0.0f : normal(rng);
          for (auto& x : b) x = pick(rng) == 0 ? 0.0f : normal(rng);
          std::vector<uint16_t> w16(n);
          for (auto& h : w16) {
            const int p = pick(rng);
            const float x = p < static_cast<int>(std::size(specials)) ? specials[p] : normal(rng);
            h = bf16 ? F32ToBF16(x) : F32ToF16(x);
          }
          std::vector<uint16_t> want(n);
          for (int64_t o = 0; o < out; ++o) {
            for (int64_t i = 0; i < in; ++i) {
              float d = 0.0f;
              for (int64_t k = 0; k < r; ++k) {
                volatile float p = b[o * r + k] * a[k * in + i];
                d = d + p;
              }
              volatile float delta = s * d;
              const uint16_t h = w16[o * in + i];
              const float y = (bf16 ? BF16ToF32(h) : F16ToF32(h)) + delta;
              want[o * in + i] = bf16 ? F32ToBF16(y) : F32ToF16(y);
            }
          }
          for (int threads : {1, 2}) {
            std::vector<uint16_t> got(n, 0xdead);
            LoraMergeRows16(w16.data(), kind, a.data(), b.data(), out, in, r, s, got.data(), threads);
            for (size_t e = 0; e < n; ++e) {
              ASSERT_EQ(got[e], want[e]) << (bf16 ? "bf16 " : "f16 ") << out << "x" << in << " r=" << r << " s=" << s
                                         << " threads=" << threads << " at (" << e / in << "," << e % in << ")";
            }
          }
        }
      }
    }
  }
}

// LoraRowMerger16 over ragged row ranges (single rows, ranges that split a register block or
// a decoding block of the F16 path, out-of-range ends clamped) gives LoraMergeRows16's bits,
// and leaves the rows outside a range untouched.
TEST(LoraRowMerger16, RowRangesGiveTheWholeMergesBits) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (Float16Kind kind : {Float16Kind::kBF16, Float16Kind::kF16}) {
    const bool bf16 = kind == Float16Kind::kBF16;
    for (int64_t in : {7, 64, 129}) {
      const int64_t out = 37, r = 5;
      const size_t n = static_cast<size_t>(out * in);
      std::vector<float> a(static_cast<size_t>(r * in)), b(static_cast<size_t>(out * r));
      for (auto& x : a) x = normal(rng);
      for (auto& x : b) x = normal(rng);
      std::vector<uint16_t> w16(n);
      for (auto& h : w16) h = bf16 ? F32ToBF16(normal(rng)) : F32ToF16(normal(rng));
      std::vector<uint16_t> whole(n);
      LoraMergeRows16(w16.data(), kind, a.data(), b.data(), out, in, r, 0.7f, whole.data(), 1);
      const LoraRowMerger16 merger(kind, a.data(), b.data(), out, in, r, 0.7f);
      for (int threads : {1, 2}) {
        std::vector<uint16_t> got(n, 0xdead);
        const std::vector<std::pair<int64_t, int64_t>> ranges = {{0, 1}, {1, 6}, {6, 7}, {7, 19}, {19, 30}, {30, 99}};
        for (const auto& [r0, r1] : ranges) {
          // The range's rows land packed from the pointer given.
          merger.Merge(w16.data(), got.data() + r0 * in, r0, r1, threads);
          const int64_t end = std::min(r1, out);
          for (size_t e = static_cast<size_t>(end * in); e < n; ++e) {
            ASSERT_EQ(got[e], 0xdead) << "row " << e / in << " written before its range " << r0 << ".." << r1;
          }
        }
        // A range alone into a buffer of its own size.
        std::vector<uint16_t> piece(static_cast<size_t>(12 * in) + 1, 0xdead);
        merger.Merge(w16.data(), piece.data(), 7, 19, threads);
        ASSERT_EQ(piece.back(), 0xdead) << "written past the 12 rows of range 7..19";
        for (size_t e = 0; e + 1 < piece.size(); ++e) {
          ASSERT_EQ(piece[e], whole[static_cast<size_t>(7 * in) + e]) << "range 7..19 alone, element " << e;
        }
        for (size_t e = 0; e < n; ++e) {
          ASSERT_EQ(got[e], whole[e]) << (bf16 ? "bf16 " : "f16 ") << "in=" << in << " threads=" << threads << " at ("
                                      << e / in << "," << e % in << ")";
        }
      }
    }
  }
}

}  // namespace
}  // namespace ferry::kernels
