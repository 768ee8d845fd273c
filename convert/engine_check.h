// What an inference engine (vLLM) does with a PEFT LoRA adapter: what it refuses to load,
// what it loads but applies wrongly, and what the operator must configure. Shared by
// `ferry inspect` (which reports every finding) and `ferry convert --layout lora` (which
// refuses what the clean-adapter layout cannot fix).
//
// The engine's rules (vLLM's LoRA loading):
//   - It loads only "base_model.model.<M>.lora_A.weight", ".lora_B.weight",
//     ".lora_embedding_A" and ".lora_embedding_B". Any other key (lora_magnitude_vector,
//     lora_B.bias, modules_to_save copies, base_layer copies, trainable_tokens_delta, keys
//     carrying an adapter name) is rejected.
//   - use_dora: "does not yet support DoRA"; modules_to_save: "only supports
//     modules_to_save being None".
//   - One global scaling lora_alpha / r: rank_pattern / alpha_pattern are ignored, so
//     modules with their own rank or alpha are scaled wrongly. Older versions ignore
//     use_rslora.
//   - Ranks above --max-lora-rank (default 16; at most 512) are refused.
//   - Adapter modules are matched by name against the served model's modules; names the
//     model does not have are refused or, when nothing overlaps, the base model is served.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "convert/layout.h"
#include "convert/merge_plan.h"
#include "convert/peft_config.h"
#include "core/checkpoint.h"

namespace ferry {

// vLLM's default --max-lora-rank, and the largest value it accepts.
inline constexpr int64_t kEngineDefaultMaxLoraRank = 16;
inline constexpr int64_t kEngineLargestMaxLoraRank = 512;

struct EngineFinding {
  enum class Severity {
    kReject,  // the engine refuses to load the adapter
    kWrong,   // the engine loads it but serves different outputs than PEFT
    kNote,    // loads and serves correctly given the right settings
  };
  // What the finding is about: an adapter tensor key, an adapter_config.json field, or a
  // module name.
  enum class Subject { kKey, kField, kModule };
  Severity severity = Severity::kNote;
  Subject subject_kind = Subject::kField;
  std::string subject;
  std::string message;  // what happens, and what fixes it (in words: "the lora layout ...")
  // The layout of the converter (convert/converter.h) that fixes it: kLora (the clean
  // adapter) or kHf (merging; kFused fixes it as well). Unset when no conversion fixes it or
  // it cannot be told without a base.
  std::optional<Layout> fix_layout;
  // The vLLM max_lora_rank to start the engine with, when the default is not enough (0 otherwise).
  int64_t engine_max_lora_rank = 0;
};

// "reject", "wrong", "note".
std::string_view EngineSeverityName(EngineFinding::Severity severity);
// "key", "field", "module".
std::string_view EngineSubjectName(EngineFinding::Subject subject);

// Whether the engine loads a tensor of this kind: lora_A / lora_B / lora_embedding_A /
// lora_embedding_B without an adapter name in the key.
bool EngineLoadsKey(const AdapterKey& key);

// Whether the adapter tensor that replaces base tensor `target` in `plan` holds exactly the
// base's bytes (e.g. an untouched embedding saved with the adapter): such a copy changes
// nothing and `--layout lora` drops it. Reads both tensors' data. False when either cannot
// be read or the target is 4-bit.
bool ReplacementEqualsBase(const Checkpoint& base, const Checkpoint& adapter, const MergePlan& plan,
                           const std::string& target);

// Why `ferry convert --layout lora` cannot turn this adapter into one an engine loads: a
// problem only merging fixes.
struct LoraLayoutRefusal {
  EngineFinding::Subject subject_kind = EngineFinding::Subject::kKey;
  std::string subject;  // the adapter tensor key, or "use_dora"
  std::string message;  // starts with the file at fault; names the tensor or field
};

// Every refusal, in this order: use_dora; adapter tensors that replace a base tensor with
// different values (modules_to_save, saved full tensors); trainable token rows; lora_B
// biases. Empty when the lora layout can be written.
std::vector<LoraLayoutRefusal> FindLoraLayoutRefusals(const PeftConfig& config, const Checkpoint& base,
                                                      const Checkpoint& adapter, const MergePlan& plan);

// The global rank `--layout lora` writes: the largest, over the base's modules, of the
// summed ranks of the adapter modules landing on it (q/k/v fused into qkv_proj add up).
int64_t LoraLayoutRank(const MergePlan& plan);

// Findings for an adapter as it stands (config fields and tensor keys), without a base:
// peft_type, use_dora, modules_to_save, every key kind the engine rejects (one finding per
// kind, naming the first key and the count), rank_pattern / alpha_pattern (kWrong when some
// module's scaling differs from lora_alpha / r), use_rslora, and the largest rank against
// --max-lora-rank. Each names the `ferry convert --layout` that fixes it where one does.
std::vector<EngineFinding> CheckAdapterForEngine(const PeftConfig& config, const Checkpoint& adapter);

// With a base and the merge plan onto it, the findings of CheckAdapterForEngine refined
// (saved copies identical to the base are fixable by --layout lora; the rank after
// --layout lora) plus adapter modules whose base tensor is fused (q/k/v_proj into
// qkv_proj, gate/up_proj into gate_up_proj) or split (a qkv_proj adapter onto separate
// q/k/v_proj), which the engine matches by name.
std::vector<EngineFinding> CheckAdapterForEngine(const PeftConfig& config, const Checkpoint& adapter,
                                                 const Checkpoint& base, const MergePlan& plan);

}  // namespace ferry
