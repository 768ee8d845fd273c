// A GRPO + LoRA training run, described by one TOML file (read with Debian's toml++).
//
// Key names are TRL's GRPOConfig names (trl 1.16.0, trl/trainer/grpo_config.py), the
// TrainingArguments names GRPOConfig inherits (transformers 5.23, training_args.py), and
// PEFT's LoraConfig names under a [lora] table; their defaults are TRL's and PEFT's. Ferry's
// own keys: model_name_or_path, dataset, threads, device, chat_template, [store],
// [publish], [control] and [[rewards]]. docs/daemon.md ("Configuration", "Rewards") lists every key with its default.
//
//   model_name_or_path = "models/tiny"      # a directory; relative to this file
//   dataset = "data/train.jsonl"            # JSONL (daemon/run/dataset.h); relative to this file
//   output_dir = "runs/add"                 # relative to this file. Default: "trainer_output"
//   learning_rate = 1e-3
//   num_generations = 8
//   [lora]
//   r = 8
//   lora_alpha = 16
//   target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
//   [[rewards]]
//   name = "digits"
//   type = "digit_match"
//   field = "answer"
//
// Errors. Every message reads "FILE: key 'NAME': what is wrong", where NAME is the dotted
// path of the key ("lora.r", "rewards[2].field", "store.path"; rewards are counted from 0,
// as TOML arrays). Codes: kNotFound for a missing config file (or, from LoadRunConfig, a
// missing model directory or dataset file); kCorruption for TOML syntax ("FILE:LINE:COL:
// TOML syntax error: ..."); kInvalidArgument for an unknown key, a wrong type or a bad value;
// kUnsupported for TRL / PEFT features ferryd does not implement (a loss_type such as
// "cispo", use_vllm = true, min_p other than 0, ...), saying so. Warnings (keys accepted but
// without effect, TRL's own warnings) are returned in RunConfig::warnings, same format.
//
// Resolution. Relative paths are resolved against the directory of the config file and
// made lexically normal; a path starting with "~" is refused (there is no home expansion).
// Derived values are resolved as TRL's GRPOConfig.__post_init__ does: steps_per_generation
// defaults to gradient_accumulation_steps and generation_batch_size to
// per_device_train_batch_size * steps_per_generation (one process); epsilon_high defaults
// to epsilon; scale_rewards true / false become "group" / "none"; the deprecated
// vllm_importance_sampling_cap becomes vllm_importance_sampling_clip_max. Absent LoRA
// target_modules resolve to PEFT's default for Llama, Mistral and Qwen2: ["q_proj",
// "v_proj"]. Every reward's weight is resolved (reward_weights, or each table's weight).
//
// Keys. Every key is one row of its table (its type, bounds, member and how it is recorded):
// config_keys.cpp for the top level, [store], [publish] and [control], config_lora.cpp for
// [lora], config_rewards.cpp for each reward type. That row alone reads and checks the key,
// writes it into ToJson() and decides whether it counts in Fingerprint(); docs/daemon.md lists
// each (a test checks both ways).
//
// ToJson() writes the resolved config: every key with its value, defaults included, in the
// table's order, keys of the TOML names ([publish] and [control] are operational and left
// out). Optional values that are unset are JSON null. Fingerprint() is the XXH3-128 (seed 0)
// of the compact form of that JSON, as 32 lowercase hex digits, except that keys added after
// runs were made (generation_dtype) count only when set away from their default: equal
// configs (after resolution) give equal fingerprints on every platform; a changed value, a
// moved file or a new Ferry default changes it; fixtures/run_config/ holds configs whose
// fingerprints earlier runs recorded.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "convert/peft_config.h"
#include "core/status.h"
#include "sync/protocol.h"

