// The model runtime against itself and against bad input: KV-cache decoding equals the full
// forward, refusals name the field or tensor. (Equality with transformers: runtime_reference_test.)
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <dlfcn.h>
#include <torch/version.h>

#include "core/mapped_file.h"
#include "daemon/runtime/model.h"
#include "daemon/runtime/torch_util.h"
#include "tests/daemon/runtime_test_util.h"
#include "tests/temp_dir.h"

namespace ferry::runtime {
namespace {

using ferry::testing::ScopedTempDir;
using ferry::testing::TinyModelSpec;

at::Tensor Positions(int64_t batch, int64_t start, int64_t count) {
  return at::arange(start, start + count, at::kLong).view({1, count}).expand({batch, count}).contiguous();
}

// Per-token log-probabilities of ids[:, 1:] under the full forward.
at::Tensor FullForwardLogprobs(const CausalLM& m, const at::Tensor& ids) {
  ForwardArgs a;
  a.input_ids = ids;
  a.positions = Positions(ids.size(0), 0, ids.size(1));
  auto logits = m.Forward(a);
  EXPECT_TRUE(logits.ok()) << logits.status().ToString();
  at::Tensor lp = at::log_softmax(logits->to(at::kFloat), -1);
  return lp.narrow(1, 0, ids.size(1) - 1).gather(-1, ids.narrow(1, 1, ids.size(1) - 1).unsqueeze(-1)).squeeze(-1);
}

// The same, computed by a prefill of `prompt` tokens and then one token per step on a KV cache.
// With `static_slots`, the decoding steps pass their slot as a device tensor (ForwardArgs::
// cache_slots) and attend over the whole capacity.
at::Tensor CachedLogprobs(const CausalLM& m, const at::Tensor& ids, int64_t prompt, bool static_slots = false) {
  const int64_t B = ids.size(0), T = ids.size(1);
  KvCache cache(m.config(), B, T, m.dtype(), m.device());
  std::vector<at::Tensor> out;
  ForwardArgs a;
  a.cache = &cache;
  a.input_ids = ids.narrow(1, 0, prompt);
  a.positions = Positions(B, 0, prompt);
  auto logits = m.Forward(a);
  EXPECT_TRUE(logits.ok()) << logits.status().ToString();
  at::Tensor lp = at::log_softmax(logits->to(at::kFloat), -1);
  out.push_back(lp.narrow(1, 0, prompt - 1).gather(-1, ids.narrow(1, 1, prompt - 1).unsqueeze(-1)).squeeze(-1));
  at::Tensor last = lp.narrow(1, prompt - 1, 1);
  for (int64_t t = prompt; t < T; ++t) {
    out.push_back(last.gather(-1, ids.narrow(1, t, 1).unsqueeze(-1)).squeeze(-1));
    if (t == T - 1) break;
    a.input_ids = ids.narrow(1, t, 1);
    a.positions = Positions(B, t, 1);
    if (static_slots) a.cache_slots = at::full({1}, t, at::kLong);
    logits = m.Forward(a);
    EXPECT_TRUE(logits.ok()) << logits.status().ToString();
    last = at::log_softmax(logits->to(at::kFloat), -1);
  }
  return at::cat(out, 1);
}

std::unique_ptr<CausalLM> LoadTiny(const ScopedTempDir& dir, const TinyModelSpec& spec, ModelOptions opts = {}) {
  EXPECT_TRUE(ferry::testing::WriteTinyModel(dir.path() / "m", spec).ok());
  auto m = CausalLM::Load(dir.path() / "m", opts);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? std::move(*m) : nullptr;
}

// OMP_DYNAMIC=true (or omp_set_dynamic(1)) let libgomp run OpenBLAS's threaded GEMM with fewer
// threads than it asked for on a loaded machine, and ferryd hung; SetTorchThreads turns it off.
TEST(RuntimeThreads, SetTorchThreadsTurnsOpenMpDynamicAdjustmentOff) {
  using SetDynamic = void (*)(int);
  auto set_dynamic = reinterpret_cast<SetDynamic>(::dlsym(RTLD_DEFAULT, "omp_set_dynamic"));
  if (!set_dynamic) GTEST_SKIP() << "no OpenMP runtime is loaded";
  const int threads = at::get_num_threads();
  set_dynamic(1);
  ASSERT_EQ(OpenMpDynamic(), std::optional<bool>(true));
  EXPECT_EQ(SetTorchThreads(threads), threads);
  EXPECT_EQ(OpenMpDynamic(), std::optional<bool>(false));
  EXPECT_EQ(at::get_num_threads(), threads);
}

TEST(RuntimeModel, KvCacheDecodingEqualsTheFullForwardOver2048PositionsF32) {
  ScopedTempDir dir;
  TinyModelSpec spec;
  spec.model_type = "qwen2";  // with q/k/v biases
  spec.max_positions = 4096;
  ModelOptions opts;
  opts.attention_chunk = 512;  // the full forward runs 4 chunks
  auto m = LoadTiny(dir, spec, opts);
  ASSERT_NE(m, nullptr);
  at::manual_seed(7);
  const at::Tensor ids = at::randint(3, spec.vocab, {2, 2049}, at::kLong);
  const at::Tensor full = FullForwardLogprobs(*m, ids);
  const at::Tensor cached = CachedLogprobs(*m, ids, 16);
  ASSERT_EQ(full.sizes(), cached.sizes());
  const double gap = (full - cached).abs().max().item<double>();
  EXPECT_LT(gap, 1e-5) << "max |logp(full) - logp(cached)| over 2,048 positions";
  // Not trivially equal: the two paths run different matrix shapes.
  EXPECT_GT((full - cached).abs().sum().item<double>(), 0.0);
}

// Without autograd the MLP forms silu(gate) * up in place (less memory at a prefill's peak) and
// the attention's BLAS products are split across threads by item: the logits must be
// bit-identical to the autograd forward's, in F32 and BF16, with the attention on the small
// products' loops or all on the BLAS.
TEST(RuntimeModel, ForwardWithoutAutogradEqualsTheAutogradForwardExactly) {
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  for (const auto& [dtype, small] : {std::pair{at::kFloat, int64_t{4096}}, std::pair{at::kFloat, int64_t{0}},
                                     std::pair{at::kBFloat16, int64_t{4096}}}) {
    ScopedTempDir dir;
    TinyModelSpec spec;
    spec.model_type = "qwen2";
    ModelOptions opts;
    opts.dtype = dtype;
    opts.small_attention_product = small;
    auto m = LoadTiny(dir, spec, opts);
    ASSERT_NE(m, nullptr);
    at::manual_seed(11);
    ForwardArgs a;
    a.input_ids = at::randint(3, spec.vocab, {3, 40}, at::kLong);
    a.positions = Positions(3, 0, 40);
    ASSERT_TRUE(at::GradMode::is_enabled());
    auto with_grad = m->Forward(a);
    ASSERT_TRUE(with_grad.ok()) << with_grad.status().ToString();
    at::NoGradGuard no_grad;
    auto without = m->Forward(a);
    ASSERT_TRUE(without.ok()) << without.status().ToString();
    EXPECT_TRUE(at::equal(*with_grad, *without))
        << c10::toString(dtype) << ", small products up to " << small << ": max |diff| "
        << (*with_grad - *without).abs().max().item<double>();
  }
  at::set_num_threads(threads);
}

// Decoding steps with their slot on the device attend over the whole cache (static shapes, for a
// captured CUDA graph): the same log-probabilities as the steps that read only the filled slots,
// and the full forward's; refused with autograd or a slot tensor of the wrong shape.
TEST(RuntimeModel, StaticSlotDecodingEqualsTheFilledSlotDecoding) {
  ScopedTempDir dir;
  TinyModelSpec spec;
  spec.model_type = "qwen2";
  auto m = LoadTiny(dir, spec);
  ASSERT_NE(m, nullptr);
  at::manual_seed(3);
  const at::Tensor ids = at::randint(3, spec.vocab, {2, 40}, at::kLong);
  at::NoGradGuard no_grad;
  const at::Tensor dynamic = CachedLogprobs(*m, ids, 8);
  const at::Tensor fixed = CachedLogprobs(*m, ids, 8, /*static_slots=*/true);
  EXPECT_LT((dynamic - fixed).abs().max().item<double>(), 1e-5);
  EXPECT_LT((FullForwardLogprobs(*m, ids) - fixed).abs().max().item<double>(), 1e-5);

  KvCache cache(m->config(), 2, 16, m->dtype(), m->device());
  ForwardArgs a;
  a.cache = &cache;
  a.input_ids = ids.narrow(1, 0, 1);
  a.positions = Positions(2, 0, 1);
  a.cache_slots = at::zeros({2}, at::kLong);
  auto wrong = m->Forward(a);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("cache_slots must be a long tensor [1]"), std::string::npos)
      << wrong.status().ToString();
  a.cache_slots = at::zeros({1}, at::kLong);
  at::AutoGradMode grad(true);
  auto with_grad = m->Forward(a);
  ASSERT_FALSE(with_grad.ok());
  EXPECT_NE(with_grad.status().message().find("without autograd"), std::string::npos) << with_grad.status().ToString();
}

// What a captured decoding step's replays rely on (GeneratorOptions::cuda_graphs): a static-slot
// step whose host count is set back (KvCache::set_length, as after the capture) and run again
// writes the same slot and gives the same logits, bit for bit, and the steps after it are those
// of a run where every step ran once. A length outside [0, capacity] is refused.
TEST(RuntimeModel, AStaticStepRunAgainAfterItsCountIsSetBackGivesTheSameLogits) {
  ScopedTempDir dir;
  TinyModelSpec spec;
  auto m = LoadTiny(dir, spec);
  ASSERT_NE(m, nullptr);
  at::manual_seed(5);
  const at::Tensor ids = at::randint(3, spec.vocab, {2, 20}, at::kLong);
  at::NoGradGuard no_grad;
  const int64_t prompt = 6;
  // Each decoding step's logits; `twice`: every step is run, set back, and run again.
  auto decode = [&](bool twice) {
    KvCache cache(m->config(), 2, 20, m->dtype(), m->device());
    ForwardArgs a;
    a.cache = &cache;
    a.input_ids = ids.narrow(1, 0, prompt);
    a.positions = Positions(2, 0, prompt);
    EXPECT_TRUE(m->Forward(a).ok());
    std::vector<at::Tensor> out;
    for (int64_t t = prompt; t < ids.size(1); ++t) {
      a.input_ids = ids.narrow(1, t, 1);
      a.positions = Positions(2, t, 1);
      a.cache_slots = at::full({1}, t, at::kLong);
      auto first = m->Forward(a);
      EXPECT_TRUE(first.ok()) << first.status().ToString();
      if (twice) {
        EXPECT_EQ(cache.length(), t + 1);
        cache.set_length(t);
        auto again = m->Forward(a);
        EXPECT_TRUE(again.ok()) << again.status().ToString();
        EXPECT_TRUE(at::equal(*first, *again)) << "step " << t;
      }
      EXPECT_EQ(cache.length(), t + 1);
      out.push_back(*first);
    }
    EXPECT_THROW(cache.set_length(21), c10::Error);
    EXPECT_THROW(cache.set_length(-1), c10::Error);
    return at::cat(out, 1);
  };
  EXPECT_TRUE(at::equal(decode(false), decode(true)));
}

// The fused attention kernel (at::scaled_dot_product_attention) is refused where this LibTorch
// lacks it, naming the function and the version; where it has it, the model runs it, and the
// KV-cache decode over it equals its full forward.
TEST(RuntimeModel, FusedAttentionRunsWhereTheLibTorchHasItAndIsRefusedElsewhere) {
  ScopedTempDir dir;
  TinyModelSpec spec;
  spec.model_type = "qwen2";
  ModelOptions opts;
  opts.attention_kernel = AttentionKernel::kFused;
  ASSERT_TRUE(WriteTinyModel(dir.path(), spec).ok());
  auto m = CausalLM::Load(dir.path(), opts);
  if (!FusedAttentionAvailable()) {
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(m.status().message().find("scaled_dot_product_attention"), std::string::npos) << m.status().ToString();
    EXPECT_NE(m.status().message().find(TORCH_VERSION), std::string::npos) << m.status().ToString();
    return;
  }
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ((*m)->attention_kernel(), AttentionKernel::kFused);
  at::manual_seed(7);
  const at::Tensor ids = at::randint(3, spec.vocab, {2, 65}, at::kLong);
  const at::Tensor full = FullForwardLogprobs(**m, ids);
  const at::Tensor cached = CachedLogprobs(**m, ids, 16);
  EXPECT_LT((full - cached).abs().max().item<double>(), 1e-5) << "max |logp(full) - logp(cached)|, fused";
  // By default the CPU runs the eager kernel.
  auto eager = CausalLM::Load(dir.path(), ModelOptions{});
  ASSERT_TRUE(eager.ok()) << eager.status().ToString();
  EXPECT_EQ((*eager)->attention_kernel(), AttentionKernel::kEager);
  EXPECT_LT((FullForwardLogprobs(**eager, ids) - full).abs().max().item<double>(), 1e-5) << "fused against eager";
}

// Decoding a few rows without autograd runs the linear layers as kernels/skinny_gemm.h loops
// (ModelOptions::skinny_linear_rows): the same logits as the BLAS within F32 rounding, q/k/v
// biases included, and not the same bits (the loops did run).
TEST(RuntimeModel, SkinnyLinearDecodingEqualsTheBlasWithinF32Rounding) {
  ScopedTempDir dir;
  TinyModelSpec spec;
  spec.model_type = "qwen2";  // with q/k/v biases
  ModelOptions blas_opts, skinny_opts;
  blas_opts.skinny_linear_rows = 0;
  skinny_opts.skinny_linear_rows = 8;
  auto blas = LoadTiny(dir, spec, blas_opts);
  ASSERT_NE(blas, nullptr);
  auto skinny = CausalLM::Load(dir.path() / "m", skinny_opts);
  ASSERT_TRUE(skinny.ok()) << skinny.status().ToString();
  at::manual_seed(12);
  const at::Tensor ids = at::randint(3, spec.vocab, {3, 40}, at::kLong);
  at::NoGradGuard no_grad;
  // 3 rows per decoding step (skinny), after a 120-row prefill (the BLAS on both).
  const at::Tensor a = CachedLogprobs(*blas, ids, 8), b = CachedLogprobs(**skinny, ids, 8);
  ASSERT_EQ(a.sizes(), b.sizes());
  EXPECT_LT((a - b).abs().max().item<double>(), 1e-5);
  EXPECT_FALSE(at::equal(a.narrow(1, 8, 31), b.narrow(1, 8, 31)))
      << "the decoded positions are bit for bit the BLAS's: the loops did not run";
  EXPECT_TRUE(at::equal(a.narrow(1, 0, 7), b.narrow(1, 0, 7))) << "the prefill (120 rows) is the BLAS's on both";
}

TEST(RuntimeModel, KvCacheDecodingGapInBf16IsReported) {
  ScopedTempDir dir;
  TinyModelSpec spec;
  spec.dtype = at::kBFloat16;
  auto m = LoadTiny(dir, spec);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->dtype(), at::kBFloat16);
  at::manual_seed(8);
  const at::Tensor ids = at::randint(3, spec.vocab, {1, 2049}, at::kLong);
  const at::Tensor gap = (FullForwardLogprobs(*m, ids) - CachedLogprobs(*m, ids, 16)).abs();
  // BF16 keeps 8 bits of mantissa: the two paths differ, but within a few BF16 ulps of a logit.
  const double max_gap = gap.max().item<double>();
  const double mean_gap = gap.mean().item<double>();
  std::cout << "BF16 KV-cache vs full forward over 2,048 positions: max |dlogp| " << max_gap << ", mean " << mean_gap
            << "\n";
  EXPECT_LT(max_gap, 0.25);
  EXPECT_LT(mean_gap, 0.05);
}

