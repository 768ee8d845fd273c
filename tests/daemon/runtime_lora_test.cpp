// LoRA on the runtime model: PEFT's initialisation, targeting and refusals, the adapter toggled
// per forward, and the save/load round trip in PEFT's format. (Against the real PEFT:
// runtime_reference_test.)
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <nlohmann/json.hpp>

#include "core/checkpoint.h"
#include "core/mapped_file.h"
#include "daemon/runtime/lora.h"
#include "tests/daemon/runtime_test_util.h"
#include "tests/temp_dir.h"

namespace ferry::runtime {
namespace {

using ferry::testing::ScopedTempDir;
using ferry::testing::TinyModelSpec;

PeftConfig Config(const std::string& json) {
  auto c = ParsePeftConfig(json, "adapter_config.json");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : PeftConfig{};
}

class LoraTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(ferry::testing::WriteTinyModel(dir_.path() / "base", spec_).ok());
    auto m = CausalLM::Load(dir_.path() / "base", {});
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    model_ = std::move(*m);
    at::manual_seed(11);
    ids_ = at::randint(3, spec_.vocab, {2, 10}, at::kLong);
  }
  at::Tensor Logits(const LoraBinding* lora) {
    ForwardArgs a;
    a.input_ids = ids_;
    a.positions = at::arange(10, at::kLong).view({1, 10}).expand({2, 10}).contiguous();
    a.lora = lora;
    auto r = model_->Forward(a);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : at::Tensor();
  }
  // Gives every lora_B random values so the adapter changes the outputs.
  static void Perturb(LoraAdapter& a) {
    at::NoGradGuard g;
    at::manual_seed(5);
    for (auto& [k, p] : a.named_parameters()) {
      if (k.find("lora_B") != std::string::npos) const_cast<at::Tensor&>(p).copy_(at::randn(p.sizes()) * 0.1);
    }
  }

  ScopedTempDir dir_;
  TinyModelSpec spec_;
  std::unique_ptr<CausalLM> model_;
  at::Tensor ids_;
};

TEST_F(LoraTest, AllLinearTargetsEverySeventhProjectionButNotLmHead) {
  auto a = LoraAdapter::Create(*model_, Config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
      "target_modules": "all-linear"})"),
                               1);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ((*a)->num_modules(), 2u * 7u);
  EXPECT_EQ((*a)->binding().lm_head, nullptr);
  EXPECT_TRUE((*a)->named_parameters().count("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"));
  // A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0.
  const at::Tensor& A = (*a)->named_parameters().at("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight");
  EXPECT_EQ(A.sizes(), (at::IntArrayRef{4, spec_.intermediate}));
  EXPECT_LE(A.abs().max().item<double>(), 1.0 / std::sqrt(64.0));
  EXPECT_GT(A.abs().max().item<double>(), 0.5 / std::sqrt(64.0));
  EXPECT_TRUE(A.requires_grad());
  // A fresh adapter (B = 0) leaves the model unchanged.
  EXPECT_TRUE(at::equal(Logits(&(*a)->binding()), Logits(nullptr)));
}

TEST_F(LoraTest, NamedTargetsPatternsAndScalings) {
  auto a = LoraAdapter::Create(*model_, Config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
      "use_rslora": true, "target_modules": ["q_proj", "v_proj", "lm_head"],
      "rank_pattern": {"v_proj": 2}, "alpha_pattern": {"layers.1.self_attn.q_proj": 3}})"),
                               1);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ((*a)->num_modules(), 5u);
  const LoraBinding& b = (*a)->binding();
  ASSERT_NE(b.lm_head, nullptr);
  EXPECT_EQ(b.layers[0][static_cast<int>(Proj::kK)], nullptr);
  EXPECT_DOUBLE_EQ(b.layers[0][static_cast<int>(Proj::kQ)]->scaling, 8.0 / 2.0);  // 8 / sqrt(4)
  EXPECT_DOUBLE_EQ(b.layers[0][static_cast<int>(Proj::kV)]->scaling, 8.0 / std::sqrt(2.0));
  EXPECT_DOUBLE_EQ(b.layers[1][static_cast<int>(Proj::kQ)]->scaling, 3.0 / 2.0);
  EXPECT_EQ(b.layers[1][static_cast<int>(Proj::kV)]->a.size(0), 2);
}

