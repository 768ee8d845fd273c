// Inspection: a structured report of what a checkpoint path holds, for `ferry inspect`
// and for checks before a conversion.
//
// A path is one of: a .safetensors file; a model directory (one file, shards with an
// index, or a legacy .bin, plus config.json when present); a PEFT adapter directory (an
// adapter_config.json beside the weights), or that adapter_config.json itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

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
  uint64_t params = 0;                // elements
  std::vector<DTypeTotal> by_dtype;  // in DType order
};

// Key fields of a model directory's config.json.
struct ModelConfigSummary {
  std::string model_type;                  // "" when absent
  std::vector<std::string> architectures;
  std::string dtype;                       // "dtype", else "torch_dtype"; "" when absent
  std::optional<bool> tie_word_embeddings;
  bool has_quantization_config = false;
  std::string quant_method;                // quantization_config.quant_method, "" when absent
};

// One LoRA-wrapped module of an adapter.
struct AdapterModuleRow {
  std::string module;                 // e.g. "model.layers.0.self_attn.q_proj"
  bool embedding = false;             // lora_embedding_A/B rather than lora_A/B
  std::optional<int64_t> tensor_rank;  // from lora_A's first dim (else lora_B's last)
  int config_rank = 0;                // PeftConfig::RankFor
  double alpha = 0;                   // PeftConfig::AlphaFor
  double scaling = 0;                 // PeftConfig::ScalingFor
  bool has_lora_b_bias = false;
  bool has_magnitude = false;
  bool rank_mismatch = false;         // tensor_rank known and != config_rank
};

struct AdapterSummary {
  PeftConfig config;
  std::vector<AdapterModuleRow> modules;        // sorted by module name
  std::vector<std::string> saved_full_modules;  // modules_to_save tensors found, by tensor name
  Status mergeable;                             // PeftConfig::CheckMergeable()
};

struct InspectReport {
  enum class Kind { kFile, kModelDirectory, kAdapterDirectory };
  std::filesystem::path path;
  Kind kind = Kind::kFile;
  std::string format;                 // "safetensors", "safetensors-sharded", "torch-pickle"
  std::vector<std::string> files;     // weight files (shards), then config files read
  std::vector<InspectTensor> tensors;  // sorted by name
  TensorTotals totals;
  std::map<std::string, std::string> metadata;  // __metadata__ of the first weights file
  std::optional<ModelConfigSummary> model_config;
  std::optional<AdapterSummary> adapter;
  std::vector<std::string> issues;    // problems found that do not stop the report
};

// "file", "model", "adapter".
std::string_view InspectKindName(InspectReport::Kind kind);

// Inspects `path` (see the top of this file). Reads headers and configs only, never
// tensor data. Errors (a missing path, a malformed safetensors header, a malformed
// adapter_config.json or config.json) name the file at fault. Findings that do not stop
// the report (a rank that disagrees with the config, an adapter that cannot be merged, a
// LoRA module the config does not target, ...) go to `issues`.
[[nodiscard]] Result<InspectReport> Inspect(const std::filesystem::path& path);

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
// config_rank, rank_mismatch, alpha, scaling, ...}]), "issues"}.
std::string ReportToJson(const InspectReport& report, const ReportJsonOptions& options = {});

}  // namespace ferry
