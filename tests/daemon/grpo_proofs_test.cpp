// ferryd's GRPO trainer: the claims of docs/daemon.md that need a measurement.
//   - One copy of the base: the generator's snapshot shares every tensor LoRA does not touch
//     with the trainer's read-only base mapping (same bytes, no copy per step); only the
//     merged target modules are new buffers, held once (the previous snapshot is released
//     once the next is acknowledged); the process's anonymous memory grows by far less than
//     a base over the steps.
//   - A 4,096-token context: prompts + completions fill 4,096 positions (the generator's KV
//     cache included); the generator/trainer log-prob gap is reported and the correction is
//     applied to the loss exactly as grpo_math (TRL's formula) says.
//   - A reward command that crashes, or writes a malformed line, at step k: the error names
//     the command and the line, nothing of step k is applied, and ferryd exits non-zero.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/checkpoint.h"
#include "daemon/grpo/grpo_math.h"
#include "daemon/grpo/optimizer.h"
#include "daemon/grpo/trainer.h"
#include "daemon/grpo/trainer_internal.h"
#include "daemon/runtime/model.h"
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

// The digit tokenizer with <bos> (12) and <pad> (13). No EOS: completions run to their maximum length.
std::string DigitTokenizerJson() { return testing::DigitTokenizerJson("<pad>"); }

// A reward command (POSIX sh, started once for the run): answers {"reward": n % 5} to its n-th
// request line, so rewards differ within every group. `fail_after` > 0: on request line
// fail_after + 1 it exits with status 3 ("crash") or answers a line that is not JSON
// ("malformed").
std::string RewardScript(int fail_after, const std::string& how) {
  std::string s = "n=0\nwhile IFS= read -r line; do\n  n=$((n + 1))\n";
  if (fail_after > 0) {
    s += "  if [ \"$n\" -gt " + std::to_string(fail_after) + " ]; then\n";
    s += how == "crash" ? "    exit 3\n" : "    echo 'reward: high'\n    continue\n";
    s += "  fi\n";
  }
  s += "  echo \"{\\\"reward\\\": $((n % 5))}\"\ndone\n";
  return s;
}

struct RunFiles {
  fs::path model;
  fs::path config;
  fs::path dir;
};

// A tiny model of `spec` over the digit tokenizer (no EOS), `prompts` dataset lines and a run
// config: `extra` is appended to the top-level keys; the reward is judge.sh (`script`).
RunFiles MakeRun(const fs::path& root, testing::TinyModelSpec spec, const std::vector<std::string>& prompts,
                 const std::string& extra, const std::string& script) {
  RunFiles r;
  r.model = root / "model";
  spec.vocab = 14;
  EXPECT_TRUE(testing::WriteTinyModel(r.model, spec).ok());
  json cfg = json::parse(ReadText(r.model / "config.json"));
  cfg["bos_token_id"] = 12;
  cfg.erase("eos_token_id");
  cfg["pad_token_id"] = 13;
  WriteText(r.model / "config.json", cfg.dump(2));
  WriteText(r.model / "tokenizer.json", DigitTokenizerJson());
  WriteText(r.model / "tokenizer_config.json",
            R"({"bos_token": "<bos>", "pad_token": "<pad>", "add_bos_token": false})");
  std::ofstream data(root / "train.jsonl");
  for (const std::string& p : prompts) data << json{{"prompt", p}}.dump() << "\n";
  data.close();
  WriteText(root / "judge.sh", script);
  r.dir = root / "run";
  r.config = root / "grpo.toml";
  WriteText(r.config, R"(model_name_or_path = "model"
dataset = "train.jsonl"
output_dir = "run"
chat_template = "none"
threads = 2
seed = 7
learning_rate = 5e-3
lr_scheduler_type = "constant"
temperature = 1.0
logging_steps = 1
save_total_limit = 10
)" + extra + R"(

[lora]
r = 4
lora_alpha = 8
target_modules = ["q_proj", "v_proj"]

[[rewards]]
name = "judge"
type = "command"
command = ["sh", "judge.sh"]
)");
  return r;
}

std::vector<std::string> AdditionPrompts(int n) {
  std::vector<std::string> out;
  for (int a = 0; a < n; ++a) {
    char line[16];
    std::snprintf(line, sizeof(line), "%02d+%02d=", (a * 37) % 100, (a * 53 + 11) % 100);
    out.push_back(line);
  }
  return out;
}

// The run's options with its config loaded (as ferryd loads it before Trainer::Create).
TrainOptions Options(const fs::path& config, int64_t max_steps) {
  TrainOptions o;
  auto c = run::LoadRunConfig(config);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  if (c.ok()) o.config = std::move(*c);
  o.max_steps = max_steps;
  return o;
}

// The process's resident anonymous memory (RssAnon of /proc/self/status), in bytes.
int64_t RssAnonBytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("RssAnon:", 0) == 0) return std::stoll(line.substr(8)) * 1024;
  }
  ADD_FAILURE() << "/proc/self/status has no RssAnon";
  return 0;
}

bool IsLoraTarget(const std::string& name) {
  return name.find(".q_proj.") != std::string::npos || name.find(".v_proj.") != std::string::npos;
}

// ---- one copy of the base ----------------------------------------------------------------------

