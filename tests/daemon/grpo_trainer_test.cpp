// ferryd's GRPO trainer end to end on a tiny model: the weight path's proofs (the generator runs
// exactly the converter's merge of the adapter saved at each step; no wrapped name ever reaches
// it; the reference policy is the base), metrics.jsonl, checkpoints, determinism and resume.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "convert/converter.h"
#include "core/checkpoint.h"
#include "daemon/dist/process_group.h"
#include "daemon/grpo/trainer.h"
#include "daemon/grpo/trainer_internal.h"
#include "daemon/grpo/vllm_generator.h"
#include "daemon/run/checkpoint_state.h"
#include "daemon/runtime/model.h"
#include "store/materialize.h"
#include "store/store.h"
#include "sync/snapshot.h"
#include "tests/daemon/runtime_test_util.h"
#include "tests/temp_dir.h"

namespace ferry::grpo {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using TempDir = testing::ScopedTempDir;
using testing::ReadText;
using testing::WriteText;

// The digit tokenizer with <bos>/<eos> (ids 12, 13).
std::string DigitTokenizerJson() { return testing::DigitTokenizerJson("<eos>"); }

// A tiny Llama (or Qwen2) over the digit tokenizer, with an addition dataset and a config.
struct RunFiles {
  fs::path model;
  fs::path config;
  fs::path dir;
};

// `model_src`: a model directory (with its tokenizer) to train instead of a tiny random one.
RunFiles MakeRun(const fs::path& root, at::ScalarType dtype, int64_t max_steps = 3, int64_t save_steps = 1,
                 const fs::path& model_src = {}) {
  RunFiles r;
  r.model = root / "model";
  if (!model_src.empty()) {
    fs::copy(model_src, r.model, fs::copy_options::recursive);
  } else {
    testing::TinyModelSpec spec;
    spec.vocab = 14;
    spec.hidden = 32;
    spec.intermediate = 64;
    spec.dtype = dtype;
    spec.std = 0.1;
    EXPECT_TRUE(testing::WriteTinyModel(r.model, spec).ok());
    json cfg = json::parse(ReadText(r.model / "config.json"));
    cfg["bos_token_id"] = 12;
    cfg["eos_token_id"] = 13;
    WriteText(r.model / "config.json", cfg.dump(2));
    WriteText(r.model / "tokenizer.json", DigitTokenizerJson());
    WriteText(r.model / "tokenizer_config.json",
              R"({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<eos>", "add_bos_token": false})");
  }
  std::ofstream data(root / "train.jsonl");
  for (int a = 0; a < 40; ++a) {
    const int x = (a * 37) % 100, y = (a * 53 + 11) % 100;
    char line[128];
    std::snprintf(line, sizeof(line), R"({"prompt": "%02d+%02d=", "answer": "%03d"})", x, y, x + y);
    data << line << "\n";
  }
  data.close();
  r.dir = root / "run";
  r.config = root / "grpo.toml";
  WriteText(r.config, R"(model_name_or_path = "model"
dataset = "train.jsonl"
output_dir = "run"
chat_template = "none"
threads = 2
bf16 = false
seed = 7
learning_rate = 5e-3
lr_scheduler_type = "constant"
max_steps = )" + std::to_string(max_steps) +
                          R"(
per_device_train_batch_size = 8
num_generations = 4
max_completion_length = 4
temperature = 1.0
logging_steps = 1
save_steps = )" + std::to_string(save_steps) +
                          R"(
save_total_limit = 10

[lora]
r = 4
lora_alpha = 8
target_modules = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]

[[rewards]]
name = "digits"
type = "digit_match"
field = "answer"
)");
  return r;
}

// Adds a top-level `key = value` line to the run's TOML (before its tables).
void AddTopLevelKey(const fs::path& config, const std::string& line) {
  std::string text = ReadText(config);
  const size_t at = text.find("threads = 2\n");
  ASSERT_NE(at, std::string::npos) << config;
  text.insert(at, line);
  WriteText(config, text);
}

// The run's options with its config loaded (as ferryd loads it before Trainer::Create).
TrainOptions Options(const fs::path& config) {
  TrainOptions o;
  auto c = run::LoadRunConfig(config);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  if (c.ok()) o.config = std::move(*c);
  return o;
}

