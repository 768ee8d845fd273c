// Seeded uniform floats for the kernel tests' inputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace ferry::testing {

// n floats uniform in [lo, hi), the same for the same seed.
inline std::vector<float> RandomFloats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

}  // namespace ferry::testing
