// PromptLogProbs (daemon/runtime/prompt_logprobs.h) against transformers: for every F32 case of
// fixtures/runtime/cases.json (the model, with its PEFT adapter where the case has one), the
// expected prompt log-probabilities are derived from the transformers logits the fixture stores
// (log_softmax in F64 of logits[b, t], gathered at input_ids[b, t + 1]) and compared with the
// runtime's, for the fixture's two 20-token rows and for prefixes of them batched together (the
// logits of a prefix are the same positions' logits: attention is causal).
//
// Tolerance: the fixture holds the runtime's F32 logits within 1e-4 (max abs) of transformers';
// log_softmax(l)[i] = l[i] - logsumexp(l), and logsumexp moves by at most the largest change of
// any logit, so a log-probability moves by at most 2e-4.
// The 16-bit cases are left out: this function runs them in F32, and their stored logits are
// transformers' BF16/F16 ones (0.15-1.0 apart from an F32 forward), no test of F32 values.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "core/status.h"
#include "daemon/runtime/lora.h"
#include "daemon/runtime/model.h"
#include "daemon/runtime/prompt_logprobs.h"
#include "daemon/runtime/torch_util.h"

namespace ferry::runtime {
namespace {

namespace fs = std::filesystem;

constexpr double kLogitsTolerance = 1e-4;                   // cases.json logits_tolerance of F32 cases
constexpr double kLogProbTolerance = 2 * kLogitsTolerance;  // see the top of this file
// The same sequences in other batch shapes: other GEMM paths (kernels/skinny_gemm.h loops for a few
// rows, the BLAS for more) round differently; measured up to 2.3e-5 on log-probabilities near -15.
constexpr double kBatchingTolerance = 1e-4;

fs::path RuntimeFixtures() { return fs::path(FERRY_FIXTURES_DIR) / "runtime"; }

nlohmann::json LoadCases() {
  std::ifstream in(RuntimeFixtures() / "cases.json");
  if (!in) return nlohmann::json::object();
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

std::vector<std::string> F32CaseNames() {
  std::vector<std::string> names;
  const nlohmann::json cases = LoadCases();
  if (!cases.contains("cases")) return {"cases_json_unreadable"};
  for (const auto& c : cases["cases"]) {
    if (c.at("dtype") == "F32") names.push_back(c.at("name").get<std::string>());
  }
  return names;
}

// One tensor of an expected file, as an owned CPU copy.
Result<at::Tensor> ReadExpected(const fs::path& file, const std::string& name) {
  FERRY_ASSIGN_OR_RETURN(auto st, SafetensorsFile::Open(file));
  for (const auto& info : st->tensors()) {
    if (info.name != name) continue;
    FERRY_ASSIGN_OR_RETURN(at::Tensor t, ToTorch(st->View(info), at::kCPU));
    return t.clone();
  }
  return Status::NotFound(file.string() + ": no tensor " + name);
}

std::vector<int64_t> Row(const at::Tensor& ids, int64_t b, int64_t len) {
  std::vector<int64_t> out;
  for (int64_t t = 0; t < len; ++t) out.push_back(ids[b][t].item<int64_t>());
  return out;
}

class PromptLogProbsReferenceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const nlohmann::json cases = LoadCases();
    ASSERT_TRUE(cases.contains("cases")) << RuntimeFixtures() / "cases.json";
    for (const auto& c : cases["cases"]) {
      if (c.at("name") == GetParam()) case_ = c;
    }
    ASSERT_FALSE(case_.is_null()) << GetParam();
    ASSERT_EQ(case_.at("logits_tolerance").get<double>(), kLogitsTolerance) << GetParam();
    ModelOptions options;
    options.dtype = at::kFloat;
    auto m = CausalLM::Load(RuntimeFixtures() / case_.at("model_dir").get<std::string>(), options);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(*m);
    if (!case_.at("adapter_dir").is_null()) {
      auto a = LoraAdapter::Load(*model_, RuntimeFixtures() / case_.at("adapter_dir").get<std::string>());
      ASSERT_TRUE(a.ok()) << a.status().ToString();
      adapter_ = std::move(*a);
    }
    const fs::path expected = RuntimeFixtures() / case_.at("expected").get<std::string>();
    auto ids = ReadExpected(expected, "input_ids");
    ASSERT_TRUE(ids.ok()) << ids.status().ToString();
    auto logits = ReadExpected(expected, "logits");
    ASSERT_TRUE(logits.ok()) << logits.status().ToString();
    ids_ = *ids;
    // want_[b, t] = log p(ids[b, t + 1] | ids[b, <= t]) under transformers' logits.
    const int64_t T = ids_.size(1);
    want_ = at::log_softmax(logits->to(at::kDouble).narrow(1, 0, T - 1), -1)
                .gather(2, ids_.narrow(1, 1, T - 1).unsqueeze(2))
                .squeeze(2);
  }

