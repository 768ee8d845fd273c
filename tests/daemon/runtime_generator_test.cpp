// The KV-cache generator: greedy decoding equals argmax of the full forward, reported
// log-probabilities equal the full forward's, seeds reproduce, EOS / stop strings / lengths.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "daemon/runtime/cuda_graph.h"
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

// The host looks at the tokens every finish_check_every steps (on CUDA, 16: the steps between
// run without waiting for the device), and each completion's draws are its own: the same
// completions, EOS and stop strings ending rows at different steps and the cache compacted at
// other times, whether it looks every step, every 5th or once at the end; whether the prompts
// are batched together or one by one; and with every step's shapes the same (static_shapes).
TEST_F(GeneratorTest, CompletionsAreTheSameWhateverTheLookCadenceAndTheBatching) {
  GeneratorOptions opts;
  opts.token_bytes = [](int32_t id) { return std::string(1, static_cast<char>('a' + id % 26)); };
  SamplingParams p;
  p.temperature = 0.9;
  p.max_new_tokens = 24;
  p.seed = 5;
  const std::vector<std::vector<int32_t>> prompts = {{5, 17, 33}, {9, 4, 70, 71, 12, 3}, {7}};
  // An EOS that occurs: the commonest token of a free run.
  opts.finish_check_every = 1;
  auto free_run = Generator(*model_, opts).Generate(prompts, 4, p);
  ASSERT_TRUE(free_run.ok()) << free_run.status().ToString();
  std::map<int32_t, int> counts;
  for (const Completion& c : *free_run) {
    for (int32_t t : c.token_ids) ++counts[t];
  }
  const auto commonest =
      std::max_element(counts.begin(), counts.end(), [](const auto& x, const auto& y) { return x.second < y.second; });
  p.eos_token_ids = {commonest->first};
  p.stop_strings = {"ab", "zz"};

  auto run = [&](int64_t every, int64_t max_batch) {
    GeneratorOptions o = opts;
    o.finish_check_every = std::abs(every);
    o.static_shapes = every < 0;
    o.max_batch = max_batch;
    auto r = Generator(*model_, o).Generate(prompts, 4, p);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : std::vector<Completion>{};
  };
  const std::vector<Completion> want = run(1, 64);
  ASSERT_EQ(want.size(), 12u);
  std::map<Completion::Finish, int> finishes;
  for (const Completion& c : want) ++finishes[c.finish];
  EXPECT_GT(finishes[Completion::Finish::kEos], 0) << "no row ended at the EOS";
  EXPECT_GT(finishes[Completion::Finish::kEos] + finishes[Completion::Finish::kStop], 6)
      << "too few rows ended early to compact the cache";
  // Negative: every step with the same shapes (GeneratorOptions::static_shapes). 2^40: one look
  // at the end (the pending tokens' buffer holds max_new_tokens steps, not 2^40).
  for (const auto& [every, max_batch] :
       {std::pair<int64_t, int64_t>{5, 64}, {64, 64}, {1, 4}, {3, 1}, {-1, 64}, {-7, 64}, {int64_t{1} << 40, 64}}) {
    const std::vector<Completion> got = run(every, max_batch);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].token_ids, want[i].token_ids) << "every " << every << ", max_batch " << max_batch << ": " << i;
      EXPECT_EQ(got[i].finish, want[i].finish) << "every " << every << ", max_batch " << max_batch << ": " << i;
      ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size());
      for (size_t t = 0; t < got[i].logprobs.size(); ++t) {
        EXPECT_NEAR(got[i].logprobs[t], want[i].logprobs[t], 1e-5) << every << "/" << max_batch << ": " << i;
      }
    }
  }
}

// cuda_graphs where no graph can be captured: refused, naming why (Debian's LibTorch has no
// CUDA; a CUDA LibTorch with the model on the CPU).
TEST_F(GeneratorTest, CudaGraphsAreRefusedWhereTheyCannotRun) {
  GeneratorOptions o;
  o.cuda_graphs = true;
  SamplingParams p;
  p.max_new_tokens = 3;
  auto r = Generator(*model_, o).Generate({{5, 17}}, 2, p);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
  const std::string want = CudaGraphsAvailable() ? "cuda_graphs: the model is on cpu, not a CUDA device"
                                                 : "cuda_graphs: this build's LibTorch has no CUDA";
  EXPECT_NE(r.status().message().find(want), std::string::npos) << r.status().ToString();
}

