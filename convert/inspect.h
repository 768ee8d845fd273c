// Inspection: a structured report of what a checkpoint path holds, for `ferry inspect`
// and for checks before a conversion.
//
// A path is one of: a .safetensors file; a model directory (one file, shards with an
// index, or a legacy .bin, plus config.json when present); a PEFT adapter directory (an
// adapter_config.json beside the weights), or that adapter_config.json itself.
//
// For adapters the report also says what an inference engine (vLLM) would reject or get
// wrong (convert/engine_check.h) and, given the base model, which base tensor each adapter
// tensor changes (convert/merge_plan.h: PlanMerge, the converter's own resolution).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "convert/engine_check.h"
#include "convert/peft_config.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"

namespace ferry {

struct InspectTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t bytes = 0;
};

struct DTypeTotal {
  DType dtype = DType::kF32;
  uint64_t count = 0;
  uint64_t bytes = 0;
  uint64_t params = 0;
};

struct TensorTotals {
  uint64_t count = 0;
  uint64_t bytes = 0;
  uint64_t params = 0;               // elements
  std::vector<DTypeTotal> by_dtype;  // in DType order
};

// Key fields of a model directory's config.json.
struct ModelConfigSummary {
  std::string model_type;  // "" when absent
  std::vector<std::string> architectures;
  std::string dtype;  // "dtype", else "torch_dtype"; "" when absent
  std::optional<bool> tie_word_embeddings;
  bool has_quantization_config = false;
  std::string quant_method;  // quantization_config.quant_method, "" when absent
};

// One LoRA-wrapped module of an adapter.
struct AdapterModuleRow {
  std::string module;                  // e.g. "model.layers.0.self_attn.q_proj"
  bool embedding = false;              // lora_embedding_A/B rather than lora_A/B
  std::optional<int64_t> tensor_rank;  // from lora_A's first dim (else lora_B's last)
  int config_rank = 0;                 // PeftConfig::RankFor
  double alpha = 0;                    // PeftConfig::AlphaFor
  double scaling = 0;                  // PeftConfig::ScalingFor
  bool has_lora_b_bias = false;
  bool has_magnitude = false;
  bool rank_mismatch = false;  // tensor_rank known and != config_rank
};

struct AdapterSummary {
  PeftConfig config;
  std::vector<AdapterModuleRow> modules;        // sorted by module name
  std::vector<std::string> saved_full_modules;  // modules_to_save tensors found, by tensor name
  Status mergeable;                             // PeftConfig::CheckMergeable()
};

// A base tensor an adapter module's delta lands on.
struct PlanTarget {
  std::string tensor;         // base tensor name, e.g. "model.layers.0.self_attn.q_proj.weight"
  std::string source;         // the stored tensor it starts from when not `tensor` (a tied lm_head), else ""
  Shape shape;                // logical shape (the dequantized one for 4-bit weights)
  DType dtype = DType::kF32;  // stored dtype; for 4-bit weights the dtype they are dequantized into
  std::string quantization;   // "nf4" / "fp4" for bitsandbytes 4-bit weights, else ""
  int64_t row_begin = 0;      // rows [row_begin, row_end) of `tensor` the delta changes
  int64_t row_end = 0;
  bool partial = false;     // only some rows: a q/k/v (gate/up) adapter onto a fused base tensor
  std::string part;         // a split fused adapter: the base module leaf ("q_proj"), else ""
  int64_t b_row_begin = 0;  // a split fused adapter: rows of lora_B used, [b_row_begin, b_row_end)
  int64_t b_row_end = 0;
};

// One adapter module and the base tensors it touches.
struct PlanModuleRow {
  std::string module;  // the adapter's module name (a split fused adapter: "...qkv_proj")
  bool embedding = false;
  int64_t rank = 0;
  double scaling = 0;
  bool dora = false;            // has a lora_magnitude_vector
  bool lora_bias = false;       // has a lora_B.bias, added to `bias_target`
  bool fan_in_fan_out = false;  // the base weight is stored [in, out] (Conv1D)
  std::string bias_target;
  std::vector<PlanTarget> targets;  // one, or one per part of a split fused adapter
};

// An adapter tensor that replaces a whole base tensor.
struct PlanReplacementRow {
  std::string base_tensor;
  std::string adapter_key;
  std::string why;  // "modules_to_save", "base_layer" or "saved tensor"
  Shape shape;
  DType dtype = DType::kF32;  // of the adapter tensor
  bool equals_base = false;   // byte-identical to the base tensor (harmless; --layout lora drops it)
};

// trainable_tokens_delta rows replacing rows of a base tensor.
struct PlanTokenRows {
  std::string base_tensor;
  std::string adapter_key;
  std::vector<int64_t> rows;
};

