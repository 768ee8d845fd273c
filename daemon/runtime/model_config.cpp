#include "daemon/runtime/model_config.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>

#include "core/json_limits.h"
#include "core/mapped_file.h"

namespace ferry::runtime {
namespace {

using json = nlohmann::json;

class Fields {
 public:
  Fields(const json& j, const std::string& source) : j_(j), source_(source) {}

  Status Bad(std::string_view field, std::string_view why, StatusCode code = StatusCode::kCorruption) const {
    return Status(code, source_ + ": field '" + std::string(field) + "' " + std::string(why));
  }

  bool Has(const char* field) const {
    auto it = j_.find(field);
    return it != j_.end() && !it->is_null();
  }

  // An integer field in [lo, hi]; `def` when absent or null (nullopt def: required).
  Result<int64_t> Int(const char* field, std::optional<int64_t> def, int64_t lo = 1,
                      int64_t hi = std::numeric_limits<int32_t>::max()) const {
    if (!Has(field)) {
      if (def) return *def;
      return Bad(field, "is missing", StatusCode::kInvalidArgument);
    }
    const json& v = j_.at(field);
    if (!v.is_number_integer()) return Bad(field, "must be an integer");
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) {
      return Bad(field,
                 "is " + std::to_string(x) + ", outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]",
                 StatusCode::kInvalidArgument);
    }
    return x;
  }

  Result<double> Number(const json& obj, const char* field, std::string_view path, double def) const {
    auto it = obj.find(field);
    if (it == obj.end() || it->is_null()) return def;
    if (!it->is_number()) return Bad(path, "must be a number");
    const double x = it->get<double>();
    if (!std::isfinite(x)) return Bad(path, "must be finite", StatusCode::kInvalidArgument);
    return x;
  }

  Result<bool> Bool(const char* field, bool def) const {
    if (!Has(field)) return def;
    const json& v = j_.at(field);
    if (!v.is_boolean()) return Bad(field, "must be true or false");
    return v.get<bool>();
  }

  Result<std::string> String(const char* field, std::string def) const {
    if (!Has(field)) return def;
    const json& v = j_.at(field);
    if (!v.is_string()) return Bad(field, "must be a string");
    return v.get<std::string>();
  }

 private:
  const json& j_;
  const std::string& source_;
};

Result<DType> DTypeFromTorchName(const std::string& name, const Fields& f, const char* field) {
  std::string n = name;
  if (n.rfind("torch.", 0) == 0) n = n.substr(6);
  if (n == "float32" || n == "float") return DType::kF32;
  if (n == "bfloat16") return DType::kBF16;
  if (n == "float16" || n == "half") return DType::kF16;
  return f.Bad(field, "is '" + name + "' (the runtime computes in float32, bfloat16 or float16)",
               StatusCode::kUnsupported);
}

Status ParseRope(const json& j, const Fields& f, ModelConfig& c) {
  // transformers >= 5: "rope_parameters": {"rope_type", "rope_theta", ...}; before: "rope_theta" and
  // "rope_scaling": {"type" | "rope_type", ...}.
  const json* params = nullptr;
  std::string where;
  if (auto it = j.find("rope_parameters"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return f.Bad("rope_parameters", "must be an object");
    params = &*it;
    where = "rope_parameters";
  }
  FERRY_ASSIGN_OR_RETURN(c.rope.theta, f.Number(j, "rope_theta", "rope_theta", 10000.0));
  if (params) {
    FERRY_ASSIGN_OR_RETURN(c.rope.theta, f.Number(*params, "rope_theta", "rope_parameters.rope_theta", c.rope.theta));
  }
  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return f.Bad("rope_scaling", "must be an object");
    if (params) {
      // Both present: transformers 5 keeps rope_scaling only as a mirror of rope_parameters.
    } else {
      params = &*it;
      where = "rope_scaling";
    }
  }
  if (!(c.rope.theta > 0))
    return f.Bad(where.empty() ? "rope_theta" : where + ".rope_theta", "must be positive",
                 StatusCode::kInvalidArgument);
  if (!params) return Status::OK();
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    if (auto it = params->find(key); it != params->end() && !it->is_null()) {
      if (!it->is_string()) return f.Bad(where + "." + key, "must be a string");
      type = it->get<std::string>();
      break;
    }
  }
  if (type == "default") return Status::OK();
  if (type != "llama3") {
    return f.Bad(where + ".rope_type", "is '" + type + "' (supported: default, llama3)", StatusCode::kUnsupported);
  }
  c.rope.type = RopeConfig::Type::kLlama3;
  FERRY_ASSIGN_OR_RETURN(c.rope.factor, f.Number(*params, "factor", where + ".factor", 8.0));
  FERRY_ASSIGN_OR_RETURN(c.rope.low_freq_factor, f.Number(*params, "low_freq_factor", where + ".low_freq_factor", 1.0));
  FERRY_ASSIGN_OR_RETURN(c.rope.high_freq_factor,
                         f.Number(*params, "high_freq_factor", where + ".high_freq_factor", 4.0));
  FERRY_ASSIGN_OR_RETURN(double orig, f.Number(*params, "original_max_position_embeddings",
                                               where + ".original_max_position_embeddings", 8192.0));
  if (!(c.rope.factor > 0) || !(c.rope.low_freq_factor > 0) || !(c.rope.high_freq_factor > c.rope.low_freq_factor) ||
      !(orig >= 1) || orig != std::floor(orig) || orig > 1e9) {
    return f.Bad(where,
                 "holds llama3 values out of range (factor > 0, 0 < low_freq_factor < high_freq_factor, "
                 "original_max_position_embeddings a positive integer)",
                 StatusCode::kInvalidArgument);
  }
  c.rope.original_max_position_embeddings = static_cast<int64_t>(orig);
  return Status::OK();
}

