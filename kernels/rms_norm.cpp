#include "kernels/rms_norm.h"

#include <cmath>

#include "kernels/lane_dot.h"

namespace ferry::kernels {

void RmsNormRows(const float* x, const float* w, float eps, float* y, float* rstd, int64_t r0, int64_t r1, int64_t D) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * D;
    float* yr = y + r * D;
    const float variance = LaneDot(xr, xr, D) / static_cast<float>(D);
    const float s = 1.0f / std::sqrt(variance + eps);
    for (int64_t d = 0; d < D; ++d) yr[d] = w[d] * (xr[d] * s);
    if (rstd) rstd[r] = s;
  }
}

void RmsNormBackwardRows(const float* dy, const float* x, const float* w, const float* rstd, float* dx, int64_t r0,
                         int64_t r1, int64_t D) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * D;
    const float* dyr = dy + r * D;
    float* dxr = dx + r * D;
    for (int64_t d = 0; d < D; ++d) dxr[d] = dyr[d] * w[d];  // g
    const float s = rstd[r];
    const float c = LaneDot(dxr, xr, D) / static_cast<float>(D) * s * s * s;
    for (int64_t d = 0; d < D; ++d) dxr[d] = s * dxr[d] - c * xr[d];
  }
}

}  // namespace ferry::kernels
