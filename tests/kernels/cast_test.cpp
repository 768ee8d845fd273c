#include "kernels/cast.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace ferry::kernels {
namespace {

// Reference binary16 decode written from the IEEE definition, independent of cast.cpp.
double RefHalf(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  double v;
  if (exp == 0) v = std::ldexp(man, -24);
  else if (exp == 31) v = man ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else v = std::ldexp(1024 + man, exp - 25);
  return sign ? -v : v;
}

TEST(Cast, F16ToF32IsExactForEveryBitPattern) {
  std::vector<uint16_t> all(65536);
  for (int i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> out(65536);
  CastF16ToF32(all.data(), out.data(), all.size());
  for (int i = 0; i < 65536; ++i) {
    double ref = RefHalf(static_cast<uint16_t>(i));
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(out[i])) << i;
    } else {
      ASSERT_EQ(static_cast<double>(out[i]), ref) << "bits " << i;
      ASSERT_EQ(std::signbit(out[i]), std::signbit(ref)) << i;
    }
  }
}

TEST(Cast, F32ToF16RoundTripsEveryHalfAndRoundsToNearestEven) {
  // Every finite half survives F16 -> F32 -> F16.
  for (int i = 0; i < 65536; ++i) {
    uint16_t h = static_cast<uint16_t>(i);
    if (((h >> 10) & 0x1f) == 31 && (h & 0x3ff)) continue;  // NaN payloads are not preserved bit-exactly
    ASSERT_EQ(F32ToF16(F16ToF32(h)), h) << i;
  }
  // Halfway between 1.0 (0x3C00) and the next half (0x3C01): ties to even -> 0x3C00.
  EXPECT_EQ(F32ToF16(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
  // Halfway between 0x3C01 and 0x3C02: ties to even -> 0x3C02.
  EXPECT_EQ(F32ToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  // Just above halfway rounds up.
  EXPECT_EQ(F32ToF16(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3C01);
  EXPECT_EQ(F32ToF16(65504.0f), 0x7BFF);  // max half
  EXPECT_EQ(F32ToF16(65520.0f), 0x7C00);  // rounds to +inf
  EXPECT_EQ(F32ToF16(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -26)), 0x0000);  // below half the smallest subnormal: 0
  uint16_t nan = F32ToF16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7C00, 0x7C00);
  EXPECT_NE(nan & 0x03FF, 0);
}

TEST(Cast, F32ToBF16RoundsToNearestEven) {
  EXPECT_EQ(F32ToBF16(1.0f), 0x3F80);
  // 1 + 2^-8 is halfway between 0x3F80 and 0x3F81: even -> 0x3F80.
  EXPECT_EQ(F32ToBF16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  // 1 + 3*2^-8 is halfway between 0x3F81 and 0x3F82: even -> 0x3F82.
  EXPECT_EQ(F32ToBF16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_EQ(F32ToBF16(std::numeric_limits<float>::max()), 0x7F80);  // rounds to inf
  uint16_t nan = F32ToBF16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7F80, 0x7F80);
  EXPECT_NE(nan & 0x007F, 0);
  // A signalling NaN whose payload sits only in the low 16 bits must stay NaN.
  EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(F32FromBits(0x7F800001u)))));
}

TEST(Cast, VectorisedLoopsMatchScalarReference) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  const size_t n = 100003;  // not a multiple of any vector width
  std::vector<float> f(n);
  for (auto& x : f) {
    do {
      x = F32FromBits(bits(rng));
    } while (std::isnan(x));
  }
  std::vector<uint16_t> h(n), b(n);
  CastF32ToF16(f.data(), h.data(), n);
  CastF32ToBF16(f.data(), b.data(), n);
  std::vector<float> hb(n), bb(n);
  CastF16ToF32(h.data(), hb.data(), n);
  CastBF16ToF32(b.data(), bb.data(), n);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(h[i], F32ToF16(f[i])) << i;
    ASSERT_EQ(b[i], F32ToBF16(f[i])) << i;
    ASSERT_EQ(F32Bits(hb[i]), F32Bits(F16ToF32(h[i]))) << i;
    ASSERT_EQ(F32Bits(bb[i]), F32Bits(BF16ToF32(b[i]))) << i;
  }
}

TEST(Cast, F8E4M3KnownValues) {
  EXPECT_EQ(F8E4M3ToF32(0x38), 1.0f);    // 0 0111 000
  EXPECT_EQ(F8E4M3ToF32(0x7E), 448.0f);  // max normal
  EXPECT_EQ(F8E4M3ToF32(0xFE), -448.0f);
  EXPECT_EQ(F8E4M3ToF32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_TRUE(std::isnan(F8E4M3ToF32(0x7F)));
  EXPECT_TRUE(std::isnan(F8E4M3ToF32(0xFF)));
  EXPECT_EQ(F8E4M3ToF32(0x78), 256.0f);  // 0 1111 000: a number, not inf, in E4M3FN
}

TEST(Cast, F8E5M2KnownValues) {
  EXPECT_EQ(F8E5M2ToF32(0x3C), 1.0f);
  EXPECT_EQ(F8E5M2ToF32(0x7B), 57344.0f);  // max normal
  EXPECT_TRUE(std::isinf(F8E5M2ToF32(0x7C)));
  EXPECT_TRUE(std::isnan(F8E5M2ToF32(0x7D)));
  EXPECT_EQ(F8E5M2ToF32(0x01), std::ldexp(1.0f, -16));
  std::vector<uint8_t> all(256);
  for (int i = 0; i < 256; ++i) all[i] = static_cast<uint8_t>(i);
  std::vector<float> out(256);
  CastF8E5M2ToF32(all.data(), out.data(), 256);
  for (int i = 0; i < 256; ++i) {
    float ref = F16ToF32(static_cast<uint16_t>(i << 8));
    if (std::isnan(ref)) EXPECT_TRUE(std::isnan(out[i]));
    else EXPECT_EQ(out[i], ref) << i;
  }
}

}  // namespace
}  // namespace ferry::kernels