  const LoraBinding* Lora() const { return adapter_ ? &adapter_->binding() : nullptr; }

  // Max |got - want| over sequence i, taken from row `row` of the fixture.
  double MaxDiff(const std::vector<float>& got, int64_t row) const {
    double worst = 0;
    for (size_t t = 0; t < got.size(); ++t) {
      worst =
          std::max(worst, std::abs(static_cast<double>(got[t]) - want_[row][static_cast<int64_t>(t)].item<double>()));
    }
    return worst;
  }

  nlohmann::json case_;
  std::unique_ptr<CausalLM> model_;
  std::unique_ptr<LoraAdapter> adapter_;
  at::Tensor ids_;   // long [2, 20]
  at::Tensor want_;  // double [2, 19]
};

TEST_P(PromptLogProbsReferenceTest, EqualsLogSoftmaxOfTransformersLogits) {
  const int64_t T = ids_.size(1);
  // Two full rows, then prefixes of both: four lengths in one call.
  const std::vector<std::vector<int64_t>> seqs = {Row(ids_, 0, T), Row(ids_, 1, T), Row(ids_, 1, 7), Row(ids_, 0, 2)};
  const std::vector<int64_t> from_row = {0, 1, 1, 0};
  auto got = PromptLogProbs(*model_, Lora(), seqs);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), seqs.size());
  double worst = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    ASSERT_EQ((*got)[i].size(), seqs[i].size() - 1) << "sequence " << i;
    const double d = MaxDiff((*got)[i], from_row[i]);
    worst = std::max(worst, d);
    EXPECT_LE(d, kLogProbTolerance) << GetParam() << " sequence " << i;
    for (float v : (*got)[i]) EXPECT_LE(v, 0.0f);
  }
  RecordProperty("max_abs_diff", std::to_string(worst));

  // Every sequence alone, and tiny batches and LM-head tiles: the same values.
  PromptLogProbsOptions tiny;
  tiny.max_batch_tokens = 1;
  tiny.logits_rows = 3;
  auto tiled = PromptLogProbs(*model_, Lora(), seqs, tiny);
  ASSERT_TRUE(tiled.ok()) << tiled.status().ToString();
  for (size_t i = 0; i < seqs.size(); ++i) {
    auto alone = PromptLogProbs(*model_, Lora(), {seqs[i]});
    ASSERT_TRUE(alone.ok()) << alone.status().ToString();
    for (size_t t = 0; t < (*got)[i].size(); ++t) {
      EXPECT_NEAR((*alone)[0][t], (*got)[i][t], kBatchingTolerance) << "sequence " << i << " token " << t + 1;
      EXPECT_NEAR((*tiled)[i][t], (*got)[i][t], kBatchingTolerance) << "sequence " << i << " token " << t + 1;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PromptLogProbsReferenceTest, ::testing::ValuesIn(F32CaseNames()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

class PromptLogProbsErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = CausalLM::Load(RuntimeFixtures() / "models" / "llama_f32", {});
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(*m);
  }

  std::unique_ptr<CausalLM> model_;
};

TEST_F(PromptLogProbsErrorTest, IdOutsideTheVocabularyNamesSequenceAndToken) {
  const int64_t vocab = model_->config().vocab_size;
  auto r = PromptLogProbs(*model_, nullptr, {{5, 6, 7}, {5, vocab, 7}});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "sequence 1, token 1: id " + std::to_string(vocab) +
                                      " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  r = PromptLogProbs(*model_, nullptr, {{5, 6, -1}});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("sequence 0, token 2: id -1"), std::string::npos) << r.status().ToString();
}

TEST_F(PromptLogProbsErrorTest, TooShortSequenceNamesIt) {
  auto r = PromptLogProbs(*model_, nullptr, {{5, 6}, {7}});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("sequence 1 has 1 token(s)"), std::string::npos) << r.status().ToString();
  r = PromptLogProbs(*model_, nullptr, {{}});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("sequence 0 has 0 token(s)"), std::string::npos) << r.status().ToString();
  r = PromptLogProbs(*model_, nullptr, {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

TEST_F(PromptLogProbsErrorTest, LongerThanMaxPositionEmbeddingsNamesIt) {
  const int64_t max = model_->config().max_position_embeddings;
  auto r = PromptLogProbs(*model_, nullptr, {{5, 6}, std::vector<int64_t>(static_cast<size_t>(max) + 1, 5)});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("sequence 1 has " + std::to_string(max + 1) +
                                      " tokens, more than max_position_embeddings " + std::to_string(max)),
            std::string::npos)
      << r.status().ToString();
}

TEST_F(PromptLogProbsErrorTest, BadOptionsAreRefused) {
  PromptLogProbsOptions o;
  o.logits_rows = 0;
  auto r = PromptLogProbs(*model_, nullptr, {{5, 6}}, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry::runtime
