#include "kernels/skinny_gemm.h"

#include "kernels/lane_dot.h"

namespace ferry::kernels {

bool SkinnyLinearFast() {
  static const bool fast = __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("fma") != 0;
  return fast;
}

namespace detail {

void SkinnyLinearPortable(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y,
                          int64_t ldy, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {
    for (int64_t i = 0; i < m; ++i) {
      const float sum = LaneDot(x + i * k_dim, w + j * k_dim, k_dim);
      y[i * ldy + j] = bias ? sum + bias[j] : sum;
    }
  }
}

}  // namespace detail

void SkinnyLinear(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y, int64_t ldy,
                  int64_t j0, int64_t j1) {
  if (SkinnyLinearFast()) {
    detail::SkinnyLinearAvx2(x, m, k_dim, w, bias, y, ldy, j0, j1);
  } else {
    detail::SkinnyLinearPortable(x, m, k_dim, w, bias, y, ldy, j0, j1);
  }
}

}  // namespace ferry::kernels
