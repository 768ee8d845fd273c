// The KV-cache generator: greedy decoding equals argmax of the full forward, reported
// log-probabilities equal the full forward's, seeds reproduce, EOS / stop strings / lengths.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "daemon/runtime/generator.h"
#include "tests/daemon/runtime_test_util.h"
#include "tests/temp_dir.h"

namespace ferry::runtime {
namespace {

using ferry::testing::ScopedTempDir;
using ferry::testing::TinyModelSpec;

class GeneratorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(ferry::testing::WriteTinyModel(dir_.path() / "m", spec_).ok());
    auto m = CausalLM::Load(dir_.path() / "m", {});
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(*m);
  }
  // log p(ids[t] | ids[:t]) for t >= from, by one full forward.
  std::vector<float> FullLogprobs(const std::vector<int32_t>& ids, size_t from, double temperature = 1.0) {
    std::vector<int64_t> v(ids.begin(), ids.end());
    ForwardArgs a;
    a.input_ids = at::tensor(v, at::kLong).view({1, -1});
    a.positions = at::arange(static_cast<int64_t>(v.size()), at::kLong).view({1, -1});
    auto logits = model_->Forward(a);
    EXPECT_TRUE(logits.ok());
    at::Tensor lp = at::log_softmax(logits->to(at::kFloat)[0] / temperature, -1);
    std::vector<float> out;
    for (size_t t = from; t < ids.size(); ++t) out.push_back(lp[static_cast<int64_t>(t - 1)][v[t]].item<float>());
    return out;
  }

  ScopedTempDir dir_;
  TinyModelSpec spec_;
  std::unique_ptr<CausalLM> model_;
};

TEST_F(GeneratorTest, GreedyEqualsArgmaxOfTheFullForwardAndLogprobsAgree) {
  Generator gen(*model_, {});
  SamplingParams p;
  p.temperature = 0;
  p.max_new_tokens = 24;
  const std::vector<int32_t> prompt = {5, 17, 33, 8, 61};
  auto r = gen.Generate({prompt}, 1, p);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->size(), 1u);
  const Completion& c = (*r)[0];
  ASSERT_EQ(c.token_ids.size(), 24u);
  EXPECT_EQ(c.finish, Completion::Finish::kLength);
  // Re-derive each token by a full forward over prompt + tokens so far.
  std::vector<int32_t> seq = prompt;
  for (size_t t = 0; t < c.token_ids.size(); ++t) {
    std::vector<int64_t> v(seq.begin(), seq.end());
    ForwardArgs a;
    a.input_ids = at::tensor(v, at::kLong).view({1, -1});
    a.positions = at::arange(static_cast<int64_t>(v.size()), at::kLong).view({1, -1});
    auto logits = model_->Forward(a);
    ASSERT_TRUE(logits.ok());
    EXPECT_EQ((*logits)[0][-1].argmax().item<int64_t>(), c.token_ids[t]) << "step " << t;
    seq.push_back(c.token_ids[t]);
  }
  const std::vector<float> full = FullLogprobs(seq, prompt.size());
  for (size_t t = 0; t < full.size(); ++t) EXPECT_NEAR(c.logprobs[t], full[t], 1e-5) << "step " << t;
}

TEST_F(GeneratorTest, SampledLogprobsAreUnderTheTemperatureScaledDistributionAndSeedsReproduce) {
  Generator gen(*model_, {});
  SamplingParams p;
  p.temperature = 0.7;
  p.top_k = 20;
  p.top_p = 0.9;
  p.max_new_tokens = 16;
  p.seed = 42;
  const std::vector<std::vector<int32_t>> prompts = {{5, 17, 33}, {9, 4, 70, 71, 12, 3}};
  auto a = gen.Generate(prompts, 4, p);
  auto b = gen.Generate(prompts, 4, p);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->size(), 8u);
  bool differ_within_group = false;
  for (size_t i = 0; i < a->size(); ++i) {
    EXPECT_EQ((*a)[i].token_ids, (*b)[i].token_ids) << "completion " << i;
    EXPECT_EQ((*a)[i].prompt_index, i / 4);
    if (i % 4 && (*a)[i].token_ids != (*a)[i - 1].token_ids) differ_within_group = true;
    std::vector<int32_t> seq = prompts[i / 4];
    seq.insert(seq.end(), (*a)[i].token_ids.begin(), (*a)[i].token_ids.end());
    const std::vector<float> full = FullLogprobs(seq, prompts[i / 4].size(), 0.7);
    for (size_t t = 0; t < full.size(); ++t) EXPECT_NEAR((*a)[i].logprobs[t], full[t], 1e-5) << i << "/" << t;
  }
  EXPECT_TRUE(differ_within_group);
  p.seed = 43;
  auto c = gen.Generate(prompts, 4, p);
  ASSERT_TRUE(c.ok());
  bool any_diff = false;
  for (size_t i = 0; i < c->size(); ++i) any_diff = any_diff || (*c)[i].token_ids != (*a)[i].token_ids;
  EXPECT_TRUE(any_diff);
}

