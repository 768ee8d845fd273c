// The offline converter: a base checkpoint + a PEFT adapter -> a generator-ready layout.
//
//   hf     merged model with Hugging Face names: the key set, dtypes and shapes PEFT's
//          merge_and_unload() + save_pretrained() produce (4-bit bases written in the dtype
//          their quant state names; a tied lm_head the adapter changes is written separately
//          and config.json says tie_word_embeddings false). config.json loses
//          quantization_config; generation_config.json and tokenizer files are copied.
//   fused  as hf, with q/k/v stacked on the output axis into self_attn.qkv_proj and gate/up
//          into mlp.gate_up_proj (the layout vLLM builds internally; Phi-3's native one).
//   lora   a clean adapter an engine can hot-load: only lora_A/lora_B (and
//          lora_embedding_A/B) keys, one global rank and scaling with what is left of each
//          module's own scaling (rank/alpha patterns, rsLoRA) baked into lora_A exactly
//          enough that its merge is the original's (convert/lora_layout.h), module names
//          matched to the base (fused adapters split, separate ones fused as the base
//          stores them). DoRA, modules_to_save, trainable tokens and lora_B.bias are
//          refused with the reason.
//
// Merging accumulates in fp32 and rounds once to the output dtype. Tensors are processed
// one at a time (memory: a few times the largest tensor). The output directory appears only
// when complete: everything is written into a hidden temporary directory beside it and
// renamed at the end, so a failed or interrupted conversion leaves nothing at `out`.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "convert/layout.h"
#include "core/dtype.h"
#include "core/status.h"

namespace ferry {

struct ConvertOptions {
  std::filesystem::path base;  // base model directory (or file)
  // PEFT adapter directory. Empty: the base alone is written (hf or fused layout), a 4-bit
  // base dequantized.
  std::filesystem::path adapter;
  std::filesystem::path out;    // output directory (must not exist unless force)
  Layout layout = Layout::kHf;  // Default: hf
  // Dtype of floating-point output tensors. Default: unset = the base's (a 4-bit weight: the
  // dtype its quant state names; lora layout: the adapter's).
  std::optional<DType> dtype;
  // Shard size limit in bytes. Default: 0 = shard exactly like the base (one file for a
  // single-file base). Ignored for the lora layout.
  uint64_t max_shard_bytes = 0;
  bool force = false;  // replace an existing `out`. Default: false.
  int threads = 0;     // merge threads. Default: 0 = all hardware threads.
  // fsync the written files before the output directory is renamed into place. Without it
  // the output still appears only when complete (a crash of the process never leaves a
  // partial output), but a power failure may lose it. Default: true.
  bool sync = true;
  // Called after each tensor with (bytes written so far, total bytes to write).
  std::function<void(uint64_t, uint64_t)> progress;
};

struct ConvertSummary {
  Layout layout = Layout::kHf;
  std::filesystem::path out;
  std::vector<std::string> files;  // relative to out: weights, then config.json and the copied files (sorted)
  int64_t tensors_written = 0;
  int64_t tensors_changed = 0;  // merged, replaced or re-typed
  int64_t lora_modules = 0;
  int64_t dequantized = 0;  // 4-bit weights dequantized
  bool untied_lm_head = false;
  int64_t global_rank = 0;                // lora layout
  double global_alpha = 0;                // lora layout: lora_alpha = global_scaling * global_rank
  double global_scaling = 0;              // lora layout
  DType lora_factor_dtype = DType::kF32;  // lora layout: dtype of lora_A / lora_B
  int64_t lora_inexact_modules = 0;       // lora layout: modules whose scaling ratio is not a power of two
  uint64_t bytes_written = 0;
  double seconds = 0;
  std::vector<std::string> warnings;
};

// What a caller can change to make a failed Convert succeed, when one option would (the
// CLI turns it into the flag to pass).
enum class ConvertRemedy {
  kNone,
  kMergedLayout,   // the adapter holds what only merging applies: layout kHf or kFused
  kReplaceOutput,  // the output exists: ConvertOptions::force
};

// Runs a conversion. Errors name the file, tensor or field at fault; on error nothing is
// left at options.out (an existing directory there is untouched), and `remedy` (when given)
// says which option would fix it: kMergedLayout with kUnsupported from the lora layout's
// refusals, kReplaceOutput with kAlreadyExists; kNone otherwise.
Result<ConvertSummary> Convert(const ConvertOptions& options, ConvertRemedy* remedy = nullptr);

// The summary as a JSON object (for `ferry convert --json`).
std::string ConvertSummaryToJson(const ConvertSummary& summary);

// Parses sizes like "5GB", "500MB", "1GiB", "1024" (bytes). kInvalidArgument otherwise.
Result<uint64_t> ParseByteSize(std::string_view text);

}  // namespace ferry
