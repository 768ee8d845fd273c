// Reading the TOML run config (the format and the rules are in config.h).
#include "daemon/run/config.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>

#include <toml++/toml.h>

#include "core/mapped_file.h"
#include "daemon/run/config_internal.h"

namespace ferry::run {
namespace {

// ---------------------------------------------------------------------------------
// Names.

template <size_t N>
bool In(const std::string_view (&names)[N], std::string_view s) {
  return std::find(std::begin(names), std::end(names), s) != std::end(names);
}

// GRPOConfig fields (trl 1.16.0) ferryd neither implements nor accepts at a neutral value:
// named as such instead of "unknown key".
// clang-format off
constexpr std::string_view kTrlUnimplemented[] = {
    "model_init_kwargs", "trust_remote_code", "router_aux_loss_coef", "num_generations_eval",
    "ds3_gather_for_generation", "pad_to_multiple_of", "generation_kwargs", "chat_template_kwargs",
    "cache_implementation", "vllm_model_impl", "vllm_enable_sleep_mode",
    "vllm_structured_outputs_regex", "vllm_group_port", "vllm_gpu_memory_utilization", "vllm_max_model_length",
    "vllm_tensor_parallel_size", "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos",
    "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "ref_model_mixup_alpha", "ref_model_sync_steps",
    "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
    "max_tool_calling_iterations", "log_completions", "log_multimodal", "num_completions_to_print",
    "log_unique_prompts", "log_completions_hub_repo", "use_transformers_continuous_batching",
    "transformers_continuous_batching_config", "use_transformers_paged", "lr_scheduler_kwargs",
    "optim", "data_seed", "report_to"};
// clang-format on

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string Suggest(std::string_view key, const std::vector<std::string_view>& known) {
  if (key.size() > 64) return "";
  std::string_view best;
  size_t best_d = std::max<size_t>(2, key.size() / 4) + 1;
  for (std::string_view k : known) {
    const size_t d = EditDistance(key, k);
    if (d < best_d) {
      best_d = d;
      best = k;
    }
  }
  return best.empty() ? "" : " (did you mean '" + std::string(best) + "'?)";
}

// ---------------------------------------------------------------------------------
// Cross-key rules (TRL's GRPOConfig.__post_init__ and the trainer's checks).

Status Resolve(Parse& p) {
  RunConfig& c = p.c;
  Reader& rd = p.rd;
  if (!p.root.contains("model_name_or_path")) {
    Reader::Scope s(rd, "model_name_or_path");
    return rd.Error("is required (the model directory)");
  }
  if (!p.root.contains("dataset")) {
    Reader::Scope s(rd, "dataset");
    return rd.Error("is required (the JSONL file of prompts)");
  }
  if (!p.root.contains("output_dir")) c.output_dir = (p.base / "trainer_output").lexically_normal();
  c.store.path = (c.output_dir / "store").lexically_normal();
  if (p.store != nullptr) {
    Reader::Scope s(rd, "store");
    FERRY_RETURN_IF_ERROR(ReadStore(p, *p.store));
  }

  if (c.max_staleness > 0 && !c.use_vllm) {
    Reader::Scope s(rd, "max_staleness");
    return rd.Error("needs use_vllm = true (it overlaps the vLLM server's generation with training)");
  }

  // Batch sizes (GRPOConfig.__post_init__, one process).
  const int64_t pdbs = c.per_device_train_batch_size;
  if (p.generation_batch_size && p.steps_per_generation) {
    Reader::Scope s(rd, "generation_batch_size");
    return rd.Error("and steps_per_generation cannot both be set (TRL's rule)");
  }
  if (p.generation_batch_size) {
    Reader::Scope s(rd, "generation_batch_size");
    if (*p.generation_batch_size % pdbs != 0) {
      return rd.Error(std::to_string(*p.generation_batch_size) + " must be divisible by per_device_train_batch_size (" +
                      std::to_string(pdbs) + ")");
    }
    c.generation_batch_size = *p.generation_batch_size;
    c.generation_batch_size_set = true;
    c.steps_per_generation = c.generation_batch_size / pdbs;
  } else {
    c.steps_per_generation = p.steps_per_generation.value_or(c.gradient_accumulation_steps);
    // Both factors are at most kMaxBatchSize (2^20): the product fits.
    c.generation_batch_size = pdbs * c.steps_per_generation;
    if (c.generation_batch_size > kMaxGenerationBatchSize) {
      Reader::Scope s(rd, "per_device_train_batch_size");
      return rd.Error("times steps_per_generation is " + std::to_string(c.generation_batch_size) +
                      " completions per generation, above the limit of " + std::to_string(kMaxGenerationBatchSize));
    }
  }
  if (c.num_generations < 2) {
    Reader::Scope s(rd, "num_generations");
    return rd.Error("must be at least 2: GRPO needs 2 completions per prompt to compute advantages (got " +
                    std::to_string(c.num_generations) + ")");
  }
  if (c.generation_batch_size % c.num_generations != 0) {
    Reader::Scope s(rd, p.generation_batch_size ? "generation_batch_size" : "num_generations");
    return rd.Error("generation_batch_size (" + std::to_string(c.generation_batch_size) +
                    (p.generation_batch_size ? "" : " = per_device_train_batch_size * steps_per_generation") +
                    ") must be divisible by num_generations (" + std::to_string(c.num_generations) + ")");
  }

  c.epsilon_high = p.epsilon_high.value_or(c.epsilon);
  if (c.lora.target_modules.empty()) {
    // PEFT's default for Llama, Mistral and Qwen2 (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
    c.lora.target_modules.form = ModuleSelector::Form::kList;
    c.lora.target_modules.names = {"q_proj", "v_proj"};
  }

  // Warmup: one of the two encodings.
  if (p.root.contains("warmup_ratio") && p.root.contains("warmup_steps") && c.warmup_ratio > 0 && c.warmup_steps > 0) {
    Reader::Scope s(rd, "warmup_ratio");
    return rd.Error("and warmup_steps are both set: give one (warmup_steps below 1 is a ratio, as in transformers 5)");
  }

  // Importance-sampling correction bounds.
  if (p.clip_cap) {
    Reader::Scope s(rd, "vllm_importance_sampling_cap");
    if (p.root.contains("vllm_importance_sampling_clip_max")) {
      return rd.Error("is the deprecated name of vllm_importance_sampling_clip_max: set only the latter");
    }
    c.vllm_importance_sampling_clip_max = *p.clip_cap;
    rd.Warn("is deprecated in TRL: it is read as vllm_importance_sampling_clip_max = " + Reader::Num(*p.clip_cap));
  }
  const auto& cmin = c.vllm_importance_sampling_clip_min;
  const auto& cmax = c.vllm_importance_sampling_clip_max;
  if (cmin && cmax && *cmin >= *cmax) {
    Reader::Scope s(rd, "vllm_importance_sampling_clip_min");
    return rd.Error(Reader::Num(*cmin) + " must be less than vllm_importance_sampling_clip_max (" + Reader::Num(*cmax) +
                    ")");
  }
  if (c.vllm_importance_sampling_correction && !cmin && !cmax &&
      (c.vllm_importance_sampling_mode == MismatchMode::kTokenTruncate ||
       c.vllm_importance_sampling_mode == MismatchMode::kSequenceTruncate)) {
    Reader::Scope s(rd, "vllm_importance_sampling_mode");
    return rd.Error("\"" + std::string(NameOf(c.vllm_importance_sampling_mode)) +
                    "\" needs vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max");
  }

  // Rewards.
  if (p.rewards == nullptr || p.rewards->empty()) {
    Reader::Scope s(rd, "rewards");
    return rd.Error("at least one [[rewards]] table is required");
  }
  if (p.rewards->size() > kMaxRewards) {
    Reader::Scope s(rd, "rewards");
    return rd.Error("has " + std::to_string(p.rewards->size()) + " entries; at most " + std::to_string(kMaxRewards));
  }
  std::vector<bool> explicit_weight;
  for (size_t i = 0; i < p.rewards->size(); ++i) {
    FERRY_ASSIGN_OR_RETURN(RewardSpec spec, ReadReward(p, (*p.rewards)[i], i));
    explicit_weight.push_back((*p.rewards)[i].as_table()->contains("weight"));
    for (size_t j = 0; j < c.rewards.size(); ++j) {
      if (c.rewards[j].name == spec.name) {
        Reader::Scope s(rd, "rewards[" + std::to_string(i) + "].name");
        return rd.Error("\"" + spec.name + "\" is also the name of rewards[" + std::to_string(j) +
                        "]: names must be unique (they name the metrics rewards/<name>/mean)");
      }
    }
    c.rewards.push_back(std::move(spec));
  }
  if (p.reward_weights) {
    Reader::Scope s(rd, "reward_weights");
    if (p.reward_weights->size() != c.rewards.size()) {
      return rd.Error("has " + std::to_string(p.reward_weights->size()) + " weights for " +
                      std::to_string(c.rewards.size()) + " rewards: the numbers must match");
    }
    for (size_t i = 0; i < c.rewards.size(); ++i) {
      const double w = (*p.reward_weights)[i];
      if (explicit_weight[i] && c.rewards[i].weight != w) {
        return rd.Error("[" + std::to_string(i) + "] = " + Reader::Num(w) + " disagrees with rewards[" +
                        std::to_string(i) + "].weight = " + Reader::Num(c.rewards[i].weight));
      }
      c.rewards[i].weight = w;
    }
  }

  // Warnings.
  if (c.bf16 && !c.device.cuda) {
    Reader::Scope s(rd, "bf16");
    rd.Warn(std::string(p.root.contains("bf16") ? "is true" : "is true (TRL's default)") +
            " on device \"cpu\": LibTorch's CPU bf16 matrix products are much slower than fp32 and less exact; set "
            "bf16 = false for fp32");
  }
  if (c.importance_sampling_level == ImportanceSamplingLevel::kSequence && c.loss_type != LossType::kGrpo) {
    Reader::Scope s(rd, "importance_sampling_level");
    rd.Warn("\"sequence\" with loss_type \"" + std::string(NameOf(c.loss_type)) +
            "\" sums per-token contributions, weighting each sequence by its length; GSPO uses loss_type \"grpo\" "
            "(TRL's warning)");
  }
  if (c.delta && *c.delta <= 1 + c.epsilon_high) {
    Reader::Scope s(rd, "delta");
    rd.Warn(Reader::Num(*c.delta) + " is not above 1 + epsilon_high (" + Reader::Num(1 + c.epsilon_high) +
            "): TRL recommends delta > 1 + epsilon");
  }
  if (c.beta == 0 && p.root.contains("use_bias_correction_kl")) {
    Reader::Scope s(rd, "use_bias_correction_kl");
    rd.Warn("has no effect with beta = 0 (no KL term)");
  }
  return Status::OK();
}

}  // namespace

Result<std::filesystem::path> ResolvePath(Reader& rd, const toml::node& v, const std::filesystem::path& base) {
  // Read in place: GCC 12 at -O2 warns (maybe-uninitialized) about a string moved out of the Result.
  const Result<std::string> text = rd.String(v);
  if (!text.ok()) return text.status();
  const std::string& s = *text;
  if (s.empty()) return rd.Error("must not be empty");
  if (s.starts_with('~'))
    return rd.Error("'~' is not expanded: write an absolute path or one relative to the config file");
  std::filesystem::path p(s);
  if (p.is_relative()) p = base / p;
  return p.lexically_normal();
}

template <>
std::span<const Spelling<ChatTemplate>> SpellingsOf() {
  static constexpr Spelling<ChatTemplate> k[] = {{ChatTemplate::kAuto, "auto"},
                                                 {ChatTemplate::kNone, "none"},
                                                 {ChatTemplate::kChatML, "chatml"},
                                                 {ChatTemplate::kLlama3, "llama3"}};
  return k;
}

template <>
std::span<const Spelling<GenerationDtype>> SpellingsOf() {
  static constexpr Spelling<GenerationDtype> k[] = {{GenerationDtype::kAuto, "auto"},
                                                    {GenerationDtype::kFloat32, "float32"},
                                                    {GenerationDtype::kBFloat16, "bfloat16"}};
  return k;
}

template <>
std::span<const Spelling<LrSchedule>> SpellingsOf() {
  static constexpr Spelling<LrSchedule> k[] = {{LrSchedule::kLinear, "linear"},
                                               {LrSchedule::kCosine, "cosine"},
                                               {LrSchedule::kConstant, "constant"},
                                               {LrSchedule::kConstantWithWarmup, "constant_with_warmup"}};
  return k;
}

template <>
std::span<const Spelling<LossType>> SpellingsOf() {
  static constexpr Spelling<LossType> k[] = {
      {LossType::kGrpo, "grpo"}, {LossType::kBnpo, "bnpo"}, {LossType::kDrGrpo, "dr_grpo"}, {LossType::kDapo, "dapo"}};
  return k;
}

template <>
std::span<const Spelling<ScaleRewards>> SpellingsOf() {
  static constexpr Spelling<ScaleRewards> k[] = {
      {ScaleRewards::kGroup, "group"}, {ScaleRewards::kBatch, "batch"}, {ScaleRewards::kNone, "none"}};
  return k;
}

template <>
std::span<const Spelling<ImportanceSamplingLevel>> SpellingsOf() {
  static constexpr Spelling<ImportanceSamplingLevel> k[] = {{ImportanceSamplingLevel::kToken, "token"},
                                                            {ImportanceSamplingLevel::kSequence, "sequence"}};
  return k;
}

template <>
std::span<const Spelling<MismatchMode>> SpellingsOf() {
  static constexpr Spelling<MismatchMode> k[] = {{MismatchMode::kTokenTruncate, "token_truncate"},
                                                 {MismatchMode::kTokenMask, "token_mask"},
                                                 {MismatchMode::kSequenceTruncate, "sequence_truncate"},
                                                 {MismatchMode::kSequenceMask, "sequence_mask"}};
  return k;
}

template <>
std::span<const Spelling<RewardType>> SpellingsOf() {
  static constexpr Spelling<RewardType> k[] = {{RewardType::kAnswerMatch, "answer_match"},
                                               {RewardType::kDigitMatch, "digit_match"},
                                               {RewardType::kRegex, "regex"},
                                               {RewardType::kLength, "length"},
                                               {RewardType::kCommand, "command"}};
  return k;
}

std::string_view RewardTypeName(RewardType t) { return NameOf(t); }

Result<RunConfig> ParseRunConfig(std::string_view text, const std::filesystem::path& source) {
  RunConfig c;
  std::error_code ec;
  c.source = std::filesystem::absolute(source, ec).lexically_normal();
  if (ec) c.source = source;
  const std::string src = source.string();
  if (text.size() > kMaxConfigFileBytes) {
    return Status::InvalidArgument(src + ": " + std::to_string(text.size()) + " bytes; a config has at most " +
                                   std::to_string(kMaxConfigFileBytes));
  }
  toml::table root;
  try {
    root = toml::parse(text, src);
  } catch (const toml::parse_error& e) {
    return Status::Corruption(src + ":" + std::to_string(e.source().begin.line) + ":" +
                              std::to_string(e.source().begin.column) +
                              ": TOML syntax error: " + std::string(e.description()));
  } catch (const std::exception& e) {
    return Status::Corruption(src + ": TOML error: " + e.what());
  }

  Reader rd(src, &c.warnings);
  Parse p{.c = c, .rd = rd, .root = root, .base = c.source.parent_path()};
  FERRY_RETURN_IF_ERROR(ReadRows(p, root, "", TopLevelKeys(), c, [&rd](const std::string& key) {
    if (key == "use_cpu") {
      return rd.Unsupported("ferryd chooses its device with device = \"cpu\", \"cuda\" or \"cuda:N\"; remove it");
    }
    if (key == "run_name") {
      return rd.Unsupported("ferryd names its run in the store with [store] run = \"...\"; remove it");
    }
    if (In(kTrlUnimplemented, key)) {
      return rd.Unsupported("a TRL GRPOConfig / TrainingArguments key ferryd does not implement; remove it");
    }
    if (key == "r" || key == "lora_alpha" || key == "target_modules" || key == "lora_dropout" || key == "use_rslora") {
      return rd.Error("unknown key: PEFT LoraConfig keys go in the [lora] table");
    }
    std::vector<std::string_view> known = NamesOf(TopLevelKeys());
    std::sort(known.begin(), known.end());
    return rd.Error("unknown key" + Suggest(key, known));
  }));
  FERRY_RETURN_IF_ERROR(Resolve(p));
  return c;
}

Result<RunConfig> LoadRunConfig(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return Status::NotFound(path.string() + ": no such config file");
  if (!std::filesystem::is_regular_file(path, ec))
    return Status::InvalidArgument(path.string() + ": not a regular file");
  FERRY_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxConfigFileBytes));
  FERRY_ASSIGN_OR_RETURN(RunConfig c, ParseRunConfig(text, path));
  const std::string src = path.string();
  if (!std::filesystem::is_directory(c.model_name_or_path, ec)) {
    return Status::NotFound(src + ": key 'model_name_or_path': " + c.model_name_or_path.string() +
                            " is not a directory");
  }
  if (!std::filesystem::is_regular_file(c.dataset, ec)) {
    return Status::NotFound(src + ": key 'dataset': " + c.dataset.string() + " is not a regular file");
  }
  return c;
}

std::string RunConfig::VllmServerUrl() const {
  if (!vllm_server_base_url.empty()) return vllm_server_base_url;
  return "http://" + vllm_server_host + ":" + std::to_string(vllm_server_port);
}

}  // namespace ferry::run