TEST_F(LoraTest, RefusesTargetsThatMatchNothingAndUnsupportedKinds) {
  auto none = LoraAdapter::Create(*model_, Config(R"({"peft_type": "LORA", "target_modules": ["c_attn"]})"), 1);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("target_modules matches no linear layer"), std::string::npos);
  auto dora = LoraAdapter::Create(*model_, Config(R"({"peft_type": "LORA", "use_dora": true,
      "target_modules": ["q_proj"]})"),
                                  1);
  ASSERT_FALSE(dora.ok());
  EXPECT_EQ(dora.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(dora.status().message().find("use_dora"), std::string::npos);
  auto embed =
      LoraAdapter::Create(*model_, Config(R"({"peft_type": "LORA", "target_modules": ["embed_tokens", "q_proj"]})"), 1);
  ASSERT_FALSE(embed.ok());
  EXPECT_EQ(embed.status().code(), StatusCode::kUnsupported);
}

TEST_F(LoraTest, TheAdapterChangesOutputsOnlyWhenBound) {
  auto a = LoraAdapter::Create(*model_, Config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
      "target_modules": ["q_proj", "down_proj"]})"),
                               1);
  ASSERT_TRUE(a.ok());
  Perturb(**a);
  const at::Tensor base = Logits(nullptr);
  const at::Tensor adapted = Logits(&(*a)->binding());
  EXPECT_GT((adapted - base).abs().max().item<double>(), 1e-3);
  // Disabling it again is the base model: the reference policy needs no copy.
  EXPECT_TRUE(at::equal(Logits(nullptr), base));
}

TEST_F(LoraTest, SaveThenLoadGivesTheSameParametersAndPeftKeys) {
  auto a = LoraAdapter::Create(*model_, Config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 16,
      "lora_dropout": 0.05, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]})"),
                               7);
  ASSERT_TRUE(a.ok());
  Perturb(**a);
  const auto out = dir_.path() / "adapter";
  ASSERT_TRUE((*a)->Save(out, "base").ok());
  // Exactly PEFT's file layout.
  auto ckpt = Checkpoint::Open(out / "adapter_model.safetensors");
  ASSERT_TRUE(ckpt.ok());
  EXPECT_EQ(ckpt->size(), 16u);
  for (const auto& name : ckpt->names()) {
    EXPECT_EQ(name.rfind("base_model.model.model.layers.", 0), 0u) << name;
    EXPECT_EQ(name.find(".default"), std::string::npos) << name;
    EXPECT_EQ(ckpt->Info(name)->dtype, DType::kF32);
  }
  auto cfg = nlohmann::json::parse(*ReadSmallFile(out / "adapter_config.json"));
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["task_type"], "CAUSAL_LM");
  EXPECT_EQ(cfg["r"], 4);
  EXPECT_EQ(cfg["lora_alpha"], 16);
  EXPECT_DOUBLE_EQ(cfg["lora_dropout"].get<double>(), 0.05);
  EXPECT_EQ(cfg["base_model_name_or_path"], "base");

  auto b = LoraAdapter::Load(*model_, out);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  ASSERT_EQ((*b)->named_parameters().size(), (*a)->named_parameters().size());
  for (const auto& [k, p] : (*a)->named_parameters()) EXPECT_TRUE(at::equal((*b)->named_parameters().at(k), p)) << k;
  EXPECT_TRUE(at::equal(Logits(&(*a)->binding()), Logits(&(*b)->binding())));
  EXPECT_DOUBLE_EQ((*b)->binding().layers[0][0]->dropout, 0.05);

  // Saving over an existing directory is refused unless forced.
  auto again = (*a)->Save(out, "base");
  EXPECT_EQ(again.code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE((*a)->Save(out, "base", /*force=*/true).ok());
}

