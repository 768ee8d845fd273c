// The lora layout of `ferry convert`: a clean adapter an engine that applies one global
// scaling (vLLM; PEFT with a config without patterns) hot-loads, whose merge is the
// original adapter's merge.
//
// ---------------------------------------------------------------------------------------
// What is written (into the output directory):
//   adapter_model.safetensors, one pair per base module M, named as the base names M:
//     base_model.model.M.lora_A.weight [R, in]    base_model.model.M.lora_B.weight [out, R]
//     (embeddings: base_model.model.M.lora_embedding_A [R, vocab], .lora_embedding_B [dim, R])
//   R, the global rank, is the largest sum of ranks landing on one base module. Adapter
//   modules that land on one base module (q/k/v adapters onto a fused qkv_proj) are stacked:
//     A' = [c_1 A_1; c_2 A_2; ...; 0]   B' = B_i in its rows and columns, zero elsewhere,
//   and a fused adapter split onto separate q/k/v keeps A and takes B's rows of each part.
//   adapter_config.json: the original, with r = R, lora_alpha = g * R (lora_alpha / r is g),
//   use_rslora false, empty rank_pattern / alpha_pattern, target_modules the base module
//   leaves, and no DoRA, modules_to_save, lora_bias, trainable tokens or layer selection.
//
// The scaling, exactly. Module i merges as W + s_i * (B_i @ A_i) with s_i = alpha_i / r_i
// (rsLoRA: alpha_i / sqrt(r_i), rank_pattern / alpha_pattern applied) rounded to fp32,
// which is what the merge kernels (kernels/lora_merge.h) and PEFT multiply by. The clean
// adapter has one scaling g for every module, so c_i = s_i / g goes into lora_A:
//   - g is the fp32 scaling shared by the most modules among the largest set of modules
//     whose scalings are powers of two apart (equal fp32 significands); an adapter with one
//     scaling everywhere keeps its factors and its lora_alpha / r.
//   - c_i a power of two (or 0): c_i * A_i is exact in every float format, and every fp32
//     product and partial sum of B_i @ (c_i A_i) is c_i times the original's, so
//     g * (B' @ A') rounds to exactly s_i * (B_i @ A_i): the clean adapter's merge is
//     bit-identical to the original's. The factors keep the adapter's dtype (BF16 stays
//     BF16), checked element by element (a product leaving the format's range is inexact).
//   - c_i not a power of two (scalings that differ by other ratios, e.g. rsLoRA with a
//     rank_pattern of ranks 8 and 4): c_i * A_i needs up to 24 more significand bits than
//     A_i holds, and rounding it to BF16 would put up to 2^-9 relative error into every
//     element of the delta. Such factors are written as F32, fp32(c_i * A_i) (one rounding,
//     2^-24 relative), and then the whole adapter is F32 (A and B of a 16-bit adapter are
//     exact in F32). Its merge differs from the original's only in the last fp32 bits of
//     the delta, which can move a 16-bit rounding by one ulp.
//   An explicitly requested output dtype is honoured; when it cannot hold the factors
//   exactly, a warning says so.
// ---------------------------------------------------------------------------------------
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "convert/merge_plan.h"
#include "convert/peft_config.h"
#include "core/checkpoint.h"
#include "core/dtype.h"
#include "core/status.h"

namespace ferry {

struct LoraLayoutOptions {
  // Dtype of the factors. Default: unset = the adapter's when every factor is exact in it
  // (see the top of this file), else F32.
  std::optional<DType> dtype;
  // fsync the written files. Default: true.
  bool sync = true;
};

struct LoraLayoutSummary {
  std::vector<std::string> files;  // relative to the directory: the weights, then adapter_config.json
  int64_t tensors_written = 0;
  int64_t modules = 0;        // base modules with a factor pair
  int64_t global_rank = 0;    // R
  double global_alpha = 0;    // lora_alpha = g * R
  double global_scaling = 0;  // g
  DType factor_dtype = DType::kF32;
  // Adapter modules whose scaling is not a power of two apart from g (factors F32).
  int64_t inexact_modules = 0;
  uint64_t bytes_written = 0;
  std::vector<std::string> warnings;
};

// Writes the clean adapter for `plan` (PlanMerge of `config` and `adapter` onto `base`) into
// the existing directory `dir`. kUnsupported with FindLoraLayoutRefusals' first reason
// (engine_check.h) when the adapter holds what only merging applies (DoRA, replaced tensors,
// trainable tokens, lora_B biases), and for nothing else; adapter read errors pass through.
Result<LoraLayoutSummary> WriteLoraLayout(const PeftConfig& config, const Checkpoint& base, const Checkpoint& adapter,
                                          const MergePlan& plan, const LoraLayoutOptions& options,
                                          const std::filesystem::path& dir);

}  // namespace ferry