std::vector<json> MetricsLines(const fs::path& dir) {
  std::vector<json> out;
  std::ifstream in(dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
  return out;
}

// The id `ferry verify` computes for the converter's merge of checkpoint-N onto the base.
std::string ConvertedId(const RunFiles& r, int64_t step, const fs::path& scratch) {
  ConvertOptions co;
  co.base = r.model;
  co.adapter = r.dir / ("checkpoint-" + std::to_string(step));
  co.out = scratch / ("converted-" + std::to_string(step));
  co.sync = false;
  auto summary = Convert(co);
  EXPECT_TRUE(summary.ok()) << summary.status().ToString();
  auto rec = store::HashPath(co.out);
  EXPECT_TRUE(rec.ok()) << rec.status().ToString();
  return rec.ok() ? rec->id.Hex() : "";
}

void ExpectGeneratorRunsConvertedCheckpoints(at::ScalarType dtype, const fs::path& model_src = {}) {
  TempDir tmp;
  RunFiles r = MakeRun(tmp.path(), dtype, 3, 1, model_src);
  auto trainer = Trainer::Create(Options(r.config));
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  auto base = store::HashPath(r.model);
  ASSERT_TRUE(base.ok());
  ASSERT_TRUE((*trainer)->Run().ok());

  const std::vector<json> lines = MetricsLines(r.dir);
  ASSERT_EQ(lines.size(), 3u);
  for (const json& line : lines) {
    const int64_t step = line.at("step").get<int64_t>();
    const std::string version = line.at("generator_version").get<std::string>();
    ASSERT_EQ(version.size(), 32u);
    // After step k the generator's weights are the converter's merge of checkpoint-k.
    EXPECT_EQ(version, ConvertedId(r, step, tmp.path())) << "step " << step;
    // ... which is not the base (the update reached the generator).
    EXPECT_NE(version, base->id.Hex()) << "step " << step;
    for (const char* key : {"reward", "reward_std", "loss", "grad_norm", "learning_rate", "entropy",
                            "completions/mean_length", "frac_reward_zero_std", "rewards/digits/mean", "num_tokens"}) {
      EXPECT_TRUE(line.contains(key)) << key << " missing at step " << step;
    }
  }
  EXPECT_NE(lines[0]["generator_version"], lines[2]["generator_version"]);
  // The store names every step's generator version (what `ferry verify --db` reports).
  auto st = store::Store::Open(r.dir / "store", store::StoreOptions{.read_only = true});
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  for (const json& line : lines) {
    auto v = (*st)->GetVersion(line["generator_version"].get<std::string>());
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    EXPECT_EQ(v->kind, store::VersionKind::kMerged);
    EXPECT_EQ(v->step, line["step"].get<int64_t>());
    ASSERT_TRUE(v->adapter_version.has_value());
    EXPECT_EQ(v->base_version->Hex(), base->id.Hex());
    // Recorded by its digests only: a step adds the adapter's bytes, not a model's.
    EXPECT_TRUE(v->derived);
  }
  // ... and rebuilt bit-identically from base + adapter.
  const std::string last = lines.back()["generator_version"].get<std::string>();
  auto id = store::Digest::FromHex(last);
  ASSERT_TRUE(id.ok());
  auto m = store::Materialize(**st, *id, tmp.path() / "materialized", store::MaterializeOptions{});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto rebuilt = store::HashPath(tmp.path() / "materialized");
  ASSERT_TRUE(rebuilt.ok());
  EXPECT_EQ(rebuilt->id.Hex(), last);
}

TEST(GrpoTrainerTest, GeneratorRunsTheConvertersMergeOfEachCheckpointF32) {
  ExpectGeneratorRunsConvertedCheckpoints(at::kFloat);
}

TEST(GrpoTrainerTest, GeneratorRunsTheConvertersMergeOfEachCheckpointBF16) {
  ExpectGeneratorRunsConvertedCheckpoints(at::kBFloat16);
}

// A bitsandbytes NF4 base with double quantisation (made by transformers + bitsandbytes):
// the trainer keeps it packed, the snapshot dequantises and merges it as `ferry convert` does.
TEST(GrpoTrainerTest, GeneratorRunsTheConvertersMergeOfEachCheckpointNF4) {
  ExpectGeneratorRunsConvertedCheckpoints(at::kFloat, fs::path(FERRY_FIXTURES_DIR) / "runtime/models/llama_nf4_dq_f32");
}

// The same NF4 base trained on CUDA: the packed base, its companions, the adapter, the
// optimizer's state and the generator's model all live on the GPU (no tensor split across
// devices), and the generator still runs exactly the converter's merge of each checkpoint.
TEST(GrpoTrainerTest, Nf4BaseTrainsWithEveryTensorOnTheCudaDevice) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device (this LibTorch or machine)";
  TempDir tmp;
  RunFiles r = MakeRun(tmp.path(), at::kFloat, 2, 1, fs::path(FERRY_FIXTURES_DIR) / "runtime/models/llama_nf4_dq_f32");
  AddTopLevelKey(r.config, "device = \"cuda\"\n");
  auto trainer = Trainer::Create(Options(r.config));
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  const Status run = (*trainer)->Run();
  ASSERT_TRUE(run.ok()) << run.ToString();

  const Trainer::State& s = *(*trainer)->state_for_testing();
  const at::Device cuda(at::kCUDA, 0);
  auto expect_on_cuda = [&](const at::Tensor& t, const std::string& what) {
    ASSERT_TRUE(t.defined()) << what;
    EXPECT_EQ(t.device(), cuda) << what << " of shape " << t.sizes() << " is on " << t.device();
  };
  size_t n = 0;
  for (const at::Tensor& t : s.model->tensors()) expect_on_cuda(t, "trainer model tensor #" + std::to_string(n++));
  EXPECT_GT(n, 0u);
  for (const auto& [key, p] : s.adapter->named_parameters()) expect_on_cuda(p, "adapter tensor " + key);
  size_t states = 0;
  for (const auto& [key, state] : s.optimizer->state()) {
    const auto& adam = static_cast<const torch::optim::AdamWParamState&>(*state);
    expect_on_cuda(adam.exp_avg(), "AdamW exp_avg");
    expect_on_cuda(adam.exp_avg_sq(), "AdamW exp_avg_sq");
    ++states;
  }
  EXPECT_EQ(states, s.adapter->named_parameters().size());
  ASSERT_NE(s.generator->model(), nullptr);
  n = 0;
  for (const at::Tensor& t : s.generator->model()->tensors()) {
    expect_on_cuda(t, "generator model tensor #" + std::to_string(n++));
  }

  const std::vector<json> lines = MetricsLines(r.dir);
  ASSERT_EQ(lines.size(), 2u);
  for (const json& line : lines) {
    const int64_t step = line.at("step").get<int64_t>();
    EXPECT_EQ(line.at("generator_version").get<std::string>(), ConvertedId(r, step, tmp.path())) << "step " << step;
    EXPECT_TRUE(std::isfinite(line.at("loss").get<double>())) << "step " << step;
  }
}