Status ParseQuantization(const json& j, const Fields& f, ModelConfig& c) {
  auto it = j.find("quantization_config");
  if (it == j.end() || it->is_null()) return Status::OK();
  const json& q = *it;
  if (!q.is_object()) return f.Bad("quantization_config", "must be an object");
  std::string method;
  if (auto m = q.find("quant_method"); m != q.end() && !m->is_null()) {
    if (!m->is_string()) return f.Bad("quantization_config.quant_method", "must be a string");
    method = m->get<std::string>();
  }
  bool load_4bit = false;
  if (auto l = q.find("load_in_4bit"); l != q.end() && !l->is_null()) {
    if (!l->is_boolean()) return f.Bad("quantization_config.load_in_4bit", "must be true or false");
    load_4bit = l->get<bool>();
  }
  if (method != "bitsandbytes" || !load_4bit) {
    return f.Bad(
        "quantization_config.quant_method",
        "is '" + method + (load_4bit ? "" : "' without load_in_4bit") + "' (supported: bitsandbytes 4-bit, NF4 or FP4)",
        StatusCode::kUnsupported);
  }
  QuantizationConfig qc;
  if (auto t = q.find("bnb_4bit_quant_type"); t != q.end() && !t->is_null()) {
    if (!t->is_string()) return f.Bad("quantization_config.bnb_4bit_quant_type", "must be a string");
    qc.quant_type = t->get<std::string>();
  }
  if (qc.quant_type != "nf4" && qc.quant_type != "fp4") {
    return f.Bad("quantization_config.bnb_4bit_quant_type", "is '" + qc.quant_type + "' (supported: nf4, fp4)",
                 StatusCode::kUnsupported);
  }
  if (auto d = q.find("bnb_4bit_use_double_quant"); d != q.end() && d->is_boolean()) qc.double_quant = d->get<bool>();
  if (auto d = q.find("bnb_4bit_compute_dtype"); d != q.end() && !d->is_null()) {
    if (!d->is_string()) return f.Bad("quantization_config.bnb_4bit_compute_dtype", "must be a string");
    FERRY_ASSIGN_OR_RETURN(qc.compute_dtype,
                           DTypeFromTorchName(d->get<std::string>(), f, "quantization_config.bnb_4bit_compute_dtype"));
  }
  if (auto s = q.find("llm_int8_skip_modules"); s != q.end() && s->is_array()) {
    for (const auto& m : *s) {
      if (m.is_string()) qc.skip_modules.push_back(m.get<std::string>());
    }
  }
  c.quantization = qc;
  return Status::OK();
}

