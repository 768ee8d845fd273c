#include "daemon/runtime/fused_ops.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <vector>

#include "daemon/runtime/parallel.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "kernels/skinny_gemm.h"

namespace ferry::runtime {
namespace {

// y = x W^T + bias + scaling (x A^T) B^T, PEFT's LoRA linear without dropout, as one autograd node: the base
// product, the adapter's two and the sum are three BLAS calls forward (the sum folded into the last one) and at
// most five backward. Through at::linear it was about 14 dispatched ops and 7 autograd nodes (transposes, views
// around 3-D matmuls, the scaled add), each a few microseconds of overhead on products of a small model.
// Backward, with gy the output's gradient and t = gy B: dx = gy W + scaling t A, dA = scaling t^T x,
// dB = scaling gy^T (x A^T), dW = gy^T x, dbias = sum of gy's rows.
class LoraLinearFunction : public torch::autograd::Function<LoraLinearFunction> {
 public:
  // `bias` is [out], or empty for none.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b, double scaling) {
    const at::Tensor x2 = x.reshape({-1, x.size(-1)});
    at::Tensor xa;
    const bool has_bias = bias.numel() > 0;
    at::Tensor y = Compute(x2, w, has_bias ? bias : at::Tensor(), a, b, scaling, &xa);
    ctx->save_for_backward({x2, xa, w, a, b});
    ctx->saved_data["scaling"] = scaling;
    ctx->saved_data["bias"] = has_bias;
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = w.size(0);
    return y.view(shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x2 = saved[0], &xa = saved[1], &w = saved[2], &a = saved[3], &b = saved[4];
    const double scaling = ctx->saved_data["scaling"].toDouble();
    const at::Tensor gy = grads[0].reshape({-1, w.size(0)});
    at::Tensor dx, dw, dbias, da, db;
    at::Tensor t;
    if (ctx->needs_input_grad(0) || ctx->needs_input_grad(3)) t = at::mm(gy, b);
    if (ctx->needs_input_grad(0)) {
      dx = at::mm(gy, w).addmm_(t, a, /*beta=*/1, /*alpha=*/scaling);
      std::vector<int64_t> shape(grads[0].sizes().begin(), grads[0].sizes().end());
      shape.back() = w.size(1);
      dx = dx.view(shape);
    }
    if (ctx->needs_input_grad(1)) dw = at::mm(gy.t(), x2);
    if (ctx->needs_input_grad(2) && ctx->saved_data["bias"].toBool()) dbias = gy.sum(0);
    // The scaling goes into the products (beta = 0: the empty tensor's contents are ignored).
    if (ctx->needs_input_grad(3)) da = at::empty_like(a).addmm_(t.t(), x2, /*beta=*/0, /*alpha=*/scaling);
    if (ctx->needs_input_grad(4)) db = at::empty_like(b).addmm_(gy.t(), xa, /*beta=*/0, /*alpha=*/scaling);
    return {dx, dw, dbias, da, db, at::Tensor()};
  }

  // The forward's arithmetic on a 2-D x; `xa` (when given) receives x A^T.
  static at::Tensor Compute(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& a,
                            const at::Tensor& b, double scaling, at::Tensor* xa_out) {
    at::Tensor y = bias.defined() ? at::addmm(bias, x2, w.t()) : at::mm(x2, w.t());
    at::Tensor xa = at::mm(x2, a.t());
    y.addmm_(xa, b.t(), /*beta=*/1, /*alpha=*/scaling);
    if (xa_out) *xa_out = std::move(xa);
    return y;
  }
};

// RmsNorm's F32 CPU path as one autograd node: the loops of kernels/rms_norm.h forward and
// backward, split across threads by row. `weight` takes no gradient.
class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    const at::Tensor xc = x.contiguous();
    at::Tensor rstd = at::empty({xc.numel() / xc.size(-1)}, xc.options());
    at::Tensor y = Forward(xc, weight, eps, &rstd);
    ctx->save_for_backward({xc, weight, rstd});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &rstd = saved[2];
    const at::Tensor dy = grads[0].contiguous();
    at::Tensor dx = at::empty_like(x);
    const int64_t D = x.size(-1);
    const float *pdy = dy.data_ptr<float>(), *px = x.data_ptr<float>(), *pw = weight.data_ptr<float>(),
                *pr = rstd.data_ptr<float>();
    float* pdx = dx.data_ptr<float>();
    at::parallel_for(0, rstd.numel(), Grain(D),
                     [&](int64_t r0, int64_t r1) { kernels::RmsNormBackwardRows(pdy, px, pw, pr, pdx, r0, r1, D); });
    return {dx, at::Tensor(), at::Tensor()};
  }

