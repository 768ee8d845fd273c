// A causal LM's config.json, as far as the runtime honours it.
//
// Supported: model_type "llama", "mistral" and "qwen2" (architectures LlamaForCausalLM,
// MistralForCausalLM, Qwen2ForCausalLM): GQA, RoPE (default, or Llama-3 `rope_type: llama3`
// frequency scaling) with rope_theta from `rope_parameters` (transformers >= 5) or the legacy
// `rope_theta` + `rope_scaling`, RMSNorm, SiLU MLP, tied or separate lm_head, biases as each
// family has them (Llama: `attention_bias` on q/k/v/o, `mlp_bias`; Qwen2: q/k/v always;
// Mistral: none), sliding-window attention (Mistral's `sliding_window` on every layer; Qwen2's
// `layer_types` / `use_sliding_window` + `max_window_layers` per layer), and bitsandbytes 4-bit
// `quantization_config`.
//
// Anything else that changes the maths is refused with kUnsupported naming the file and the
// field, never run wrongly: another model_type, a hidden_act other than silu, an unknown
// rope type, per-layer attention kinds the runtime cannot honour, attention_dropout above
// zero, another quantisation method.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"

namespace ferry::runtime {

enum class Architecture { kLlama, kMistral, kQwen2 };
std::string_view ArchitectureName(Architecture arch);  // "LlamaForCausalLM", ...

struct RopeConfig {
  enum class Type { kDefault, kLlama3 };
  Type type = Type::kDefault;
  double theta = 10000.0;
  // Llama-3 frequency scaling (type kLlama3 only).
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// bitsandbytes 4-bit quantisation as transformers records it in quantization_config.
struct QuantizationConfig {
  std::string quant_type = "nf4";         // bnb_4bit_quant_type: nf4 | fp4
  bool double_quant = false;              // bnb_4bit_use_double_quant
  DType compute_dtype = DType::kF32;      // bnb_4bit_compute_dtype. Default: float32
  std::vector<std::string> skip_modules;  // llm_int8_skip_modules
};

struct ModelConfig {
  std::string source;  // file name used in messages
  Architecture arch = Architecture::kLlama;
  std::string model_type;  // "llama" | "mistral" | "qwen2"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // Default: num_attention_heads
  int64_t head_dim = 0;             // Default: hidden_size / num_attention_heads
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  RopeConfig rope;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // q/k/v projections have biases
  bool o_bias = false;    // o_proj has a bias
  bool mlp_bias = false;  // gate/up/down have biases
  // Sliding-window attention: a layer with sliding_layers[i] set sees the keys k with
  // q - k < sliding_window (and k <= q); the others see every earlier key. Empty = none.
  int64_t sliding_window = 0;
  std::vector<bool> sliding_layers;
  DType dtype = DType::kF32;  // torch_dtype / dtype. Default: float32
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // eos_token_id (a number or a list)
  std::optional<int64_t> pad_token_id;
  std::optional<QuantizationConfig> quantization;
  std::string text;  // the file's text, for passthrough (snapshots, adapters)

  int64_t q_size() const { return num_attention_heads * head_dim; }
  int64_t kv_size() const { return num_key_value_heads * head_dim; }
};

// Parses config.json text. `source` starts every error message. kCorruption for text that is
// not a JSON object or a field of the wrong type; kInvalidArgument for values out of range
// (sizes <= 0, heads not dividing, ...); kUnsupported as described above.
Result<ModelConfig> ParseModelConfig(std::string_view text, std::string source);

// Reads and parses `dir`/config.json.
Result<ModelConfig> LoadModelConfig(const std::filesystem::path& dir);

}  // namespace ferry::runtime