Status ParseSliding(const json& j, const Fields& f, ModelConfig& c) {
  std::optional<int64_t> window;
  if (f.Has("sliding_window")) {
    FERRY_ASSIGN_OR_RETURN(int64_t w, f.Int("sliding_window", std::nullopt));
    window = w;
  }
  c.sliding_layers.assign(static_cast<size_t>(c.num_hidden_layers), false);
  if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
    if (!it->is_array() || it->size() != static_cast<size_t>(c.num_hidden_layers)) {
      return f.Bad("layer_types",
                   "must be a list of num_hidden_layers (" + std::to_string(c.num_hidden_layers) + ") strings");
    }
    for (size_t i = 0; i < it->size(); ++i) {
      const json& t = (*it)[i];
      const std::string field = "layer_types[" + std::to_string(i) + "]";
      if (!t.is_string()) return f.Bad(field, "must be a string");
      const std::string kind = t.get<std::string>();
      if (kind == "sliding_attention") {
        if (!window)
          return f.Bad(field, "is sliding_attention but sliding_window is not set", StatusCode::kInvalidArgument);
        c.sliding_layers[i] = true;
      } else if (kind != "full_attention") {
        return f.Bad(field, "is '" + kind + "' (supported: full_attention, sliding_attention)",
                     StatusCode::kUnsupported);
      }
    }
  } else if (window) {
    if (c.arch == Architecture::kMistral) {
      c.sliding_layers.assign(c.sliding_layers.size(), true);
    } else if (c.arch == Architecture::kQwen2) {
      FERRY_ASSIGN_OR_RETURN(bool use, f.Bool("use_sliding_window", false));
      FERRY_ASSIGN_OR_RETURN(int64_t max_window_layers, f.Int("max_window_layers", 28, 0));
      for (int64_t i = max_window_layers; use && i < c.num_hidden_layers; ++i)
        c.sliding_layers[static_cast<size_t>(i)] = true;
    }
  }
  bool any = false;
  for (bool b : c.sliding_layers) any = any || b;
  c.sliding_window = any ? *window : 0;
  if (!any) c.sliding_layers.clear();
  return Status::OK();
}

}  // namespace

std::string_view ArchitectureName(Architecture arch) {
  switch (arch) {
    case Architecture::kLlama: return "LlamaForCausalLM";
    case Architecture::kMistral: return "MistralForCausalLM";
    case Architecture::kQwen2: return "Qwen2ForCausalLM";
  }
  return "?";
}

