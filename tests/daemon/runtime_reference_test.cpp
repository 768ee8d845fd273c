// The runtime against the real transformers / PEFT / bitsandbytes, through the committed
// fixtures of fixtures/runtime/ (generate.py made them; see its README.md). For every case of
// cases.json (one parameter each):
//   - logits of the expected input_ids within the case's logits_tolerance (max abs) and
//     logits_mean_tolerance (mean abs, 16-bit cases), with the PEFT adapter when the case has one;
//   - greedy generation token for token equal to transformers' generate (64 new tokens, EOS
//     kept and ending the row as HF does). 16-bit computations: equal up to a near tie (two top
//     logits within the case's logits_tolerance: cases.json's 16-bit margins, 0.09-0.19, are
//     about one BF16 ulp of the largest logits, below what correct implementations differ by, so
//     another op order may legitimately flip a token), and teacher forced on HF's sequence,
//     every HF token within that of this runtime's best;
//   - the left-padded batch: Generator takes the two prompts unpadded and pads them itself; each
//     row's new tokens equal HF's (HF fills a row finished at EOS with pad ids: compared up to
//     and including its EOS);
//   - gradient cases: the loss and every LoRA gradient within 1e-5 of PyTorch autograd;
//   - adapter cases: an adapter saved by Ferry (the loaded PEFT one, and a fresh one with random
//     B) and reloaded by Ferry gives identical logits.
// Every case runs three times: on the CPU; on the CPU with the fused attention kernel
// (at::scaled_dot_product_attention, attention.h; skipped where this LibTorch lacks it, Debian's
// 1.13); and on CUDA (skipped where this LibTorch or machine has no CUDA device; the fused kernel
// where the LibTorch has it, as by default), where the model is loaded onto the GPU and every tensor it holds (a 4-bit
// base's packed data and companions too) must be there. On CUDA, F16 weights compute in F16 (the CPU refuses that, see
// below) and are held to the 16-bit rules. With FERRY_RUNTIME_EXPORT_DIR set, the adapter test also writes, per adapter
// case, DIR/<case>/{peft_resaved,fresh}/ (Ferry-saved adapters) and DIR/<case>/{peft_resaved,fresh}.safetensors
// (input_ids and Ferry's logits) for `generate.py --check-adapter` (fixtures/runtime/README.md).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "core/status.h"
#include "daemon/runtime/generator.h"
#include "daemon/runtime/lora.h"
#include "daemon/runtime/model.h"
#include "daemon/runtime/torch_util.h"
#include "tests/daemon/runtime_test_util.h"
#include "tests/temp_dir.h"

namespace ferry::runtime {
namespace {

namespace fs = std::filesystem;
using ferry::testing::ScopedTempDir;

// What generate.py asked transformers' generate for (README.md "Expected files").
constexpr int64_t kGreedyMaxNew = 64;
constexpr int64_t kBatchMaxNew = 32;
// LoRA gradients and the loss (F32): the brief's bound; the fixture's own hand-written forward
// lands within 1e-6 (cases.json grad.ref_max_abs_diff).
constexpr double kGradTolerance = 1e-5;

fs::path RuntimeFixtures() { return fs::path(FERRY_FIXTURES_DIR) / "runtime"; }

struct CasesFile {
  nlohmann::json doc;
  std::string error;
};

const CasesFile& Cases() {
  static const CasesFile loaded = [] {
    CasesFile out;
    std::ifstream in(RuntimeFixtures() / "cases.json");
    if (!in) {
      out.error = "cannot open " + (RuntimeFixtures() / "cases.json").string();
      return out;
    }
    try {
      out.doc = nlohmann::json::parse(in);
      if (!out.doc.contains("cases") || !out.doc["cases"].is_array()) out.error = "cases.json: no \"cases\" array";
    } catch (const std::exception& e) {
      out.error = std::string("cases.json: ") + e.what();
    }
    return out;
  }();
  return loaded;
}

std::vector<std::string> CaseNames() {
  if (!Cases().error.empty()) return {"cases_json_unreadable"};
  std::vector<std::string> names;
  for (const auto& c : Cases().doc["cases"]) names.push_back(c.at("name").get<std::string>());
  return names;
}

// One test parameter: a case of cases.json on one device.
struct ReferenceParam {
  std::string name;
  bool cuda = false;
  bool fused = false;  // the CPU with AttentionKernel::kFused
};

// How gtest names a parameter in its messages (instead of a byte dump).
void PrintTo(const ReferenceParam& p, std::ostream* os) {
  *os << p.name << (p.cuda ? " on cuda" : " on cpu") << (p.fused ? ", fused attention" : "");
}

std::vector<ReferenceParam> Params(bool cuda, bool fused = false) {
  std::vector<ReferenceParam> out;
  for (std::string& n : CaseNames()) out.push_back({std::move(n), cuda, fused});
  return out;
}

// Every tensor of an expected file, as owned CPU copies.
Result<std::map<std::string, at::Tensor>> ReadExpected(const fs::path& file) {
  FERRY_ASSIGN_OR_RETURN(auto st, SafetensorsFile::Open(file));
  std::map<std::string, at::Tensor> out;
  for (const auto& info : st->tensors()) {
    FERRY_ASSIGN_OR_RETURN(at::Tensor t, ToTorch(st->View(info), at::kCPU));
    out[info.name] = t.clone();  // own the bytes: the mapping goes away with `st`
  }
  return out;
}

// The row's tokens as HF reports them, cut after the first EOS (HF pads a finished row).
std::vector<int64_t> UpToEos(const at::Tensor& row, int64_t eos) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < row.size(0); ++i) {
    out.push_back(row[i].item<int64_t>());
    if (out.back() == eos) break;
  }
  return out;
}

