// The resolved run config as JSON, its fingerprint, and values derived from it.
#include <algorithm>
#include <cmath>
#include <limits>
#include <thread>

#include <nlohmann/json.hpp>

#include "daemon/run/config_internal.h"
#include "kernels/hash.h"
#include "store/store.h"

namespace ferry::run {
namespace {

using OJson = nlohmann::ordered_json;

OJson PathJson(const std::filesystem::path& p) { return p.string(); }

OJson SelectorJson(const ModuleSelector& s) {
  switch (s.form) {
    case ModuleSelector::Form::kNone: return nullptr;
    case ModuleSelector::Form::kList: return s.names;
    case ModuleSelector::Form::kRegex:
    case ModuleSelector::Form::kAllLinear: return s.pattern;
  }
  return nullptr;
}

// lora_alpha is an int in PEFT's LoraConfig: written as one when it is whole.
OJson AlphaJson(double a) {
  if (a == std::floor(a) && std::fabs(a) < 1e15) return static_cast<int64_t>(a);
  return a;
}

}  // namespace

OJson LoraJson(const LoraSettings& l) {
  OJson j;
  j["r"] = l.r;
  j["lora_alpha"] = AlphaJson(l.lora_alpha);
  j["lora_dropout"] = l.lora_dropout;
  j["target_modules"] = SelectorJson(l.target_modules);
  j["exclude_modules"] = SelectorJson(l.exclude_modules);
  j["use_rslora"] = l.use_rslora;
  OJson rank = OJson::object();
  for (const auto& e : l.rank_pattern) rank[e.key] = e.rank;
  OJson alpha = OJson::object();
  for (const auto& e : l.alpha_pattern) alpha[e.key] = AlphaJson(e.alpha);
  j["rank_pattern"] = rank;
  j["alpha_pattern"] = alpha;
  if (l.layers_to_transform.empty()) {
    j["layers_to_transform"] = nullptr;
  } else if (l.layers_to_transform_is_int) {
    j["layers_to_transform"] = l.layers_to_transform[0];
  } else {
    j["layers_to_transform"] = l.layers_to_transform;
  }
  j["layers_pattern"] = l.layers_pattern.empty() ? OJson(nullptr) : OJson(l.layers_pattern);
  j["bias"] = l.bias;
  return j;
}

OJson RewardJson(const RewardSpec& r) {
  OJson j;
  j["name"] = r.name;
  j["type"] = std::string(RewardTypeName(r.type));
  j["weight"] = r.weight;
  switch (r.type) {
    case RewardType::kAnswerMatch:
      j["field"] = r.field;
      j["pattern"] = *r.pattern;
      j["group"] = r.group;
      j["normalize"] = r.normalize;
      break;
    case RewardType::kDigitMatch:
      j["field"] = r.field;
      j["pattern"] = *r.pattern;
      j["group"] = r.group;
      j["align"] = r.align;
      break;
    case RewardType::kRegex:
      j["pattern"] = *r.pattern;
      j["match"] = r.match;
      break;
    case RewardType::kLength: j["target"] = r.target; break;
    case RewardType::kCommand:
      j["command"] = r.command;
      j["timeout_seconds"] = r.timeout_seconds;
      j["batch_size"] = r.batch_size;
      j["stderr_file"] = r.stderr_file.empty() ? OJson(nullptr) : PathJson(r.stderr_file);
      j["working_dir"] = PathJson(r.working_dir);
      break;
  }
  return j;
}

namespace {

// The resolved config in TopLevelKeys() order; `fingerprint`: as Fingerprint() hashes it.
OJson ConfigJson(const RunConfig& c, bool fingerprint) {
  OJson j;
  j["ferry_run_config"] = 1;
  for (const KeyInfo& k : TopLevelKeys()) {
    if (k.record == KeyInfo::Record::kNever) continue;
    if (fingerprint && k.record == KeyInfo::Record::kUnlessDefault && k.at_default(c)) continue;
    j[std::string(k.name)] = k.value(c);
  }
  return j;
}

constexpr auto kReplace = nlohmann::json::error_handler_t::replace;

}  // namespace

std::string RunConfig::ToJson() const {
  return ConfigJson(*this, /*fingerprint=*/false).dump(2, ' ', false, kReplace) + "\n";
}

std::string RunConfig::Fingerprint() const {
  // Keys added after runs were made count only when set away from their default, so a run made
  // before them still resumes (its checkpoints hold the fingerprint without them).
  const std::string text = ConfigJson(*this, /*fingerprint=*/true).dump(-1, ' ', false, kReplace);
  const kernels::Hash128 h = kernels::Xxh3_128(text.data(), text.size());
  return store::Digest{h.hi, h.lo}.Hex();
}

Result<PeftConfig> LoraPeftConfig(const RunConfig& config) {
  OJson j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = PathJson(config.model_name_or_path);
  const OJson lora = LoraJson(config.lora);
  for (auto it = lora.begin(); it != lora.end(); ++it) j[it.key()] = it.value();
  j["use_dora"] = false;
  j["fan_in_fan_out"] = false;
  j["init_lora_weights"] = true;
  j["modules_to_save"] = nullptr;
  j["inference_mode"] = false;
  return ParsePeftConfig(j.dump(2, ' ', false, kReplace), config.source.string() + " [lora]");
}

Result<int64_t> TotalSteps(const RunConfig& c, uint64_t dataset_size) {
  if (c.max_steps > 0) return c.max_steps;
  const uint64_t per_generation = static_cast<uint64_t>(c.prompts_per_generation());
  if (dataset_size / per_generation == 0) {
    return Status::InvalidArgument(c.source.string() + ": key 'max_steps': the dataset has " +
                                   std::to_string(dataset_size) + " prompts, fewer than one generation (" +
                                   std::to_string(per_generation) +
                                   " = generation_batch_size / num_generations): set max_steps");
  }
  // Every factor is bounded by config.h's limits; long double keeps the count exact well
  // past any real dataset.
  const long double batches = static_cast<long double>(dataset_size / per_generation) *
                              static_cast<long double>(c.num_iterations) *
                              static_cast<long double>(c.steps_per_generation);
  const long double per_epoch = std::ceil(batches / static_cast<long double>(c.gradient_accumulation_steps));
  const long double total = std::ceil(static_cast<long double>(c.num_train_epochs) * per_epoch);
  return total >= 9.2e18L ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(total);
}

int64_t WarmupSteps(const RunConfig& c, int64_t total_steps) {
  if (c.warmup_steps >= 1) return static_cast<int64_t>(c.warmup_steps);
  const double ratio = c.warmup_steps > 0 ? c.warmup_steps : c.warmup_ratio;
  return static_cast<int64_t>(std::ceil(static_cast<long double>(total_steps) * ratio));
}

int64_t ResolvedThreads(const RunConfig& c) {
  if (c.threads > 0) return c.threads;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int64_t>(hw);
}

}  // namespace ferry::run