Result<ModelConfig> ParseModelConfig(std::string_view text, std::string source) {
  if (JsonNestsDeeperThan(text, 16)) return Status::Corruption(source + ": JSON nests deeper than 16 levels");
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Corruption(source + ": not a JSON object");
  ModelConfig c;
  c.source = source;
  c.text = std::string(text);
  Fields f(j, c.source);

  FERRY_ASSIGN_OR_RETURN(c.model_type, f.String("model_type", ""));
  if (c.model_type == "llama") {
    c.arch = Architecture::kLlama;
  } else if (c.model_type == "mistral") {
    c.arch = Architecture::kMistral;
  } else if (c.model_type == "qwen2") {
    c.arch = Architecture::kQwen2;
  } else {
    return f.Bad("model_type", "is '" + c.model_type + "' (supported: llama, mistral, qwen2)",
                 StatusCode::kUnsupported);
  }
  if (auto it = j.find("architectures"); it != j.end() && it->is_array()) {
    for (const auto& a : *it) {
      if (!a.is_string() || a.get<std::string>() != ArchitectureName(c.arch)) {
        return f.Bad("architectures",
                     "must be [\"" + std::string(ArchitectureName(c.arch)) + "\"] for model_type " + c.model_type +
                         " (a causal LM head is required)",
                     StatusCode::kUnsupported);
      }
    }
  }
  FERRY_ASSIGN_OR_RETURN(std::string act, f.String("hidden_act", "silu"));
  if (act != "silu") return f.Bad("hidden_act", "is '" + act + "' (supported: silu)", StatusCode::kUnsupported);

  FERRY_ASSIGN_OR_RETURN(c.vocab_size, f.Int("vocab_size", std::nullopt));
  FERRY_ASSIGN_OR_RETURN(c.hidden_size, f.Int("hidden_size", std::nullopt, 1, 1 << 20));
  FERRY_ASSIGN_OR_RETURN(c.intermediate_size, f.Int("intermediate_size", std::nullopt, 1, 1 << 22));
  FERRY_ASSIGN_OR_RETURN(c.num_hidden_layers, f.Int("num_hidden_layers", std::nullopt, 1, 4096));
  FERRY_ASSIGN_OR_RETURN(c.num_attention_heads, f.Int("num_attention_heads", std::nullopt, 1, 1 << 14));
  FERRY_ASSIGN_OR_RETURN(c.num_key_value_heads, f.Int("num_key_value_heads", c.num_attention_heads, 1, 1 << 14));
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return f.Bad("num_key_value_heads",
                 "(" + std::to_string(c.num_key_value_heads) + ") must divide num_attention_heads (" +
                     std::to_string(c.num_attention_heads) + ")",
                 StatusCode::kInvalidArgument);
  }
  if (f.Has("head_dim")) {
    FERRY_ASSIGN_OR_RETURN(c.head_dim, f.Int("head_dim", std::nullopt, 2, 1 << 12));
  } else if (c.hidden_size % c.num_attention_heads == 0) {
    c.head_dim = c.hidden_size / c.num_attention_heads;
  } else {
    return f.Bad("head_dim", "is missing and hidden_size is not a multiple of num_attention_heads",
                 StatusCode::kInvalidArgument);
  }
  if (c.head_dim % 2 != 0)
    return f.Bad("head_dim", "must be even (rotary embeddings rotate pairs)", StatusCode::kInvalidArgument);
  FERRY_ASSIGN_OR_RETURN(c.max_position_embeddings, f.Int("max_position_embeddings", 2048, 1, int64_t{1} << 30));
  FERRY_ASSIGN_OR_RETURN(c.rms_norm_eps, f.Number(j, "rms_norm_eps", "rms_norm_eps", 1e-6));
  if (!(c.rms_norm_eps > 0)) return f.Bad("rms_norm_eps", "must be positive", StatusCode::kInvalidArgument);
  FERRY_RETURN_IF_ERROR(ParseRope(j, f, c));
  FERRY_ASSIGN_OR_RETURN(double attention_dropout, f.Number(j, "attention_dropout", "attention_dropout", 0.0));
  if (attention_dropout != 0) {
    return f.Bad("attention_dropout", "is " + std::to_string(attention_dropout) + " (only 0 is supported)",
                 StatusCode::kUnsupported);
  }
  FERRY_ASSIGN_OR_RETURN(c.tie_word_embeddings, f.Bool("tie_word_embeddings", false));

  switch (c.arch) {
    case Architecture::kLlama: {
      FERRY_ASSIGN_OR_RETURN(bool attention_bias, f.Bool("attention_bias", false));
      c.qkv_bias = c.o_bias = attention_bias;
      FERRY_ASSIGN_OR_RETURN(c.mlp_bias, f.Bool("mlp_bias", false));
      if (f.Has("pretraining_tp")) {
        FERRY_ASSIGN_OR_RETURN(int64_t tp, f.Int("pretraining_tp", 1));
        (void)tp;  // only changes how the original training sliced matmuls; the maths is the same
      }
      break;
    }
    case Architecture::kQwen2: c.qkv_bias = true; break;
    case Architecture::kMistral: break;
  }
  FERRY_RETURN_IF_ERROR(ParseSliding(j, f, c));

  for (const char* dtype_field : {"dtype", "torch_dtype"}) {
    if (f.Has(dtype_field)) {
      FERRY_ASSIGN_OR_RETURN(std::string name, f.String(dtype_field, ""));
      FERRY_ASSIGN_OR_RETURN(c.dtype, DTypeFromTorchName(name, f, dtype_field));
      break;
    }
  }
  if (f.Has("bos_token_id")) {
    FERRY_ASSIGN_OR_RETURN(int64_t bos, f.Int("bos_token_id", std::nullopt, 0, c.vocab_size - 1));
    c.bos_token_id = bos;
  }
  if (f.Has("pad_token_id")) {
    FERRY_ASSIGN_OR_RETURN(int64_t pad, f.Int("pad_token_id", std::nullopt, 0, c.vocab_size - 1));
    c.pad_token_id = pad;
  }
  if (f.Has("eos_token_id")) {
    const json& e = j.at("eos_token_id");
    std::vector<json> ids = e.is_array() ? std::vector<json>(e.begin(), e.end()) : std::vector<json>{e};
    for (const json& id : ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= c.vocab_size) {
        return f.Bad("eos_token_id", "must be a token id (or a list of them) below vocab_size",
                     StatusCode::kInvalidArgument);
      }
      c.eos_token_ids.push_back(id.get<int64_t>());
    }
  }
  FERRY_RETURN_IF_ERROR(ParseQuantization(j, f, c));
  return c;
}

Result<ModelConfig> LoadModelConfig(const std::filesystem::path& dir) {
  const std::filesystem::path p = dir / "config.json";
  FERRY_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(p, 4u << 20));
  return ParseModelConfig(text, p.string());
}

}  // namespace ferry::runtime