std::vector<int64_t> Widen(const std::vector<int32_t>& v) { return {v.begin(), v.end()}; }

// "equal" or where the two sequences first differ.
std::string FirstDifference(const std::vector<int64_t>& got, const std::vector<int64_t>& want) {
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    if (got[i] != want[i]) {
      return "first difference at new token " + std::to_string(i) + ": got " + std::to_string(got[i]) +
             ", transformers " + std::to_string(want[i]);
    }
  }
  if (got.size() != want.size()) {
    return "lengths differ: got " + std::to_string(got.size()) + ", transformers " + std::to_string(want.size());
  }
  return "equal";
}

class RuntimeReferenceTest : public ::testing::TestWithParam<ReferenceParam> {
 protected:
  const std::string& Name() const { return GetParam().name; }

  void SetUp() override {
    if (GetParam().cuda && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device (this LibTorch or machine)";
    if (GetParam().fused && !FusedAttentionAvailable()) {
      GTEST_SKIP() << "this LibTorch has no scaled_dot_product_attention";
    }
    device_ = GetParam().cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
    ASSERT_TRUE(Cases().error.empty()) << Cases().error;
    for (const auto& c : Cases().doc["cases"]) {
      if (c.at("name") == Name()) case_ = c;
    }
    ASSERT_FALSE(case_.is_null()) << Name();
    model_dir_ = RuntimeFixtures() / case_.at("model_dir").get<std::string>();
    ModelOptions options;
    options.device = device_;
    if (GetParam().fused) options.attention_kernel = AttentionKernel::kFused;
    if (case_.at("dtype") == "F16" && !device_.is_cuda()) {
      // LibTorch has no CPU F16 matmul: the runtime refuses F16 compute there (naming the weights),
      // and F32 compute of the F16 weights is within the F16 tolerance (cases.json measured:
      // hf_f32_same_weights, transformers in F32 on these weights, lands at 0.063 of 0.15).
      auto refused = CausalLM::Load(model_dir_, options);
      ASSERT_FALSE(refused.ok()) << Name();
      EXPECT_EQ(refused.status().code(), StatusCode::kUnsupported) << refused.status().ToString();
      EXPECT_NE(refused.status().message().find("model.safetensors"), std::string::npos) << refused.status().ToString();
      options.dtype = at::kFloat;
    }
    sixteen_bit_ = options.dtype ? false : case_.at("dtype") != "F32";
    auto m = CausalLM::Load(model_dir_, options);
    ASSERT_TRUE(m.ok()) << Name() << ": " << m.status().ToString();
    model_ = std::move(*m);
    // Nothing of the model (a 4-bit base's packed data and companions included) on another device.
    for (const at::Tensor& t : model_->tensors()) {
      ASSERT_TRUE(t.defined()) << Name();
      ASSERT_EQ(t.device(), device_) << Name() << ": a model tensor of shape " << t.sizes() << " is on " << t.device();
    }
    if (!case_.at("adapter_dir").is_null()) {
      adapter_dir_ = RuntimeFixtures() / case_.at("adapter_dir").get<std::string>();
      auto a = LoraAdapter::Load(*model_, adapter_dir_);
      ASSERT_TRUE(a.ok()) << Name() << ": " << a.status().ToString();
      adapter_ = std::move(*a);
      for (const auto& [key, p] : adapter_->named_parameters()) {
        ASSERT_EQ(p.device(), device_) << Name() << ": adapter tensor " << key << " is on " << p.device();
      }
    }
    auto e = ReadExpected(RuntimeFixtures() / case_.at("expected").get<std::string>());
    ASSERT_TRUE(e.ok()) << Name() << ": " << e.status().ToString();
    expected_ = std::move(*e);
    eos_ = case_.at("eos_id").get<int64_t>();
  }

  const at::Tensor& Expected(const std::string& name) {
    auto it = expected_.find(name);
    if (it == expected_.end()) {
      ADD_FAILURE() << Name() << ": no tensor " << name << " in " << case_.at("expected");
      static const at::Tensor none;
      return none;
    }
    return it->second;
  }

  const LoraBinding* Lora() const { return adapter_ ? &adapter_->binding() : nullptr; }

  // Logits [B, T, V] (F32) of `ids` at positions 0..T-1, no padding.
  Result<at::Tensor> Logits(const at::Tensor& ids, const LoraBinding* lora, bool training = false) {
    ForwardArgs a;
    a.input_ids = ids.to(device_);
    a.positions =
        at::arange(ids.size(1), at::kLong).view({1, -1}).expand({ids.size(0), ids.size(1)}).contiguous().to(device_);
    a.lora = lora;
    a.training = training;
    FERRY_ASSIGN_OR_RETURN(at::Tensor logits, model_->Forward(a));
    return logits.to(at::kFloat).cpu();
  }

  SamplingParams Greedy(int64_t max_new) const {
    SamplingParams p;
    p.temperature = 0;
    p.max_new_tokens = max_new;
    p.eos_token_ids = {eos_};
    return p;
  }

  // Greedy tokens of a 16-bit computation: equal to HF's up to a step where the two top tokens
  // are a near tie, and, teacher forced on HF's whole sequence, every HF token a near tie with
  // this runtime's best. Near tie: within the case's logits_tolerance, which is twice the largest
  // per-logit difference measured between correct implementations (cases.json
  // measured.correct_variants), so the gap between two logits can legitimately move by that
  // much. `rows` [B, P + S] holds prompt + HF's new tokens per row (left padded, `mask` 0 on pads).
  void ExpectSixteenBitGreedy(const at::Tensor& rows, const at::Tensor& mask, int64_t prompt_len,
                              const std::vector<std::vector<int64_t>>& want, const std::vector<Completion>& got) {
    ForwardArgs a;
    a.input_ids = rows.to(device_);
    a.positions = (mask.to(at::kLong).cumsum(1) - 1).clamp_min(0).to(device_);
    a.attention_mask = mask.to(at::kBool).to(device_);
    a.lora = Lora();
    auto logits = model_->Forward(a);
    ASSERT_TRUE(logits.ok()) << Name() << ": " << logits.status().ToString();
    const at::Tensor lf = logits->to(at::kFloat).cpu();
    const double slack = case_.at("logits_tolerance").get<double>();
    for (size_t r = 0; r < want.size(); ++r) {
      bool diverged = false;
      for (size_t t = 0; t < want[r].size(); ++t) {
        const at::Tensor step = lf[static_cast<int64_t>(r)][prompt_len - 1 + static_cast<int64_t>(t)];
        const double best = step.max().item<double>();
        const double hf = step[want[r][t]].item<double>();
        EXPECT_GE(hf, best - slack) << Name() << " row " << r << " step " << t << ": transformers' token " << want[r][t]
                                    << " is " << best - hf << " below this runtime's best";
        if (diverged || t >= got[r].token_ids.size()) continue;
        const int64_t mine = got[r].token_ids[t];
        if (mine != want[r][t]) {
          diverged = true;
          EXPECT_GE(step[mine].item<double>(), best - slack) << Name() << " row " << r << " step " << t;
          EXPECT_GE(hf, best - slack) << Name() << " row " << r << " diverged at step " << t << ": got " << mine
                                      << ", transformers " << want[r][t] << ", not a near tie";
          RecordProperty("diverged_row" + std::to_string(r) + "_at", static_cast<int>(t));
        }
      }
      if (!diverged) {
        EXPECT_EQ(Widen(got[r].token_ids), want[r]) << Name() << " row " << r;
      }
    }
  }

  nlohmann::json case_;
  at::Device device_ = at::kCPU;
  bool sixteen_bit_ = false;  // computing in BF16 or F16
  fs::path model_dir_, adapter_dir_;
  std::unique_ptr<CausalLM> model_;
  std::unique_ptr<LoraAdapter> adapter_;
  std::map<std::string, at::Tensor> expected_;
  int64_t eos_ = -1;
};

TEST_P(RuntimeReferenceTest, LogitsEqualTransformers) {
  const at::Tensor& ids = Expected("input_ids");
  const at::Tensor& want = Expected("logits");
  ASSERT_TRUE(ids.defined() && want.defined());
  auto got = Logits(ids, Lora());
  ASSERT_TRUE(got.ok()) << Name() << ": " << got.status().ToString();
  ASSERT_EQ(got->sizes(), want.sizes()) << Name();
  const at::Tensor diff = (*got - want).abs();
  const double max_diff = diff.max().item<double>();
  const double mean_diff = diff.mean().item<double>();
  const double tol = case_.at("logits_tolerance").get<double>();
  RecordProperty("max_abs_diff", std::to_string(max_diff));
  RecordProperty("mean_abs_diff", std::to_string(mean_diff));
  EXPECT_LE(max_diff, tol) << Name() << ": max |logits - transformers'| (mean " << mean_diff << ")";
  if (!case_.at("logits_mean_tolerance").is_null()) {
    EXPECT_LE(mean_diff, case_.at("logits_mean_tolerance").get<double>())
        << Name() << ": mean |logits - transformers'| (max " << max_diff << ")";
  }
  // Every position's argmax agrees where transformers' top-1 leads by more than the tolerance.
  const at::Tensor top2 = std::get<0>(want.topk(2, -1));
  const at::Tensor clear = (top2.select(-1, 0) - top2.select(-1, 1)) > 2 * tol;
  const at::Tensor agree = got->argmax(-1) == want.argmax(-1);
  EXPECT_TRUE(at::all(agree.logical_or(clear.logical_not())).item<bool>()) << Name() << ": argmax differs";
}

TEST_P(RuntimeReferenceTest, GreedyEqualsTransformersGenerate) {
  const at::Tensor& prompt = Expected("greedy_prompt");
  const at::Tensor& want_t = Expected("greedy_new_tokens");
  ASSERT_TRUE(prompt.defined() && want_t.defined());
  const std::vector<int64_t> want = UpToEos(want_t, eos_);
  ASSERT_LE(static_cast<int64_t>(want.size()), kGreedyMaxNew);
  std::vector<int32_t> p;
  for (int64_t i = 0; i < prompt.size(0); ++i) p.push_back(static_cast<int32_t>(prompt[i].item<int64_t>()));
  Generator gen(*model_, {});
  auto r = gen.Generate({p}, 1, Greedy(kGreedyMaxNew), Lora());
  ASSERT_TRUE(r.ok()) << Name() << ": " << r.status().ToString();
  ASSERT_EQ(r->size(), 1u);
  const Completion& c = (*r)[0];
  if (sixteen_bit_) {
    const at::Tensor seq = at::cat({prompt, want_t.narrow(0, 0, static_cast<int64_t>(want.size()))}).view({1, -1});
    ExpectSixteenBitGreedy(seq, at::ones_like(seq), prompt.size(0), {want}, *r);
    return;
  }
  EXPECT_EQ(Widen(c.token_ids), want) << Name() << ": " << FirstDifference(Widen(c.token_ids), want)
                                      << " (greedy_min_margin " << case_.at("greedy_min_margin") << ")";
  EXPECT_EQ(c.finish, want.back() == eos_ ? Completion::Finish::kEos : Completion::Finish::kLength) << Name();
}

TEST_P(RuntimeReferenceTest, LeftPaddedBatchEqualsTransformersGenerate) {
  const at::Tensor& prompts = Expected("batch_prompts");
  const at::Tensor& mask = Expected("batch_attention_mask");
  const at::Tensor& want = Expected("batch_new_tokens");
  ASSERT_TRUE(prompts.defined() && mask.defined() && want.defined());
  ASSERT_EQ(prompts.size(0), want.size(0));
  const int64_t pad = case_.at("batch_pad_id").get<int64_t>();
  std::vector<std::vector<int32_t>> unpadded(static_cast<size_t>(prompts.size(0)));
  for (int64_t r = 0; r < prompts.size(0); ++r) {
    for (int64_t i = 0; i < prompts.size(1); ++i) {
      if (mask[r][i].item<int64_t>() == 0) {
        ASSERT_EQ(prompts[r][i].item<int64_t>(), pad) << Name() << " row " << r;
        continue;
      }
      unpadded[static_cast<size_t>(r)].push_back(static_cast<int32_t>(prompts[r][i].item<int64_t>()));
    }
  }
  ASSERT_NE(unpadded[0].size(), unpadded[1].size()) << Name() << ": the batch should need padding";
  Generator gen(*model_, {});
  auto r = gen.Generate(unpadded, 1, Greedy(kBatchMaxNew), Lora());
  ASSERT_TRUE(r.ok()) << Name() << ": " << r.status().ToString();
  ASSERT_EQ(r->size(), unpadded.size());
  if (sixteen_bit_) {
    // Teacher forcing needs one length per row: HF's rows are cut at their EOS, the pads after it
    // are masked out.
    std::vector<std::vector<int64_t>> w;
    for (int64_t row = 0; row < want.size(0); ++row) w.push_back(UpToEos(want[row], eos_));
    const at::Tensor seq = at::cat({prompts, want}, 1);
    at::Tensor m = at::cat({mask, at::ones_like(want)}, 1);
    for (size_t row = 0; row < w.size(); ++row) {
      m[static_cast<int64_t>(row)]
          .narrow(0, prompts.size(1) + static_cast<int64_t>(w[row].size()),
                  want.size(1) - static_cast<int64_t>(w[row].size()))
          .fill_(0);
    }
    ExpectSixteenBitGreedy(seq, m, prompts.size(1), w, *r);
    return;
  }
  for (size_t row = 0; row < unpadded.size(); ++row) {
    const Completion& c = (*r)[row];
    ASSERT_EQ(c.prompt_index, row);
    const std::vector<int64_t> w = UpToEos(want[static_cast<int64_t>(row)], eos_);
    EXPECT_EQ(Widen(c.token_ids), w) << Name() << " row " << row << ": " << FirstDifference(Widen(c.token_ids), w)
                                     << " (batch_min_margin " << case_.at("batch_min_margin") << ")";
    // HF pads after EOS; the rest of the row must be the pad id.
    for (int64_t i = static_cast<int64_t>(w.size()); i < want.size(1); ++i) {
      EXPECT_EQ(want[static_cast<int64_t>(row)][i].item<int64_t>(), pad) << Name() << " row " << row;
    }
  }
}

TEST_P(RuntimeReferenceTest, LoraGradientsEqualAutograd) {
  if (!case_.contains("grad")) GTEST_SKIP() << Name() << " has no gradient fixture";
  ASSERT_NE(adapter_, nullptr) << Name();
  const at::Tensor& ids = Expected("grad_input_ids");
  const at::Tensor& want_loss = Expected("grad_loss");
  ASSERT_TRUE(ids.defined() && want_loss.defined());
  for (const at::Tensor& p : adapter_->parameters()) ASSERT_TRUE(p.requires_grad()) << Name();
  auto logits = Logits(ids, Lora(), /*training=*/true);
  ASSERT_TRUE(logits.ok()) << Name() << ": " << logits.status().ToString();
  const int64_t V = logits->size(-1);
  // cases.json "loss": mean cross-entropy of logits[:, :-1] against input_ids[:, 1:].
  const at::Tensor loss = at::cross_entropy_loss(logits->narrow(1, 0, ids.size(1) - 1).reshape({-1, V}),
                                                 ids.narrow(1, 1, ids.size(1) - 1).reshape({-1}));
  EXPECT_NEAR(loss.item<double>(), want_loss.item<double>(), kGradTolerance) << Name() << ": loss";
  loss.backward();
  size_t compared = 0;
  for (const auto& [key, p] : adapter_->named_parameters()) {
    const at::Tensor& want = Expected("grad." + key);
    if (!want.defined()) continue;
    ASSERT_TRUE(p.grad().defined()) << Name() << ": no gradient for " << key;
    ASSERT_EQ(p.grad().sizes(), want.sizes()) << Name() << ": " << key;
    const double d = (p.grad().to(at::kFloat).cpu() - want).abs().max().item<double>();
    EXPECT_LE(d, kGradTolerance) << Name() << ": d loss / d " << key;
    ++compared;
  }
  size_t in_file = 0;
  for (const auto& [name, t] : expected_) in_file += name.rfind("grad.", 0) == 0 ? 1 : 0;
  EXPECT_EQ(compared, in_file) << Name() << ": gradients in the fixture vs adapter parameters";
  EXPECT_EQ(compared, adapter_->named_parameters().size()) << Name();
}

TEST_P(RuntimeReferenceTest, FerrySavedAdaptersReloadWithIdenticalLogits) {
  if (!adapter_) GTEST_SKIP() << Name() << " has no adapter";
  const at::Tensor& ids = Expected("input_ids");
  ASSERT_TRUE(ids.defined());
  ScopedTempDir tmp("ferry_runtime_reference_");
  const char* export_env = std::getenv("FERRY_RUNTIME_EXPORT_DIR");
  const fs::path out = export_env != nullptr && *export_env != '\0' ? fs::path(export_env) / Name() : tmp.path();
  std::error_code ec;
  fs::create_directories(out, ec);
  ASSERT_FALSE(ec) << out << ": " << ec.message();

  // A fresh Ferry adapter with the PEFT adapter's config, B random so it changes the logits.
  auto fresh = LoraAdapter::Create(*model_, adapter_->config(), 7);
  ASSERT_TRUE(fresh.ok()) << Name() << ": " << fresh.status().ToString();
  {
    at::NoGradGuard no_grad;
    at::Generator gen = at::detail::createCPUGenerator(1234);
    for (const auto& [key, p] : (*fresh)->named_parameters()) {
      if (key.find(".lora_B.") == std::string::npos) continue;
      at::Tensor b = p;
      b.copy_(at::randn(p.sizes(), gen, at::kFloat) * 0.1);
    }
  }
  const std::vector<std::pair<std::string, const LoraAdapter*>> adapters = {{"peft_resaved", adapter_.get()},
                                                                            {"fresh", fresh->get()}};
  auto base = Logits(ids, nullptr);
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  for (const auto& [label, adapter] : adapters) {
    auto before = Logits(ids, &adapter->binding());
    ASSERT_TRUE(before.ok()) << Name() << " " << label << ": " << before.status().ToString();
    EXPECT_GT((*before - *base).abs().max().item<double>(), 1e-2) << Name() << " " << label << ": no effect";
    const fs::path dir = out / label;
    Status s = adapter->Save(dir, fs::absolute(model_dir_).string(), /*force=*/true);
    ASSERT_TRUE(s.ok()) << Name() << " " << label << ": " << s.ToString();
    auto reloaded = LoraAdapter::Load(*model_, dir);
    ASSERT_TRUE(reloaded.ok()) << Name() << " " << label << ": " << reloaded.status().ToString();
    EXPECT_EQ((*reloaded)->named_parameters().size(), adapter->named_parameters().size()) << Name() << " " << label;
    auto after = Logits(ids, &(*reloaded)->binding());
    ASSERT_TRUE(after.ok()) << after.status().ToString();
    EXPECT_TRUE(at::equal(*after, *before)) << Name() << " " << label << ": reloaded adapter changes the logits by "
                                            << (*after - *before).abs().max().item<double>();
    if (export_env != nullptr && *export_env != '\0') {
      Status w = ferry::testing::WriteTensors(out / (label + ".safetensors"),
                                              {{"input_ids", ids.contiguous()}, {"logits", before->contiguous()}});
      ASSERT_TRUE(w.ok()) << w.ToString();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, RuntimeReferenceTest, ::testing::ValuesIn(Params(false)),
                         [](const ::testing::TestParamInfo<ReferenceParam>& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(FusedAttention, RuntimeReferenceTest, ::testing::ValuesIn(Params(false, true)),
                         [](const ::testing::TestParamInfo<ReferenceParam>& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Cuda, RuntimeReferenceTest, ::testing::ValuesIn(Params(true)),
                         [](const ::testing::TestParamInfo<ReferenceParam>& info) { return info.param.name; });

}  // namespace
}  // namespace ferry::runtime