namespace ferry::run {

// Limits on hostile input; larger values are refused with kInvalidArgument naming the key.
inline constexpr size_t kMaxConfigFileBytes = 1u << 20;
inline constexpr int64_t kMaxBatchSize = 1 << 20;  // per_device_train_batch_size, ...
inline constexpr int64_t kMaxNumGenerations = 1 << 16;
inline constexpr int64_t kMaxSequenceTokens = 1 << 20;       // max_completion_length, max_prompt_length
inline constexpr int64_t kMaxGenerationBatchSize = 1 << 30;  // completions per generation
inline constexpr int64_t kMaxThreads = 4096;
inline constexpr size_t kMaxRewards = 64;
inline constexpr size_t kMaxRegexLength = 4096;
inline constexpr size_t kMaxRewardNameLength = 64;
inline constexpr size_t kMaxCommandArgs = 256;

// How chat-message prompts ("prompt" as a list of messages, or "messages") become text.
enum class ChatTemplate {
  kAuto,    // chosen from the tokenizer's special tokens (ChatML or Llama-3)
  kNone,    // plain-text prompts only: a dataset with messages is refused
  kChatML,  // <|im_start|>role\ncontent<|im_end|>\n ... <|im_start|>assistant\n
  kLlama3,  // <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> ...
};

// The dtype the co-located generator computes in (vLLM's `dtype`): the trainer's own, or another, as
// when vLLM samples in BF16 for a trainer in F32. The snapshot the generator receives is the same either
// way (the merge in the base's dtype); the generator casts its copy.
enum class GenerationDtype {
  kAuto,      // the trainer's: BF16 with bf16 = true, else the weights' own
  kFloat32,   // F32
  kBFloat16,  // BF16
};

// TRL's GRPO settings, parsed once when the config is read (daemon/grpo uses them as they are).
// transformers' `lr_scheduler_type` (the four ferryd implements; daemon/grpo/lr_schedule.h).
enum class LrSchedule { kLinear, kCosine, kConstant, kConstantWithWarmup };
// TRL `loss_type` (daemon/grpo/grpo_math.h).
enum class LossType { kGrpo, kBnpo, kDrGrpo, kDapo };
// TRL `scale_rewards`: per group, over the whole batch, or not at all.
enum class ScaleRewards { kGroup, kBatch, kNone };
// TRL `importance_sampling_level`: per token, or per sequence (GSPO).
enum class ImportanceSamplingLevel { kToken, kSequence };
// TRL `vllm_importance_sampling_mode`.
enum class MismatchMode { kTokenTruncate, kTokenMask, kSequenceTruncate, kSequenceMask };

// How each enum of this file is spelled in the TOML file and the resolved JSON.
template <typename E>
struct Spelling {
  E value;
  std::string_view name;
};
// Every spelling of E, in the order messages list them. Defined for the enums of this file.
template <typename E>
std::span<const Spelling<E>> SpellingsOf();
// `value`'s spelling ("?" for a value without one).
template <typename E>
std::string_view NameOf(E value) {
  for (const Spelling<E>& s : SpellingsOf<E>()) {
    if (s.value == value) return s.name;
  }
  return "?";
}
// The value spelled `name`; nullopt for another spelling.
template <typename E>
std::optional<E> FromName(std::string_view name) {
  for (const Spelling<E>& s : SpellingsOf<E>()) {
    if (s.name == name) return s.value;
  }
  return std::nullopt;
}
template <>
std::span<const Spelling<ChatTemplate>> SpellingsOf();
template <>
std::span<const Spelling<GenerationDtype>> SpellingsOf();
template <>
std::span<const Spelling<LrSchedule>> SpellingsOf();
template <>
std::span<const Spelling<LossType>> SpellingsOf();
template <>
std::span<const Spelling<ScaleRewards>> SpellingsOf();
template <>
std::span<const Spelling<ImportanceSamplingLevel>> SpellingsOf();
template <>
std::span<const Spelling<MismatchMode>> SpellingsOf();

// The answer answer_match and digit_match look for when a reward sets no pattern: the last
// number in the completion (an optional minus sign, digits with optional thousands commas,
// an optional decimal part). RE2 syntax; no capture groups.
inline constexpr std::string_view kDefaultAnswerPattern = R"(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)";

// The built-in reward functions and the external command (daemon/run/rewards.h says
// exactly how each one scores).
enum class RewardType { kAnswerMatch, kDigitMatch, kRegex, kLength, kCommand };
template <>
std::span<const Spelling<RewardType>> SpellingsOf();
// "answer_match" | "digit_match" | "regex" | "length" | "command".
std::string_view RewardTypeName(RewardType t);

// One [[rewards]] table. Keys that do not belong to `type` are refused.
struct RewardSpec {
  std::string name;  // unique; used in metric names (rewards/<name>/mean). Default: the type name
  RewardType type = RewardType::kAnswerMatch;
  double weight = 1.0;  // resolved from `weight` or reward_weights. Default: 1.0

