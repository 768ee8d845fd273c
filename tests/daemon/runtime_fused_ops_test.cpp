// daemon/runtime/fused_ops.h against the LibTorch compositions they replace, their gradients
// from LibTorch's own autograd: the LoRA linear in double (the same products, so nearly exact)
// and in float, RMSNorm against transformers' formula computed in double, the few-row linear
// against at::linear in double; the attention backend (attention.h) against transformers' eager
// attention in double, on both of its product paths, forward and backward.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <limits>
#include <vector>

#include "daemon/runtime/attention.h"
#include "daemon/runtime/fused_ops.h"
#include "kernels/skinny_gemm.h"

namespace ferry::runtime {
namespace {

double MaxRelError(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  return ((g - w).abs().max() / w.abs().max().clamp_min(1e-12)).item<double>();
}

struct LoraCase {
  at::ScalarType dtype;
  bool bias;
  bool weight_grad;
  double tolerance;
};

class LoraLinearTest : public ::testing::TestWithParam<LoraCase> {};

TEST_P(LoraLinearTest, OutputAndEveryGradientEqualAutogradOfTheComposition) {
  const LoraCase p = GetParam();
  at::manual_seed(5);
  const auto o = at::TensorOptions().dtype(p.dtype);
  const double scaling = 1.7;  // not a power of two: its rounding shows
  std::vector<at::Tensor> inputs = {at::randn({3, 5, 24}, o), at::randn({20, 24}, o) * 0.2, at::randn({20}, o),
                                    at::randn({6, 24}, o) * 0.3, at::randn({20, 6}, o) * 0.3};
  auto run = [&](bool fused) {
    std::vector<at::Tensor> in;
    for (const at::Tensor& t : inputs) in.push_back(t.clone());
    in[0].requires_grad_(true);
    in[1].requires_grad_(p.weight_grad);
    in[2].requires_grad_(p.bias);
    in[3].requires_grad_(true);
    in[4].requires_grad_(true);
    const at::Tensor bias = p.bias ? in[2] : at::Tensor();
    at::Tensor y = fused ? LoraLinear(in[0], in[1], bias, in[3], in[4], scaling)
                         : at::linear(in[0], in[1], bias) + scaling * at::linear(at::linear(in[0], in[3]), in[4]);
    const at::Tensor dy = at::randn(y.sizes(), o);
    (y * dy).sum().backward();
    std::vector<at::Tensor> out = {y.detach()};
    for (const at::Tensor& t : in) out.push_back(t.grad());
    return out;
  };
  at::manual_seed(9);
  const std::vector<at::Tensor> want = run(false);
  at::manual_seed(9);
  const std::vector<at::Tensor> got = run(true);
  const char* names[] = {"y", "dx", "dW", "dbias", "dA", "dB"};
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].defined(), want[i].defined()) << names[i];
    if (!want[i].defined()) continue;
    EXPECT_EQ(got[i].sizes(), want[i].sizes()) << names[i];
    EXPECT_LT(MaxRelError(got[i], want[i]), p.tolerance) << names[i];
  }
  // Without gradients recorded: the same output, no graph.
  at::NoGradGuard no_grad;
  const at::Tensor y =
      LoraLinear(inputs[0], inputs[1], p.bias ? inputs[2] : at::Tensor(), inputs[3], inputs[4], scaling);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_LT(MaxRelError(y, want[0]), p.tolerance);
}

INSTANTIATE_TEST_SUITE_P(Cases, LoraLinearTest,
                         ::testing::Values(LoraCase{at::kDouble, false, false, 1e-13},
                                           LoraCase{at::kDouble, true, true, 1e-13},
                                           LoraCase{at::kFloat, true, false, 1e-5},
                                           LoraCase{at::kFloat, false, true, 1e-5}));

// transformers' LlamaRMSNorm in double.
at::Tensor RmsNormReference(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::Tensor h = x.to(at::kDouble);
  return w.to(at::kDouble) * (h * at::rsqrt(h.pow(2).mean(-1, true) + eps));
}