TEST(GrpoProofsTest, SnapshotSharesTheBaseMappingAndHoldsOnlyTheMergedModules) {
  TempDir tmp;
  testing::TinyModelSpec spec;
  spec.hidden = 512;  // ~31 MiB of F32 weights: a second copy cannot hide in the noise
  spec.intermediate = 2048;
  spec.std = 0.05;
  RunFiles r = MakeRun(tmp.path(), spec, AdditionPrompts(40), R"(bf16 = false
max_steps = 5
save_steps = 100
per_device_train_batch_size = 8
num_generations = 4
max_completion_length = 4
)",
                       RewardScript(0, ""));
  const int64_t base_bytes = static_cast<int64_t>(fs::file_size(r.model / "model.safetensors"));
  ASSERT_GT(base_bytes, 30 << 20);

  constexpr int kSteps = 3;
  const int64_t rss_before = RssAnonBytes();
  auto trainer = Trainer::Create(Options(r.config, kSteps));
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  const Trainer::State& s = *(*trainer)->state_for_testing();
  const Checkpoint& base = s.publisher->base();

  std::weak_ptr<const sync::Snapshot> previous;
  int64_t merged_bytes = 0;
  for (int k = 1; k <= kSteps; ++k) {
    auto step = (*trainer)->Step();
    ASSERT_TRUE(step.ok()) << step.status().ToString();
    const std::shared_ptr<const sync::Snapshot>& snap = s.generator->current().snapshot;
    // The snapshot of step k-1 is gone once the generator acknowledged step k's.
    if (k > 1) {
      EXPECT_TRUE(previous.expired()) << "the snapshot before step " << k << " is still alive";
    }
    previous = snap;
    ASSERT_EQ(snap->checkpoint().names(), base.names());
    int64_t fresh = 0;
    for (const std::string& name : snap->checkpoint().names()) {
      auto held = snap->checkpoint().Get(name);
      auto mapped = base.Get(name);
      ASSERT_TRUE(held.ok() && mapped.ok()) << name;
      if (IsLoraTarget(name)) {
        // Merged into a new buffer of the snapshot's.
        EXPECT_NE(held->data(), mapped->data()) << name;
        fresh += static_cast<int64_t>(held->nbytes());
      } else {
        // The base mapping's own bytes: a view, not a copy.
        EXPECT_EQ(held->data(), mapped->data()) << name << " at step " << k;
      }
    }
    if (k == 1) merged_bytes = fresh;
    EXPECT_EQ(fresh, merged_bytes) << "step " << k;
  }
  // q_proj (512 x 512) and v_proj (256 x 512), F32, in each of the 2 layers.
  EXPECT_EQ(merged_bytes, 2 * (512 * 512 + 256 * 512) * 4);

  // Measured: the anonymous memory the trainer, the generator and the steps' snapshots added
  // (LibTorch's and the store's own included: 4 to 18 MiB in our runs) stays under one base; with
  // copied snapshots it was 72 MiB (a whole base per live snapshot).
  const int64_t growth = RssAnonBytes() - rss_before;
  std::printf(
      "base %lld bytes; merged modules %lld bytes per snapshot; RssAnon growth over Create + %d steps: %lld bytes\n",
      static_cast<long long>(base_bytes), static_cast<long long>(merged_bytes), kSteps, static_cast<long long>(growth));
  EXPECT_LT(growth, base_bytes);

  // The trainer's model and the generator's run the same mapped bytes (an untargeted linear).
  const void* mapped_down = base.Get("model.layers.1.mlp.down_proj.weight")->data();
  EXPECT_EQ(s.model->layer_linear(1, runtime::Proj::kDown).weight.data_ptr(), mapped_down);
  EXPECT_EQ(s.generator->model()->layer_linear(1, runtime::Proj::kDown).weight.data_ptr(), mapped_down);
  EXPECT_EQ(s.generator->model()->lm_head().weight.data_ptr(), base.Get("lm_head.weight")->data());

  // Sharing changes no digest: the same source copied whole has the same id.
  {
    auto src = s.publisher->Source(s.adapter.get());
    ASSERT_TRUE(src.ok()) << src.status().ToString();
    sync::SnapshotOptions copy;
    copy.threads = 2;
    auto copied = sync::BuildSnapshot(*src, copy);
    ASSERT_TRUE(copied.ok()) << copied.status().ToString();
    EXPECT_EQ((*copied)->manifest_id().Hex(), (*trainer)->generator_version());
    EXPECT_EQ((*copied)->digests(), s.generator->current().snapshot->digests());
    EXPECT_NE((*copied)->checkpoint().Get("lm_head.weight")->data(), base.Get("lm_head.weight")->data());
  }
}

// ---- a 4,096-token context ----------------------------------------------------------------------

// TRL's vLLM importance-sampling ratio, written out here: exp(old - sampling) on real tokens
// (per token, or its sum per sequence), clamped to the cap (truncate) or zeroed above it (mask).
at::Tensor ExpectedRatio(const at::Tensor& old, const at::Tensor& sampling, const at::Tensor& mask, bool sequence,
                         bool truncate, double cap) {
  // In the log-probs' dtype (fp32), as TRL computes it.
  at::Tensor diff = (old - sampling) * mask.to(old.scalar_type());
  at::Tensor ratio = at::exp(sequence ? diff.sum(-1, true) : diff);
  return truncate ? ratio.clamp_max(cap) : ratio.masked_fill(ratio > cap, 0.0);
}

