#include "kernels/adamw.h"

#include <cmath>

namespace ferry::kernels {

void AdamWUpdate(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s) {
  const float decay = static_cast<float>(1 - s.lr * s.weight_decay);
  const float beta1 = static_cast<float>(s.beta1), beta2 = static_cast<float>(s.beta2);
  const float one_minus_beta1 = static_cast<float>(1 - s.beta1), one_minus_beta2 = static_cast<float>(1 - s.beta2);
  const double bias_correction1 = 1 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bias_correction2 = 1 - std::pow(s.beta2, static_cast<double>(s.step));
  const float sqrt_bc2 = static_cast<float>(std::sqrt(bias_correction2));
  const float eps = static_cast<float>(s.eps);
  const float neg_step_size = static_cast<float>(-(s.lr / bias_correction1));
  if (s.weight_decay != 0) {
    for (int64_t i = 0; i < n; ++i) p[i] = p[i] * decay;
  }
  for (int64_t i = 0; i < n; ++i) {
    m[i] = m[i] * beta1 + one_minus_beta1 * g[i];
    v[i] = v[i] * beta2 + one_minus_beta2 * g[i] * g[i];
    const float denom = std::sqrt(v[i]) / sqrt_bc2 + eps;
    p[i] = p[i] + neg_step_size * m[i] / denom;
  }
}

double SumOfSquares(const float* x, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  return sum;
}

void Scale(float* x, int64_t n, float c) {
  for (int64_t i = 0; i < n; ++i) x[i] *= c;
}

}  // namespace ferry::kernels