// The few-row product (kernels/skinny_gemm.h) as a node: its output and x's gradient against
// at::linear's in double, with and without bias; the same bits with and without autograd; a W
// that takes gradients, too many rows or another dtype leave it to the caller.
TEST(SkinnyLinearTest, OutputAndInputGradientEqualTheLinearOfLibTorch) {
  if (!kernels::SkinnyLinearFast()) GTEST_SKIP() << "no AVX-512 or AVX2 + FMA on this CPU";
  at::manual_seed(4);
  for (bool with_bias : {false, true}) {
    const at::Tensor x0 = at::randn({2, 3, 37}), w = at::randn({29, 37}), dy = at::randn({2, 3, 29});
    const at::Tensor bias = with_bias ? at::randn({29}) : at::Tensor();
    at::Tensor xd = x0.to(at::kDouble).requires_grad_(true);
    const at::Tensor want = at::linear(xd, w.to(at::kDouble), with_bias ? bias.to(at::kDouble) : at::Tensor());
    (want * dy.to(at::kDouble)).sum().backward();
    at::Tensor x = x0.clone().requires_grad_(true);
    const at::Tensor y = SkinnyLinearOrUndefined(x, w, bias, 8);
    ASSERT_TRUE(y.defined());
    ASSERT_TRUE(y.requires_grad());
    EXPECT_EQ(y.sizes(), (at::IntArrayRef{2, 3, 29}));
    (y * dy).sum().backward();
    EXPECT_LT(MaxRelError(y.detach(), want.detach()), 1e-6) << "bias " << with_bias;
    EXPECT_LT(MaxRelError(x.grad(), xd.grad()), 1e-6) << "bias " << with_bias;
    at::NoGradGuard no_grad;
    EXPECT_TRUE(at::equal(SkinnyLinearOrUndefined(x0, w, bias, 8), y.detach()));
  }
  const at::Tensor x = at::randn({9, 16}), w = at::randn({5, 16});
  EXPECT_FALSE(SkinnyLinearOrUndefined(x, w, at::Tensor(), 8).defined()) << "9 rows, at most 8";
  EXPECT_TRUE(SkinnyLinearOrUndefined(x, w, at::Tensor(), 9).defined());
  EXPECT_FALSE(SkinnyLinearOrUndefined(x.to(at::kDouble), w.to(at::kDouble), at::Tensor(), 9).defined());
  const at::Tensor trained = w.clone().requires_grad_(true);
  EXPECT_FALSE(SkinnyLinearOrUndefined(x, trained, at::Tensor(), 9).defined()) << "a W that takes gradients";
}

TEST(RmsNormTest, OutputAndInputGradientEqualTheFormula) {
  at::manual_seed(3);
  for (int64_t D : {8, 40, 131}) {  // whole vectors of 8 lanes, and a tail
    const at::Tensor x0 = at::randn({4, 9, D}) * 3 + 0.5;
    const at::Tensor w = at::rand({D}) + 0.5;
    const at::Tensor dy = at::randn({4, 9, D});
    const double eps = 1e-6;
    at::Tensor xd = x0.to(at::kDouble).requires_grad_(true);
    at::Tensor want = RmsNormReference(xd, w, eps);
    (want * dy.to(at::kDouble)).sum().backward();
    at::Tensor x = x0.clone().requires_grad_(true);
    at::Tensor y = RmsNorm(x, w, eps);
    ASSERT_TRUE(y.requires_grad());
    (y * dy).sum().backward();
    EXPECT_LT(MaxRelError(y.detach(), want.detach()), 1e-6) << "D " << D;
    EXPECT_LT(MaxRelError(x.grad(), xd.grad()), 1e-5) << "D " << D;
    {
      at::NoGradGuard no_grad;
      EXPECT_TRUE(at::equal(RmsNorm(x0, w, eps), y.detach())) << "D " << D;
      // A non-contiguous input gives the same rows.
      const at::Tensor xt = x0.transpose(0, 1).contiguous().transpose(0, 1);
      ASSERT_FALSE(xt.is_contiguous());
      EXPECT_TRUE(at::equal(RmsNorm(xt, w, eps), y.detach())) << "D " << D;
    }
  }
}

TEST(RmsNormTest, OtherDtypesAndATrainedWeightTakeLibTorchsPath) {
  at::manual_seed(4);
  const at::Tensor x = at::randn({5, 16});
  const at::Tensor w = at::rand({16}) + 0.5;
  const at::Tensor bf = x.to(at::kBFloat16), wbf = w.to(at::kBFloat16);
  at::Tensor h = bf.to(at::kFloat);
  const at::Tensor want_bf = wbf * (h * at::rsqrt(h.pow(2).mean(-1, true) + 1e-5)).to(at::kBFloat16);
  EXPECT_TRUE(at::equal(RmsNorm(bf, wbf, 1e-5), want_bf));
  // A weight that takes a gradient gets one.
  at::Tensor wg = w.clone().requires_grad_(true);
  RmsNorm(x, wg, 1e-5).sum().backward();
  ASSERT_TRUE(wg.grad().defined());
  const at::Tensor want_dw = (x.to(at::kDouble) * at::rsqrt(x.to(at::kDouble).pow(2).mean(-1, true) + 1e-5)).sum(0);
  EXPECT_LT(MaxRelError(wg.grad(), want_dw), 1e-5);
}

