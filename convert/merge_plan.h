// Resolution of a PEFT adapter onto a base checkpoint: which base tensor each adapter
// tensor changes, and how, and the merge that executes it (MergedF32, MergeFusable16). Shared
// by `ferry convert` and sync snapshots (which execute the plan) and `ferry inspect ADAPTER
// --base DIR` (which reports it).
//
// Rules (PEFT's peft/tuners/lora/layer.py and model.py, as the fixtures in fixtures/ record them):
//   - lora_A/lora_B of module M change "M.weight": W += scaling(M) * B @ A (transposed for
//     fan_in_fan_out / GPT-2 Conv1D, detected from the base shape as PEFT forces it).
//   - lora_embedding_A/B change "M.weight" of an embedding: W += scaling * (B @ A)^T.
//   - lora_magnitude_vector (DoRA) rescales each output row of the merged weight.
//   - lora_B.bias changes "M.bias": b += scaling * lora_B.bias (the base must have a bias).
//   - modules_to_save tensors, "M.base_layer.P" (saved embeddings, bias="all") and other
//     full tensors replace the base tensor "M.P" before any delta is added.
//   - trainable_tokens_delta rows replace rows trainable_token_indices of "M.weight".
//   - In a model with tied embeddings (no "lm_head.weight" stored), anything that changes
//     lm_head makes a separate lm_head.weight, starting from the embedding (untied).
//   - q/k/v (gate/up) adapters onto a base that stores them fused (qkv_proj, gate_up_proj)
//     land on the matching row range of the fused tensor; a fused adapter (qkv_proj,
//     gate_up_proj) onto a base that stores them separately is split: A shared, B by rows.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "convert/bnb4.h"
#include "convert/peft_config.h"
#include "core/checkpoint.h"
#include "core/status.h"

namespace ferry {

// One LoRA-wrapped module of the adapter.
struct LoraModule {
  enum class Kind { kLinear, kEmbedding };
  std::string module;  // "model.layers.0.self_attn.q_proj"
  Kind kind = Kind::kLinear;
  std::string a_key, b_key;   // adapter tensors: lora_A/lora_B or lora_embedding_A/B
  std::string bias_key;       // lora_B.bias, or ""
  std::string magnitude_key;  // lora_magnitude_vector (DoRA), or ""
  int64_t rank = 0;
  int64_t in = 0, out = 0;  // of the delta B @ A: [out, in] (embedding: out = dim, in = vocab)
  double scaling = 0;
  bool fan_in_fan_out = false;  // the base weight is stored [in, out]
  std::string target;           // base (output) tensor the delta lands on
  int64_t row_offset = 0;       // first row within a fused target (0 otherwise)
  int64_t b_row_begin = 0;      // first row of lora_B used: a fused adapter (qkv_proj) split onto
                                // separate base tensors (q/k/v_proj) uses a row slice of B
  std::string fused_module;     // the adapter module when it was split ("...qkv_proj"), else ""
  std::string bias_target;      // "M.bias" when bias_key is set
};

struct MergePlan {
  std::vector<LoraModule> modules;
  // target tensor -> indices into modules whose deltas land on it.
  std::map<std::string, std::vector<size_t>> deltas;
  // bias tensor -> indices into modules whose lora_B.bias lands on it.
  std::map<std::string, std::vector<size_t>> bias_deltas;
  // base tensor -> adapter tensor that replaces it (modules_to_save, base_layer, saved biases).
  std::map<std::string, std::string> replacements;
  // base tensor -> (adapter trainable_tokens_delta key, row indices).
  std::map<std::string, std::pair<std::string, std::vector<int64_t>>> token_rows;
  // 4-bit base weights (dequantized on read) and their companion keys (dropped on write).
  std::map<std::string, QuantState4bit> quantized;
  std::set<std::string> quant_aux;
  // Tied embeddings: the base stores no lm_head.weight and `tied_source` plays its part.
  bool tied = false;
  std::string lm_head_key = "lm_head.weight";
  std::string tied_source;  // e.g. "model.embed_tokens.weight"
  bool untie = false;       // something changes lm_head: write it separately
  std::vector<std::string> warnings;

  // True when the output tensor `name` differs from the base tensor of the same name.
  bool Changes(const std::string& name) const;
  // The single plain LoRA delta on `name` when that is all the plan does to it (no DoRA,
  // bias, replacement, token rows, fused rows or fan_in_fan_out) and the base tensor is a
  // 16-bit [out, in] weight: the case kernels::LoraMergeRows16 handles in one pass.
  // nullptr otherwise. `base_dtype`/`base_shape` describe the stored base tensor.
  const LoraModule* FusableDelta(const std::string& name, DType base_dtype, const Shape& base_shape) const;
  // The base tensor an output tensor starts from ("lm_head.weight" -> tied_source when tied).
  std::string SourceOf(const std::string& name) const;
};

// Builds the plan. Every inconsistency is an error naming the adapter tensor and the base
// tensor involved: an adapter tensor with no base tensor, lora_A without lora_B, an A/B rank
// mismatch or a rank that disagrees with the config, a shape that does not fit the base,
// lora_bias on a layer without bias. `tie_word_embeddings` comes from the base config.json.
Result<MergePlan> PlanMerge(const PeftConfig& config, const Checkpoint& adapter, const Checkpoint& base,
                            bool tie_word_embeddings);

// A tensor of `c` as fp32 values; errors name the file (or origin) and tensor.
Result<std::vector<float>> ReadTensorAsF32(const Checkpoint& c, const std::string& key);

// Applies what `plan` does to base-space tensor `name` on top of its starting values `w`
// (fp32: the base tensor, dequantized, or its replacement), in this order: trainable-token
// rows, LoRA deltas (with DoRA), lora_B biases. fp32 accumulation; the caller rounds once.
// The one implementation of Ferry's merge arithmetic (converter, snapshots, materialize).
Status ApplyPlanEdits(const MergePlan& plan, const Checkpoint& adapter, const std::string& name, const Shape& shape,
                      std::vector<float>& w, int threads);

// The merged fp32 values of output tensor `name` (base space, shape `shape`): its starting
// values (the adapter tensor replacing it, a 4-bit base weight dequantized as loaded
// (convert/bnb4.h: rounded to the quant state's dtype), or the base tensor SourceOf(name)
// as fp32) with ApplyPlanEdits applied. The caller rounds once (WriteFromF32, core/tensor.h).
// The one merge of a changed tensor: the converter (and so materialize) and in-memory
// snapshots (sync/snapshot.h) both call it.
Result<std::vector<float>> MergedF32(const MergePlan& plan, const Checkpoint& base, const Checkpoint& adapter,
                                     const std::string& name, const Shape& shape, int threads);

// The FusableDelta case in one pass (kernels::LoraMergeRows16): the 16-bit base weight
// `base` of module `m` merged with its LoRA delta and rounded once to base's dtype, into
// `out`. Bit-identical to MergedF32 followed by WriteFromF32 in that dtype. kInvalidArgument
// when `base` is not the [m.out, m.in] BF16 or F16 tensor, or `out` does not hold it.
Status MergeFusable16(const Tensor& base, const Checkpoint& adapter, const LoraModule& m, std::span<uint16_t> out,
                      int threads);

}  // namespace ferry