constexpr int64_t kContext = 4096, kCompletion = 32, kPrompt = kContext - kCompletion;

// A run whose one generation (1 prompt x 2 completions of 32 tokens) fills 4,096 positions, on a
// 1-layer model; `config` adds its keys to the shared ones.
RunFiles MakeLongContextRun(const fs::path& root, const std::string& config) {
  testing::TinyModelSpec spec;
  spec.hidden = 32;
  spec.intermediate = 64;
  spec.heads = 2;
  spec.kv_heads = 1;
  spec.layers = 1;
  spec.max_positions = 4096;
  spec.std = 0.1;
  std::vector<std::string> prompts;
  for (int i = 0; i < 2; ++i) {
    std::string p;
    for (int64_t t = 0; t < kPrompt; ++t) p += static_cast<char>('0' + (t * (3 + 2 * i) + i) % 10);
    prompts.push_back(p);
  }
  return MakeRun(root, spec, prompts, R"(max_steps = 2
save_steps = 100
per_device_train_batch_size = 1
steps_per_generation = 2
num_generations = 2
max_completion_length = 32
)" + config,
                 RewardScript(0, ""));
}

// One line with the step's generator/trainer gap metrics, for the log.
void PrintGap(const char* what, const Metrics& m) {
  std::printf("%s: |old - sampling| mean %.6g max %.6g; ratio min %.6g mean %.6g max %.6g\n", what,
              m.at("sampling/sampling_logp_difference/mean"), m.at("sampling/sampling_logp_difference/max"),
              m.at("sampling/importance_sampling_ratio/min"), m.at("sampling/importance_sampling_ratio/mean"),
              m.at("sampling/importance_sampling_ratio/max"));
}