// generation_dtype bfloat16 over an F32 base: the generator converts the base once. At each
// sync the tensors the step left unchanged (equal digests: k_proj, up_proj, embeddings, norms,
// lm_head here) are the previous model's converted copies, the others are converted anew, and
// the model computes exactly what one converted afresh from the same snapshot computes.
TEST(GrpoTrainerTest, Bf16GeneratorOverAnF32BaseConvertsOnlyWhatAStepChanged) {
  TempDir tmp;
  RunFiles r = MakeRun(tmp.path(), at::kFloat, 2, 1);
  AddTopLevelKey(r.config, "generation_dtype = \"bfloat16\"\n");
  auto trainer = Trainer::Create(Options(r.config));
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  const Trainer::State& s = *(*trainer)->state_for_testing();
  // The weights by checkpoint name (held, so a freed buffer's address cannot come back).
  auto weights = [](const runtime::CausalLM& m) {
    std::map<std::string, at::Tensor> w;
    for (int i = 0; i < m.num_layers(); ++i) {
      for (int p = 0; p < runtime::kNumProj; ++p) {
        const auto proj = static_cast<runtime::Proj>(p);
        w["model.layers." + std::to_string(i) + "." + std::string(runtime::ProjName(proj)) + ".weight"] =
            m.layer_linear(i, proj).weight;
      }
    }
    w["lm_head.weight"] = m.lm_head().weight;
    return w;
  };
  ASSERT_NE(s.generator->model(), nullptr);
  EXPECT_EQ(s.generator->model()->dtype(), at::kBFloat16);
  const std::map<std::string, at::Tensor> before = weights(*s.generator->model());
  const std::shared_ptr<const sync::Snapshot> base_snapshot = s.generator->current().snapshot;

  ASSERT_TRUE((*trainer)->Step().ok());
  const runtime::CausalLM& model = *s.generator->model();
  const std::shared_ptr<const sync::Snapshot> snapshot = s.generator->current().snapshot;
  ASSERT_NE(snapshot->manifest_id(), base_snapshot->manifest_id());
  const std::map<std::string, at::Tensor> after = weights(model);
  int shared = 0, converted = 0;
  for (const auto& [name, t] : after) {
    const bool unchanged = base_snapshot->digests().at(name) == snapshot->digests().at(name);
    EXPECT_EQ(t.data_ptr() == before.at(name).data_ptr(), unchanged) << name << (unchanged ? " unchanged" : " changed");
    EXPECT_EQ(t.scalar_type(), at::kBFloat16) << name;
    ++(unchanged ? shared : converted);
  }
  EXPECT_EQ(shared, 2 * 2 + 1) << "k_proj and up_proj of both layers, and lm_head";
  EXPECT_EQ(converted, 2 * 5);

  runtime::ModelOptions mo;
  mo.dtype = at::kBFloat16;
  auto fresh = runtime::CausalLM::FromCheckpoint(model.config(), snapshot->checkpoint(), mo, snapshot);
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  runtime::ForwardArgs args;
  args.input_ids = at::tensor({1, 5, 3, 9, 2, 11}, at::kLong).reshape({2, 3});
  args.positions = at::arange(3, at::kLong).repeat({2, 1});
  auto got = model.Forward(args);
  auto want = (*fresh)->Forward(args);
  ASSERT_TRUE(got.ok() && want.ok());
  EXPECT_TRUE(at::equal(*got, *want));
}

TEST(GrpoTrainerTest, NoWrappedNameReachesTheGeneratorAndTheReferenceIsTheBase) {
  TempDir tmp;
  RunFiles r = MakeRun(tmp.path(), at::kFloat);
  TrainOptions o = Options(r.config);
  o.max_steps = 1;
  auto trainer = Trainer::Create(o);
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  const Trainer::State& s = *(*trainer)->state_for_testing();
  ASSERT_TRUE((*trainer)->Step().ok());
  const Checkpoint& held = s.generator->current().snapshot->checkpoint();
  ASSERT_FALSE(held.names().empty());
  for (const std::string& name : held.names()) {
    EXPECT_EQ(name.find("base_model.model."), std::string::npos) << name;
    EXPECT_EQ(name.find(".base_layer"), std::string::npos) << name;
    EXPECT_EQ(name.find("lora_"), std::string::npos) << name;
  }
  // The reference policy (the trainer's model with the adapter off) is the base model's,
  // bit for bit, after an update moved the adapter.
  auto base = runtime::CausalLM::Load(r.model, runtime::ModelOptions{});
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  at::Tensor ids = at::tensor({12, 1, 2, 10, 3, 4, 11, 0, 4}, at::kLong).unsqueeze(0);
  runtime::ForwardArgs without;
  without.input_ids = ids;
  without.positions = at::arange(ids.size(1), at::kLong).unsqueeze(0);
  auto ref = s.model->Forward(without);
  auto expected = (*base)->Forward(without);
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  EXPECT_TRUE(at::equal(*ref, *expected)) << "max |diff| " << (*ref - *expected).abs().max().item<double>();
  runtime::ForwardArgs with = without;
  with.lora = &s.adapter->binding();
  auto policy = s.model->Forward(with);
  ASSERT_TRUE(policy.ok());
  EXPECT_FALSE(at::equal(*policy, *expected)) << "the adapter should have moved after one step";
}

