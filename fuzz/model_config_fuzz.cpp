// libFuzzer target for ParseModelConfig (daemon/runtime/model_config.h): a model directory's
// config.json is input from outside, so any bytes must give a ModelConfig or an error, never a
// crash, hang or unbounded allocation. An error must be one of the three codes the header
// names and start with the source; an accepted config must keep the header's promises
// (checked below, trapping otherwise), and parsing its text again must give the same config.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "daemon/runtime/model_config.h"

namespace {

using ferry::DType;
using ferry::StatusCode;
using ferry::runtime::Architecture;
using ferry::runtime::ModelConfig;
using ferry::runtime::RopeConfig;

constexpr const char* kSource = "/fuzz/model/config.json";

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

bool ComputeDType(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

bool IsToken(const ModelConfig& c, int64_t id) { return id >= 0 && id < c.vocab_size; }

void CheckPromises(const ModelConfig& c, std::string_view text) {
  Check(c.source == kSource && c.text == text);
  switch (c.arch) {
    case Architecture::kLlama: Check(c.model_type == "llama" && c.qkv_bias == c.o_bias); break;
    case Architecture::kMistral: Check(c.model_type == "mistral" && !c.qkv_bias && !c.o_bias && !c.mlp_bias); break;
    case Architecture::kQwen2: Check(c.model_type == "qwen2" && c.qkv_bias && !c.o_bias && !c.mlp_bias); break;
  }
  Check(ferry::runtime::ArchitectureName(c.arch) != "?");
  Check(c.vocab_size >= 1 && c.hidden_size >= 1 && c.intermediate_size >= 1);
  Check(c.num_hidden_layers >= 1 && c.num_attention_heads >= 1 && c.num_key_value_heads >= 1);
  Check(c.num_attention_heads % c.num_key_value_heads == 0);
  Check(c.head_dim >= 2 && c.head_dim % 2 == 0);
  Check(c.q_size() > 0 && c.kv_size() > 0 && c.kv_size() <= c.q_size());
  Check(c.max_position_embeddings >= 1);
  Check(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0);
  Check(std::isfinite(c.rope.theta) && c.rope.theta > 0);
  if (c.rope.type == RopeConfig::Type::kLlama3) {
    Check(std::isfinite(c.rope.factor) && c.rope.factor > 0);
    Check(c.rope.low_freq_factor > 0 && c.rope.high_freq_factor > c.rope.low_freq_factor);
    Check(std::isfinite(c.rope.high_freq_factor) && c.rope.original_max_position_embeddings >= 1);
  }
  // Sliding windows: none at all, or a window and one flag per layer with at least one set.
  if (c.sliding_layers.empty()) {
    Check(c.sliding_window == 0);
  } else {
    Check(c.sliding_window >= 1 && c.sliding_layers.size() == static_cast<size_t>(c.num_hidden_layers));
    bool any = false;
    for (bool b : c.sliding_layers) any = any || b;
    Check(any);
  }
  Check(ComputeDType(c.dtype));
  if (c.bos_token_id) Check(IsToken(c, *c.bos_token_id));
  if (c.pad_token_id) Check(IsToken(c, *c.pad_token_id));
  for (int64_t id : c.eos_token_ids) Check(IsToken(c, id));
  if (c.quantization) {
    Check(c.quantization->quant_type == "nf4" || c.quantization->quant_type == "fp4");
    Check(ComputeDType(c.quantization->compute_dtype));
  }
}

// The fields the runtime reads, compared between two parses of the same text.
bool Same(const ModelConfig& a, const ModelConfig& b) {
  const bool quant_same = a.quantization.has_value() == b.quantization.has_value() &&
                          (!a.quantization || (a.quantization->quant_type == b.quantization->quant_type &&
                                               a.quantization->double_quant == b.quantization->double_quant &&
                                               a.quantization->compute_dtype == b.quantization->compute_dtype &&
                                               a.quantization->skip_modules == b.quantization->skip_modules));
  return a.arch == b.arch && a.vocab_size == b.vocab_size && a.hidden_size == b.hidden_size &&
         a.intermediate_size == b.intermediate_size && a.num_hidden_layers == b.num_hidden_layers &&
         a.num_attention_heads == b.num_attention_heads && a.num_key_value_heads == b.num_key_value_heads &&
         a.head_dim == b.head_dim && a.max_position_embeddings == b.max_position_embeddings &&
         a.rms_norm_eps == b.rms_norm_eps && a.rope.type == b.rope.type && a.rope.theta == b.rope.theta &&
         a.rope.factor == b.rope.factor && a.rope.low_freq_factor == b.rope.low_freq_factor &&
         a.rope.high_freq_factor == b.rope.high_freq_factor &&
         a.rope.original_max_position_embeddings == b.rope.original_max_position_embeddings &&
         a.tie_word_embeddings == b.tie_word_embeddings && a.qkv_bias == b.qkv_bias && a.o_bias == b.o_bias &&
         a.mlp_bias == b.mlp_bias && a.sliding_window == b.sliding_window && a.sliding_layers == b.sliding_layers &&
         a.dtype == b.dtype && a.bos_token_id == b.bos_token_id && a.eos_token_ids == b.eos_token_ids &&
         a.pad_token_id == b.pad_token_id && quant_same;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto c = ferry::runtime::ParseModelConfig(text, kSource);
  if (!c.ok()) {
    const StatusCode code = c.status().code();
    Check(code == StatusCode::kCorruption || code == StatusCode::kInvalidArgument || code == StatusCode::kUnsupported);
    Check(c.status().message().rfind(kSource, 0) == 0);
    return 0;
  }
  CheckPromises(*c, text);
  auto again = ferry::runtime::ParseModelConfig(c->text, kSource);
  Check(again.ok() && Same(*c, *again));
  return 0;
}
