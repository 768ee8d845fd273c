// GRPO maths against TRL 1.16.0's own outputs (fixtures/grpo/) and on hand-checkable inputs:
// rewards and advantages, the generator/trainer mismatch correction, the four clipped losses.
#include "daemon/grpo/grpo_math.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <tuple>

#include "tests/daemon/grpo_test_util.h"

namespace ferry::grpo {
namespace {

// A TRL fixture's spelling of a setting, as the run config reads it (daemon/run/config.h).
template <typename E>
Result<E> ParseSpelling(const std::string& s) {
  if (std::optional<E> v = run::FromName<E>(s)) return *v;
  return Status::InvalidArgument("\"" + s + "\" is not a spelling of the setting");
}

using ferry::testing::ExpectMetricsNear;
using ferry::testing::ExpectTensorNear;
using ferry::testing::GrpoCase;
using ferry::testing::GrpoCases;
using ferry::testing::OptionalNumber;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

at::Tensor F64(std::vector<double> v, std::vector<int64_t> shape) {
  return at::tensor(v, at::kDouble).view(shape).clone();
}
at::Tensor I64(std::vector<int64_t> v, std::vector<int64_t> shape) {
  return at::tensor(v, at::kLong).view(shape).clone();
}

// ------------------------------------------------------------------------------------ TRL fixture

void CheckRewardsCase(const GrpoCase& c, const at::Device& device) {
  AdvantageOptions o;
  o.num_generations = c.config.at("num_generations").get<int64_t>();
  auto scale = ParseSpelling<ScaleRewards>(c.config.at("scale_rewards").get<std::string>());
  ASSERT_TRUE(scale.ok()) << scale.status().ToString();
  o.scale_rewards = *scale;
  o.reward_weights = c.config.at("reward_weights").get<std::vector<double>>();
  o.reward_names = c.config.at("reward_names").get<std::vector<std::string>>();
  auto r = ComputeAdvantages(c.tensor("rewards_per_func").to(device), o);
  ASSERT_TRUE(r.ok()) << c.name << ": " << r.status().ToString();
  EXPECT_EQ(r->advantages.device(), device);
  ExpectTensorNear(r->rewards, c.tensor("rewards"), c.name + " rewards");
  ExpectTensorNear(r->advantages, c.tensor("advantages"), c.name + " advantages");
  ExpectMetricsNear(r->metrics, c.metrics, c.name);
}

MismatchOptions MismatchOptionsOf(const nlohmann::json& config, const std::string& mode_key) {
  MismatchOptions o;
  auto mode = ParseSpelling<MismatchMode>(config.at(mode_key).get<std::string>());
  EXPECT_TRUE(mode.ok()) << mode.status().ToString();
  if (mode.ok()) o.mode = *mode;
  o.clip_min = OptionalNumber(config.at("clip_min"));
  o.clip_max = OptionalNumber(config.at("clip_max"));
  return o;
}

void CheckMismatchCase(const GrpoCase& c, const at::Device& device) {
  auto r = ComputeMismatchCorrection(c.tensor("old_per_token_logps").to(device),
                                     c.tensor("sampling_per_token_logps").to(device),
                                     c.tensor("completion_mask").to(device), MismatchOptionsOf(c.config, "mode"));
  ASSERT_TRUE(r.ok()) << c.name << ": " << r.status().ToString();
  EXPECT_EQ(r->ratio.device(), device);
  ExpectTensorNear(r->ratio, c.tensor("importance_sampling_ratio"), c.name + " ratio");
  ExpectMetricsNear(r->metrics, c.metrics, c.name);
}

void CheckLossCase(const GrpoCase& c, const at::Device& device) {
  const nlohmann::json& k = c.config;
  LossOptions o;
  auto type = ParseSpelling<LossType>(k.at("loss_type").get<std::string>());
  auto level = ParseSpelling<ImportanceSamplingLevel>(k.at("importance_sampling_level").get<std::string>());
  ASSERT_TRUE(type.ok() && level.ok());
  o.loss_type = *type;
  o.importance_sampling_level = *level;
  o.beta = k.at("beta").get<double>();
  o.epsilon = k.at("epsilon").get<double>();
  o.epsilon_high = OptionalNumber(k.at("epsilon_high"));
  o.delta = OptionalNumber(k.at("delta"));
  o.use_bias_correction_kl = k.at("use_bias_correction_kl").get<bool>();
  o.max_completion_length = k.at("max_completion_length").get<int64_t>();
  o.gradient_accumulation_steps = k.at("gradient_accumulation_steps").get<int64_t>();
  o.steps_per_generation = k.at("steps_per_generation").get<int64_t>();
  o.training = k.at("training").get<bool>();

  LossInputs in;
  in.per_token_logps = c.tensor("per_token_logps").to(device).clone().requires_grad_(true);
  in.completion_mask = c.tensor("completion_mask").to(device);
  in.advantages = c.tensor("advantages").to(device);
  in.entropies = c.tensor("entropies").to(device);
  if (c.has("old_per_token_logps")) in.old_per_token_logps = c.tensor("old_per_token_logps").to(device);
  if (c.has("ref_per_token_logps")) in.ref_per_token_logps = c.tensor("ref_per_token_logps").to(device);
  in.num_items_in_batch = k.at("num_items_in_batch").get<int64_t>();
  if (!k.at("mismatch_mode").is_null()) {
    auto m = ComputeMismatchCorrection(in.old_per_token_logps, c.tensor("sampling_per_token_logps").to(device),
                                       in.completion_mask, MismatchOptionsOf(k, "mismatch_mode"));
    ASSERT_TRUE(m.ok()) << c.name << ": " << m.status().ToString();
    ExpectTensorNear(m->ratio, c.tensor("importance_sampling_ratio"), c.name + " ratio");
    ExpectMetricsNear(m->metrics, c.mismatch_metrics, c.name + " mismatch");
    in.importance_sampling_ratio = m->ratio;
  }
  auto r = ComputeLoss(in, o);
  ASSERT_TRUE(r.ok()) << c.name << ": " << r.status().ToString();
  ExpectTensorNear(r->loss, c.tensor("loss"), c.name + " loss");
  ExpectMetricsNear(r->metrics, c.metrics, c.name);
  r->loss.backward();
  ASSERT_TRUE(in.per_token_logps.grad().defined()) << c.name;
  ExpectTensorNear(in.per_token_logps.grad(), c.tensor("grad_per_token_logps"), c.name + " d loss / d logps");
}

TEST(GrpoFixtureTest, RewardsAndAdvantagesEqualTrl) {
  for (const GrpoCase* c : GrpoCases("rewards")) {
    SCOPED_TRACE(c->name);
    CheckRewardsCase(*c, at::kCPU);
  }
}

TEST(GrpoFixtureTest, MismatchCorrectionEqualsTrl) {
  std::set<std::string> modes;
  for (const GrpoCase* c : GrpoCases("mismatch")) {
    SCOPED_TRACE(c->name);
    modes.insert(c->config.at("mode").get<std::string>());
    CheckMismatchCase(*c, at::kCPU);
  }
  EXPECT_EQ(modes.size(), 4u);
}

TEST(GrpoFixtureTest, LossGradientAndMetricsEqualTrlForEveryCombination) {
  // loss_type x importance_sampling_level x beta on/off x mismatch on/off, each in fp32 and fp64.
  std::set<std::tuple<std::string, std::string, bool, bool, std::string>> seen;
  for (const GrpoCase* c : GrpoCases("loss")) {
    SCOPED_TRACE(c->name);
    seen.emplace(c->config.at("loss_type").get<std::string>(),
                 c->config.at("importance_sampling_level").get<std::string>(), c->config.at("beta").get<double>() != 0,
                 !c->config.at("mismatch_mode").is_null(), c->dtype);
    CheckLossCase(*c, at::kCPU);
  }
  EXPECT_EQ(seen.size(), 4u * 2u * 2u * 2u * 2u);
}

TEST(GrpoFixtureTest, SameNumbersOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device (this LibTorch or machine)";
  const at::Device cuda(at::kCUDA, 0);  // results carry the index: cuda:0, not "cuda"
  for (const GrpoCase* c : GrpoCases("rewards")) CheckRewardsCase(*c, cuda);
  for (const GrpoCase* c : GrpoCases("mismatch")) CheckMismatchCase(*c, cuda);
  for (const GrpoCase* c : GrpoCases("loss")) CheckLossCase(*c, cuda);
}

// ------------------------------------------------------------------------------------ advantages

TEST(GrpoAdvantagesTest, ZeroStdGroupGetsZeroAdvantageAndCountsInFracRewardZeroStd) {
  // Two groups of 3: the first all 1.0, the second 0, 1, 2 (mean 1, Bessel std 1).
  AdvantageOptions o;
  o.num_generations = 3;
  o.reward_names = {"acc"};
  auto r = ComputeAdvantages(F64({1, 1, 1, 0, 1, 2}, {6, 1}), o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const double s = 1.0 + 1e-4;
  ExpectTensorNear(r->advantages, F64({0, 0, 0, -1 / s, 0, 1 / s}, {6}), "advantages");
  EXPECT_DOUBLE_EQ(r->metrics.at("frac_reward_zero_std"), 0.5);
  EXPECT_DOUBLE_EQ(r->metrics.at("reward"), 1.0);
  // Squared deviations 0 0 0 1 0 1: 2 / 6 times Bessel's 6 / 5 (an fp32 number in TRL).
  EXPECT_NEAR(r->metrics.at("reward_std"), std::sqrt(0.4), 1e-7);
  EXPECT_DOUBLE_EQ(r->metrics.at("rewards/acc/mean"), 1.0);
}

TEST(GrpoAdvantagesTest, UnscorableCompletionIsLeftOutOfItsGroupAndGetsZero) {
  // Group of 3: 1, 3 and one completion no function scored. Mean 2, std sqrt(2).
  AdvantageOptions o;
  o.num_generations = 3;
  o.reward_weights = {1.0, 0.5};
  o.reward_names = {"a", "b"};
  auto r = ComputeAdvantages(F64({1, kNaN, kNaN, 6, kNaN, kNaN}, {3, 2}), o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rewards[0].item<double>(), 1.0);
  EXPECT_EQ(r->rewards[1].item<double>(), 3.0);  // NaN * 1 skipped, 6 * 0.5
  EXPECT_TRUE(std::isnan(r->rewards[2].item<double>()));
  const double s = std::sqrt(2.0) + 1e-4;
  ExpectTensorNear(r->advantages, F64({-1 / s, 1 / s, 0}, {3}), "advantages");
  EXPECT_DOUBLE_EQ(r->metrics.at("rewards/a/mean"), 1.0);
  EXPECT_TRUE(std::isnan(r->metrics.at("rewards/a/std")));  // one value
  EXPECT_DOUBLE_EQ(r->metrics.at("rewards/b/mean"), 6.0);
  EXPECT_DOUBLE_EQ(r->metrics.at("reward"), 2.0);
  EXPECT_DOUBLE_EQ(r->metrics.at("frac_reward_zero_std"), 0.0);
}

TEST(GrpoAdvantagesTest, ScaleNoneSubtractsTheGroupMeanAndBatchDividesByTheBatchStd) {
  AdvantageOptions o;
  o.num_generations = 2;
  o.reward_names = {"r"};
  o.scale_rewards = ScaleRewards::kNone;
  const at::Tensor rewards = F64({0, 2, 5, 5}, {4, 1});
  auto none = ComputeAdvantages(rewards, o);
  ASSERT_TRUE(none.ok());
  ExpectTensorNear(none->advantages, F64({-1, 1, 0, 0}, {4}), "none");
  EXPECT_DOUBLE_EQ(none->metrics.at("frac_reward_zero_std"), 0.5);  // the 5, 5 group still counts
  o.scale_rewards = ScaleRewards::kBatch;
  auto batch = ComputeAdvantages(rewards, o);
  ASSERT_TRUE(batch.ok());
  // Batch mean 3, deviations -3 -1 2 2: variance 18/3 = 6.
  const double s = std::sqrt(6.0) + 1e-4;
  ExpectTensorNear(batch->advantages, F64({-1 / s, 1 / s, 0, 0}, {4}), "batch");
  EXPECT_DOUBLE_EQ(batch->metrics.at("frac_reward_zero_std"), 0.0);
}

TEST(GrpoAdvantagesTest, OneGenerationPerPromptHasZeroStd) {
  AdvantageOptions o;
  o.num_generations = 1;
  o.reward_names = {"r"};
  auto r = ComputeAdvantages(F64({0.5, 2}, {2, 1}), o);
  ASSERT_TRUE(r.ok());
  ExpectTensorNear(r->advantages, F64({0, 0}, {2}), "advantages");
  EXPECT_DOUBLE_EQ(r->metrics.at("frac_reward_zero_std"), 1.0);
}

TEST(GrpoAdvantagesTest, BadInputsAreRefused) {
  AdvantageOptions o;
  o.num_generations = 4;
  o.reward_names = {"r"};
  auto ragged = ComputeAdvantages(F64({1, 2, 3, 4, 5, 6}, {6, 1}), o);
  EXPECT_EQ(ragged.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(ragged.status().message().find("num_generations 4"), std::string::npos) << ragged.status().message();
  o.num_generations = 2;
  auto names = ComputeAdvantages(F64({1, 2, 3, 4}, {2, 2}), o);
  EXPECT_EQ(names.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(names.status().message().find("reward_names"), std::string::npos) << names.status().message();
  o.reward_names = {"a", "b"};
  o.reward_weights = {1.0};
  auto weights = ComputeAdvantages(F64({1, 2, 3, 4}, {2, 2}), o);
  EXPECT_EQ(weights.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(weights.status().message().find("reward_weights"), std::string::npos) << weights.status().message();
  o.reward_weights.clear();
  auto ints = ComputeAdvantages(I64({1, 2, 3, 4}, {2, 2}), o);
  EXPECT_EQ(ints.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(ints.status().message().find("rewards_per_func must be a floating tensor"), std::string::npos);
  auto flat = ComputeAdvantages(F64({1, 2}, {2}), o);
  EXPECT_EQ(flat.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(flat.status().message().find("[N, F]"), std::string::npos);
}

TEST(GrpoAdvantagesTest, NanStdIsBesselCorrectedAndNanBelowTwoValues) {
  EXPECT_DOUBLE_EQ(NanStd(F64({1, kNaN, 3}, {3}), std::nullopt).item<double>(), std::sqrt(2.0));
  EXPECT_TRUE(std::isnan(NanStd(F64({kNaN, 3}, {2}), std::nullopt).item<double>()));
  const at::Tensor rows = NanStd(F64({0, 2, 4, 4}, {2, 2}), 1);
  EXPECT_DOUBLE_EQ(rows[0].item<double>(), std::sqrt(2.0));
  EXPECT_DOUBLE_EQ(rows[1].item<double>(), 0.0);
}

// ------------------------------------------------------------------------------------ mismatch

TEST(GrpoMismatchTest, SequenceMaskZeroesSequencesOutsideTheBoundsAndTokenTruncateClamps) {
  // Per-token differences old - sampling; row 1's last token is padding (ignored).
  const at::Tensor old = F64({0.5, 0.7, -1.0, 0.0}, {2, 2});
  const at::Tensor sampling = F64({0.0, 0.0, -1.1, 9.0}, {2, 2});
  const at::Tensor mask = I64({1, 1, 1, 0}, {2, 2});
  MismatchOptions o;  // sequence_mask, max 3
  auto seq = ComputeMismatchCorrection(old, sampling, mask, o);
  ASSERT_TRUE(seq.ok()) << seq.status().ToString();
  // Row 0: exp(1.2) = 3.32 > 3 -> 0. Row 1: exp(0.1).
  ExpectTensorNear(seq->ratio, F64({0, std::exp(0.1)}, {2, 1}), "sequence_mask");
  EXPECT_DOUBLE_EQ(seq->metrics.at("sampling/importance_sampling_ratio/min"), 0.0);
  EXPECT_NEAR(seq->metrics.at("sampling/importance_sampling_ratio/mean"), std::exp(0.1) / 2, 1e-12);
  EXPECT_NEAR(seq->metrics.at("sampling/sampling_logp_difference/mean"), (0.5 + 0.7 + 0.1) / 3, 1e-12);
  EXPECT_NEAR(seq->metrics.at("sampling/sampling_logp_difference/max"), 0.7, 1e-12);
  o.mode = MismatchMode::kTokenTruncate;
  o.clip_min = 1.2;
  o.clip_max = 1.8;
  auto tok = ComputeMismatchCorrection(old, sampling, mask, o);
  ASSERT_TRUE(tok.ok());
  // exp(0.5) = 1.65, exp(0.7) = 2.01 -> 1.8, exp(0.1) = 1.105 -> 1.2, padding exp(0) -> 1.2.
  ExpectTensorNear(tok->ratio, F64({std::exp(0.5), 1.8, 1.2, 1.2}, {2, 2}), "token_truncate");
  EXPECT_DOUBLE_EQ(tok->metrics.at("sampling/importance_sampling_ratio/min"), 1.2);  // real tokens only
  EXPECT_DOUBLE_EQ(tok->metrics.at("sampling/importance_sampling_ratio/max"), 1.8);
}

TEST(GrpoMismatchTest, UnscoredSamplingTokenCountsAsNoDifference) {
  const at::Tensor old = F64({-1.0, -2.0}, {1, 2});
  const at::Tensor sampling = F64({kNaN, -2.5}, {1, 2});
  MismatchOptions o;
  o.mode = MismatchMode::kTokenMask;
  auto r = ComputeMismatchCorrection(old, sampling, I64({1, 1}, {1, 2}), o);
  ASSERT_TRUE(r.ok());
  ExpectTensorNear(r->ratio, F64({1.0, std::exp(0.5)}, {1, 2}), "ratio");
  EXPECT_DOUBLE_EQ(r->metrics.at("sampling/sampling_logp_difference/mean"), 0.5);  // the NaN one left out
}

TEST(GrpoMismatchTest, EmptyBatchReportsZeros) {
  const at::Tensor z = at::zeros({2, 3}, at::kDouble);
  MismatchOptions o;
  o.mode = MismatchMode::kTokenMask;
  auto r = ComputeMismatchCorrection(z, z, at::zeros({2, 3}, at::kLong), o);
  ASSERT_TRUE(r.ok());
  for (const auto& [name, value] : r->metrics) EXPECT_EQ(value, 0.0) << name;
}

TEST(GrpoMismatchTest, BadBoundsAndShapesAreRefused) {
  const at::Tensor x = at::zeros({2, 3}, at::kDouble);
  const at::Tensor m = at::ones({2, 3}, at::kLong);
  MismatchOptions o;
  o.mode = MismatchMode::kSequenceTruncate;
  o.clip_max.reset();
  auto none = ComputeMismatchCorrection(x, x, m, o);
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("sequence_truncate needs clip_min or clip_max"), std::string::npos);
  o.clip_min = 2.0;
  o.clip_max = 2.0;
  EXPECT_EQ(ComputeMismatchCorrection(x, x, m, o).status().code(), StatusCode::kInvalidArgument);
  auto shape = ComputeMismatchCorrection(x, at::zeros({2, 4}, at::kDouble), m, MismatchOptions{});
  EXPECT_EQ(shape.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(shape.status().message().find("sampling_per_token_logps must be [2, 3], got [2, 4]"), std::string::npos)
      << shape.status().message();
}

// ------------------------------------------------------------------------------------ loss

double LossOf(const LossInputs& in, const LossOptions& o) {
  auto r = ComputeLoss(in, o);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? r->loss.item<double>() : kNaN;
}

LossInputs OnPolicy(const at::Tensor& logps, const at::Tensor& mask, const at::Tensor& advantages) {
  LossInputs in;
  in.per_token_logps = logps.clone().requires_grad_(true);
  in.completion_mask = mask;
  in.advantages = advantages;
  in.entropies = at::ones_like(logps);
  return in;
}

TEST(GrpoLossTest, OnPolicyGrpoIsMinusTheMeanAdvantageAndItsGradientIsPerToken) {
  const at::Tensor mask = I64({1, 1, 0, 1, 1, 1}, {2, 3});
  LossInputs in = OnPolicy(F64({-1, -2, 7, -0.5, -0.1, -3}, {2, 3}), mask, F64({1, -2}, {2}));
  LossOptions o;
  o.loss_type = LossType::kGrpo;
  o.gradient_accumulation_steps = 2;
  auto r = ComputeLoss(in, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_NEAR(r->loss.item<double>(), -(1.0 - 2.0) / 2 / 2, 1e-15);
  r->loss.backward();
  // d/dlogp of -A * exp(logp - logp.detach()) averaged per sequence, then over 2 sequences, / 2.
  ExpectTensorNear(in.per_token_logps.grad(), F64({-0.125, -0.125, 0, 1.0 / 6, 1.0 / 6, 1.0 / 6}, {2, 3}), "grad");
  EXPECT_DOUBLE_EQ(r->metrics.at("clip_ratio/region_mean"), 0.0);
  EXPECT_DOUBLE_EQ(r->metrics.at("entropy"), 1.0);
  EXPECT_EQ(r->metrics.count("kl"), 0u);
}

TEST(GrpoLossTest, AggregationsDivideByTheirOwnNormalisers) {
  const at::Tensor mask = I64({1, 1, 0, 1, 1, 1}, {2, 3});
  // On-policy: per-token loss is -A; masked sum = -(1 * 2 + (-2) * 3) = 4 over 5 tokens.
  const LossInputs in = OnPolicy(at::zeros({2, 3}, at::kDouble), mask, F64({1, -2}, {2}));
  LossOptions o;
  o.gradient_accumulation_steps = 3;
  o.steps_per_generation = 4;
  o.max_completion_length = 10;
  LossInputs dapo_in = in;
  dapo_in.num_items_in_batch = 20;
  o.loss_type = LossType::kBnpo;
  EXPECT_NEAR(LossOf(in, o), 4.0 / 5 / 3, 1e-15);
  o.loss_type = LossType::kDrGrpo;
  EXPECT_NEAR(LossOf(in, o), 4.0 / (2 * 10) / 3, 1e-15);
  o.loss_type = LossType::kDapo;
  EXPECT_NEAR(LossOf(dapo_in, o), 4.0 / (20.0 * 3 / 4), 1e-15);
  o.training = false;  // eval: no accumulation terms
  EXPECT_NEAR(LossOf(dapo_in, o), 4.0 / 20, 1e-15);
  o.loss_type = LossType::kBnpo;
  EXPECT_NEAR(LossOf(in, o), 4.0 / 5, 1e-15);
}

TEST(GrpoLossTest, RatiosOutsideTheClipRangeStopTheGradientOnlyOnTheirSide) {
  // ratio 1.5 on every token; eps 0.2 / eps_high 0.28. A = +1: clipped at 1.28 (no gradient),
  // A = -1: min(-1.5, -1.28) = -1.5, unclipped (gradient 1.5 per token / 2 tokens / 2 rows).
  const at::Tensor logps = at::zeros({2, 2}, at::kDouble);
  LossInputs in = OnPolicy(logps, at::ones({2, 2}, at::kLong), F64({1, -1}, {2}));
  in.old_per_token_logps = at::full({2, 2}, -std::log(1.5), at::kDouble);
  LossOptions o;
  o.loss_type = LossType::kGrpo;
  o.epsilon_high = 0.28;
  auto r = ComputeLoss(in, o);
  ASSERT_TRUE(r.ok());
  EXPECT_NEAR(r->loss.item<double>(), (-1.28 + 1.5) / 2, 1e-12);
  r->loss.backward();
  ExpectTensorNear(in.per_token_logps.grad(), F64({0, 0, 0.375, 0.375}, {2, 2}), "grad");
  EXPECT_DOUBLE_EQ(r->metrics.at("clip_ratio/high_mean"), 0.5);
  EXPECT_DOUBLE_EQ(r->metrics.at("clip_ratio/high_max"), 1.0);
  EXPECT_DOUBLE_EQ(r->metrics.at("clip_ratio/low_mean"), 0.0);
  EXPECT_DOUBLE_EQ(r->metrics.at("clip_ratio/region_mean"), 0.5);
  // delta = 1.2 caps coef_1 (coef_2 stays clamp(1.5, 0.8, 1.28) = 1.28): A = +1 gives
  // -min(1.2, 1.28) = -1.2, A = -1 gives -min(-1.2, -1.28) = 1.28.
  o.delta = 1.2;
  auto d = ComputeLoss(in, o);
  ASSERT_TRUE(d.ok());
  EXPECT_NEAR(d->loss.item<double>(), (-1.2 + 1.28) / 2, 1e-12);
}

TEST(GrpoLossTest, KlIsK3TimesTheRatioAndAddsBetaTimesIt) {
  const at::Tensor logps = at::zeros({1, 2}, at::kDouble);
  LossInputs in = OnPolicy(logps, at::ones({1, 2}, at::kLong), F64({0}, {1}));
  in.ref_per_token_logps = F64({0.5, -0.5}, {1, 2});
  LossOptions o;
  o.loss_type = LossType::kBnpo;
  o.beta = 0.1;
  auto r = ComputeLoss(in, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const double kl = ((std::exp(0.5) - 0.5 - 1) + (std::exp(-0.5) + 0.5 - 1)) / 2;
  EXPECT_NEAR(r->metrics.at("kl"), kl, 1e-15);
  EXPECT_NEAR(r->loss.item<double>(), 0.1 * kl, 1e-15);
  // d/dlogp [k3 * exp(logp - logp.detach())] = -(exp(d) - 1) + k3 with d = ref - logp.
  r->loss.backward();
  const double g0 = 0.1 * (-(std::exp(0.5) - 1) + (std::exp(0.5) - 0.5 - 1)) / 2;
  EXPECT_NEAR(in.per_token_logps.grad()[0][0].item<double>(), g0, 1e-15);
}

TEST(GrpoLossTest, BoolAndLongMasksGiveTheSameLoss) {
  const at::Tensor logps = F64({-1, -2, -3, -0.5, -0.25, -4}, {2, 3});
  const at::Tensor mask = I64({1, 0, 0, 1, 1, 0}, {2, 3});
  LossInputs a = OnPolicy(logps, mask, F64({0.3, -1}, {2}));
  a.old_per_token_logps = logps - 0.3;
  LossInputs b = a;
  b.completion_mask = mask.to(at::kBool);
  LossOptions o;
  o.importance_sampling_level = ImportanceSamplingLevel::kSequence;
  a.num_items_in_batch = b.num_items_in_batch = 3;
  EXPECT_EQ(LossOf(a, o), LossOf(b, o));
}

TEST(GrpoLossTest, MissingOrMisshapenInputsAreRefusedNamingThem) {
  const at::Tensor logps = at::zeros({2, 3}, at::kDouble);
  const LossInputs good = OnPolicy(logps, at::ones({2, 3}, at::kLong), F64({1, 2}, {2}));
  LossOptions o;
  o.beta = 0.04;
  auto no_ref = ComputeLoss(good, o);
  EXPECT_EQ(no_ref.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_ref.status().message().find("ref_per_token_logps"), std::string::npos) << no_ref.status().message();
  o.beta = 0;
  LossInputs bad = good;
  bad.completion_mask = at::ones({3, 2}, at::kLong);
  auto mask = ComputeLoss(bad, o);
  EXPECT_EQ(mask.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(mask.status().message().find("completion_mask must be [2, 3], got [3, 2]"), std::string::npos);
  bad = good;
  bad.advantages = at::zeros({3}, at::kDouble);
  EXPECT_NE(ComputeLoss(bad, o).status().message().find("advantages must be [B], [B, 1] or [B, T]"), std::string::npos);
  bad = good;
  bad.importance_sampling_ratio = at::ones({2, 2}, at::kDouble);
  EXPECT_NE(ComputeLoss(bad, o).status().message().find("importance_sampling_ratio must be [2, 3] or [2, 1]"),
            std::string::npos);
  bad = good;
  bad.entropies = at::Tensor();
  EXPECT_NE(ComputeLoss(bad, o).status().message().find("entropies is undefined"), std::string::npos);
  o.gradient_accumulation_steps = 0;
  EXPECT_NE(ComputeLoss(good, o).status().message().find("gradient_accumulation_steps must be at least 1"),
            std::string::npos);
  o.gradient_accumulation_steps = 1;
  bad = good;
  bad.num_items_in_batch = -1;
  EXPECT_EQ(ComputeLoss(bad, o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry::grpo