std::vector<json> WithoutTimes(std::vector<json> lines) {
  for (json& l : lines) {
    // Seconds differ from run to run: step_time and each phase's timing/*.
    l.erase("step_time");
    for (auto it = l.begin(); it != l.end();) it = it.key().starts_with("timing/") ? l.erase(it) : std::next(it);
  }
  return lines;
}

TEST(GrpoTrainerTest, SameSeedSameRunAndResumeEqualsUninterrupted) {
  // Uninterrupted: 4 steps, checkpoints at 2 and 4.
  TempDir a;
  RunFiles ra = MakeRun(a.path(), at::kFloat, 4, 2);
  {
    auto t = Trainer::Create(Options(ra.config));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ASSERT_TRUE((*t)->Run().ok());
  }
  // Interrupted after step 3 (one step past the checkpoint at 2, its line logged), then
  // restarted with the same command: it resumes from checkpoint-2, drops step 3's line and
  // redoes it.
  TempDir b;
  RunFiles rb = MakeRun(b.path(), at::kFloat, 4, 2);
  {
    auto t = Trainer::Create(Options(rb.config));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    for (int i = 0; i < 3; ++i) {
      auto step = (*t)->Step();
      ASSERT_TRUE(step.ok()) << step.status().ToString();
      if ((*step).step == 2) {
        ASSERT_TRUE((*t)->SaveCheckpoint().ok());
      }
    }
    EXPECT_EQ(MetricsLines(rb.dir).size(), 3u);
  }
  {
    auto t = Trainer::Create(Options(rb.config));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ((*t)->step(), 2);
    ASSERT_TRUE((*t)->Run().ok());
  }
  const auto la = WithoutTimes(MetricsLines(ra.dir));
  const auto lb = WithoutTimes(MetricsLines(rb.dir));
  ASSERT_EQ(la.size(), 4u);
  ASSERT_EQ(lb.size(), 4u);
  for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lb[i]) << "line " << i;
  // The store shows each step once.
  auto st = store::Store::Open(rb.dir / "store", store::StoreOptions{.read_only = true});
  ASSERT_TRUE(st.ok());
  auto versions = (*st)->ListVersions(std::nullopt);
  ASSERT_TRUE(versions.ok());
  std::map<int64_t, int> merged_per_step;
  for (const auto& v : *versions) {
    if (v.kind == store::VersionKind::kMerged && v.step) ++merged_per_step[*v.step];
  }
  EXPECT_EQ(merged_per_step, (std::map<int64_t, int>{{1, 1}, {2, 1}, {3, 1}, {4, 1}}));
}

TEST(GrpoTrainerTest, BadConfigNamesTheKeyAndTheFile) {
  TempDir tmp;
  RunFiles r = MakeRun(tmp.path(), at::kFloat);
  WriteText(r.config, ReadText(r.config) + "\nnum_generatoins = 4\n");
  auto t = run::LoadRunConfig(r.config);  // what ferryd does before Trainer::Create
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("num_generatoins"), std::string::npos) << t.status().ToString();
  EXPECT_NE(t.status().message().find(r.config.string()), std::string::npos) << t.status().ToString();
  EXPECT_FALSE(fs::exists(r.dir / "metrics.jsonl"));
}

// --- Resume verifies a checkpoint before using it (training_state.cpp) -----------------------

// The file offset of element `index` of tensor `name` in a safetensors file.
uint64_t ElementOffset(const fs::path& file, const std::string& name, int64_t index, int64_t elem_bytes) {
  auto ckpt = Checkpoint::Open(file);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  return ckpt->RangeOf(name).offset + static_cast<uint64_t>(index * elem_bytes);
}

void FlipByte(const fs::path& file, uint64_t offset, uint8_t mask) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f.good()) << file;
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(static_cast<uint8_t>(c) ^ mask);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

