// RMSNorm over the rows of a row-major float matrix, forward and backward, as transformers'
// LlamaRMSNorm computes it in float: y = w * (x * rstd), rstd = 1 / sqrt(mean(x^2) + eps).
// Rows are independent; callers split [0, R) across threads. x, y, dy and dx are [R, D], w is
// [D], rstd is [R].
#pragma once

#include <cstdint>

namespace ferry::kernels {

// Rows [r0, r1): y and, when not null, rstd (the backward's input).
void RmsNormRows(const float* x, const float* w, float eps, float* y, float* rstd, int64_t r0, int64_t r1, int64_t D);

// Rows [r0, r1) of the gradient with respect to x, for a weight that takes none:
// dx = rstd * g - x * rstd^3 * mean(g * x), with g = dy * w.
void RmsNormBackwardRows(const float* dy, const float* x, const float* w, const float* rstd, float* dx, int64_t r0,
                         int64_t r1, int64_t D);

}  // namespace ferry::kernels