TEST(GrpoProofsTest, A4096TokenContextShowsTheGapAndTheCorrectionChangesTheLossAsTrlSays) {
  TempDir tmp;
  // The generator decodes through its KV cache, the trainer runs whole sequences: their fp32
  // log-probs differ in the last bits. The correction per token, masked above a cap of 1, so
  // it is active on the tokens where the trainer's log-prob is the higher.
  RunFiles r = MakeLongContextRun(tmp.path(), R"(bf16 = false
vllm_importance_sampling_mode = "token_mask"
vllm_importance_sampling_clip_max = 1.0
)");
  auto trainer = Trainer::Create(Options(r.config, 2));
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  const Trainer::State& s = *(*trainer)->state_for_testing();
  auto step1 = (*trainer)->Step();
  ASSERT_TRUE(step1.ok()) << step1.status().ToString();

  // The generation batch (kept for step 2's micro-batch): every row fills 4,096 positions.
  ASSERT_TRUE(s.buffer.has_value());
  const Rollout& ro = *s.buffer;
  ASSERT_EQ(ro.prompt_ids.size(0), 2);
  EXPECT_EQ(ro.prompt_ids.size(1), kPrompt);
  EXPECT_EQ(ro.completion_ids.size(1), kCompletion);
  EXPECT_EQ(ro.prompt_mask.sum().item<int64_t>(), 2 * kPrompt);
  EXPECT_EQ(ro.completion_mask.sum().item<int64_t>(), 2 * kCompletion);
  EXPECT_EQ(ro.prompt_ids.size(1) + ro.completion_ids.size(1), kContext);

  // The gap, reported and non-trivial.
  const Metrics& m = step1->metrics;
  for (const char* key : {"sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                          "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                          "sampling/importance_sampling_ratio/max"}) {
    ASSERT_TRUE(m.count(key)) << key << " not reported";
  }
  const at::Tensor old = ro.old_logps, sampling = ro.sampling_logps, mask = ro.completion_mask;
  ASSERT_TRUE(old.defined());
  const at::Tensor gap = (old.to(at::kDouble) - sampling.to(at::kDouble)).abs() * mask;
  const double gap_mean = gap.sum().item<double>() / static_cast<double>(mask.sum().item<int64_t>());
  PrintGap("4096-token context", m);
  EXPECT_GT(m.at("sampling/sampling_logp_difference/mean"), 0.0);
  EXPECT_NEAR(m.at("sampling/sampling_logp_difference/mean"), gap_mean, 1e-6 * gap_mean);
  EXPECT_NEAR(m.at("sampling/sampling_logp_difference/max"), gap.max().item<double>(), 1e-12);
  EXPECT_GT(m.at("sampling/sampling_logp_difference/max"), m.at("sampling/sampling_logp_difference/mean"));
  EXPECT_EQ(m.at("sampling/importance_sampling_ratio/min"), 0.0);  // masked above the cap
  EXPECT_LE(m.at("sampling/importance_sampling_ratio/max"), 1.0);

  // The ratio the trainer applies is TRL's (token, masked above 1).
  ASSERT_TRUE(ro.is_ratio.defined());
  const at::Tensor expected = ExpectedRatio(old, sampling, mask, false, false, 1.0);
  EXPECT_TRUE(at::equal(ro.is_ratio, expected));
  EXPECT_GT((expected == 0.0).sum().item<int64_t>(), 0);
  EXPECT_GT((expected > 0.0).sum().item<int64_t>(), 0);
  // Every mode on the same tensors, as TRL's formula says (the sequence modes with a cap
  // between the two sequences' ratios).
  const at::Tensor seq = ExpectedRatio(old, sampling, mask, true, true, 1e30);
  const double seq_cap = 0.5 * (seq.min().item<double>() + seq.max().item<double>());
  struct ModeCase {
    MismatchMode mode;
    bool sequence, truncate;
    double cap;
  };
  for (const ModeCase& c :
       {ModeCase{MismatchMode::kTokenTruncate, false, true, 1.0}, ModeCase{MismatchMode::kTokenMask, false, false, 1.0},
        ModeCase{MismatchMode::kSequenceTruncate, true, true, seq_cap},
        ModeCase{MismatchMode::kSequenceMask, true, false, seq_cap}}) {
    MismatchOptions mo;
    mo.mode = c.mode;
    mo.clip_max = c.cap;
    auto mc = ComputeMismatchCorrection(old, sampling, mask, mo);
    ASSERT_TRUE(mc.ok()) << mc.status().ToString();
    const at::Tensor want = ExpectedRatio(old, sampling, mask, c.sequence, c.truncate, c.cap);
    EXPECT_TRUE(at::equal(mc->ratio, want)) << run::NameOf(c.mode);
    if (!c.sequence || seq.min().item<double>() < seq.max().item<double>()) {
      EXPECT_GT((want != ExpectedRatio(old, sampling, mask, c.sequence, true, 1e30)).sum().item<int64_t>(), 0)
          << run::NameOf(c.mode) << ": the cap changes nothing";
    }
  }

  // Step 2 trains on the batch's second micro-batch: its loss is grpo_math's with the ratio
  // (TRL: per_token_loss * importance_sampling_ratio), and not the loss without it.
  const std::vector<int64_t>& rows = ro.rows_of_micro_batch.at(1);
  auto mb = MicroBatchLogProbs(s, ro, rows, /*lora=*/true, /*training=*/true);
  ASSERT_TRUE(mb.ok()) << mb.status().ToString();
  LossInputs in;
  in.per_token_logps = mb->logps.detach();
  in.completion_mask = mb->mask;
  in.advantages = ro.advantages.index_select(0, mb->rows);
  in.entropies = mb->entropy.detach();
  in.num_items_in_batch = ro.num_items;
  in.old_per_token_logps = ro.old_logps.index_select(0, mb->rows);
  in.importance_sampling_ratio = ro.is_ratio.index_select(0, mb->rows);
  auto with = ComputeLoss(in, s.loss_options);
  in.importance_sampling_ratio = at::Tensor();
  auto without = ComputeLoss(in, s.loss_options);
  ASSERT_TRUE(with.ok() && without.ok());
  const double loss_with = with->loss.item<double>(), loss_without = without->loss.item<double>();
  ASSERT_TRUE(ro.advantages.index_select(0, mb->rows).abs().sum().item<double>() > 0);
  auto step2 = (*trainer)->Step();
  ASSERT_TRUE(step2.ok()) << step2.status().ToString();
  std::printf("step 2 loss %.9g; grpo_math with the correction %.9g, without %.9g\n", step2->metrics.at("loss"),
              loss_with, loss_without);
  EXPECT_NEAR(step2->metrics.at("loss"), loss_with, 1e-6 * std::max(1.0, std::abs(loss_with)));
  EXPECT_GT(std::abs(loss_with - loss_without), 1e-4 * std::max(1e-3, std::abs(loss_without)));
}

// vLLM's usual case: the generator samples in BF16 (generation_dtype) for a trainer in F32. At
// 4,096 positions the gap is that of BF16 rounding, thousands of times the F32 one above, the
// metrics report it, and the correction (per token, truncated at 1) caps the ratio as TRL does.
TEST(GrpoProofsTest, ABf16GeneratorForAnF32TrainerShowsItsGapAt4096Tokens) {
  TempDir tmp;
  RunFiles r = MakeLongContextRun(tmp.path(), R"(bf16 = false
generation_dtype = "bfloat16"
vllm_importance_sampling_mode = "token_truncate"
vllm_importance_sampling_clip_max = 1.0
)");
  auto trainer = Trainer::Create(Options(r.config, 1));
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  const Trainer::State& s = *(*trainer)->state_for_testing();
  EXPECT_EQ(s.model->dtype(), at::kFloat);
  ASSERT_NE(s.generator->model(), nullptr);
  EXPECT_EQ(s.generator->model()->dtype(), at::kBFloat16);
  auto step1 = (*trainer)->Step();
  ASSERT_TRUE(step1.ok()) << step1.status().ToString();
  ASSERT_TRUE(s.buffer.has_value());
  const Rollout& ro = *s.buffer;
  EXPECT_EQ(ro.prompt_ids.size(1) + ro.completion_ids.size(1), kContext);
  const at::Tensor old = ro.old_logps, sampling = ro.sampling_logps, mask = ro.completion_mask;
  ASSERT_TRUE(old.defined() && sampling.defined());
  EXPECT_EQ(old.scalar_type(), at::kFloat);
  const at::Tensor gap = (old.to(at::kDouble) - sampling.to(at::kDouble)).abs() * mask;
  const double gap_mean = gap.sum().item<double>() / static_cast<double>(mask.sum().item<int64_t>());
  const Metrics& m = step1->metrics;
  PrintGap("4096-token context, BF16 generator, F32 trainer", m);
  // BF16 keeps 8 bits of mantissa: a gap far above the F32 run's ~1e-7.
  EXPECT_GT(gap_mean, 1e-4);
  EXPECT_NEAR(m.at("sampling/sampling_logp_difference/mean"), gap_mean, 1e-6 * gap_mean);
  EXPECT_NEAR(m.at("sampling/sampling_logp_difference/max"), gap.max().item<double>(), 1e-12);
  // Truncated at 1: every ratio at most 1, some well below it, and exactly TRL's formula.
  ASSERT_TRUE(ro.is_ratio.defined());
  EXPECT_TRUE(at::equal(ro.is_ratio, ExpectedRatio(old, sampling, mask, false, true, 1.0)));
  EXPECT_LE(m.at("sampling/importance_sampling_ratio/max"), 1.0);
  EXPECT_LT(m.at("sampling/importance_sampling_ratio/min"), 1.0 - 1e-4);
}

