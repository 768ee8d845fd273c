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

// transformers' LlamaRMSNorm: weight * (x * rsqrt(mean(x^2, -1) + eps)) in float, cast back to
// x's dtype before the weight. F32 CPU tensors whose weight takes no gradient run as loops
// (kernels/rms_norm.h); anything else as LibTorch ops.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace ferry::runtime
