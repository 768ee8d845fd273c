#include "kernels/small_products.h"
#include "tests/kernels/random_floats.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace ferry::kernels {
namespace {

using ferry::testing::RandomFloats;

// D = 13 and 40: the 8-lane loop with and without a remainder; items [1, 3) of 4 only.
class SmallProductsTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(SmallProductsTest, DotsEqualADoubleReference) {
  const int64_t Z = 4, I = 3, J = 5, D = GetParam();
  const auto x = RandomFloats(Z * I * D, 1), y = RandomFloats(Z * J * D, 2);
  std::vector<float> out(Z * I * J, -7.0f);
  SmallDots(x.data(), y.data(), out.data(), 1, 3, I, J, D);
  for (int64_t z = 0; z < Z; ++z) {
    for (int64_t i = 0; i < I; ++i) {
      for (int64_t j = 0; j < J; ++j) {
        const float got = out[(z * I + i) * J + j];
        if (z < 1 || z >= 3) {
          EXPECT_EQ(got, -7.0f) << "item " << z << " is outside the range and was written";
          continue;
        }
        double want = 0;
        for (int64_t d = 0; d < D; ++d) want += double(x[(z * I + i) * D + d]) * double(y[(z * J + j) * D + d]);
        EXPECT_NEAR(got, want, 1e-5) << z << " " << i << " " << j;
      }
    }
  }
}

TEST_P(SmallProductsTest, CombineEqualsADoubleReferencePlainAndTransposed) {
  const int64_t Z = 4, I = 3, J = 5, D = GetParam();
  const auto w = RandomFloats(Z * I * J, 3), y = RandomFloats(Z * J * D, 4);
  for (bool transposed : {false, true}) {
    std::vector<float> out(Z * I * D, -7.0f);
    SmallCombine(w.data(), transposed, y.data(), out.data(), 1, 3, I, J, D);
    for (int64_t z = 0; z < Z; ++z) {
      for (int64_t i = 0; i < I; ++i) {
        for (int64_t d = 0; d < D; ++d) {
          const float got = out[(z * I + i) * D + d];
          if (z < 1 || z >= 3) {
            EXPECT_EQ(got, -7.0f) << "item " << z << " is outside the range and was written";
            continue;
          }
          double want = 0;
          for (int64_t j = 0; j < J; ++j) {
            const float c = transposed ? w[(z * J + j) * I + i] : w[(z * I + i) * J + j];
            want += double(c) * double(y[(z * J + j) * D + d]);
          }
          EXPECT_NEAR(got, want, 1e-5) << (transposed ? "transposed " : "") << z << " " << i << " " << d;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(HeadDims, SmallProductsTest, ::testing::Values(int64_t{13}, int64_t{40}));

}  // namespace
}  // namespace ferry::kernels