// transformers' rotate_half, spelled out.
at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

TEST(RotaryTest, SameBitsAsTransformersFormulaForwardAndBackward) {
  at::manual_seed(6);
  const at::Tensor angles = at::rand({3, 5, 1, 8}) * 10;
  const at::Tensor cos = at::cat({angles, angles}, -1).cos();
  const at::Tensor sin = at::cat({angles, angles}, -1).sin();
  const at::Tensor sin_signed = at::cat({-sin.narrow(-1, 0, 8), sin.narrow(-1, 8, 8)}, -1).contiguous();
  const at::Tensor x0 = at::randn({3, 5, 4, 16});
  const at::Tensor g = at::randn({3, 5, 4, 16});
  at::Tensor xr = x0.clone().requires_grad_(true);
  const at::Tensor want = xr * cos + RotateHalf(xr) * sin;
  want.backward(g);
  for (bool narrowed : {false, true}) {  // narrowed: heads of a fused projection, not contiguous
    at::Tensor leaf = (narrowed ? at::cat({x0, x0}, -1) : x0).clone().requires_grad_(true);
    const at::Tensor x = narrowed ? leaf.narrow(-1, 0, 16) : leaf;
    ASSERT_EQ(x.is_contiguous(), !narrowed);
    const at::Tensor y = Rotary(x, cos, sin_signed);
    EXPECT_TRUE(at::equal(y, want.detach())) << narrowed;
    y.backward(g);
    EXPECT_TRUE(at::equal(narrowed ? leaf.grad().narrow(-1, 0, 16) : leaf.grad(), xr.grad())) << narrowed;
    if (narrowed) {
      EXPECT_EQ(leaf.grad().narrow(-1, 16, 16).abs().max().item<float>(), 0.0f);
    }
  }
  at::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(Rotary(x0, cos, sin_signed), want.detach()));
  // BF16 takes LibTorch's ops: the same formula in BF16.
  const at::Tensor xb = x0.to(at::kBFloat16), cb = cos.to(at::kBFloat16), sb = sin.to(at::kBFloat16);
  EXPECT_TRUE(at::equal(Rotary(xb, cb, sin_signed.to(at::kBFloat16)), xb * cb + RotateHalf(xb) * sb));
}

// transformers' eager attention with the KV heads repeated, for q [B, T, nH, D], k and v
// [B, nKV, S, D] and blocked [B, 1, 1, T, S]: [B, T, nH * D].
at::Tensor EagerAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& blocked) {
  const int64_t B = q.size(0), T = q.size(1), nH = q.size(2), D = q.size(3), S = k.size(2);
  const at::Tensor kk = k.repeat_interleave(nH / k.size(1), 1), vv = v.repeat_interleave(nH / k.size(1), 1);
  at::Tensor scores = at::matmul(q.transpose(1, 2), kk.transpose(-1, -2)) / std::sqrt(static_cast<double>(D));
  scores = scores.masked_fill(blocked.view({B, 1, T, S}), -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(scores, -1), vv).transpose(1, 2).reshape({B, T, nH * D});
}

// The attention of `inputs` (q, k, v) under `blocked` and its gradients for the output gradient
// `dy`: {y, dq, dk, dv}, by the F64 eager reference or by ScaledDotProductAttention with `o`.
std::vector<at::Tensor> AttentionAndGradients(const std::vector<at::Tensor>& inputs, const at::Tensor& blocked,
                                              const at::Tensor& dy, bool reference, const AttentionOptions& o) {
  std::vector<at::Tensor> in;
  for (const at::Tensor& t : inputs) in.push_back((reference ? t.to(at::kDouble) : t.clone()).requires_grad_(true));
  const at::Tensor y = reference ? EagerAttention(in[0], in[1], in[2], blocked)
                                 : ScaledDotProductAttention(in[0], in[1], in[2], blocked, o);
  (y * (reference ? dy.to(at::kDouble) : dy)).sum().backward();
  return {y.detach(), in[0].grad(), in[1].grad(), in[2].grad()};
}

