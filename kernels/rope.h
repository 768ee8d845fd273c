// Rotary position embedding of float rows, forward and backward, with the roundings of
// transformers' q * cos + rotate_half(q) * sin: each product rounded, then their sum.
// With the first half of the sine negated (sin_signed), rotate_half(x) * sin is
// swap(x) * sin_signed, swap exchanging the two halves of the head dimension.
#pragma once

#include <cstdint>

namespace ferry::kernels {

// Rows [r0, r1) of x [R, H, D] (R = batch x tokens, H heads): y = x * cos + swap(x) * sin_signed,
// with cos and sin_signed [R, D] shared by a row's heads. D is even.
void RopeRows(const float* x, const float* cos, const float* sin_signed, float* y, int64_t r0, int64_t r1, int64_t H,
              int64_t D);

// The gradient with respect to x: dx = g * cos + swap(g * sin_signed), rows [r0, r1).
void RopeBackwardRows(const float* g, const float* cos, const float* sin_signed, float* dx, int64_t r0, int64_t r1,
                      int64_t H, int64_t D);

}  // namespace ferry::kernels
