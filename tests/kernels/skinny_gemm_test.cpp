#include "kernels/skinny_gemm.h"
#include "tests/kernels/random_floats.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace ferry::kernels {
namespace {

using ferry::testing::RandomFloats;

struct Shape {
  int64_t m, k, n, j0, j1;
};

using Impl = void (*)(const float*, int64_t, int64_t, const float*, const float*, float*, int64_t, int64_t, int64_t);

// Rows m = 1..9 (the 4-row tiles and every remainder), k with and without an 8- or 16-lane
// tail, column ranges that start and end off the 3- and 6-row weight tiles, and a wider ldy;
// then m = 12..70 (the AVX-512 copy's rows in lanes: 1 to 4 vectors of rows, partly filled, a
// second pass past 64 rows) over column ranges that end in every one of its narrower tiles;
// each through SkinnyLinear (what callers get) and through every copy this CPU can run: the
// portable loops always, the AVX2 and AVX-512 copies where the CPU has them.
class SkinnyGemmTest : public ::testing::TestWithParam<Shape> {};

void Check(const Shape& s, bool with_bias, Impl impl) {
  const int64_t ldy = s.n + 3;
  const auto x = RandomFloats(s.m * s.k, 1), w = RandomFloats(s.n * s.k, 2), bias = RandomFloats(s.n, 3);
  std::vector<float> y(s.m * ldy, -7.0f);
  impl(x.data(), s.m, s.k, w.data(), with_bias ? bias.data() : nullptr, y.data(), ldy, s.j0, s.j1);
  for (int64_t i = 0; i < s.m; ++i) {
    for (int64_t j = 0; j < ldy; ++j) {
      const float got = y[i * ldy + j];
      if (j < s.j0 || j >= s.j1) {
        EXPECT_EQ(got, -7.0f) << "column " << j << " is outside [" << s.j0 << ", " << s.j1 << ") and was written";
        continue;
      }
      double want = with_bias ? bias[j] : 0.0;
      for (int64_t k = 0; k < s.k; ++k) want += double(x[i * s.k + k]) * double(w[j * s.k + k]);
      EXPECT_NEAR(got, want, 2e-6 * std::sqrt(double(s.k)) + 1e-6) << "row " << i << " column " << j;
    }
  }
}

TEST_P(SkinnyGemmTest, EqualsADoubleReferenceWithoutBias) { Check(GetParam(), false, SkinnyLinear); }
TEST_P(SkinnyGemmTest, EqualsADoubleReferenceWithBias) { Check(GetParam(), true, SkinnyLinear); }
TEST_P(SkinnyGemmTest, PortableLoopsEqualADoubleReference) {
  Check(GetParam(), false, detail::SkinnyLinearPortable);
  Check(GetParam(), true, detail::SkinnyLinearPortable);
}
TEST_P(SkinnyGemmTest, Avx2CopyEqualsADoubleReference) {
  if (!detail::HasAvx2Fma()) GTEST_SKIP() << "this CPU has no AVX2 + FMA";
  Check(GetParam(), false, detail::SkinnyLinearAvx2);
  Check(GetParam(), true, detail::SkinnyLinearAvx2);
}
TEST_P(SkinnyGemmTest, Avx512CopyEqualsADoubleReference) {
  if (!detail::HasAvx512()) GTEST_SKIP() << "this CPU has no AVX-512";
  Check(GetParam(), false, detail::SkinnyLinearAvx512);
  Check(GetParam(), true, detail::SkinnyLinearAvx512);
}

INSTANTIATE_TEST_SUITE_P(Shapes, SkinnyGemmTest,
                         ::testing::Values(Shape{1, 8, 3, 0, 3}, Shape{2, 13, 7, 1, 6}, Shape{3, 1, 5, 0, 5},
                                           Shape{4, 64, 9, 2, 9}, Shape{5, 40, 10, 0, 10}, Shape{6, 7, 4, 1, 3},
                                           Shape{7, 130, 11, 0, 11}, Shape{8, 896, 8, 3, 8}, Shape{9, 33, 6, 0, 6},
                                           Shape{4, 47, 20, 1, 19}, Shape{5, 16, 13, 0, 13}, Shape{2, 900, 7, 0, 7},
                                           Shape{12, 37, 50, 0, 50}, Shape{16, 896, 47, 0, 47},
                                           Shape{17, 65, 31, 1, 30}, Shape{32, 19, 15, 0, 15}, Shape{33, 9, 40, 2, 40},
                                           Shape{48, 70, 12, 0, 12}, Shape{64, 5, 9, 0, 9}, Shape{70, 31, 26, 1, 26}));

// The result of a row does not depend on the column split, nor, below 12 rows, on the other
// rows (a fixed order of sums): what lets callers split the columns across threads and batch
// rows freely. (From 12 rows on see Avx512RowsInLanesAreOneFmaChainPerOutput.)
TEST(SkinnyGemm, RowsAndSplitsDoNotChangeTheResult) {
  const int64_t m = 6, k = 77, n = 13;
  const auto x = RandomFloats(m * k, 4), w = RandomFloats(n * k, 5);
  std::vector<float> whole(m * n), split(m * n), one(n);
  SkinnyLinear(x.data(), m, k, w.data(), nullptr, whole.data(), n, 0, n);
  SkinnyLinear(x.data(), m, k, w.data(), nullptr, split.data(), n, 0, 5);
  SkinnyLinear(x.data(), m, k, w.data(), nullptr, split.data(), n, 5, n);
  EXPECT_EQ(whole, split);
  for (int64_t i = 0; i < m; ++i) {
    SkinnyLinear(x.data() + i * k, 1, k, w.data(), nullptr, one.data(), n, 0, n);
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(one[j], whole[i * n + j]) << "row " << i << " column " << j;
  }
}

// From 12 rows on, the AVX-512 copy sums each output in one fused multiply-add per k, in order
// (bias added last): exactly that chain, for every row, whatever m and the column split.
TEST(SkinnyGemm, Avx512RowsInLanesAreOneFmaChainPerOutput) {
  if (!detail::HasAvx512()) GTEST_SKIP() << "this CPU has no AVX-512";
  const int64_t k = 203, n = 41;
  const auto x = RandomFloats(70 * k, 10), w = RandomFloats(n * k, 11), bias = RandomFloats(n, 12);
  for (int64_t m : {12, 16, 29, 64, 70}) {
    std::vector<float> y(m * n);
    detail::SkinnyLinearAvx512(x.data(), m, k, w.data(), bias.data(), y.data(), n, 0, 17);
    detail::SkinnyLinearAvx512(x.data(), m, k, w.data(), bias.data(), y.data(), n, 17, n);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        float acc = 0.0f;
        for (int64_t kk = 0; kk < k; ++kk) acc = std::fma(x[i * k + kk], w[j * k + kk], acc);
        ASSERT_EQ(y[i * n + j], acc + bias[j]) << "m " << m << " row " << i << " column " << j;
      }
    }
  }
}