  // answer_match, digit_match: the dataset field holding the reference answer (a string or a
  // number) and how the completion's answer is found: the last match of `pattern` (RE2),
  // capture group `group` (0: the whole match).
  std::string field;
  // Resolved: kDefaultAnswerPattern when the table sets none. regex: required.
  std::optional<std::string> pattern;
  int group = 1;  // Default: 1, or 0 when `pattern` has no capture groups
  // answer_match: "auto" (numbers compared as decimals when both sides are numbers, else
  // trimmed text) or "none" (exact bytes). Default: "auto".
  std::string normalize = "auto";
  // digit_match: which ends of the two answers line up: "left" or "right". Default: "left".
  std::string align = "left";

  // regex: `pattern` (required) must match the completion: "full" (the whole completion)
  // or "search" (anywhere). Default: "full".
  std::string match = "full";

  // length: the target completion length in tokens (required, >= 1).
  int64_t target = 0;

  // command: argv (argv[0] with a '/' is resolved against the config file's directory,
  // otherwise looked up in PATH), run in the config file's directory.
  std::vector<std::string> command;
  double timeout_seconds = 60.0;  // per batch, (0, 86400]. Default: 60
  int64_t batch_size = 0;         // completions per batch; 0: all of a call. Default: 0
  // Where the command's stderr goes: empty = ferryd's stderr; else a file (appended,
  // relative to the config file). Default: "".
  std::filesystem::path stderr_file;
  std::filesystem::path working_dir;  // the config file's directory (resolved, not a key)
};

// PEFT LoraConfig keys ([lora] table).
struct LoraSettings {
  int r = 8;                                     // [1, 65536]. Default: 8 (peft lora/config.py)
  double lora_alpha = 8;                         // > 0. Default: 8
  double lora_dropout = 0.0;                     // [0, 1). Default: 0.0
  ModuleSelector target_modules;                 // list, regex string or "all-linear". Default: ["q_proj", "v_proj"]
  ModuleSelector exclude_modules;                // Default: none
  bool use_rslora = false;                       // Default: false
  std::vector<RankPatternEntry> rank_pattern;    // file order. Default: none
  std::vector<AlphaPatternEntry> alpha_pattern;  // file order. Default: none
  std::vector<int64_t> layers_to_transform;      // Default: none (every layer)
  bool layers_to_transform_is_int = false;       // written as one integer
  std::vector<std::string> layers_pattern;       // Default: none
  std::string bias = "none";                     // only "none" is implemented. Default: "none"
};

// Where the run's versions go (sync/store).
struct StoreSettings {
  std::filesystem::path path;   // Default: <output_dir>/store
  std::string run = "default";  // the store's run name. Default: "default"
};

// [publish]: each step's version also served to generators on other hosts (`ferry sync
// receive`) by a sync publisher (sync/publisher.h) that ferryd runs off the training thread.
// Operational settings: left out of ToJson() and Fingerprint(), so a run resumes under
// another endpoint. Endpoint policy: sync/endpoints.h (ipc:// a private directory; tcp://
// only with CURVE: `key` and `allow`).
struct PublishSettings {
  // "ipc://DIR" or "tcp://HOST:PORT" (announcements on PORT+1); `ferryd train --publish`
  // overrides it. Default: "" (not published)
  std::string endpoint;
  // "adapter": receivers get each step's adapter plus the base once, merge, and prove the
  // merged digest; "merged": each step's merged weights whole; "delta": only the merged
  // tensors a receiver's active version lacks (daemon/ferryd/remote.h: served from the
  // trainer's in-memory snapshots). Default: "adapter"
  sync::PublishMode mode = sync::PublishMode::kAdapter;
  // CURVE keypair prefix (PREFIX.key / PREFIX.pub, `ferry keys generate`); relative to the
  // config file. Default: none
  std::filesystem::path key;
  // File of allowed receiver public keys, one per line; required with `key`. Default: none
  std::filesystem::path allow;
};

// [control]: an extra control socket beside the private ipc:// one in DIR/.ferryd/ (which is
// always bound, so `ferry daemon ... --dir` keeps working). Operational, like [publish].
struct ControlSettings {
  // "tcp://HOST:PORT" (with `key` and `allow`) or "ipc://PATH". Default: "" (only DIR/.ferryd/control)
  std::string endpoint;
  // CURVE keypair prefix of ferryd; clients pin PREFIX.pub (`ferry daemon status --connect EP
  // --key THEIRS --server-key PREFIX.pub`). Relative to the config file. Default: none
  std::filesystem::path key;
  // File of allowed client public keys, one per line; required with `key`. Default: none
  std::filesystem::path allow;
};

// [distributed]: how data-parallel ranks (torchrun's environment, or `ferryd train
// --nproc-per-node N`) meet and check each other. Operational, like [publish]: left out of
// ToJson() and Fingerprint(), so a run resumes under another world size or timeout.
struct DistributedSettings {
  // "gloo" or "nccl"; empty: by device (gloo on the CPU, nccl on CUDA). Default: ""
  std::string backend;
  // Seconds a collective waits for the slowest rank before the run stops, naming it.
  // Default: 1800 (torch's default_pg_timeout)
  double timeout = 1800;
  // Every this many steps the ranks compare a digest of their adapter parameters (0: never;
  // the acknowledged snapshot ids are compared every step). Default: 10
  int64_t check_every = 10;
};

// `device`: where the trainer and its generator compute: "cpu", "cuda" (the current CUDA
// device) or "cuda:N" (N < 128).
struct DeviceSpec {
  bool cuda = false;
  std::optional<int> index;  // with cuda: the N of "cuda:N"
  std::string Name() const;  // "cpu", "cuda" or "cuda:N"
  bool operator==(const DeviceSpec&) const = default;
};

// The resolved run. Field names are the TOML keys; defaults are TRL 1.16's.
struct RunConfig {
  std::filesystem::path source;  // the config file (absolute)

