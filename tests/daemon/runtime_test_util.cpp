#include "tests/daemon/runtime_test_util.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "daemon/runtime/torch_util.h"

namespace ferry::testing {

std::map<std::string, at::Tensor> RandomModelTensors(const TinyModelSpec& s) {
  at::manual_seed(s.seed);
  const int64_t D = s.hidden / s.heads;
  const bool qkv_bias = s.qkv_bias || s.model_type == "qwen2";
  std::map<std::string, at::Tensor> t;
  auto randn = [&](std::vector<int64_t> shape) { return (at::randn(shape) * s.std).to(s.dtype); };
  auto norm = [&](int64_t n) { return (1.0 + at::randn({n}) * 0.1).to(s.dtype); };
  t["model.embed_tokens.weight"] = randn({s.vocab, s.hidden});
  t["model.norm.weight"] = norm(s.hidden);
  for (int64_t i = 0; i < s.layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    t[p + "input_layernorm.weight"] = norm(s.hidden);
    t[p + "post_attention_layernorm.weight"] = norm(s.hidden);
    t[p + "self_attn.q_proj.weight"] = randn({s.heads * D, s.hidden});
    t[p + "self_attn.k_proj.weight"] = randn({s.kv_heads * D, s.hidden});
    t[p + "self_attn.v_proj.weight"] = randn({s.kv_heads * D, s.hidden});
    t[p + "self_attn.o_proj.weight"] = randn({s.hidden, s.heads * D});
    if (qkv_bias) {
      t[p + "self_attn.q_proj.bias"] = randn({s.heads * D});
      t[p + "self_attn.k_proj.bias"] = randn({s.kv_heads * D});
      t[p + "self_attn.v_proj.bias"] = randn({s.kv_heads * D});
    }
    t[p + "mlp.gate_proj.weight"] = randn({s.intermediate, s.hidden});
    t[p + "mlp.up_proj.weight"] = randn({s.intermediate, s.hidden});
    t[p + "mlp.down_proj.weight"] = randn({s.hidden, s.intermediate});
  }
  if (!s.tied) t["lm_head.weight"] = randn({s.vocab, s.hidden});
  return t;
}

std::string TinyConfigJson(const TinyModelSpec& s) {
  nlohmann::json j;
  j["model_type"] = s.model_type;
  j["architectures"] = {s.model_type == "qwen2"     ? "Qwen2ForCausalLM"
                        : s.model_type == "mistral" ? "MistralForCausalLM"
                                                    : "LlamaForCausalLM"};
  j["vocab_size"] = s.vocab;
  j["hidden_size"] = s.hidden;
  j["intermediate_size"] = s.intermediate;
  j["num_hidden_layers"] = s.layers;
  j["num_attention_heads"] = s.heads;
  j["num_key_value_heads"] = s.kv_heads;
  j["max_position_embeddings"] = s.max_positions;
  j["rms_norm_eps"] = 1e-6;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", s.rope_theta}};
  j["tie_word_embeddings"] = s.tied;
  j["hidden_act"] = "silu";
  j["attention_bias"] = s.qkv_bias;
  j["dtype"] = s.dtype == at::kBFloat16 ? "bfloat16" : s.dtype == at::kHalf ? "float16" : "float32";
  j["bos_token_id"] = 1;
  j["eos_token_id"] = 2;
  return j.dump(2);
}

Status WriteTensors(const std::filesystem::path& file, const std::map<std::string, at::Tensor>& tensors) {
  std::vector<TensorSpec> specs;
  std::vector<Tensor> views;
  for (const auto& [name, t] : tensors) {
    FERRY_ASSIGN_OR_RETURN(Tensor v, runtime::ToCore(t));
    specs.push_back({name, v.dtype(), v.shape()});
    views.push_back(v);
  }
  WriterOptions opts;
  opts.sync = false;
  FERRY_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::CreateFile(file, specs, opts));
  size_t i = 0;
  for (const auto& [name, t] : tensors) FERRY_RETURN_IF_ERROR(writer->Write(name, views[i++]));
  return writer->Finish();
}

Status WriteTinyModel(const std::filesystem::path& dir, const TinyModelSpec& spec) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IOError(dir.string() + ": " + ec.message());
  FERRY_RETURN_IF_ERROR(WriteFileAtomic(dir / "config.json", TinyConfigJson(spec), false));
  return WriteTensors(dir / "model.safetensors", RandomModelTensors(spec));
}

void WriteText(const std::filesystem::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }

std::string ReadText(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string DigitTokenizerJson(const std::string& token13) {
  using nlohmann::json;
  json vocab = json::object();
  const std::string chars = "0123456789+=";
  for (size_t i = 0; i < chars.size(); ++i) vocab[std::string(1, chars[i])] = i;
  auto added = [](int id, const std::string& content) {
    return json{{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
                {"rstrip", false}, {"normalized", false}, {"special", true}};
  };
  json j = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", {added(12, "<bos>"), added(13, token13)}},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", json::array()}}}};
  return j.dump();
}

}  // namespace ferry::testing
