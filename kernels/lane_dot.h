// The dot product the CPU loop kernels share: 8 independent partial sums, so that GCC
// vectorises the loop over d; the tail and the lanes are added in a fixed order.
#pragma once

#include <cstdint>

namespace ferry::kernels {

inline float LaneDot(const float* a, const float* b, int64_t n) {
  constexpr int64_t kLanes = 8;
  float lane[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lane[l] += a[d + l] * b[d + l];
  }
  float sum = 0;
  for (; d < n; ++d) sum += a[d] * b[d];
  for (int64_t l = 0; l < kLanes; ++l) sum += lane[l];
  return sum;
}

}  // namespace ferry::kernels