// Each decoding step replayed from a CUDA graph gives the completions the eager steps give at
// the same (static) shapes: tokens, finishes and log-probabilities, greedy and sampled, with
// compactions (a new capture at each batch size) and looks every 1, 3 and 16 steps, under a
// LoRA adapter too. Needs a CUDA device and a CUDA LibTorch (scripts/gpu-check.sh runs it).
TEST_F(GeneratorTest, CudaGraphStepsGiveTheEagerStepsCompletions) {
  if (!CudaGraphsAvailable() || !at::hasCUDA()) GTEST_SKIP() << "no CUDA device (this LibTorch or machine)";
  ModelOptions mo;
  mo.device = at::Device(at::kCUDA, 0);
  auto m = CausalLM::Load(dir_.path() / "m", mo);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const CausalLM& model = **m;
  // A LoRA adapter with B != 0 on every projection, so the adapter's products are in the graph.
  std::vector<LoraModule> modules;
  modules.reserve(static_cast<size_t>(model.num_layers()) * kNumProj);
  LoraBinding binding;
  at::manual_seed(3);
  for (int l = 0; l < model.num_layers(); ++l) {
    std::array<const LoraModule*, kNumProj> row{};
    for (Proj pr : kAllProj) {
      const Linear& lin = model.layer_linear(l, pr);
      LoraModule mod;
      mod.a = at::randn({4, lin.in}, at::TensorOptions().device(mo.device)) * 0.1;
      mod.b = at::randn({lin.out, 4}, at::TensorOptions().device(mo.device)) * 0.1;
      mod.scaling = 2.0;
      modules.push_back(mod);
      row[static_cast<size_t>(pr)] = &modules.back();
    }
    binding.layers.push_back(row);
  }
  GeneratorOptions opts;
  opts.token_bytes = [](int32_t id) { return std::string(1, static_cast<char>('a' + id % 26)); };
  const std::vector<std::vector<int32_t>> prompts = {{5, 17, 33}, {9, 4, 70, 71, 12, 3}, {7}};
  for (const LoraBinding* lora : std::array<const LoraBinding*, 2>{nullptr, &binding}) {
    for (double temperature : {0.0, 0.9}) {
      SamplingParams p;
      p.temperature = temperature;
      p.max_new_tokens = 40;
      p.seed = 11;
      // As EOS, the token most completions of a free run hold, so rows finish and the cache is
      // compacted (a new capture at the smaller batch).
      auto free_run = Generator(model, opts).Generate(prompts, 4, p, lora);
      ASSERT_TRUE(free_run.ok()) << free_run.status().ToString();
      std::map<int32_t, int> counts;
      for (const Completion& c : *free_run) {
        for (int32_t t : std::set<int32_t>(c.token_ids.begin(), c.token_ids.end())) ++counts[t];
      }
      const auto commonest = std::max_element(counts.begin(), counts.end(),
                                              [](const auto& x, const auto& y) { return x.second < y.second; });
      p.eos_token_ids = {commonest->first};
      for (int64_t every : {1, 3, 16}) {
        GeneratorOptions o = opts;
        o.finish_check_every = every;
        o.static_shapes = true;
        auto eager = Generator(model, o).Generate(prompts, 4, p, lora);
        o.cuda_graphs = true;
        auto replayed = Generator(model, o).Generate(prompts, 4, p, lora);
        ASSERT_TRUE(eager.ok()) << eager.status().ToString();
        ASSERT_TRUE(replayed.ok()) << replayed.status().ToString();
        const std::string what = std::string(lora ? "lora" : "base") + ", T " + std::to_string(temperature) +
                                 ", every " + std::to_string(every);
        int early = 0;
        ASSERT_EQ(replayed->size(), eager->size());
        for (size_t i = 0; i < eager->size(); ++i) {
          const Completion &want = (*eager)[i], &got = (*replayed)[i];
          early += want.finish != Completion::Finish::kLength;
          EXPECT_EQ(got.token_ids, want.token_ids) << what << ": completion " << i;
          EXPECT_EQ(got.finish, want.finish) << what << ": completion " << i;
          ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << what;
          for (size_t t = 0; t < got.logprobs.size(); ++t) {
            EXPECT_NEAR(got.logprobs[t], want.logprobs[t], 1e-5) << what << ": completion " << i << ", token " << t;
          }
        }
        // Sampled rows differ, so most end early; greedy rows of one prompt are one sequence.
        if (temperature > 0) {
          EXPECT_GE(early, 6) << what << ": too few rows ended early to compact the cache";
        }
      }
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