// ---- the shared prompt forward ------------------------------------------------------------------

// The trainer runs each distinct prompt of a micro-batch once and every row's completion
// against its keys and values: the log-probs, entropies and LoRA gradients equal the plain
// forward over prompt + completion per row, with prompts of different lengths (left padding).
TEST(GrpoProofsTest, SharedPromptForwardEqualsThePlainForward) {
  TempDir tmp;
  testing::TinyModelSpec spec;
  spec.std = 0.1;
  RunFiles r = MakeRun(tmp.path(), spec, {"7+5=", "12+34=", "3+41=", "99+9=", "1+2=", "40+60="}, R"(bf16 = false
max_steps = 2
save_steps = 100
per_device_train_batch_size = 8
steps_per_generation = 2
num_generations = 4
max_completion_length = 5
gradient_checkpointing = false
)",
                       RewardScript(0, ""));
  auto trainer = Trainer::Create(Options(r.config, 2));
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  Trainer::State& s = const_cast<Trainer::State&>(*(*trainer)->state_for_testing());
  auto step1 = (*trainer)->Step();  // trains a little, so the adapter's B is not zero
  ASSERT_TRUE(step1.ok()) << step1.status().ToString();
  ASSERT_TRUE(s.buffer.has_value());
  const Rollout& ro = *s.buffer;
  const std::vector<int64_t>& rows = ro.rows_of_micro_batch.at(1);
  ASSERT_EQ(rows.size(), 8u);
  const at::Tensor pmask = ro.prompt_mask.index_select(0, at::tensor(rows, at::kLong));
  ASSERT_GT(pmask.sum(1).max().item<int64_t>(), pmask.sum(1).min().item<int64_t>()) << "no left padding to test";
  // The rows of a micro-batch are shuffled across the generation batch: count their prompts.
  std::set<std::vector<int64_t>> prompts;
  for (int64_t row : rows) {
    const at::Tensor real = ro.prompt_mask[row].to(at::kBool);
    const at::Tensor ids = ro.prompt_ids[row].masked_select(real).contiguous();
    prompts.insert(std::vector<int64_t>(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel()));
  }
  ASSERT_LT(prompts.size(), rows.size()) << "no prompt repeats in the micro-batch";

  const std::vector<at::Tensor> params = s.adapter->parameters();
  const at::Tensor weights = at::rand({8, ro.completion_ids.size(1)}, at::TensorOptions().dtype(at::kFloat));
  struct Result {
    MicroBatchLogps mb;
    std::vector<at::Tensor> grads;
  };
  auto run = [&](bool share) {
    s.share_prompt_forward = share;
    for (const at::Tensor& p : params) p.mutable_grad() = at::Tensor();
    auto mb = MicroBatchLogProbs(s, ro, rows, /*lora=*/true, /*training=*/true);
    EXPECT_TRUE(mb.ok()) << mb.status().ToString();
    ((mb->logps + 0.1 * mb->entropy) * weights * mb->mask).sum().backward();
    Result out{*mb, {}};
    for (const at::Tensor& p : params) out.grads.push_back(p.grad().clone());
    return out;
  };
  const Result shared = run(true);
  const Result plain = run(false);
  EXPECT_EQ(shared.mb.distinct_prompts, static_cast<int64_t>(prompts.size()));
  EXPECT_EQ(plain.mb.distinct_prompts, 0);
  EXPECT_TRUE(at::equal(shared.mb.mask, plain.mb.mask));
  EXPECT_LT((shared.mb.logps - plain.mb.logps).abs().max().item<double>(), 1e-5);
  EXPECT_LT((shared.mb.entropy - plain.mb.entropy).abs().max().item<double>(), 1e-5);
  EXPECT_GT(plain.mb.logps.abs().sum().item<double>(), 0);
  double grad_norm = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const double scale = std::max(1e-3, plain.grads[i].abs().max().item<double>());
    EXPECT_LT((shared.grads[i] - plain.grads[i]).abs().max().item<double>(), 1e-5 * scale) << "parameter " << i;
    grad_norm += plain.grads[i].abs().sum().item<double>();
  }
  EXPECT_GT(grad_norm, 0);
}

