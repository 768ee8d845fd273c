#include "kernels/cast.h"

#include <array>
#include <cmath>

// Multi-versioned loops: GCC and clang emit an AVX2 (+F16C) clone and a baseline one
// and pick at load time. Bodies are written branch-free so both vectorise.
// Not under ASan or TSan: the clones' resolver runs during relocation, before the sanitizer
// runtime is set up, and the instrumented resolver crashes there.
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__) && defined(__GNUC__) && \
    !defined(__clang__)
#define FERRY_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define FERRY_MULTIVERSION
#endif

namespace ferry::kernels {
namespace {

// Branch-free binary16 conversions (after Maratyszcza's FP16 library, MIT).
inline float HalfToFloat(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = F32FromBits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = F32FromBits((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t r = sign | (two_w < (1u << 27) ? F32Bits(denormalized) : F32Bits(normalized));
  return F32FromBits(r);
}

inline uint16_t FloatToHalf(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = F32Bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = F32FromBits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = F32Bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

float DecodeE4M3(uint8_t v) {
  const float sign = (v & 0x80) ? -1.0f : 1.0f;
  const int exp = (v >> 3) & 0xF;
  const int man = v & 0x7;
  if (exp == 0xF && man == 0x7) return std::nanf("");
  if (exp == 0) return sign * std::ldexp(static_cast<float>(man) / 8.0f, -6);
  return sign * std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
}

float DecodeE5M2(uint8_t v) { return HalfToFloat(static_cast<uint16_t>(v) << 8); }

struct F8Tables {
  std::array<float, 256> e4m3;
  std::array<float, 256> e5m2;
  F8Tables() {
    for (int i = 0; i < 256; ++i) {
      e4m3[i] = DecodeE4M3(static_cast<uint8_t>(i));
      e5m2[i] = DecodeE5M2(static_cast<uint8_t>(i));
    }
  }
};

const F8Tables& Tables() {
  static const F8Tables t;
  return t;
}

}  // namespace

float F16ToF32(uint16_t h) { return HalfToFloat(h); }
uint16_t F32ToF16(float f) { return FloatToHalf(f); }
float F8E4M3ToF32(uint8_t v) { return Tables().e4m3[v]; }
float F8E5M2ToF32(uint8_t v) { return Tables().e5m2[v]; }

FERRY_MULTIVERSION void CastF16ToF32(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = HalfToFloat(src[i]);
}

FERRY_MULTIVERSION void CastBF16ToF32(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F32FromBits(static_cast<uint32_t>(src[i]) << 16);
}

FERRY_MULTIVERSION void CastF32ToF16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = FloatToHalf(src[i]);
}

FERRY_MULTIVERSION void CastF32ToBF16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t u = F32Bits(src[i]);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    dst[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
}

void CastF8E4M3ToF32(const uint8_t* src, float* dst, size_t n) {
  const auto& t = Tables().e4m3;
  for (size_t i = 0; i < n; ++i) dst[i] = t[src[i]];
}

void CastF8E5M2ToF32(const uint8_t* src, float* dst, size_t n) {
  const auto& t = Tables().e5m2;
  for (size_t i = 0; i < n; ++i) dst[i] = t[src[i]];
}

}  // namespace ferry::kernels