  // y for a contiguous x; `rstd` (when given, [rows]) receives each row's 1 / rms.
  static at::Tensor Forward(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor* rstd) {
    at::Tensor y = at::empty_like(x);
    const int64_t D = x.size(-1);
    const float *px = x.data_ptr<float>(), *pw = weight.data_ptr<float>();
    float* py = y.data_ptr<float>();
    float* pr = rstd ? rstd->data_ptr<float>() : nullptr;
    const float e = static_cast<float>(eps);
    at::parallel_for(0, x.numel() / D, Grain(D),
                     [&](int64_t r0, int64_t r1) { kernels::RmsNormRows(px, pw, e, py, pr, r0, r1, D); });
    return y;
  }

  // Rows per task: at least ~32k elements, LibTorch's own grain for elementwise ops.
  static int64_t Grain(int64_t D) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, D)); }
};

// Rotary's F32 CPU path as one autograd node: forward and backward as loops, split across
// threads by (batch, token) row.
class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin_signed) {
    ctx->save_for_backward({cos, sin_signed});
    return Run(x.contiguous(), cos, sin_signed, /*backward=*/false);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {Run(grads[0].contiguous(), saved[0], saved[1], /*backward=*/true), at::Tensor(), at::Tensor()};
  }

  // x (or the output's gradient) [B, T, H, D] contiguous; cos and sin_signed [B, T, 1, D] contiguous.
  static at::Tensor Run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed, bool backward) {
    at::Tensor y = at::empty_like(x);
    const int64_t H = x.size(2), D = x.size(3), rows = x.size(0) * x.size(1);
    const float *px = x.data_ptr<float>(), *pc = cos.data_ptr<float>(), *ps = sin_signed.data_ptr<float>();
    float* py = y.data_ptr<float>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, H * D)), [&](int64_t r0, int64_t r1) {
      if (backward) {
        kernels::RopeBackwardRows(px, pc, ps, py, r0, r1, H, D);
      } else {
        kernels::RopeRows(px, pc, ps, py, r0, r1, H, D);
      }
    });
    return y;
  }
};

// cat(x2, x1) for x = cat(x1, x2) along the last dimension (even): with the sign in the sine,
// transformers' rotate_half(x) = cat(-x2, x1). One flip, forward and backward, where
// narrow + neg + cat cost five ops and two zero-filled slice gradients.
at::Tensor SwapHalves(const at::Tensor& x) {
  std::vector<int64_t> halves(x.sizes().begin(), x.sizes().end());
  halves.back() /= 2;
  halves.insert(halves.end() - 1, 2);
  return x.reshape(halves).flip({-2}).view(x.sizes());
}

}  // namespace