// ---- a reward command that fails mid-run -----------------------------------------------------

constexpr int kRowsPerStep = 8;  // per_device_train_batch_size: 2 prompts x 4 generations

RunFiles MakeRewardRun(const fs::path& root, const std::string& how) {
  testing::TinyModelSpec spec;
  spec.std = 0.1;
  // The probe line ferryd sends before creating anything, then step 1 is scored; step 2's
  // third request line fails.
  return MakeRun(root, spec, AdditionPrompts(40), R"(bf16 = false
max_steps = 3
save_steps = 1
per_device_train_batch_size = 8
num_generations = 4
max_completion_length = 4
)",
                 RewardScript(1 + kRowsPerStep + 2, how));
}

// Everything a step could apply: the trainer's state and every file of the run directory
// (metrics.jsonl, checkpoints, the store).
struct Observed {
  int64_t step = 0, micro_step = 0;
  double num_tokens = 0;
  run::DatasetPosition position;
  std::string generator_version;
  std::vector<at::Tensor> params, optimizer;
  std::vector<int64_t> optimizer_steps;
  std::map<std::string, std::string> files;  // relative path -> contents
};

Observed Observe(const Trainer& t) {
  const Trainer::State& s = *t.state_for_testing();
  Observed o;
  o.step = t.step();
  o.micro_step = s.micro_step;
  o.num_tokens = s.num_tokens;
  o.position = s.sampler->position();
  o.generator_version = t.generator_version();
  auto& state = s.optimizer->state();
  for (const at::Tensor& p : s.adapter->parameters()) {
    o.params.push_back(p.detach().clone());
    EXPECT_FALSE(p.grad().defined()) << "a gradient is left over (a step, failed or not, resets them to none)";
    auto it = state.find(grpo::StateKey(p));
    if (it == state.end()) continue;
    const auto& st = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    o.optimizer.push_back(st.exp_avg().clone());
    o.optimizer.push_back(st.exp_avg_sq().clone());
    o.optimizer_steps.push_back(st.step());
  }
  for (const auto& e : fs::recursive_directory_iterator(t.dir())) {
    if (e.is_regular_file()) o.files[fs::relative(e.path(), t.dir()).string()] = ReadText(e.path());
  }
  return o;
}

void ExpectSame(const Observed& a, const Observed& b) {
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.micro_step, b.micro_step);
  EXPECT_EQ(a.num_tokens, b.num_tokens);
  EXPECT_EQ(a.position.epoch, b.position.epoch);
  EXPECT_EQ(a.position.index, b.position.index);
  EXPECT_EQ(a.generator_version, b.generator_version);
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) EXPECT_TRUE(at::equal(a.params[i], b.params[i])) << "parameter " << i;
  ASSERT_EQ(a.optimizer.size(), b.optimizer.size());
  for (size_t i = 0; i < a.optimizer.size(); ++i)
    EXPECT_TRUE(at::equal(a.optimizer[i], b.optimizer[i])) << "moment " << i;
  EXPECT_EQ(a.optimizer_steps, b.optimizer_steps);
  std::set<std::string> names_a, names_b;
  for (const auto& [n, c] : a.files) names_a.insert(n);
  for (const auto& [n, c] : b.files) names_b.insert(n);
  EXPECT_EQ(names_a, names_b);
  for (const auto& [n, c] : a.files) {
    auto it = b.files.find(n);
    if (it != b.files.end()) {
      EXPECT_TRUE(it->second == c) << n << " changed";
    }
  }
}

