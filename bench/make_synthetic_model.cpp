// Writes a synthetic Llama-shaped BF16 base model and a PEFT LoRA adapter for it, for the
// `ferry convert` benchmark (bench/convert_bench.sh) and the PEFT comparison
// (bench/peft_compare.py). The defaults are TinyLlama-1.1B's shapes (about 2.2 GB).
//
// Base directory: config.json (LlamaForCausalLM, bfloat16), generation_config.json, and
// model.safetensors or model-0000i-of-0000N.safetensors + model.safetensors.index.json
// (--max-shard-bytes), tensors in Hugging Face order:
//   model.embed_tokens.weight [vocab, hidden]
//   model.layers.N.self_attn.{q,k,v,o}_proj.weight, model.layers.N.mlp.{gate,up,down}_proj.weight,
//   model.layers.N.{input,post_attention}_layernorm.weight [hidden]
//   model.norm.weight [hidden], lm_head.weight [vocab, hidden] (untied)
// Adapter directory: adapter_config.json (r, lora_alpha, all 7 linear projections) and
// adapter_model.safetensors with base_model.model.model.layers.N.<module>.lora_A.weight
// [r, in] and lora_B.weight [out, r] in F32.
//
// Values are pseudo-random (a fixed-seed xorshift), so two runs with the same flags write
// byte-identical files. Tensors are streamed in chunks: memory stays a few MB whatever
// the model size.
//
// Usage: ferry_bench_make_model --base DIR --adapter DIR [--hidden 2048] [--intermediate 5632]
//          [--layers 22] [--vocab 32000] [--heads 32] [--kv-heads 4] [--rank 16] [--alpha 32]
//          [--max-shard-bytes 1000000000] [--seed 1]
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "core/status.h"
#include "core/tensor.h"

namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

struct Flags {
  fs::path base, adapter;
  int64_t hidden = 2048, intermediate = 5632, layers = 22, vocab = 32000, heads = 32, kv_heads = 4;
  int64_t rank = 16, alpha = 32;
  uint64_t max_shard_bytes = 1'000'000'000;
  uint64_t seed = 1;
};

// xorshift64*: fast, deterministic; uniform floats in [-1, 1).
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  float Uniform() {
    s_ ^= s_ >> 12;
    s_ ^= s_ << 25;
    s_ ^= s_ >> 27;
    const uint64_t r = s_ * 0x2545F4914F6CDD1Dull;
    return static_cast<float>(static_cast<int64_t>(r >> 40) - (int64_t{1} << 23)) * (1.0f / (1 << 23));
  }

 private:
  uint64_t s_;
};

struct Linear {
  const char* group;  // "self_attn" or "mlp"
  const char* name;
  int64_t out, in;
};

std::vector<Linear> Linears(const Flags& f) {
  const int64_t head_dim = f.hidden / f.heads;
  const int64_t kv = f.kv_heads * head_dim;
  return {{"self_attn", "q_proj", f.hidden, f.hidden},    {"self_attn", "k_proj", kv, f.hidden},
          {"self_attn", "v_proj", kv, f.hidden},          {"self_attn", "o_proj", f.hidden, f.hidden},
          {"mlp", "gate_proj", f.intermediate, f.hidden}, {"mlp", "up_proj", f.intermediate, f.hidden},
          {"mlp", "down_proj", f.hidden, f.intermediate}};
}

// Streams `numel` values of `dtype`: uniform in [-scale, scale) plus `offset`.
ferry::Status AppendRandom(ferry::SafetensorsWriter& w, Rng& rng, int64_t numel, ferry::DType dtype, float scale,
                           float offset) {
  constexpr int64_t kChunk = 1 << 20;
  std::vector<float> values(static_cast<size_t>(std::min(numel, kChunk)));
  const size_t esize = static_cast<size_t>(ferry::DTypeBits(dtype) / 8);
  std::vector<std::byte> bytes(values.size() * esize);
  for (int64_t i = 0; i < numel; i += kChunk) {
    const size_t n = static_cast<size_t>(std::min(kChunk, numel - i));
    for (size_t j = 0; j < n; ++j) values[j] = offset + scale * rng.Uniform();
    std::span<std::byte> out(bytes.data(), n * esize);
    FERRY_RETURN_IF_ERROR(ferry::WriteFromF32(std::span<const float>(values.data(), n), dtype, out));
    FERRY_RETURN_IF_ERROR(w.Append(out));
  }
  return ferry::Status::OK();
}

