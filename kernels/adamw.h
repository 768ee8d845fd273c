// One AdamW update of a float tensor in place, with the arithmetic of LibTorch's
// torch::optim::AdamW::step (amsgrad off), the float casts of its scalars included:
//   p *= 1 - lr * weight_decay                      (only when weight_decay != 0)
//   m = m * beta1 + (1 - beta1) * g
//   v = v * beta2 + (1 - beta2) * g * g
//   p += (-lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// ATen may fuse a multiply-add where this does not (on CPUs with AVX2), so results agree to
// rounding, not bit for bit.
#pragma once

#include <cstdint>

namespace ferry::kernels {

struct AdamWScalars {
  double lr = 0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  int64_t step = 1;  // the update's step number t, counting from 1
};

// Elements [0, n) of the parameter p, its gradient g and its moments m and v.
void AdamWUpdate(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s);

// sum of x[i]^2 over [0, n), accumulated in double.
double SumOfSquares(const float* x, int64_t n);

// x[i] *= c over [0, n).
void Scale(float* x, int64_t n, float c);

}  // namespace ferry::kernels