// The merge plan of an adapter onto a base model (inspect --base).
struct AdapterPlanReport {
  std::filesystem::path base;
  std::optional<ModelConfigSummary> base_config;  // the base's config.json, when present
  bool tie_word_embeddings = false;               // as PlanMerge was told (config.json; false when absent)
  Status error;                                   // PlanMerge's error; when set the lists below are empty
  std::vector<PlanModuleRow> modules;             // sorted by adapter module name
  std::vector<PlanReplacementRow> replacements;   // sorted by base tensor
  std::vector<PlanTokenRows> token_rows;
  bool tied = false;  // the base stores no lm_head.weight; `tied_source` plays its part
  std::string tied_source;
  bool untie = false;            // the adapter changes lm_head: merged output stores it separately
  std::string lm_head;           // "lm_head.weight"
  size_t quantized_targets = 0;  // targets that are 4-bit in the base
  std::vector<std::string> warnings;
};

// What an inference engine (vLLM) makes of the adapter.
struct EngineReport {
  std::vector<EngineFinding> findings;  // rejects, then wrongs, then notes; each in discovery order
  bool with_base = false;               // findings used the merge plan onto a base
  // With a base: whether `ferry convert --layout lora` can write an engine-loadable adapter,
  // else its first refusal; and the global rank it would write.
  std::optional<bool> lora_layout_possible;
  std::string lora_layout_refusal;
  int64_t lora_layout_rank = 0;
};

struct InspectReport {
  enum class Kind { kFile, kModelDirectory, kAdapterDirectory };
  std::filesystem::path path;
  Kind kind = Kind::kFile;
  std::string format;                  // "safetensors", "safetensors-sharded", "torch-pickle"
  std::vector<std::string> files;      // weight files (shards), then config files read
  std::vector<InspectTensor> tensors;  // sorted by name
  TensorTotals totals;
  std::map<std::string, std::string> metadata;  // __metadata__ of the first weights file
  std::optional<ModelConfigSummary> model_config;
  std::optional<AdapterSummary> adapter;
  std::optional<EngineReport> engine;     // LoRA adapters
  std::optional<AdapterPlanReport> plan;  // adapters inspected with a base
  std::vector<std::string> issues;        // problems found that do not stop the report
};

// "file", "model", "adapter".
std::string_view InspectKindName(InspectReport::Kind kind);

// Inspects `path` (see the top of this file). Reads headers and configs only, never
// tensor data. Errors (a missing path, a malformed safetensors header, a malformed
// adapter_config.json or config.json) name the file at fault. Findings that do not stop
// the report (a rank that disagrees with the config, an adapter that cannot be merged, a
// LoRA module the config does not target, ...) go to `issues`.
[[nodiscard]] Result<InspectReport> Inspect(const std::filesystem::path& path);

struct InspectOptions {
  // A base model (directory or file) to resolve an adapter onto. Default: empty (none).
  std::filesystem::path base;
};

// As Inspect(path), and with options.base: opens the base (kNotFound naming it when absent;
// its config.json gives tie_word_embeddings), runs PlanMerge and fills `plan`; the engine
// findings then use the plan. Reads tensor data only to compare the adapter's saved full
// tensors (modules_to_save, base_layer copies) with the base. A failed plan is not an error of this call: plan->error
// holds it (naming the adapter tensor and the base tensor) and it is added to `issues`. kInvalidArgument naming --base
// when `path` is not an adapter.
[[nodiscard]] Result<InspectReport> Inspect(const std::filesystem::path& path, const InspectOptions& options);

struct ReportJsonOptions {
  bool include_tensors = true;  // the per-tensor list. Default: true.
  size_t tensor_limit = 0;      // at most this many tensors listed; 0: all. Default: 0.
  int indent = 2;               // -1: one line. Default: 2.
};

// The report as JSON text: {"path", "kind", "format", "files", "metadata", "totals":
// {"count", "bytes", "params", "by_dtype": {dtype: {count, bytes, params}}}, "tensors":
// [{name, dtype, shape, bytes}], "tensors_truncated", "config" (model directories),
// "adapter" (adapters: peft_type, r, lora_alpha, use_rslora, use_dora, target_modules as
// written, modules_to_save, mergeable, refusal, modules: [{module, tensor_rank,
// config_rank, rank_mismatch, alpha, scaling, ...}]), "engine" (adapters: {"findings":
// [{severity, key | field | module, message}], "counts": {reject, wrong, note}, "with_base",
// "lora_layout": {possible, refusal, rank} with a base}), "plan" (with a base: {"base",
// "tie_word_embeddings", "error", "modules": [{module, kind, rank, scaling, dora, lora_bias,
// fan_in_fan_out, bias_target, targets: [{tensor, source, shape, dtype, quantization,
// rows, partial, part, lora_b_rows}]}], "replacements", "token_rows", "tied", "tied_source",
// "untie", "quantized_targets", "warnings"}), "issues"}.
std::string ReportToJson(const InspectReport& report, const ReportJsonOptions& options = {});

}  // namespace ferry