ferry::Status WriteBase(const Flags& f) {
  using ferry::DType;
  std::error_code ec;
  fs::create_directories(f.base, ec);
  if (ec) return ferry::Status::IOError(f.base.string() + ": " + ec.message());
  struct Item {
    std::string name;
    ferry::Shape shape;
    float scale, offset;
  };
  std::vector<Item> items;
  items.push_back({"model.embed_tokens.weight", {f.vocab, f.hidden}, 0.02f, 0.0f});
  for (int64_t l = 0; l < f.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const Linear& m : Linears(f)) {
      items.push_back({p + m.group + "." + m.name + ".weight", {m.out, m.in}, 0.02f, 0.0f});
    }
    items.push_back({p + "input_layernorm.weight", {f.hidden}, 0.1f, 1.0f});
    items.push_back({p + "post_attention_layernorm.weight", {f.hidden}, 0.1f, 1.0f});
  }
  items.push_back({"model.norm.weight", {f.hidden}, 0.1f, 1.0f});
  items.push_back({"lm_head.weight", {f.vocab, f.hidden}, 0.02f, 0.0f});

  std::vector<ferry::TensorSpec> specs;
  for (const auto& it : items) specs.push_back({it.name, DType::kBF16, it.shape});
  ferry::WriterOptions opt;
  opt.max_shard_bytes = f.max_shard_bytes;
  FERRY_ASSIGN_OR_RETURN(auto writer, ferry::SafetensorsWriter::CreateInDirectory(f.base, specs, opt));
  Rng rng(f.seed);
  for (const auto& it : items) {
    FERRY_ASSIGN_OR_RETURN(int64_t n, ferry::CheckedNumel(it.shape));
    FERRY_RETURN_IF_ERROR(AppendRandom(*writer, rng, n, DType::kBF16, it.scale, it.offset));
  }
  FERRY_RETURN_IF_ERROR(writer->Finish());

  ojson config = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_size", f.hidden},
      {"intermediate_size", f.intermediate},
      {"num_hidden_layers", f.layers},
      {"num_attention_heads", f.heads},
      {"num_key_value_heads", f.kv_heads},
      {"head_dim", f.hidden / f.heads},
      {"vocab_size", f.vocab},
      {"max_position_embeddings", 2048},
      {"rms_norm_eps", 1e-5},
      {"rope_theta", 10000.0},
      {"hidden_act", "silu"},
      {"initializer_range", 0.02},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"mlp_bias", false},
      {"pretraining_tp", 1},
      {"tie_word_embeddings", false},
      {"bos_token_id", 1},
      {"eos_token_id", 2},
      {"use_cache", true},
      {"torch_dtype", "bfloat16"},
  };
  FERRY_RETURN_IF_ERROR(ferry::WriteFileAtomic(f.base / "config.json", config.dump(2) + "\n"));
  ojson gen = {{"bos_token_id", 1}, {"eos_token_id", 2}, {"max_length", 2048}};
  return ferry::WriteFileAtomic(f.base / "generation_config.json", gen.dump(2) + "\n");
}