// Each copy rounds in its own order, so SkinnyLinear's result names the copy it ran.
TEST(SkinnyGemm, SkinnyLinearRunsTheWidestCopyThisCpuHas) {
  const int64_t m = 5, k = 301, n = 17;
  const auto x = RandomFloats(m * k, 8), w = RandomFloats(n * k, 9);
  std::vector<float> got(m * n), want(m * n);
  SkinnyLinear(x.data(), m, k, w.data(), nullptr, got.data(), n, 0, n);
  Impl widest = detail::HasAvx512()    ? detail::SkinnyLinearAvx512
                : detail::HasAvx2Fma() ? detail::SkinnyLinearAvx2
                                       : detail::SkinnyLinearPortable;
  widest(x.data(), m, k, w.data(), nullptr, want.data(), n, 0, n);
  EXPECT_EQ(got, want);
  EXPECT_EQ(SkinnyLinearFast(), detail::HasAvx512() || detail::HasAvx2Fma());
}

TEST(SkinnyGemm, AnEmptyColumnRangeWritesNothing) {
  const auto x = RandomFloats(8, 6), w = RandomFloats(16, 7);
  std::vector<float> y(2, -7.0f);
  SkinnyLinear(x.data(), 1, 8, w.data(), nullptr, y.data(), 2, 1, 1);
  EXPECT_EQ(y, std::vector<float>(2, -7.0f));
}

}  // namespace
}  // namespace ferry::kernels
