// Element-type conversion kernels (CPU reference; CUDA versions in cuda/cast.cuh).
//
// All conversions to narrower formats round to nearest, ties to even, and keep NaN a
// NaN (quiet) and infinities infinite. Overflow to F16 gives infinity, as in PyTorch.
// F8 formats (OCP E4M3FN and E5M2) can be read only.
//
// The array functions are vectorised (compiled for AVX2/F16C and baseline x86-64 and
// dispatched at run time); the scalar functions are the reference definitions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ferry::kernels {

inline uint32_t F32Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float F32FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary16 -> binary32 (exact).
float F16ToF32(uint16_t h);
// binary32 -> binary16, round to nearest even.
uint16_t F32ToF16(float f);
// bfloat16 -> binary32 (exact).
inline float BF16ToF32(uint16_t b) { return F32FromBits(static_cast<uint32_t>(b) << 16); }
// binary32 -> bfloat16, round to nearest even; NaN stays a quiet NaN.
inline uint16_t F32ToBF16(float f) {
  uint32_t u = F32Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
// OCP FP8 E4M3FN (no infinities; S.1111.111 is NaN) -> binary32 (exact).
float F8E4M3ToF32(uint8_t v);
// OCP FP8 E5M2 -> binary32 (exact).
float F8E5M2ToF32(uint8_t v);

void CastF16ToF32(const uint16_t* src, float* dst, size_t n);
void CastBF16ToF32(const uint16_t* src, float* dst, size_t n);
void CastF32ToF16(const float* src, uint16_t* dst, size_t n);
void CastF32ToBF16(const float* src, uint16_t* dst, size_t n);
void CastF8E4M3ToF32(const uint8_t* src, float* dst, size_t n);
void CastF8E5M2ToF32(const uint8_t* src, float* dst, size_t n);

}  // namespace ferry::kernels