TEST_F(LoraTest, LoadRefusesTensorsThatDoNotFit) {
  auto a = LoraAdapter::Create(*model_, Config(R"({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]})"), 1);
  ASSERT_TRUE(a.ok());
  const auto out = dir_.path() / "adapter";
  ASSERT_TRUE((*a)->Save(out, "base").ok());
  // The config claims rank 8: every tensor has the wrong shape.
  auto cfg = nlohmann::json::parse(*ReadSmallFile(out / "adapter_config.json"));
  cfg["r"] = 8;
  ASSERT_TRUE(WriteFileAtomic(out / "adapter_config.json", cfg.dump(), false).ok());
  auto b = LoraAdapter::Load(*model_, out);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(
      b.status().message().find("'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has shape [4, 32], "
                                "expected [8, 32] (rank 8)"),
      std::string::npos)
      << b.status().message();
  // A key the config does not target.
  cfg["r"] = 4;
  cfg["target_modules"] = {"model.layers.0.self_attn.q_proj"};
  ASSERT_TRUE(WriteFileAtomic(out / "adapter_config.json", cfg.dump(), false).ok());
  b = LoraAdapter::Load(*model_, out);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(
      b.status().message().find("tensor 'base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight' does not "
                                "belong to a module the config targets"),
      std::string::npos)
      << b.status().message();
}

TEST_F(LoraTest, DropoutIsAppliedOnlyInTraining) {
  auto a = LoraAdapter::Create(*model_, Config(R"({"peft_type": "LORA", "r": 4, "lora_dropout": 0.5,
      "target_modules": ["down_proj"]})"),
                               1);
  ASSERT_TRUE(a.ok());
  Perturb(**a);
  ForwardArgs args;
  args.input_ids = ids_;
  args.positions = at::arange(10, at::kLong).view({1, 10}).expand({2, 10}).contiguous();
  args.lora = &(*a)->binding();
  auto eval1 = model_->Forward(args);
  auto eval2 = model_->Forward(args);
  args.training = true;
  auto train = model_->Forward(args);
  ASSERT_TRUE(eval1.ok() && eval2.ok() && train.ok());
  EXPECT_TRUE(at::equal(*eval1, *eval2));
  EXPECT_GT((*train - *eval1).abs().max().item<double>(), 1e-4);
}

// Gradients of every LoRA parameter for a next-token loss, with or without checkpointing.
std::map<std::string, at::Tensor> Gradients(const CausalLM& model, LoraAdapter& a, const at::Tensor& ids,
                                            bool checkpoint) {
  for (auto& p : a.parameters()) {
    if (p.grad().defined()) p.mutable_grad().reset();
  }
  ForwardArgs args;
  args.input_ids = ids;
  args.positions = at::arange(ids.size(1), at::kLong).view({1, -1}).expand(ids.sizes()).contiguous();
  args.lora = &a.binding();
  args.training = true;
  args.checkpoint_layers = checkpoint;
  at::manual_seed(99);  // the same dropout masks in both runs
  auto logits = model.Forward(args);
  EXPECT_TRUE(logits.ok()) << logits.status().ToString();
  const int64_t T = ids.size(1);
  at::Tensor loss = at::cross_entropy_loss(logits->narrow(1, 0, T - 1).reshape({-1, logits->size(-1)}),
                                           ids.narrow(1, 1, T - 1).reshape({-1}));
  loss.backward();
  std::map<std::string, at::Tensor> g;
  for (const auto& [k, p] : a.named_parameters()) g[k] = p.grad().clone();
  return g;
}

TEST_F(LoraTest, ActivationCheckpointingGivesTheSameGradients) {
  for (double dropout : {0.0, 0.3}) {
    auto a = LoraAdapter::Create(*model_,
                                 Config(R"({"peft_type": "LORA", "r": 4, "lora_dropout": )" + std::to_string(dropout) +
                                        R"(, "target_modules": "all-linear"})"),
                                 1);
    ASSERT_TRUE(a.ok());
    Perturb(**a);
    const auto plain = Gradients(*model_, **a, ids_, false);
    const auto checkpointed = Gradients(*model_, **a, ids_, true);
    double max_grad = 0;
    for (const auto& [k, g] : plain) {
      ASSERT_TRUE(checkpointed.at(k).defined()) << k;
      EXPECT_LT((g - checkpointed.at(k)).abs().max().item<double>(), 1e-6) << k << " dropout " << dropout;
      max_grad = std::max(max_grad, g.abs().max().item<double>());
    }
    EXPECT_GT(max_grad, 1e-4);  // the gradients are not all zero
  }
}