ferry::Status WriteAdapter(const Flags& f) {
  using ferry::DType;
  std::error_code ec;
  fs::create_directories(f.adapter, ec);
  if (ec) return ferry::Status::IOError(f.adapter.string() + ": " + ec.message());
  struct Item {
    std::string name;
    ferry::Shape shape;
    float scale;
  };
  std::vector<Item> items;
  for (int64_t l = 0; l < f.layers; ++l) {
    for (const Linear& m : Linears(f)) {
      const std::string p = "base_model.model.model.layers." + std::to_string(l) + "." + m.group + "." + m.name;
      // lora_A like PEFT's kaiming-uniform init; lora_B as after some training (PEFT starts it at zero).
      items.push_back({p + ".lora_A.weight", {f.rank, m.in}, 1.0f / std::sqrt(static_cast<float>(m.in))});
      items.push_back({p + ".lora_B.weight", {m.out, f.rank}, 0.01f});
    }
  }
  std::vector<ferry::TensorSpec> specs;
  for (const auto& it : items) specs.push_back({it.name, DType::kF32, it.shape});
  ferry::WriterOptions opt;
  opt.basename = "adapter_model";
  FERRY_ASSIGN_OR_RETURN(auto writer, ferry::SafetensorsWriter::CreateInDirectory(f.adapter, specs, opt));
  Rng rng(f.seed + 1000);
  for (const auto& it : items) {
    FERRY_ASSIGN_OR_RETURN(int64_t n, ferry::CheckedNumel(it.shape));
    FERRY_RETURN_IF_ERROR(AppendRandom(*writer, rng, n, DType::kF32, it.scale, 0.0f));
  }
  FERRY_RETURN_IF_ERROR(writer->Finish());

  ojson config = {
      {"alpha_pattern", ojson::object()},
      {"base_model_name_or_path", fs::absolute(f.base).string()},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"layers_pattern", nullptr},
      {"layers_to_transform", nullptr},
      {"lora_alpha", f.alpha},
      {"lora_dropout", 0.0},
      {"modules_to_save", nullptr},
      {"peft_type", "LORA"},
      {"r", f.rank},
      {"rank_pattern", ojson::object()},
      {"revision", nullptr},
      {"target_modules", {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}},
      {"task_type", "CAUSAL_LM"},
      {"use_dora", false},
      {"use_rslora", false},
  };
  return ferry::WriteFileAtomic(f.adapter / "adapter_config.json", config.dump(2) + "\n");
}

// The usage on stderr with exit status 2 after an error, on stdout with 0 for --help.
[[noreturn]] void Usage(const char* argv0, const std::string& error) {
  if (!error.empty()) std::fprintf(stderr, "%s: %s\n", argv0, error.c_str());
  std::fprintf(error.empty() ? stdout : stderr,
               "usage: %s --base DIR --adapter DIR [--hidden 2048] [--intermediate 5632] [--layers 22]\n"
               "          [--vocab 32000] [--heads 32] [--kv-heads 4] [--rank 16] [--alpha 32]\n"
               "          [--max-shard-bytes 1000000000] [--seed 1]\n",
               argv0);
  std::exit(error.empty() ? 0 : 2);
}

bool ParsePositive(std::string_view text, int64_t* out) {
  char* end = nullptr;
  const std::string s(text);
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || v <= 0) return false;
  *out = v;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help" || flag == "-h") Usage(argv[0], "");
    if (i + 1 >= argc) Usage(argv[0], "flag " + std::string(flag) + " needs a value");
    const std::string_view value = argv[++i];
    int64_t n = 0;
    if (flag == "--base") {
      f.base = value;
      continue;
    }
    if (flag == "--adapter") {
      f.adapter = value;
      continue;
    }
    const bool zero_ok = flag == "--max-shard-bytes";
    if (!ParsePositive(value, &n) && !(zero_ok && value == "0")) {
      Usage(argv[0], std::string(flag) + ": '" + std::string(value) + "' is not a positive integer");
    }
    if (flag == "--hidden") f.hidden = n;
    else if (flag == "--intermediate") f.intermediate = n;
    else if (flag == "--layers") f.layers = n;
    else if (flag == "--vocab") f.vocab = n;
    else if (flag == "--heads") f.heads = n;
    else if (flag == "--kv-heads") f.kv_heads = n;
    else if (flag == "--rank") f.rank = n;
    else if (flag == "--alpha") f.alpha = n;
    else if (flag == "--max-shard-bytes") f.max_shard_bytes = static_cast<uint64_t>(n);
    else if (flag == "--seed") f.seed = static_cast<uint64_t>(n);
    else Usage(argv[0], "unknown flag " + std::string(flag));
  }
  if (f.base.empty() || f.adapter.empty()) Usage(argv[0], "--base and --adapter are required");
  if (f.hidden % f.heads != 0 || f.heads % f.kv_heads != 0) {
    Usage(argv[0], "--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads");
  }
  std::error_code ec;
  for (const fs::path& p : {f.base, f.adapter}) {
    if (fs::exists(p, ec)) Usage(argv[0], p.string() + ": already exists (remove it first)");
  }
  if (ferry::Status s = WriteBase(f); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[0], s.ToString().c_str());
    return 1;
  }
  if (ferry::Status s = WriteAdapter(f); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", argv[0], s.ToString().c_str());
    return 1;
  }
  std::printf("wrote %s and %s\n", f.base.c_str(), f.adapter.c_str());
  return 0;
}