at::Tensor LoraLinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& a,
                      const at::Tensor& b, double scaling) {
  const bool grad = at::GradMode::is_enabled() &&
                    (x.requires_grad() || w.requires_grad() || (bias.defined() && bias.requires_grad()) ||
                     a.requires_grad() || b.requires_grad());
  // apply() takes defined tensors only: no bias is an empty one.
  if (grad) return LoraLinearFunction::apply(x, w, bias.defined() ? bias : at::empty({0}, w.options()), a, b, scaling);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.size(0);
  return LoraLinearFunction::Compute(x.reshape({-1, x.size(-1)}), w, bias, a, b, scaling, nullptr).view(shape);
}

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const bool grad = at::GradMode::is_enabled();
  if (x.device().is_cpu() && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
      weight.device().is_cpu() && weight.dim() == 1 && weight.is_contiguous() && x.dim() >= 1 &&
      x.size(-1) == weight.size(0) && x.size(-1) > 0 && !(grad && weight.requires_grad())) {
    if (grad && x.requires_grad()) return RmsNormFunction::apply(x, weight, eps);
    return RmsNormFunction::Forward(x.contiguous(), weight, eps, nullptr);
  }
  at::Tensor h = x.to(at::kFloat);
  at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  return weight * h.to(x.scalar_type());
}

at::Tensor Rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed) {
  auto fits = [&](const at::Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 4 && t.is_contiguous() &&
           t.size(0) == x.size(0) && t.size(1) == x.size(1) && t.size(2) == 1 && t.size(3) == x.size(3) &&
           !t.requires_grad();
  };
  if (x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 4 && x.size(3) % 2 == 0 && fits(cos) &&
      fits(sin_signed)) {
    if (at::GradMode::is_enabled() && x.requires_grad()) return RotaryFunction::apply(x, cos, sin_signed);
    return RotaryFunction::Run(x.contiguous(), cos, sin_signed, /*backward=*/false);
  }
  return x * cos + SwapHalves(x) * sin_signed;
}

namespace {

// y = x W^T + bias over the kernels/skinny_gemm.h loops, split across the intra-op threads by
// output column. x [rows, k] F32 contiguous; W [n, k] and bias [n] (or undefined) contiguous.
at::Tensor SkinnyProduct(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& bias) {
  const int64_t rows = x2.size(0), k = x2.size(1), n = w.size(0);
  at::Tensor y = at::empty({rows, n}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Weight rows per task: about 64 KB of weight, so that a small layer is not split finer than it pays.
  const int64_t grain = std::max<int64_t>(1, (int64_t{16} << 10) / k);
  at::parallel_for(0, n, grain,
                   [&](int64_t j0, int64_t j1) { kernels::SkinnyLinear(xp, rows, k, wp, bp, yp, n, j0, j1); });
  return y;
}

// The few-row product as an autograd node for an x that requires grad (a frozen W and bias):
// dx = dy W through the BLAS.
class SkinnyLinearFunction : public torch::autograd::Function<SkinnyLinearFunction> {
 public:
  // The bias by pointer: an undefined tensor cannot be an input of a custom function's apply.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x2, const at::Tensor& w,
                            const at::Tensor* bias) {
    ctx->saved_data["w"] = w;
    return SkinnyProduct(x2, w, *bias);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor w = ctx->saved_data["w"].toTensor();
    return {grads[0].mm(w), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor SkinnyLinearOrUndefined(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t max_rows) {
  if (max_rows < 1 || !kernels::SkinnyLinearFast() || x.dim() < 1 || x.size(-1) < 1) return {};
  const int64_t k = x.size(-1), rows = x.numel() / k;
  if (rows < 1 || rows > max_rows || w.dim() != 2 || w.size(1) != k) return {};
  auto plain = [](const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat; };
  if (!plain(x) || !plain(w) || !w.is_contiguous()) return {};
  if (bias.defined() && (!plain(bias) || bias.dim() != 1 || bias.size(0) != w.size(0) || !bias.is_contiguous())) {
    return {};
  }
  const bool grad = at::GradMode::is_enabled();
  if (grad && (w.requires_grad() || (bias.defined() && bias.requires_grad()))) return {};
  const at::Tensor x2 = x.reshape({rows, k}).contiguous();
  const at::Tensor y =
      grad && x.requires_grad() ? SkinnyLinearFunction::apply(x2, w, &bias) : SkinnyProduct(x2, w, bias);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.size(0);
  return y.view(shape);
}

}  // namespace ferry::runtime
