// Operations of the model's forward that run as one autograd node each (forward and backward
// written out) where LibTorch's composition of small ops would cost more in dispatch and
// autograd overhead than in arithmetic: a small model's step is thousands of such ops.
// Without gradients recorded they compute the same values without the node.
#pragma once

#include <ATen/ATen.h>

namespace ferry::runtime {

// PEFT's LoRA linear without dropout: x W^T + bias + scaling (x A^T) B^T, for x [..., in],
// W [out, in], bias [out] or undefined, A [r, in], B [out, r], all of one dtype and device.
// Gradients for every operand that requires one.
at::Tensor LoraLinear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& a,
                      const at::Tensor& b, double scaling);

// x W^T + bias for F32 CPU tensors whose x has at most `max_rows` rows (x [..., in], W [out, in]
// contiguous, bias [out] or undefined): the kernels/skinny_gemm.h loops across the intra-op
// threads, which read each weight row once where a BLAS packs the whole weight first. An x that
// requires grad gets it (dx = dy W); W and bias must be frozen. Returns an undefined tensor when
// the inputs do not qualify (another dtype or device, more rows, a W or bias that requires grad
// with grad mode on, no AVX-512 or AVX2 + FMA): the caller then runs at::linear.
at::Tensor SkinnyLinearOrUndefined(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t max_rows);

// transformers' LlamaRMSNorm: weight * (x * rsqrt(mean(x^2, -1) + eps)) in float, cast back to
// x's dtype before the weight. F32 CPU tensors whose weight takes no gradient run as loops
// (kernels/rms_norm.h); anything else as LibTorch ops.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// transformers' x * cos + rotate_half(x) * sin for x [B, T, H, D] and cos, sin [B, T, 1, D],
// given sin_signed: sin with its first half negated, so that rotate_half(x) * sin is
// SwapHalves(x) * sin_signed (the same products, bit for bit). F32 CPU tensors run as loops
// (kernels/rope.h) with the same roundings; anything else as LibTorch ops. cos and sin_signed
// take no gradient.
at::Tensor Rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed);

}  // namespace ferry::runtime