std::vector<std::string> DirNames(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Each test: an uninterrupted run of 4 steps with checkpoints at 2 and 4 (its metrics kept as
// the reference), then damage to it.
class ResumeVerifyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    run_ = MakeRun(tmp_.path(), at::kFloat, 4, 2);
    auto t = Trainer::Create(Options(run_.config));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ASSERT_TRUE((*t)->Run().ok());
    reference_ = WithoutTimes(MetricsLines(run_.dir));
    ASSERT_EQ(reference_.size(), 4u);
  }

  // A restart of the damaged run: what it said, and the trainer.
  Result<std::unique_ptr<Trainer>> Restart(std::vector<std::string>& said) {
    TrainOptions o = Options(run_.config);
    o.on_message = [&said](const std::string& m) { said.push_back(m); };
    return Trainer::Create(o);
  }

  // Restarts after `damage` to checkpoint-4: the run resumes from checkpoint-2, says which
  // checkpoint it skipped and why (`why`, naming the file and tensor), keeps it aside, and
  // ends with the metrics of the uninterrupted run.
  void ExpectResumeSkipsCheckpoint4(const std::string& why) {
    std::vector<std::string> said;
    auto t = Restart(said);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ((*t)->step(), 2);
    std::string all;
    for (const auto& m : said) all += m + "\n";
    EXPECT_NE(all.find("skipped checkpoint-4: "), std::string::npos) << all;
    EXPECT_NE(all.find(why), std::string::npos) << all;
    EXPECT_NE(all.find("moved checkpoint-4 aside to checkpoint-4.refused"), std::string::npos) << all;
    EXPECT_NE(all.find("resumed from " + (run_.dir / "checkpoint-2").string()), std::string::npos) << all;
    EXPECT_TRUE(fs::exists(run_.dir / "checkpoint-4.refused" / "adapter_model.safetensors"));
    EXPECT_EQ(MetricsLines(run_.dir).size(), 2u);
    ASSERT_TRUE((*t)->Run().ok());
    const auto got = WithoutTimes(MetricsLines(run_.dir));
    ASSERT_EQ(got.size(), 4u);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], reference_[i]) << "line " << i;
  }

  TempDir tmp_;
  RunFiles run_;
  std::vector<json> reference_;
};

const char* const kLoraB = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";

TEST_F(ResumeVerifyTest, AdapterWithAFlippedHighByteIsSkipped) {
  const fs::path file = run_.dir / "checkpoint-4" / "adapter_model.safetensors";
  FlipByte(file, ElementOffset(file, kLoraB, 3, 4) + 3, 0x40);  // the exponent's top bit
  ExpectResumeSkipsCheckpoint4(file.string() + ": tensor '" + kLoraB + "' differs from what was written");
}

TEST_F(ResumeVerifyTest, AdapterWithALowMantissaBitFlippedIsSkipped) {
  const fs::path file = run_.dir / "checkpoint-4" / "adapter_model.safetensors";
  FlipByte(file, ElementOffset(file, kLoraB, 5, 4), 0x01);  // the value changes in its last bit
  ExpectResumeSkipsCheckpoint4(file.string() + ": tensor '" + kLoraB + "' differs from what was written");
}

TEST_F(ResumeVerifyTest, OptimizerStateWithAFlippedByteIsSkipped) {
  const fs::path file = run_.dir / "checkpoint-4" / "optimizer.safetensors";
  const std::string moment = std::string("exp_avg_sq.") + kLoraB;
  FlipByte(file, ElementOffset(file, moment, 0, 4) + 1, 0x10);
  ExpectResumeSkipsCheckpoint4(file.string() + ": tensor '" + moment + "' differs from what was written");
}

TEST_F(ResumeVerifyTest, TruncatedOptimizerStateIsSkipped) {
  const fs::path file = run_.dir / "checkpoint-4" / "optimizer.safetensors";
  fs::resize_file(file, fs::file_size(file) - 100);
  ExpectResumeSkipsCheckpoint4(file.string() + ": ");
}

TEST_F(ResumeVerifyTest, EditedTrainerStateIsSkipped) {
  const fs::path file = run_.dir / "checkpoint-4" / "trainer_state.json";
  std::string text = ReadText(file);
  const size_t at = text.find("\"num_tokens\": ");
  ASSERT_NE(at, std::string::npos) << text;
  text.insert(at + 14, "1");
  WriteText(file, text);
  ExpectResumeSkipsCheckpoint4(file.string() + ": differs from what the store recorded for checkpoint-4");
}

TEST_F(ResumeVerifyTest, NoCheckpointVerifiesRefusesToStartAndChangesNothing) {
  for (const char* c : {"checkpoint-2", "checkpoint-4"}) {
    const fs::path file = run_.dir / c / "adapter_model.safetensors";
    FlipByte(file, ElementOffset(file, kLoraB, 0, 4) + 3, 0x40);
  }
  const std::string metrics_before = ReadText(run_.dir / "metrics.jsonl");
  const std::vector<std::string> names_before = DirNames(run_.dir);
  std::vector<std::string> said;
  auto t = Restart(said);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kCorruption);
  const std::string msg = t.status().message();
  EXPECT_NE(msg.find("no checkpoint of " + run_.dir.string() + " verifies"), std::string::npos) << msg;
  EXPECT_NE(msg.find("checkpoint-4: " + (run_.dir / "checkpoint-4" / "adapter_model.safetensors").string()),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("checkpoint-2: " + (run_.dir / "checkpoint-2" / "adapter_model.safetensors").string()),
            std::string::npos)
      << msg;
  EXPECT_EQ(ReadText(run_.dir / "metrics.jsonl"), metrics_before);
  EXPECT_EQ(DirNames(run_.dir), names_before);
}

