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

// The resolved config in TopLevelKeys() order; `fingerprint`: as Fingerprint() hashes it.
OJson ConfigJson(const RunConfig& c, bool fingerprint) {
  OJson j = {{"ferry_run_config", 1}};
  j.update(RowsJson(TopLevelKeys(), c, fingerprint));
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
  j["base_model_name_or_path"] = config.model_name_or_path.string();
  j.update(RowsJson(LoraKeys(), config.lora));
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

Result<RunConfig> ForWorldSize(const RunConfig& config, int world_size) {
  if (world_size < 1) return Status::InvalidArgument("world size " + std::to_string(world_size) + " is below 1");
  RunConfig c = config;
  if (world_size == 1) return c;
  const int64_t w = world_size, pdbs = c.per_device_train_batch_size;
  const std::string src = c.source.string();
  const std::string ranks = " with " + std::to_string(w) + " ranks";
  if (c.generation_batch_size_set) {
    if (c.generation_batch_size % (pdbs * w) != 0) {
      return Status::InvalidArgument(src + ": key 'generation_batch_size': " + std::to_string(c.generation_batch_size) +
                                     " must be divisible by per_device_train_batch_size * world size (" +
                                     std::to_string(pdbs) + " * " + std::to_string(w) + ")" + ranks);
    }
    c.steps_per_generation = c.generation_batch_size / (pdbs * w);
  } else {
    c.generation_batch_size = pdbs * w * c.steps_per_generation;
    if (c.generation_batch_size > kMaxGenerationBatchSize) {
      return Status::InvalidArgument(src +
                                     ": key 'per_device_train_batch_size': times steps_per_generation and the "
                                     "world size is " +
                                     std::to_string(c.generation_batch_size) +
                                     " completions per generation, above the limit of " +
                                     std::to_string(kMaxGenerationBatchSize) + ranks);
    }
  }
  if ((c.generation_batch_size / w) % c.num_generations != 0) {
    return Status::InvalidArgument(
        src + ": key '" + (c.generation_batch_size_set ? "generation_batch_size" : "per_device_train_batch_size") +
        "': each rank takes whole groups of num_generations (" + std::to_string(c.num_generations) +
        ") completions, but generation_batch_size / world size is " + std::to_string(c.generation_batch_size / w) +
        ranks);
  }
  return c;
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
