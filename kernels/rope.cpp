#include "kernels/rope.h"

namespace ferry::kernels {

void RopeRows(const float* x, const float* cos, const float* sin_signed, float* y, int64_t r0, int64_t r1, int64_t H,
              int64_t D) {
  const int64_t half = D / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const float* c = cos + r * D;
    const float* s = sin_signed + r * D;
    for (int64_t h = 0; h < H; ++h) {
      const float* xr = x + (r * H + h) * D;
      float* yr = y + (r * H + h) * D;
      for (int64_t d = 0; d < half; ++d) yr[d] = xr[d] * c[d] + xr[d + half] * s[d];
      for (int64_t d = half; d < D; ++d) yr[d] = xr[d] * c[d] + xr[d - half] * s[d];
    }
  }
}

void RopeBackwardRows(const float* g, const float* cos, const float* sin_signed, float* dx, int64_t r0, int64_t r1,
                      int64_t H, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const float* c = cos + r * D;
    const float* s = sin_signed + r * D;
    for (int64_t h = 0; h < H; ++h) {
      const float* gr = g + (r * H + h) * D;
      float* dr = dx + (r * H + h) * D;
      for (int64_t d = 0; d < half; ++d) dr[d] = gr[d] * c[d] + gr[d + half] * s[d + half];
      for (int64_t d = half; d < D; ++d) dr[d] = gr[d] * c[d] + gr[d - half] * s[d - half];
    }
  }
}

}  // namespace ferry::kernels