TEST(RuntimeModel, LeftPaddedBatchRowMatchesTheUnpaddedSequence) {
  ScopedTempDir dir;
  auto m = LoadTiny(dir, TinyModelSpec{});
  ASSERT_NE(m, nullptr);
  at::manual_seed(3);
  const at::Tensor seq = at::randint(3, 96, {1, 12}, at::kLong);
  ForwardArgs a;
  a.input_ids = seq;
  a.positions = Positions(1, 0, 12);
  auto alone = m->Forward(a);
  ASSERT_TRUE(alone.ok());
  // Row 1 is the same sequence left-padded by 5 pad tokens (id 0), positions counted from the
  // first real token, as transformers' generate does.
  at::Tensor ids = at::zeros({2, 17}, at::kLong);
  ids[0] = at::randint(3, 96, {17}, at::kLong);
  ids[1].narrow(0, 5, 12).copy_(seq[0]);
  at::Tensor mask = at::ones({2, 17}, at::kBool);
  mask[1].narrow(0, 0, 5).fill_(false);
  at::Tensor pos = (mask.to(at::kLong).cumsum(1) - 1).clamp_min(0);
  a.input_ids = ids;
  a.positions = pos;
  a.attention_mask = mask;
  auto batch = m->Forward(a);
  ASSERT_TRUE(batch.ok()) << batch.status().ToString();
  EXPECT_TRUE(at::isfinite(*batch).all().item<bool>());
  const double diff = ((*batch)[1].narrow(0, 5, 12) - (*alone)[0]).abs().max().item<double>();
  EXPECT_LT(diff, 1e-5);
}