TEST(AttentionTest, BothProductPathsAndChunksEqualEagerAttentionForwardAndBackward) {
  at::manual_seed(8);
  const int64_t B = 2, T = 5, nH = 4, nKV = 2, D = 8;
  const std::vector<at::Tensor> inputs = {at::randn({B, T, nH, D}), at::randn({B, nKV, T, D}),
                                          at::randn({B, nKV, T, D})};
  const at::Tensor dy = at::randn({B, T, nH * D});
  // Causal, and row 0's key 1 is padding.
  at::Tensor blocked = at::ones({T, T}).triu(1).to(at::kBool).expand({B, T, T}).clone();
  blocked[0].select(1, 1).fill_(true);
  blocked = blocked.view({B, 1, 1, T, T});
  auto run = [&](bool reference, const AttentionOptions& o) {
    return AttentionAndGradients(inputs, blocked, dy, reference, o);
  };
  const std::vector<at::Tensor> want = run(true, {});
  const char* names[] = {"y", "dq", "dk", "dv"};
  for (const int64_t small : {int64_t{0}, int64_t{1} << 40}) {  // every product on bmm; every one as loops
    for (const int64_t chunk : {int64_t{1024}, int64_t{2}}) {
      const std::vector<at::Tensor> got = run(false, {.query_chunk = chunk, .small_product = small});
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_LT(MaxRelError(got[i], want[i]), 1e-5) << names[i] << " small " << small << " chunk " << chunk;
      }
      at::NoGradGuard no_grad;  // generation: the bmm split across threads
      EXPECT_LT(MaxRelError(ScaledDotProductAttention(inputs[0], inputs[1], inputs[2], blocked,
                                                      {.query_chunk = chunk, .small_product = small}),
                            want[0]),
                1e-5)
          << "no grad, small " << small << " chunk " << chunk;
    }
  }
}

// The fused kernel (at::scaled_dot_product_attention, where this LibTorch has it): forward and
// backward equal eager attention in F64. A query whose every key is blocked (a left-padded row's
// padding) averages the values as the eager kernel does, finite. Nothing reads such a position
// (every real query blocks it as a key), so it gets no gradient; with none, the gradients equal
// the eager kernel's. (With one, the additive mask lets it reach q and k, as in transformers'
// sdpa attention, where the eager kernel's masked_fill stops it.)
TEST(AttentionTest, FusedKernelEqualsEagerAttentionForwardAndBackward) {
  if (!FusedAttentionAvailable()) GTEST_SKIP() << "this LibTorch has no scaled_dot_product_attention";
  at::manual_seed(9);
  const int64_t B = 2, T = 5, nH = 4, nKV = 2, D = 8;
  const std::vector<at::Tensor> inputs = {at::randn({B, T, nH, D}), at::randn({B, nKV, T, D}),
                                          at::randn({B, nKV, T, D})};
  at::Tensor causal = at::ones({T, T}).triu(1).to(at::kBool).expand({B, T, T}).clone();
  causal[0].select(1, 1).fill_(true);
  const AttentionOptions fused{.kernel = AttentionKernel::kFused};
  const AttentionOptions eager{.kernel = AttentionKernel::kEager};
  auto run = [&](bool reference, const at::Tensor& blocked, const at::Tensor& dy, const AttentionOptions& o) {
    return AttentionAndGradients(inputs, blocked, dy, reference, o);
  };
  const char* names[] = {"y", "dq", "dk", "dv"};
  at::Tensor dy = at::randn({B, T, nH * D});
  const at::Tensor blocked = causal.view({B, 1, 1, T, T});
  const std::vector<at::Tensor> want = run(true, blocked, dy, {});
  const std::vector<at::Tensor> got = run(false, blocked, dy, fused);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_LT(MaxRelError(got[i], want[i]), 1e-5) << names[i];

  // Row 1's key 0 is padding too: its query 0 sees no key at all, and nothing reads it.
  at::Tensor padded = causal.clone();
  padded[1].select(1, 0).fill_(true);
  const at::Tensor blocked_row = padded.view({B, 1, 1, T, T});
  dy[1][0].zero_();
  const std::vector<at::Tensor> f = run(false, blocked_row, dy, fused);
  const std::vector<at::Tensor> e = run(false, blocked_row, dy, eager);
  for (size_t i = 0; i < f.size(); ++i) {
    EXPECT_TRUE(at::isfinite(f[i]).all().item<bool>()) << names[i] << ", a query with no visible key";
    EXPECT_LT(MaxRelError(f[i], e[i]), 1e-5) << names[i] << ", a query with no visible key";
  }
  // Its output: each head the mean of its KV head's values over every key.
  const at::Tensor mean_values = inputs[2][1].mean(1).repeat_interleave(nH / nKV, 0).reshape({nH * D});
  EXPECT_LT(MaxRelError(f[0][1][0], mean_values), 1e-5) << "a query with no visible key: not the values' mean";
}

}  // namespace
}  // namespace ferry::runtime