TEST_F(ResumeVerifyTest, CheckpointsRecordTheirFilesAndTheStoreRecordsTheCheckpoint) {
  const fs::path c4 = run_.dir / "checkpoint-4";
  const std::string text = ReadText(c4 / "trainer_state.json");
  auto st = run::ParseTrainerState(text, "trainer_state.json");
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(st->global_step, 4);
  for (const char* f : {"adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors"}) {
    ASSERT_TRUE(st->files.count(f)) << f;
    EXPECT_EQ(st->files.at(f).size, fs::file_size(c4 / f)) << f;
  }
  EXPECT_EQ(st->files.at("adapter_model.safetensors").tensors.size(), 20u);  // 5 modules x 2 layers x A, B
  auto store = store::Store::Open(run_.dir / "store", store::StoreOptions{.read_only = true});
  ASSERT_TRUE(store.ok());
  auto events = (*store)->ListEvents(std::nullopt);
  ASSERT_TRUE(events.ok());
  int found = 0;
  for (const auto& e : *events) {
    if (e.type != store::Event::Type::kCheckpoint) continue;
    const json d = json::parse(e.detail);
    if (d.at("step") == 4) {
      ++found;
      EXPECT_EQ(d.at("checkpoint"), "checkpoint-4");
      EXPECT_EQ(d.at("trainer_state"), store::AuxDigest(text).Hex());
      EXPECT_EQ(e.version.Hex(), st->generator_version);
    }
  }
  EXPECT_EQ(found, 1);
}

// ---------------------------------------------------------------------------------------------
// Data-parallel ranks (daemon/grpo/data_parallel.h): with the completions fixed, W = 2 ranks
// taking half the prompts each make the same update as one process taking all of them.

// num_generations completions of each prompt, a function of the prompt's ids, the completion's
// index and the step only (so a prompt gets the same ones whichever rank samples it).
std::vector<runtime::Completion> FixedCompletions(const std::vector<std::vector<int32_t>>& prompts, int64_t step) {
  std::vector<runtime::Completion> out;
  for (size_t p = 0; p < prompts.size(); ++p) {
    for (uint64_t j = 0; j < 4; ++j) {
      uint64_t h = 1469598103934665603ULL ^ (static_cast<uint64_t>(step) * 1000003ULL + j);
      for (int32_t id : prompts[p]) h = (h ^ static_cast<uint64_t>(id)) * 1099511628211ULL;
      h ^= h >> 29;
      h *= 0xbf58476d1ce4e5b9ULL;
      h ^= h >> 32;
      runtime::Completion c;
      c.prompt_index = p;
      const int digits = 1 + static_cast<int>(h % 3);
      for (int t = 0; t < digits; ++t) c.token_ids.push_back(static_cast<int32_t>((h >> (4 + 4 * t)) % 10));
      if ((h >> 24) % 4 != 0) {
        c.token_ids.push_back(13);  // <eos>
        c.finish = runtime::Completion::Finish::kEos;
      }
      for (size_t t = 0; t < c.token_ids.size(); ++t) {
        c.logprobs.push_back(-0.2f - 0.1f * static_cast<float>((h >> (40 + 3 * t)) % 8));
      }
      out.push_back(std::move(c));
    }
  }
  return out;
}

struct DpResult {
  std::map<std::string, at::Tensor> adapter;
  std::vector<std::map<std::string, double>> metrics;  // per step (rank 0's)
};

// Rank `rank` of `world` (threads of this process) on a loopback TCPStore at `port`.
Result<std::unique_ptr<dist::ProcessGroup>> JoinRank(int rank, int world, int port, std::chrono::seconds timeout) {
  dist::Launch l;
  l.rank = rank;
  l.world_size = world;
  l.master_port = port;
  dist::GroupOptions go;
  go.timeout = timeout;
  return dist::ProcessGroup::Join(l, go);
}

// Trains 3 steps with `world` ranks (threads of this process, one Gloo group) at a global
// batch of 4 prompts x 4 completions, `extra` added to the config.
DpResult TrainWithRanks(const fs::path& root, int world, const std::string& extra) {
  RunFiles r = MakeRun(root, at::kFloat, 3, 100);
  AddTopLevelKey(r.config, extra);
  std::string text = ReadText(r.config);
  text.replace(text.find("threads = 2"), 11, "threads = 1");
  text.replace(text.find("per_device_train_batch_size = 8"), 31,
               "per_device_train_batch_size = " + std::to_string(16 / world));
  WriteText(r.config, text);
  DpResult out;
  auto free_port = dist::FreeLoopbackPort();
  EXPECT_TRUE(free_port.ok()) << free_port.status().ToString();
  const int port = free_port.ok() ? *free_port : 0;
  auto rank = [&](int rk) {
    std::unique_ptr<dist::ProcessGroup> group;
    TrainOptions o = Options(r.config);
    o.completions_for_testing = FixedCompletions;
    if (world > 1) {
      auto g = JoinRank(rk, world, port, std::chrono::seconds(60));
      ASSERT_TRUE(g.ok()) << g.status().ToString();
      group = std::move(*g);
      o.group = group.get();
    }
    auto trainer = Trainer::Create(o);
    ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
    std::vector<std::map<std::string, double>> metrics;
    for (int i = 0; i < 3; ++i) {
      auto step = (*trainer)->Step();
      ASSERT_TRUE(step.ok()) << step.status().ToString();
      ASSERT_EQ(step->rank_versions.size(), static_cast<size_t>(world));
      for (const std::string& v : step->rank_versions) EXPECT_EQ(v, step->generator_version);
      metrics.push_back(step->metrics);
    }
    if (rk == 0) {
      for (const auto& [k, p] : (*trainer)->state_for_testing()->adapter->named_parameters()) {
        out.adapter[k] = p.detach().clone();
      }
      out.metrics = metrics;
    }
  };
  std::vector<std::thread> others;
  for (int rk = 1; rk < world; ++rk) others.emplace_back(rank, rk);
  rank(0);
  for (auto& t : others) t.join();
  return out;
}

class DataParallelTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DataParallelTest, TwoRanksAtHalfThePromptsUpdateAsOneProcess) {
  TempDir tmp;
  const DpResult one = TrainWithRanks(tmp.path() / "w1", 1, GetParam());
  const DpResult two = TrainWithRanks(tmp.path() / "w2", 2, GetParam());
  ASSERT_EQ(one.adapter.size(), two.adapter.size());
  ASSERT_FALSE(one.adapter.empty());
  // F32 sums in another order (each rank's share, then the all-reduce): the parameters after
  // three AdamW steps (moving them by ~1e-2) agree to 2e-5 absolute. Measured: 6e-7 to 1.6e-6,
  // and 1.4e-5 with beta and unscaled rewards (AdamW divides by the root of small second
  // moments there). The rewards are the same numbers.
  double worst = 0;
  for (const auto& [k, p] : one.adapter) {
    ASSERT_TRUE(two.adapter.count(k)) << k;
    worst = std::max(worst, (p - two.adapter.at(k)).abs().max().item<double>());
  }
  EXPECT_LT(worst, 2e-5) << GetParam();
  // And the update is not nothing: the adapter moved away from its start by far more.
  double moved = 0;
  for (const auto& [k, p] : one.adapter) {
    if (k.find("lora_B") != std::string::npos) moved = std::max(moved, p.abs().max().item<double>());
  }
  EXPECT_GT(moved, 1e-3);
  ASSERT_EQ(one.metrics.size(), two.metrics.size());
  for (size_t i = 0; i < one.metrics.size(); ++i) {
    for (const char* k : {"reward", "reward_std", "num_tokens", "completions/mean_length", "frac_reward_zero_std"}) {
      EXPECT_NEAR(one.metrics[i].at(k), two.metrics[i].at(k), 1e-6) << k << " step " << i + 1;
    }
    EXPECT_NEAR(one.metrics[i].at("grad_norm"), two.metrics[i].at("grad_norm"), 1e-5) << "step " << i + 1;
  }
}

INSTANTIATE_TEST_SUITE_P(LossTypes, DataParallelTest,
                         ::testing::Values("loss_type = \"grpo\"\n", "loss_type = \"bnpo\"\n",
                                           "loss_type = \"dr_grpo\"\n", "loss_type = \"dapo\"\n",
                                           "loss_type = \"dapo\"\nscale_rewards = \"batch\"\n",
                                           "loss_type = \"grpo\"\nscale_rewards = \"none\"\n",
                                           "loss_type = \"grpo\"\nbeta = 0.04\n",
                                           "loss_type = \"grpo\"\nscale_rewards = \"none\"\nbeta = 0.04\n"));

// A rank that leaves after step 1: rank 0's step 2 fails naming the step once, the collective
// and the rank (kUnavailable), and refuses another step.
TEST(DataParallelFailureTest, ARankThatLeavesIsNamedWithTheStepOnce) {
  TempDir tmp;
  RunFiles r = MakeRun(tmp.path(), at::kFloat, 3, 100);
  std::string text = ReadText(r.config);
  text.replace(text.find("threads = 2"), 11, "threads = 1");
  WriteText(r.config, text);
  auto free_port = dist::FreeLoopbackPort();
  ASSERT_TRUE(free_port.ok()) << free_port.status().ToString();
  Status second = Status::OK(), third = Status::OK();
  auto rank = [&](int rk) {
    auto g = JoinRank(rk, 2, *free_port, std::chrono::seconds(10));
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    TrainOptions o = Options(r.config);
    o.completions_for_testing = FixedCompletions;
    o.group = g->get();
    auto trainer = Trainer::Create(o);
    ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
    auto first = (*trainer)->Step();
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    if (rk == 1) return;  // gone: its trainer and group end here
    second = (*trainer)->Step().status();
    third = (*trainer)->Step().status();
  };
  std::thread one(rank, 1);
  rank(0);
  one.join();
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.code(), StatusCode::kUnavailable) << second.ToString();
  const std::string m = second.message();
  EXPECT_EQ(m.rfind("step 2: gathering the rewards and completion lengths: rank 1 (host ", 0), 0u) << m;
  EXPECT_NE(m.find("stopped answering"), std::string::npos) << m;
  EXPECT_EQ(m.find("step 2: step 2"), std::string::npos) << m;
  EXPECT_EQ(third.code(), StatusCode::kFailedPrecondition) << third.ToString();
  EXPECT_NE(third.message().find("step 2: an earlier step failed on this rank"), std::string::npos) << third.message();
}