TEST(RuntimeModel, RefusesAnotherModelType) {
  auto c = ParseModelConfig(R"({"model_type": "gemma", "vocab_size": 8, "hidden_size": 8,
      "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})",
                            "x/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(c.status().message().find("x/config.json: field 'model_type' is 'gemma'"), std::string::npos)
      << c.status().message();
}

TEST(RuntimeModel, RefusesAnUnknownRopeType) {
  auto c = ParseModelConfig(R"({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
      "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
      "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}})",
                            "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(c.status().message().find("'rope_parameters.rope_type' is 'yarn'"), std::string::npos)
      << c.status().message();
  auto legacy = ParseModelConfig(R"({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
      "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
      "rope_scaling": {"type": "dynamic", "factor": 2.0}})",
                                 "config.json");
  ASSERT_FALSE(legacy.ok());
  EXPECT_NE(legacy.status().message().find("'rope_scaling.rope_type' is 'dynamic'"), std::string::npos)
      << legacy.status().message();
}

TEST(RuntimeModel, RefusesAnUnknownLayerTypeAndAnotherActivation) {
  auto c = ParseModelConfig(R"({"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8,
      "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
      "sliding_window": 4, "layer_types": ["full_attention", "chunked_attention"]})",
                            "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(c.status().message().find("'layer_types[1]' is 'chunked_attention'"), std::string::npos);
  auto act = ParseModelConfig(R"({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
      "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "hidden_act": "gelu"})",
                              "config.json");
  ASSERT_FALSE(act.ok());
  EXPECT_NE(act.status().message().find("'hidden_act' is 'gelu'"), std::string::npos);
}

