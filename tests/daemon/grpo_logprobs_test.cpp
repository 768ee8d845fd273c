// Per-token log-probabilities and entropies: the logits path and the chunked (fused LM head)
// path against TRL 1.16.0's own outputs and gradients (fixtures/grpo/), against each other,
// across chunk sizes, and their refusals.
#include "daemon/grpo/grpo_logprobs.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <string>

#include "tests/daemon/grpo_test_util.h"

namespace ferry::grpo {
namespace {

using ferry::testing::ExpectTensorNear;
using ferry::testing::GrpoCase;
using ferry::testing::GrpoCases;
using ferry::testing::ToleranceScale;

TEST(GrpoLogProbsFixtureTest, FromLogitsEqualsTrlSelectiveLogSoftmaxAndEntropyWithGradients) {
  for (const GrpoCase* c : GrpoCases("logprobs_logits")) {
    SCOPED_TRACE(c->name);
    const at::Tensor logits = c->tensor("logits").clone().requires_grad_(true);
    const at::Tensor mask = c->has("mask") ? c->tensor("mask") : at::Tensor();
    auto r = TokenLogProbsFromLogits(logits, c->tensor("index"), c->config.at("temperature").get<double>(), mask);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ExpectTensorNear(r->logps, c->tensor("logps"), c->name + " logps");
    ExpectTensorNear(r->entropy, c->tensor("entropy"), c->name + " entropy");
    torch::autograd::backward({r->logps, r->entropy}, {c->tensor("grad_logps"), c->tensor("grad_entropy")});
    ExpectTensorNear(logits.grad(), c->tensor("grad_logits"), c->name + " d / d logits");
  }
}

TEST(GrpoLogProbsFixtureTest, FromHiddenEqualsTrlFusedLmHeadWithGradients) {
  for (const GrpoCase* c : GrpoCases("logprobs_fused")) {
    SCOPED_TRACE(c->name);
    const int64_t p = c->config.at("prompt_length").get<int64_t>();
    const int64_t t = c->config.at("completion_length").get<int64_t>();
    const at::Tensor hidden = c->tensor("hidden").clone().requires_grad_(true);
    const at::Tensor weight = c->tensor("weight").clone().requires_grad_(true);
    const at::Tensor bias = c->has("bias") ? c->tensor("bias").clone().requires_grad_(true) : at::Tensor();
    ChunkedLogProbOptions o;
    o.temperature = c->config.at("temperature").get<double>();
    o.token_chunk = c->config.at("token_chunk").get<int64_t>();
    o.vocab_chunk = c->config.at("vocab_chunk").get<int64_t>();
    // Position P - 1 + j predicts completion token j.
    auto r = TokenLogProbsFromHidden(hidden.slice(1, p - 1, p + t - 1), weight, bias,
                                     c->tensor("input_ids").slice(1, p, p + t),
                                     c->tensor("attention_mask").slice(1, p, p + t), o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ExpectTensorNear(r->logps, c->tensor("logps"), c->name + " logps");
    ExpectTensorNear(r->entropy, c->tensor("entropy"), c->name + " entropy");
    torch::autograd::backward({r->logps, r->entropy}, {c->tensor("grad_logps"), c->tensor("grad_entropy")});
    // TRL's head accumulates these in fp32 whatever the dtype; on these cases its own values are
    // up to 1.5e-6 from the exact (fp64) gradients, so two fp32 implementations (different BLAS)
    // are compared normwise.
    ExpectTensorNear(hidden.grad(), c->tensor("grad_hidden"), c->name + " d / d hidden", ToleranceScale::kTensor);
    ExpectTensorNear(weight.grad(), c->tensor("grad_weight"), c->name + " d / d weight", ToleranceScale::kTensor);
    if (bias.defined()) {
      ExpectTensorNear(bias.grad(), c->tensor("grad_bias"), c->name + " d / d bias", ToleranceScale::kTensor);
    }
  }
}

struct Problem {
  at::Tensor hidden;  // [B, T, H]
  at::Tensor weight;  // [V, H]
  at::Tensor bias;    // [V]
  at::Tensor ids;     // [B, T]
  at::Tensor mask;    // [B, T]
};

Problem MakeProblem(at::ScalarType dtype, int64_t b, int64_t t, int64_t h, int64_t v, uint64_t seed) {
  at::manual_seed(seed);
  Problem p;
  p.hidden = at::randn({b, t, h}, at::kDouble).to(dtype);
  p.weight = (at::randn({v, h}, at::kDouble) * 0.4).to(dtype);
  p.bias = (at::randn({v}, at::kDouble) * 0.3).to(dtype);
  p.ids = at::randint(0, v, {b, t}, at::kLong);
  p.mask = at::ones({b, t}, at::kLong);
  p.mask[0].slice(0, t - 2).fill_(0);
  p.ids[0][t - 1] = -100;  // TRL's ignore label at a padded position is fine
  return p;
}

TEST(GrpoLogProbsTest, ChunkedHeadEqualsTheLogitsPathAndItsGradients) {
  const Problem p = MakeProblem(at::kFloat, 3, 11, 24, 301, 7);
  const double temperature = 0.8;
  const at::Tensor h1 = p.hidden.clone().requires_grad_(true);
  const at::Tensor w1 = p.weight.clone().requires_grad_(true);
  const at::Tensor b1 = p.bias.clone().requires_grad_(true);
  auto full = TokenLogProbsFromLogits(at::matmul(h1, w1.t()) + b1, p.ids, temperature, p.mask);
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  const at::Tensor h2 = p.hidden.clone().requires_grad_(true);
  const at::Tensor w2 = p.weight.clone().requires_grad_(true);
  const at::Tensor b2 = p.bias.clone().requires_grad_(true);
  ChunkedLogProbOptions o;
  o.temperature = temperature;
  o.token_chunk = 5;   // 33 tokens: 7 tiles, the last partial
  o.vocab_chunk = 64;  // 301 columns: 5 chunks, the last partial
  auto chunked = TokenLogProbsFromHidden(h2, w2, b2, p.ids, p.mask, o);
  ASSERT_TRUE(chunked.ok()) << chunked.status().ToString();
  EXPECT_TRUE(at::allclose(chunked->logps, full->logps, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(chunked->entropy, full->entropy, 1e-5, 1e-5));
  EXPECT_EQ(chunked->logps[0][10].item<float>(), 0.0f);  // padding
  EXPECT_EQ(chunked->entropy[0][9].item<float>(), 0.0f);
  const at::Tensor g1 = at::randn({3, 11});
  const at::Tensor g2 = at::randn({3, 11});
  torch::autograd::backward({full->logps, full->entropy}, {g1, g2});
  torch::autograd::backward({chunked->logps, chunked->entropy}, {g1, g2});
  EXPECT_TRUE(at::allclose(h2.grad(), h1.grad(), 1e-4, 1e-5)) << (h2.grad() - h1.grad()).abs().max();
  EXPECT_TRUE(at::allclose(w2.grad(), w1.grad(), 1e-4, 1e-5)) << (w2.grad() - w1.grad()).abs().max();
  EXPECT_TRUE(at::allclose(b2.grad(), b1.grad(), 1e-4, 1e-5)) << (b2.grad() - b1.grad()).abs().max();
  EXPECT_EQ(h2.grad()[0][10].abs().max().item<float>(), 0.0f);  // padding takes no gradient
}

TEST(GrpoLogProbsTest, ChunkSizesChangeOnlyRounding) {
  const Problem p = MakeProblem(at::kDouble, 2, 9, 16, 97, 11);
  ChunkedLogProbOptions whole;
  auto a = TokenLogProbsFromHidden(p.hidden, p.weight, p.bias, p.ids, p.mask, whole);
  ChunkedLogProbOptions tiny;
  tiny.token_chunk = 1;
  tiny.vocab_chunk = 1;
  auto b = TokenLogProbsFromHidden(p.hidden, p.weight, p.bias, p.ids, p.mask, tiny);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->logps.scalar_type(), at::kFloat);  // fp32 statistics, as TRL's head
  EXPECT_TRUE(at::allclose(a->logps, b->logps, 1e-6, 1e-6));
  EXPECT_TRUE(at::allclose(a->entropy, b->entropy, 1e-6, 1e-6));
}

TEST(GrpoLogProbsTest, SixteenBitInputsWork) {
  const Problem p = MakeProblem(at::kBFloat16, 2, 4, 8, 50, 3);
  auto hidden_path = TokenLogProbsFromHidden(p.hidden, p.weight, at::Tensor(), p.ids, p.mask, {});
  ASSERT_TRUE(hidden_path.ok()) << hidden_path.status().ToString();
  auto logits_path = TokenLogProbsFromLogits(at::matmul(p.hidden, p.weight.t()), p.ids, 1.0, p.mask);
  ASSERT_TRUE(logits_path.ok()) << logits_path.status().ToString();
  EXPECT_EQ(logits_path->logps.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::allclose(hidden_path->logps, logits_path->logps.to(at::kFloat), 0.05, 0.05));
}

TEST(GrpoLogProbsTest, BadInputsAreRefusedNamingThem) {
  const Problem p = MakeProblem(at::kFloat, 2, 4, 8, 50, 5);
  at::Tensor ids = p.ids.clone();
  ids[1][2] = 50;
  auto out_of_vocab = TokenLogProbsFromHidden(p.hidden, p.weight, p.bias, ids, p.mask, {});
  EXPECT_EQ(out_of_vocab.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(out_of_vocab.status().message().find("token_ids[1, 2] = 50 is outside the vocabulary [0, 50)"),
            std::string::npos)
      << out_of_vocab.status().message();
  auto logits_vocab = TokenLogProbsFromLogits(at::zeros({2, 4, 50}), ids, 1.0, p.mask);
  EXPECT_NE(logits_vocab.status().message().find("token_ids[1, 2] = 50"), std::string::npos);
  auto weight = TokenLogProbsFromHidden(p.hidden, p.weight.t(), at::Tensor(), p.ids, p.mask, {});
  EXPECT_EQ(weight.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(weight.status().message().find("weight must be [V, 8]"), std::string::npos) << weight.status().message();
  auto bias = TokenLogProbsFromHidden(p.hidden, p.weight, at::zeros({49}), p.ids, p.mask, {});
  EXPECT_NE(bias.status().message().find("bias must be [50], got [49]"), std::string::npos);
  ChunkedLogProbOptions zero;
  zero.vocab_chunk = 0;
  EXPECT_EQ(TokenLogProbsFromHidden(p.hidden, p.weight, p.bias, p.ids, p.mask, zero).status().code(),
            StatusCode::kInvalidArgument);
  ChunkedLogProbOptions cold;
  cold.temperature = 0;
  auto t0 = TokenLogProbsFromHidden(p.hidden, p.weight, p.bias, p.ids, p.mask, cold);
  EXPECT_NE(t0.status().message().find("temperature must be positive"), std::string::npos);
  auto float_ids = TokenLogProbsFromLogits(at::zeros({2, 4, 50}), p.ids.to(at::kFloat), 1.0);
  EXPECT_NE(float_ids.status().message().find("token_ids must be an integer tensor"), std::string::npos);
  auto mask = TokenLogProbsFromLogits(at::zeros({2, 4, 50}), p.ids.clamp_min(0), 1.0, at::ones({2, 5}));
  EXPECT_NE(mask.status().message().find("mask must be [2, 4], got [2, 5]"), std::string::npos);
}

TEST(GrpoLogProbsTest, SameNumbersOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device (this LibTorch or machine)";
  const Problem p = MakeProblem(at::kFloat, 3, 7, 16, 120, 13);
  ChunkedLogProbOptions o;
  o.vocab_chunk = 32;
  auto cpu = TokenLogProbsFromHidden(p.hidden, p.weight, p.bias, p.ids, p.mask, o);
  auto gpu = TokenLogProbsFromHidden(p.hidden.cuda(), p.weight.cuda(), p.bias.cuda(), p.ids.cuda(), p.mask.cuda(), o);
  ASSERT_TRUE(cpu.ok() && gpu.ok());
  EXPECT_TRUE(at::allclose(gpu->logps.cpu(), cpu->logps, 1e-5, 1e-5));
  EXPECT_TRUE(at::allclose(gpu->entropy.cpu(), cpu->entropy, 1e-5, 1e-5));
}

}  // namespace
}  // namespace ferry::grpo
