#include "kernels/skinny_gemm.h"

namespace ferry::kernels {

bool SkinnyLinearFast() {
  static const bool fast = __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("fma") != 0;
  return fast;
}

void SkinnyLinear(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y, int64_t ldy,
                  int64_t j0, int64_t j1) {
  if (SkinnyLinearFast()) {
    detail::SkinnyLinearAvx2(x, m, k_dim, w, bias, y, ldy, j0, j1);
    return;
  }
  for (int64_t j = j0; j < j1; ++j) {
    const float* wj = w + j * k_dim;
    for (int64_t i = 0; i < m; ++i) {
      const float* xi = x + i * k_dim;
      float sum = 0;
      for (int64_t k = 0; k < k_dim; ++k) sum += xi[k] * wj[k];
      y[i * ldy + j] = bias ? sum + bias[j] : sum;
    }
  }
}

}  // namespace ferry::kernels