  // --- Ferry: what to train on, where, with what.
  std::filesystem::path model_name_or_path;          // required; a model directory
  std::filesystem::path dataset;                     // required; a JSONL file
  std::filesystem::path output_dir;                  // Default: "trainer_output"
  int64_t threads = 0;                               // LibTorch intra-op threads; 0: hardware threads. Default: 0
  DeviceSpec device;                                 // Default: "cpu"
  ChatTemplate chat_template = ChatTemplate::kAuto;  // Default: "auto"
  GenerationDtype generation_dtype = GenerationDtype::kAuto;  // Default: "auto"
  StoreSettings store;
  PublishSettings publish;
  ControlSettings control;
  DistributedSettings distributed;

  // --- TrainingArguments (as GRPOConfig overrides them).
  double learning_rate = 1e-6;                         // Default: 1e-6 (GRPOConfig)
  LrSchedule lr_scheduler_type = LrSchedule::kLinear;  // Default: "linear"
  double warmup_ratio = 0.0;                           // [0, 1]. Default: 0.0 (transformers 4.x name)
  double warmup_steps = 0;                             // >= 0; below 1: a ratio of the total steps. Default: 0
  double weight_decay = 0.0;                           // Default: 0.0
  double adam_beta1 = 0.9;                             // Default: 0.9
  double adam_beta2 = 0.999;                           // Default: 0.999
  double adam_epsilon = 1e-8;                          // Default: 1e-8
  double max_grad_norm = 1.0;                          // 0: no clipping. Default: 1.0
  double num_train_epochs = 3.0;                       // Default: 3.0
  int64_t max_steps = -1;                              // -1: from num_train_epochs. Default: -1
  double logging_steps = 10;                           // >= 1 (whole) or a ratio in (0, 1). Default: 10 (TRL)
  double save_steps = 500;                             // as logging_steps. Default: 500
  std::optional<int64_t> save_total_limit;             // Default: none (keep every checkpoint)
  int64_t seed = 42;                                   // Default: 42
  bool shuffle_dataset = true;                         // Default: true
  int64_t per_device_train_batch_size = 8;             // completions per micro-step. Default: 8
  int64_t gradient_accumulation_steps = 1;             // Default: 1
  bool bf16 = true;                                    // Default: true (TRL: "true if fp16 is not set")
  bool gradient_checkpointing = true;                  // Default: true (TRL)