TEST(RuntimeModel, AQuantizationConfigFieldOfTheWrongTypeIsCorruption) {
  // nlohmann's value() threw type_error out of the parser for these (found writing the fuzz target).
  const std::string base = R"({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
      "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "quantization_config": )";
  auto method = ParseModelConfig(base + R"({"quant_method": 4, "load_in_4bit": true}})", "config.json");
  ASSERT_FALSE(method.ok());
  EXPECT_EQ(method.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(method.status().message(), "config.json: field 'quantization_config.quant_method' must be a string");
  auto load = ParseModelConfig(base + R"({"quant_method": "bitsandbytes", "load_in_4bit": "yes"}})", "config.json");
  ASSERT_FALSE(load.ok());
  EXPECT_EQ(load.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(load.status().message(), "config.json: field 'quantization_config.load_in_4bit' must be true or false");
}

TEST(RuntimeModel, QwenSlidingWindowFollowsUseSlidingWindowAndMaxWindowLayers) {
  const std::string base = R"({"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8,
      "intermediate_size": 8, "num_hidden_layers": 3, "num_attention_heads": 2, "sliding_window": 4,
      "max_window_layers": 1, "use_sliding_window": )";
  auto off = ParseModelConfig(base + "false}", "config.json");
  ASSERT_TRUE(off.ok()) << off.status().ToString();
  EXPECT_TRUE(off->sliding_layers.empty());
  auto on = ParseModelConfig(base + "true}", "config.json");
  ASSERT_TRUE(on.ok()) << on.status().ToString();
  EXPECT_EQ(on->sliding_window, 4);
  EXPECT_EQ(on->sliding_layers, (std::vector<bool>{false, true, true}));
}

TEST(RuntimeModel, AMissingOrMisShapedTensorIsNamed) {
  ScopedTempDir dir;
  TinyModelSpec spec;
  auto tensors = ferry::testing::RandomModelTensors(spec);
  ASSERT_TRUE(WriteFileAtomic(dir.path() / "config.json", ferry::testing::TinyConfigJson(spec), false).ok());
  auto missing = tensors;
  missing.erase("model.layers.1.mlp.up_proj.weight");
  ASSERT_TRUE(ferry::testing::WriteTensors(dir.path() / "model.safetensors", missing).ok());
  auto m = CausalLM::Load(dir.path(), {});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
  EXPECT_NE(m.status().message().find("missing tensor 'model.layers.1.mlp.up_proj.weight'"), std::string::npos);

  auto bad = tensors;
  bad["model.layers.0.self_attn.k_proj.weight"] = at::zeros({8, 32});
  ASSERT_TRUE(ferry::testing::WriteTensors(dir.path() / "model.safetensors", bad).ok());
  m = CausalLM::Load(dir.path(), {});
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(
      m.status().message().find("tensor 'model.layers.0.self_attn.k_proj.weight' has shape [8, 32], expected [16, 32]"),
      std::string::npos)
      << m.status().message();

  auto extra = tensors;
  extra["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] = at::zeros({4, 32});
  ASSERT_TRUE(ferry::testing::WriteTensors(dir.path() / "model.safetensors", extra).ok());
  m = CausalLM::Load(dir.path(), {});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(
      m.status().message().find("unexpected tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'"),
      std::string::npos)
      << m.status().message();
}

TEST(RuntimeModel, TokenIdsOutsideTheVocabularyAreRefused) {
  ScopedTempDir dir;
  auto m = LoadTiny(dir, TinyModelSpec{});
  ASSERT_NE(m, nullptr);
  ForwardArgs a;
  a.input_ids = at::tensor({1, 2, 96}, at::kLong).view({1, 3});
  a.positions = Positions(1, 0, 3);
  auto r = m->Forward(a);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("token id 96 is outside the vocabulary [0, 96)"), std::string::npos);
}

TEST(RuntimeModel, MappedWeightsAreViewsNotCopies) {
  ScopedTempDir dir;
  auto m = LoadTiny(dir, TinyModelSpec{});
  ASSERT_NE(m, nullptr);
  // A view over the mapped file (from_blob) has a storage LibTorch cannot resize; a copy would.
  const Linear& q = m->layer_linear(0, Proj::kQ);
  EXPECT_FALSE(q.weight.storage().resizable());
  EXPECT_FALSE(m->lm_head().weight.storage().resizable());
  auto ckpt = Checkpoint::Open(dir.path() / "m" / "model.safetensors");
  ASSERT_TRUE(ckpt.ok());
  EXPECT_EQ(m->weight_bytes(), static_cast<int64_t>(ckpt->total_bytes()));
}

}  // namespace
}  // namespace ferry::runtime