TEST_F(GeneratorTest, TopKOneIsGreedy) {
  Generator gen(*model_, {});
  SamplingParams greedy;
  greedy.temperature = 0;
  greedy.max_new_tokens = 12;
  SamplingParams k1 = greedy;
  k1.temperature = 1.3;
  k1.top_k = 1;
  k1.seed = 9;
  auto a = gen.Generate({{1, 2, 3}}, 1, greedy);
  auto b = gen.Generate({{1, 2, 3}}, 3, k1);
  ASSERT_TRUE(a.ok() && b.ok());
  for (const auto& c : *b) EXPECT_EQ(c.token_ids, (*a)[0].token_ids);
}

TEST_F(GeneratorTest, EosStopsARowAndIsKept) {
  Generator gen(*model_, {});
  SamplingParams p;
  p.temperature = 0;
  p.max_new_tokens = 20;
  auto free_run = gen.Generate({{5, 17, 33}}, 1, p);
  ASSERT_TRUE(free_run.ok());
  // Declare the 4th generated token an EOS: generation stops right after it.
  p.eos_token_ids = {(*free_run)[0].token_ids[3]};
  auto r = gen.Generate({{5, 17, 33}}, 1, p);
  ASSERT_TRUE(r.ok());
  const auto& want = (*free_run)[0].token_ids;
  const size_t first = static_cast<size_t>(std::find(want.begin(), want.end(), want[3]) - want.begin());
  EXPECT_EQ((*r)[0].token_ids, std::vector<int32_t>(want.begin(), want.begin() + static_cast<long>(first) + 1));
  EXPECT_EQ((*r)[0].finish, Completion::Finish::kEos);
}

TEST_F(GeneratorTest, StopStringsEndACompletionAcrossTokenBoundaries) {
  GeneratorOptions opts;
  opts.token_bytes = [](int32_t id) { return std::string(1, static_cast<char>('a' + id % 26)) + "|"; };
  Generator gen(*model_, opts);
  SamplingParams p;
  p.temperature = 0;
  p.max_new_tokens = 20;
  auto free_run = gen.Generate({{5, 17, 33}}, 1, p);
  ASSERT_TRUE(free_run.ok());
  const auto& t = (*free_run)[0].token_ids;
  // "x|y" spans tokens 5 and 6 ("x|" + "y|"): the completion ends with token 6.
  std::string stop = opts.token_bytes(t[5]) + opts.token_bytes(t[6]).substr(0, 1);
  p.stop_strings = {stop};
  auto r = gen.Generate({{5, 17, 33}}, 1, p);
  ASSERT_TRUE(r.ok());
  std::string text;
  size_t end = 0;
  for (size_t i = 0; i < t.size(); ++i) {
    text += opts.token_bytes(t[i]);
    if (text.find(stop) != std::string::npos) {
      end = i + 1;
      break;
    }
  }
  ASSERT_GT(end, 0u);
  EXPECT_EQ((*r)[0].token_ids, std::vector<int32_t>(t.begin(), t.begin() + static_cast<long>(end)));
  EXPECT_EQ((*r)[0].finish, Completion::Finish::kStop);
}

TEST_F(GeneratorTest, ABatchOfMixedLengthsEqualsEachPromptAlone) {
  GeneratorOptions small;
  small.max_batch = 1;
  Generator one(*model_, small);
  Generator many(*model_, {});
  SamplingParams p;
  p.temperature = 0;
  p.max_new_tokens = 10;
  const std::vector<std::vector<int32_t>> prompts = {{5}, {9, 4, 70, 71, 12, 3, 44, 45}, {7, 7, 7}};
  auto batched = many.Generate(prompts, 2, p);
  auto alone = one.Generate(prompts, 2, p);
  ASSERT_TRUE(batched.ok() && alone.ok());
  for (size_t i = 0; i < batched->size(); ++i) {
    EXPECT_EQ((*batched)[i].token_ids, (*alone)[i].token_ids) << i;
    for (size_t t = 0; t < (*batched)[i].logprobs.size(); ++t) {
      EXPECT_NEAR((*batched)[i].logprobs[t], (*alone)[i].logprobs[t], 1e-5);
    }
  }
}

TEST_F(GeneratorTest, BadRequestsAreRefused) {
  Generator gen(*model_, {});
  SamplingParams p;
  EXPECT_EQ(gen.Generate({{}}, 1, p).status().code(), StatusCode::kInvalidArgument);
  auto r = gen.Generate({{1, 96}}, 1, p);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("prompt 0: token id 96 is outside the vocabulary"), std::string::npos);
  p.top_p = 0;
  EXPECT_EQ(gen.Generate({{1}}, 1, p).status().code(), StatusCode::kInvalidArgument);
  p.top_p = 1;
  p.max_new_tokens = 5000;
  r = gen.Generate({{1}}, 1, p);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("exceed max_position_embeddings 4096"), std::string::npos);
  p.max_new_tokens = 4;
  p.stop_strings = {"x"};
  EXPECT_EQ(gen.Generate({{1}}, 1, p).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry::runtime