  // --- GRPOConfig.
  int64_t num_generations = 8;               // >= 2. Default: 8
  std::optional<int64_t> max_prompt_length;  // Ferry: keep the last N prompt tokens. Default: none
  int64_t max_completion_length = 512;       // Default: 512
  int64_t generation_batch_size = 0;         // resolved (see the top of this file)
  int64_t steps_per_generation = 0;          // resolved
  // generation_batch_size was set in the file (TRL then keeps it as the global batch when the
  // run has several ranks; see ForWorldSize). Not a key of its own.
  bool generation_batch_size_set = false;
  double temperature = 1.0;     // > 0. Default: 1.0
  double top_p = 1.0;           // (0, 1]. Default: 1.0
  int64_t top_k = 0;            // 0: off. Default: 0
  double beta = 0.0;            // KL coefficient. Default: 0.0
  int64_t num_iterations = 1;   // Default: 1
  double epsilon = 0.2;         // [0, 1]. Default: 0.2
  double epsilon_high = 0.2;    // resolved; Default: epsilon
  std::optional<double> delta;  // two-sided clipping bound. Default: none
  ImportanceSamplingLevel importance_sampling_level = ImportanceSamplingLevel::kToken;  // Default: "token"
  ScaleRewards scale_rewards = ScaleRewards::kGroup;                                    // Default: "group"
  LossType loss_type = LossType::kDapo;                                                 // Default: "dapo"
  bool mask_truncated_completions = false;                                              // Default: false
  // TRL's vLLM importance-sampling correction; in Ferry it corrects the mismatch between
  // ferryd's co-located generator and its trainer.
  bool vllm_importance_sampling_correction = true;                           // Default: true
  MismatchMode vllm_importance_sampling_mode = MismatchMode::kSequenceMask;  // Default: "sequence_mask"
  std::optional<double> vllm_importance_sampling_clip_max = 3.0;             // Default: 3.0; inf: none
  std::optional<double> vllm_importance_sampling_clip_min;                   // Default: none
  bool use_bias_correction_kl = true;                                        // Default: true (trl 1.16)

  // --- Rollouts from a vLLM server (TRL's server mode; docs/vllm.md). Each step's completions
  // come from the server, under the version proven on it for the step before.
  bool use_vllm = false;                     // Default: false (ferryd's co-located generator)
  std::string vllm_mode = "server";          // only "server" ("colocate" is ferryd's own generator). Default
  std::string vllm_server_base_url;          // Default: "" = http://vllm_server_host:vllm_server_port
  std::string vllm_server_host = "0.0.0.0";  // Default: "0.0.0.0" (TRL's; connects to this host)
  int64_t vllm_server_port = 8000;           // Default: 8000
  double vllm_server_timeout = 240.0;        // seconds a request or an adoption may take. Default: 240
  // The server's --dtype (float32, bfloat16, float16; Ferry's key, as `ferry sync receive
  // --engine-dtype`): the probe's tolerance is the looser of its and the trainer's dtype's.
  // Default: "" = the trainer's.
  std::string vllm_server_dtype;
  // AsyncGRPO's bound: a step trains on completions generated by a version at most this many
  // steps old; >= 1 overlaps the next step's generation with this step's training. Default: 0
  int64_t max_staleness = 0;
  // The server's URL: vllm_server_base_url, else http://HOST:PORT.
  std::string VllmServerUrl() const;