void ExpectFailedStepAppliesNothing(const std::string& how, StatusCode code, const std::string& what) {
  TempDir tmp;
  RunFiles r = MakeRewardRun(tmp.path(), how);
  auto trainer = Trainer::Create(Options(r.config, 3));
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  auto step1 = (*trainer)->Step();
  ASSERT_TRUE(step1.ok()) << step1.status().ToString();
  ASSERT_TRUE((*trainer)->SaveCheckpoint().ok());  // as Run does with save_steps = 1
  const Observed after1 = Observe(**trainer);
  ASSERT_EQ(after1.step, 1);
  ASSERT_TRUE(after1.files.count("checkpoint-1/adapter_model.safetensors"));
  ASSERT_EQ(after1.optimizer_steps.size(), after1.params.size());

  auto step2 = (*trainer)->Step();
  ASSERT_FALSE(step2.ok());
  const std::string msg = step2.status().message();
  EXPECT_EQ(step2.status().code(), code) << step2.status().ToString();
  EXPECT_NE(msg.find("step 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("reward 'judge' (sh judge.sh)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("reply line 3"), std::string::npos) << msg;
  EXPECT_NE(msg.find(what), std::string::npos) << msg;
  // Nothing of step 2 was applied.
  ExpectSame(after1, Observe(**trainer));
}

TEST(GrpoProofsTest, RewardCommandCrashAtStep2AppliesNothingOfStep2) {
  ExpectFailedStepAppliesNothing("crash", StatusCode::kUnavailable, "3");
}

TEST(GrpoProofsTest, RewardCommandMalformedLineAtStep2AppliesNothingOfStep2) {
  ExpectFailedStepAppliesNothing("malformed", StatusCode::kCorruption, "reward: high");
}

// ferryd itself: the same crash ends `ferryd train` with a non-zero status and the message,
// after step 1's line and checkpoint and nothing of step 2.
TEST(GrpoProofsTest, FerrydExitsNonZeroNamingTheRewardCommandAndTheLine) {
  TempDir tmp;
  RunFiles r = MakeRewardRun(tmp.path(), "crash");
  const std::string cmd = std::string(FERRYD_PATH) + " train --config '" + r.config.string() + "' 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  const int status = ::pclose(p);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_NE(WEXITSTATUS(status), 0) << out;
  EXPECT_NE(out.find("step 2"), std::string::npos) << out;
  EXPECT_NE(out.find("reward 'judge' (sh judge.sh)"), std::string::npos) << out;
  EXPECT_NE(out.find("reply line 3"), std::string::npos) << out;
  const std::string metrics = ReadText(r.dir / "metrics.jsonl");
  EXPECT_EQ(std::count(metrics.begin(), metrics.end(), '\n'), 1) << metrics;
  EXPECT_TRUE(fs::exists(r.dir / "checkpoint-1" / "adapter_model.safetensors"));
  for (const auto& e : fs::directory_iterator(r.dir)) {
    const std::string name = e.path().filename().string();
    // No checkpoint of step 2, whole or temporary.
    EXPECT_TRUE(name.find("checkpoint") == std::string::npos || name == "checkpoint-1") << name;
    EXPECT_EQ(name.find("tmp"), std::string::npos) << name;
  }
  auto st = store::Store::Open(r.dir / "store", store::StoreOptions{.read_only = true});
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  auto versions = (*st)->ListVersions(std::nullopt);
  ASSERT_TRUE(versions.ok());
  for (const auto& v : *versions) {
    if (v.step) {
      EXPECT_EQ(*v.step, 1) << "a version of step " << *v.step << " was recorded";
    }
  }
}

// --- A refused start leaves the run directory as it was ---------------------------------------

// Every file under `dir` with its contents ("" for directories); empty when `dir` is absent.
std::map<std::string, std::string> Tree(const fs::path& dir) {
  std::map<std::string, std::string> out;
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string rel = fs::relative(e.path(), dir).string();
    out[rel] = e.is_regular_file() ? ReadText(e.path()) : "";
  }
  return out;
}

// Runs `ferryd ARGS` to its end; returns (exit status, output).
std::pair<int, std::string> RunFerryd(const std::string& args) {
  const std::string cmd = std::string(FERRYD_PATH) + " " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

struct Refusal {
  std::string name;
  std::string script;  // judge.sh
  std::string extra;   // top-level config keys
  StatusCode code;     // what Trainer::Create returns
  std::string what;    // in its message
};

std::vector<Refusal> Refusals() {
  const std::string base = "bf16 = false\nmax_steps = 2\nsave_steps = 1\nper_device_train_batch_size = 8\n";
  return {
      {"reward command hangs", "sleep 600\n", base + "num_generations = 4\nmax_completion_length = 4\n",
       StatusCode::kUnavailable, "reward 'judge' (sh judge.sh)"},
      {"reward command prints garbage", "read -r line; echo 'reward: high'; sleep 5\n",
       base + "num_generations = 4\nmax_completion_length = 4\n", StatusCode::kCorruption, "reward: high"},
      {"reward command exits 1", "exit 1\n", base + "num_generations = 4\nmax_completion_length = 4\n",
       StatusCode::kUnavailable, "exited with status 1"},
      {"reward command returns Infinity", "while read -r line; do echo '{\"reward\": Infinity}'; done\n",
       base + "num_generations = 4\nmax_completion_length = 4\n", StatusCode::kCorruption, "Infinity"},
      {"max_completion_length above max_position_embeddings", RewardScript(0, ""),
       base + "num_generations = 4\nmax_completion_length = 5000\n", StatusCode::kInvalidArgument,
       "key 'max_completion_length': 5000 tokens after a prompt of at least 1 exceed max_position_embeddings 4096"},
      {"num_generations too large for memory", RewardScript(0, ""),
       "bf16 = false\nmax_steps = 2\nper_device_train_batch_size = 65536\nnum_generations = 65536\n"
       "max_completion_length = 4000\nsteps_per_generation = 64\n",
       StatusCode::kInvalidArgument, "key 'num_generations': generating 4194304 completions at once"},
  };
}

RunFiles MakeRefusalRun(const fs::path& root, const Refusal& c, int64_t intermediate = 64) {
  testing::TinyModelSpec spec;
  spec.std = 0.1;
  spec.intermediate = intermediate;
  RunFiles r = MakeRun(root, spec, AdditionPrompts(40), c.extra, c.script);
  // The hanging command's batch times out at once.
  WriteText(r.config, ReadText(r.config) + "timeout_seconds = 2\n");
  return r;
}

TEST(GrpoProofsTest, RefusedInputCreatesNothing) {
  for (const Refusal& c : Refusals()) {
    SCOPED_TRACE(c.name);
    TempDir tmp;
    RunFiles r = MakeRefusalRun(tmp.path(), c);
    auto t = Trainer::Create(Options(r.config, 2));
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), c.code) << t.status().ToString();
    EXPECT_NE(t.status().message().find(c.what), std::string::npos) << t.status().ToString();
    EXPECT_FALSE(fs::exists(r.dir)) << "the run directory was created";
  }
}

