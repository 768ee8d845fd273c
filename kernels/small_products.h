// Batched products of small row-major float matrices: the attention products of a short
// context (a few queries against a few keys per batch row and KV head), where a BLAS call per
// item costs more than its arithmetic. Items z are independent; callers split [0, Z) across
// threads. Every array is contiguous: item z of a [Z, R, C] array starts at z * R * C.
#pragma once

#include <cstdint>

namespace ferry::kernels {

// out[z][i][j] = sum_d x[z][i][d] * y[z][j][d] for z in [z0, z1): x [Z, I, D], y [Z, J, D],
// out [Z, I, J] (x y^T per item).
void SmallDots(const float* x, const float* y, float* out, int64_t z0, int64_t z1, int64_t I, int64_t J, int64_t D);

// out[z][i][:] = sum_j w(z, i, j) * y[z][j][:] for z in [z0, z1), where w(z, i, j) is
// w[z][i][j] (w [Z, I, J]: w y per item) or, with `w_transposed`, w[z][j][i] (w [Z, J, I]:
// w^T y per item). y [Z, J, D], out [Z, I, D].
void SmallCombine(const float* w, bool w_transposed, const float* y, float* out, int64_t z0, int64_t z1, int64_t I,
                  int64_t J, int64_t D);

}  // namespace ferry::kernels
