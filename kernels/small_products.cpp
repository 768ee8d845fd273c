#include "kernels/small_products.h"

#include "kernels/lane_dot.h"

namespace ferry::kernels {

void SmallDots(const float* x, const float* y, float* out, int64_t z0, int64_t z1, int64_t I, int64_t J, int64_t D) {
  for (int64_t z = z0; z < z1; ++z) {
    const float* xz = x + z * I * D;
    const float* yz = y + z * J * D;
    float* oz = out + z * I * J;
    for (int64_t i = 0; i < I; ++i) {
      const float* xi = xz + i * D;
      for (int64_t j = 0; j < J; ++j) {
        oz[i * J + j] = LaneDot(xi, yz + j * D, D);
      }
    }
  }
}

void SmallCombine(const float* w, bool w_transposed, const float* y, float* out, int64_t z0, int64_t z1, int64_t I,
                  int64_t J, int64_t D) {
  for (int64_t z = z0; z < z1; ++z) {
    const float* wz = w + z * I * J;
    const float* yz = y + z * J * D;
    float* oz = out + z * I * D;
    for (int64_t i = 0; i < I; ++i) {
      float* oi = oz + i * D;
      for (int64_t d = 0; d < D; ++d) oi[d] = 0;
      for (int64_t j = 0; j < J; ++j) {
        const float c = w_transposed ? wz[j * I + i] : wz[i * J + j];
        const float* yj = yz + j * D;
        for (int64_t d = 0; d < D; ++d) oi[d] += c * yj[d];
      }
    }
  }
}

}  // namespace ferry::kernels