// With earlier steps in the directory, a refused restart changes none of its files.
TEST(GrpoProofsTest, RefusedRestartLeavesTheRunAsItWas) {
  TempDir tmp;
  const Refusal garbage = Refusals()[1];
  Refusal ok = garbage;
  ok.script = RewardScript(0, "");
  RunFiles r = MakeRefusalRun(tmp.path(), ok);
  {
    auto t = Trainer::Create(Options(r.config, 1));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ASSERT_TRUE((*t)->Run().ok());
  }
  const auto before = Tree(r.dir);
  ASSERT_TRUE(before.count("checkpoint-1/trainer_state.json"));
  WriteText(tmp.path() / "judge.sh", garbage.script);
  auto t = Trainer::Create(Options(r.config, 2));
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("reward: high"), std::string::npos) << t.status().ToString();
  EXPECT_EQ(Tree(r.dir), before);
}

// ferryd: a refused dataset, model or tokenizer leaves no run directory and no ferryd.lock;
// in an existing directory, nothing new. A corrupt object of the base in an existing store
// stops the start naming the tensor and its object.
TEST(GrpoProofsTest, FerrydRefusalsLeaveNoLockFileOrDirectory) {
  TempDir tmp;
  RunFiles r = MakeRefusalRun(tmp.path(),
                              Refusal{"", RewardScript(0, ""),
                                      "bf16 = false\nmax_steps = 1\n"
                                      "save_steps = 1\nper_device_train_batch_size = 8\n"
                                      "num_generations = 4\nmax_completion_length = 4\n",
                                      StatusCode::kOk, ""},
                              /*intermediate=*/1024);  // MLP weights of 128 KiB: object files in the store
  const std::string train = "train --config '" + r.config.string() + "'";
  const fs::path data = tmp.path() / "train.jsonl";
  const std::string good_data = ReadText(data);
  // A dataset line that is not JSON.
  WriteText(data, good_data + "{\"prompt\": \n");
  auto [rc, out] = RunFerryd(train);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(out.find(data.string()), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(r.dir)) << out;
  WriteText(data, good_data);
  // A tokenizer that is not JSON, in an existing (empty) run directory.
  fs::create_directories(r.dir);
  const std::string tokenizer = ReadText(r.model / "tokenizer.json");
  WriteText(r.model / "tokenizer.json", "{");
  std::tie(rc, out) = RunFerryd(train);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(out.find("tokenizer.json"), std::string::npos) << out;
  EXPECT_TRUE(Tree(r.dir).empty()) << out;
  WriteText(r.model / "tokenizer.json", tokenizer);
  // A model whose weights do not match its config: found while the model loads, after the
  // run directory, lock and store were made; all three are removed again.
  json cfg = json::parse(ReadText(r.model / "config.json"));
  const json good_cfg = cfg;
  cfg["intermediate_size"] = 96;
  WriteText(r.model / "config.json", cfg.dump(2));
  std::tie(rc, out) = RunFerryd(train);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(out.find("mlp"), std::string::npos) << out;
  EXPECT_TRUE(Tree(r.dir).empty()) << out;
  WriteText(r.model / "config.json", good_cfg.dump(2));
  // --publish tcp:// without [publish] key and allow.
  std::tie(rc, out) = RunFerryd(train + " --publish tcp://127.0.0.1:5999");
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(out.find("publish"), std::string::npos) << out;
  EXPECT_TRUE(Tree(r.dir).empty()) << out;
  // A run that trains; then one object of its base corrupted in the store.
  std::tie(rc, out) = RunFerryd(train);
  ASSERT_EQ(rc, 0) << out;
  auto before = Tree(r.dir);
  fs::path object;
  std::string tensor;
  {
    auto st = store::Store::Open(r.dir / "store", store::StoreOptions{.read_only = true});
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    auto versions = (*st)->ListVersions(std::nullopt);
    ASSERT_TRUE(versions.ok());
    for (const auto& v : *versions) {
      if (v.kind != store::VersionKind::kBase) continue;
      for (const auto& row : v.tensors) {
        const std::string hex = row.digest.Hex();
        const fs::path p = r.dir / "store" / "objects" / hex.substr(0, 2) / hex.substr(2);
        if (fs::exists(p)) {
          object = p;
          tensor = row.name;
        }
      }
    }
  }
  ASSERT_FALSE(object.empty()) << "no base tensor is stored as an object file";
  fs::permissions(object, fs::perms::owner_write, fs::perm_options::add);
  {
    std::fstream f(object, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(7);
    f.put('\x55');
  }
  std::tie(rc, out) = RunFerryd(train + " --max-steps 2");
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(out.find("base version"), std::string::npos) << out;
  EXPECT_NE(out.find("tensor '" + tensor + "'"), std::string::npos) << out;
  EXPECT_NE(out.find("no longer hashes to its digest"), std::string::npos) << out;
  // Nothing outside the store changed (RocksDB rewrites its own log files when opened).
  auto after = Tree(r.dir);
  for (auto* tree : {&before, &after}) {
    std::erase_if(*tree, [](const auto& kv) { return kv.first.rfind("store", 0) == 0; });
  }
  EXPECT_EQ(after, before) << out;
}

}  // namespace
}  // namespace ferry::grpo