TEST(DataParallelConfigTest, ARankTakesWholeGroups) {
  TempDir tmp;
  RunFiles r = MakeRun(tmp.path(), at::kFloat);
  AddTopLevelKey(r.config, "generation_batch_size = 8\n");
  auto c = run::LoadRunConfig(r.config);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  // TRL: a generation_batch_size that is set stays the global one; 8 / 4 ranks = 2 completions
  // per rank, not whole groups of 4.
  auto four = run::ForWorldSize(*c, 4);
  ASSERT_FALSE(four.ok());
  EXPECT_NE(four.status().message().find("generation_batch_size"), std::string::npos) << four.status().message();
  auto two = run::ForWorldSize(*c, 2);
  ASSERT_FALSE(two.ok());  // 8 is not divisible by per_device_train_batch_size 8 * 2
  EXPECT_NE(two.status().message().find("per_device_train_batch_size * world size (8 * 2)"), std::string::npos)
      << two.status().message();
  // Unset, it grows with the ranks (per_device_train_batch_size is each rank's).
  auto plain = run::LoadRunConfig(MakeRun(tmp.path() / "b", at::kFloat).config);
  ASSERT_TRUE(plain.ok());
  auto three = run::ForWorldSize(*plain, 3);
  ASSERT_TRUE(three.ok()) << three.status().ToString();
  EXPECT_EQ(three->generation_batch_size, 24);
  EXPECT_EQ(three->prompts_per_generation(), 6);
  EXPECT_EQ(three->Fingerprint(), three->Fingerprint());
  EXPECT_EQ(plain->Fingerprint(), run::ForWorldSize(*plain, 1)->Fingerprint());
}

// The probe's tolerance: the looser of the trainer's dtype and the server's (an F32 trainer
// against a BF16 server was held to 1e-4 and never proven).
TEST(VllmGeneratorTest, ProbeToleranceIsTheLooserOfTheTwoDtypes) {
  EXPECT_EQ(*ProbeToleranceFor(at::kFloat, ""), 1e-4);
  EXPECT_EQ(*ProbeToleranceFor(at::kFloat, "bfloat16"), 1e-1);
  EXPECT_EQ(*ProbeToleranceFor(at::kFloat, "float16"), 2e-2);
  EXPECT_EQ(*ProbeToleranceFor(at::kBFloat16, "float32"), 1e-1);
  EXPECT_EQ(*ProbeToleranceFor(at::kHalf, ""), 2e-2);
  EXPECT_EQ(ProbeToleranceFor(at::kFloat, "int8").status().code(), StatusCode::kInvalidArgument);
}

// The probe's reference shares the cores with a server on this machine (half each) and takes
// them all for a remote one.
TEST(VllmGeneratorTest, ReferenceThreadsAreHalfTheCoresForAServerOnThisMachine) {
  EXPECT_EQ(ReferenceThreadsFor("http://127.0.0.1:8000", 2), 1);
  EXPECT_EQ(ReferenceThreadsFor("http://127.0.0.2:8000/", 16), 8);
  EXPECT_EQ(ReferenceThreadsFor("http://localhost:8000", 8), 4);
  EXPECT_EQ(ReferenceThreadsFor("http://[::1]:8000", 4), 2);
  EXPECT_EQ(ReferenceThreadsFor("http://127.0.0.1:8000", 1), 1);
  EXPECT_EQ(ReferenceThreadsFor("http://10.0.0.7:8000", 16), 0);
  EXPECT_EQ(ReferenceThreadsFor("http://127.example.org:8000", 16), 0);
  EXPECT_EQ(ReferenceThreadsFor("http://[fe80::1]:8000", 16), 0);
  EXPECT_EQ(ReferenceThreadsFor("http://localhost.example.org", 16), 0);
}

// A process titled as vLLM's multiprocess executor titles its model workers is found (a real
// process: argv[0] is what setproctitle rewrites); other processes are not.
TEST(VllmGeneratorTest, AWorkerOfVllmsMultiprocessExecutorIsFound) {
  auto spawn = [](const char* title) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::execl("/bin/sleep", title, "30", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    return pid;
  };
  const pid_t worker = spawn("VLLM::Worker_TP0");
  const pid_t other = spawn("sleep");
  struct Reap {  // the children end with the test, whatever fails
    pid_t pids[2];
    ~Reap() {
      for (const pid_t pid : pids) {
        if (pid > 0 && ::kill(pid, SIGKILL) == 0) ::waitpid(pid, nullptr, 0);
      }
    }
  } reap{{worker, other}};
  ASSERT_GT(worker, 0);
  ASSERT_GT(other, 0);
  std::vector<int64_t> found;
  for (int i = 0; i < 100 && std::find(found.begin(), found.end(), worker) == found.end(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // until exec has run
    found = VllmWorkerProcesses();
  }
  EXPECT_NE(std::find(found.begin(), found.end(), worker), found.end());
  EXPECT_EQ(std::find(found.begin(), found.end(), other), found.end());
  EXPECT_TRUE(std::is_sorted(found.begin(), found.end()));
  ::kill(worker, SIGKILL);
  ::waitpid(worker, nullptr, 0);
  reap.pids[0] = 0;  // reaped: its pid may be another process's by now
  found = VllmWorkerProcesses();
  EXPECT_EQ(std::find(found.begin(), found.end(), worker), found.end());
}

}  // namespace
}  // namespace ferry::grpo
