#include "kernels/skinny_gemm.h"

#include "kernels/lane_dot.h"

namespace ferry::kernels {

namespace detail {

bool HasAvx2Fma() {
  static const bool has = __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("fma") != 0;
  return has;
}

// libgcc's check includes the OS saving the 512-bit state (XCR0).
bool HasAvx512() {
  static const bool has = __builtin_cpu_supports("avx512f") != 0;
  return has;
}

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

bool SkinnyLinearFast() { return detail::HasAvx512() || detail::HasAvx2Fma(); }

int64_t SkinnyLinearRowsThatPay() {
  if (detail::HasAvx512()) return 64;
  return detail::HasAvx2Fma() ? 8 : 0;
}

void SkinnyLinear(const float* x, int64_t m, int64_t k_dim, const float* w, const float* bias, float* y, int64_t ldy,
                  int64_t j0, int64_t j1) {
  if (detail::HasAvx512()) {
    detail::SkinnyLinearAvx512(x, m, k_dim, w, bias, y, ldy, j0, j1);
  } else if (detail::HasAvx2Fma()) {
    detail::SkinnyLinearAvx2(x, m, k_dim, w, bias, y, ldy, j0, j1);
  } else {
    detail::SkinnyLinearPortable(x, m, k_dim, w, bias, y, ldy, j0, j1);
  }
}

}  // namespace ferry::kernels