  // --- PEFT and rewards.
  LoraSettings lora;
  std::vector<RewardSpec> rewards;  // at least one

  // Warnings, "FILE: key 'NAME': ...", in the order found.
  std::vector<std::string> warnings;

  // generation_batch_size / num_generations: prompts drawn per generation.
  int64_t prompts_per_generation() const { return generation_batch_size / num_generations; }
  // The resolved config as pretty-printed JSON (see the top of this file).
  std::string ToJson() const;
  // 32 lowercase hex digits (see the top of this file).
  std::string Fingerprint() const;
};

// Parses TOML `text` as the config file `source` (used in messages; relative paths are
// resolved against its directory, made absolute against the current directory). Touches
// no file. Errors as described at the top of this file.
[[nodiscard]] Result<RunConfig> ParseRunConfig(std::string_view text, const std::filesystem::path& source);

// Reads and parses `path` (at most kMaxConfigFileBytes), then checks that
// model_name_or_path is a directory and dataset a regular file (kNotFound naming the key
// and the path otherwise).
[[nodiscard]] Result<RunConfig> LoadRunConfig(const std::filesystem::path& path);

// The PEFT LoraConfig of the run as adapter_config.json would hold it (peft_type LORA,
// task_type CAUSAL_LM, base_model_name_or_path the model directory), parsed by
// convert/peft_config.h: what runtime::LoraAdapter::Create takes.
[[nodiscard]] Result<PeftConfig> LoraPeftConfig(const RunConfig& config);

// Optimizer steps of the run over a dataset of `dataset_size` prompts, as TRL counts them:
// max_steps when positive, else ceil(num_train_epochs * ceil(L / G)) with
// L = floor(dataset_size / prompts_per_generation) * num_iterations * steps_per_generation
// (TRL's RepeatSampler drops an incomplete last generation of each epoch) and
// G = gradient_accumulation_steps. Ferry's DatasetSampler does not drop prompts (it reads
// across epoch boundaries), so the same step count ends a little past that many epochs.
// kInvalidArgument naming max_steps when L is 0 (fewer prompts than one generation) and
// max_steps is not set: TRL refuses that too.
[[nodiscard]] Result<int64_t> TotalSteps(const RunConfig& config, uint64_t dataset_size);

// Warmup steps for a run of `total_steps`: warmup_steps when >= 1, else
// ceil(total_steps * warmup_steps) when warmup_steps > 0, else ceil(total_steps * warmup_ratio).
[[nodiscard]] int64_t WarmupSteps(const RunConfig& config, int64_t total_steps);

// The config of one rank of `world_size` data-parallel ranks, as TRL resolves GRPOConfig with
// num_processes = world_size: per_device_train_batch_size stays each rank's;
// generation_batch_size (the global batch of a generation) becomes per_device_train_batch_size
// * world_size * steps_per_generation, or, when the file set it, stays as set and
// steps_per_generation becomes generation_batch_size / (per_device_train_batch_size *
// world_size). Each rank takes whole groups, so generation_batch_size / world_size must be a
// multiple of num_generations. ToJson() and Fingerprint() of the result are not the run's:
// those of `config` (world size 1) are, so a run resumes under another world size. Errors
// (kInvalidArgument) name the key and the world size. world_size 1: `config` unchanged.
[[nodiscard]] Result<RunConfig> ForWorldSize(const RunConfig& config, int world_size);

// `threads`, or the hardware threads when it is 0 (at least 1).
[[nodiscard]] int64_t ResolvedThreads(const RunConfig& config);

}  // namespace ferry::run