// Short contexts run the attention products as plain batched loops (kernels/small_products.h) instead of a batched
// matmul (ModelOptions::small_attention_product): logits, KV-cache decoding and LoRA gradients
// agree with the bmm path.
TEST_F(LoraTest, SmallAttentionProductsEqualTheBatchedMatmul) {
  ModelOptions bmm_opts, small_opts;
  bmm_opts.small_attention_product = 0;
  small_opts.small_attention_product = int64_t{1} << 40;
  std::map<std::string, at::Tensor> grads[2], cached_grads[2];
  at::Tensor logits[2], decoded[2];
  for (int i = 0; i < 2; ++i) {
    auto m = CausalLM::Load(dir_.path() / "base", i == 0 ? bmm_opts : small_opts);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    auto a = LoraAdapter::Create(**m, Config(R"({"peft_type": "LORA", "r": 4, "target_modules": "all-linear"})"), 1);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    Perturb(**a);
    grads[i] = Gradients(**m, **a, ids_, false);
    {
      // As the trainer's shared prompt: a prefill into a cache, then more tokens on the same
      // cache, one backward through both (the second forward writes the cache the first read).
      KvCache cache((*m)->config(), 2, 10, (*m)->dtype(), (*m)->device());
      ForwardArgs f;
      f.lora = &(*a)->binding();
      f.training = true;
      f.cache = &cache;
      f.input_ids = ids_.narrow(1, 0, 4);
      f.positions = at::arange(4, at::kLong).view({1, 4}).expand({2, 4}).contiguous();
      auto first = (*m)->Forward(f);
      f.input_ids = ids_.narrow(1, 4, 6);
      f.positions = at::arange(4, 10, at::kLong).view({1, 6}).expand({2, 6}).contiguous();
      auto second = (*m)->Forward(f);
      ASSERT_TRUE(first.ok() && second.ok());
      for (auto& p : (*a)->parameters()) p.mutable_grad().reset();
      try {
        (first->sum() + second->sum()).backward();
      } catch (const c10::Error& e) {
        FAIL() << (i == 0 ? "bmm" : "small products") << ": " << e.what_without_backtrace();
      }
      for (const auto& [k, p] : (*a)->named_parameters()) cached_grads[i][k] = p.grad().clone();
    }
    at::NoGradGuard no_grad;
    ForwardArgs f;
    f.input_ids = ids_;
    f.positions = at::arange(10, at::kLong).view({1, 10}).expand({2, 10}).contiguous();
    f.lora = &(*a)->binding();
    auto full = (*m)->Forward(f);
    ASSERT_TRUE(full.ok()) << full.status().ToString();
    logits[i] = *full;
    // A prefill of 4 tokens, then one token per step on the cache.
    KvCache cache((*m)->config(), 2, 10, (*m)->dtype(), (*m)->device());
    std::vector<at::Tensor> steps;
    for (int64_t t0 = 0; t0 < 10; t0 += t0 == 0 ? 4 : 1) {
      const int64_t n = t0 == 0 ? 4 : 1;
      ForwardArgs d = f;
      d.input_ids = ids_.narrow(1, t0, n);
      d.positions = f.positions.narrow(1, t0, n);
      d.cache = &cache;
      auto r = (*m)->Forward(d);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      steps.push_back(*r);
    }
    decoded[i] = at::cat(steps, 1);
  }
  EXPECT_LT((logits[0] - logits[1]).abs().max().item<double>(), 1e-5);
  EXPECT_LT((decoded[0] - decoded[1]).abs().max().item<double>(), 1e-5);
  EXPECT_LT((decoded[1] - logits[1]).abs().max().item<double>(), 1e-5);
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (const auto& [k, g] : grads[0]) {
    const double scale = std::max(1e-3, g.abs().max().item<double>());
    EXPECT_LT((g - grads[1].at(k)).abs().max().item<double>() / scale, 1e-5) << k;
    const at::Tensor& c = cached_grads[0].at(k);
    EXPECT_LT((c - cached_grads[1].at(k)).abs().max().item<double>() / std::max(1e-3, c.abs().max().item<double>()),
              1e-5)
        << k << " (through a cache)";
  }
}

}  // namespace
}  // namespace ferry::runtime
