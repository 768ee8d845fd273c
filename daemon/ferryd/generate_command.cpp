// ferryd generate: sample completions from a model directory (and a PEFT adapter) with the
// runtime's KV-cache generator.
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "core/mapped_file.h"
#include "daemon/ferryd/commands.h"
#include "daemon/runtime/generator.h"
#include "daemon/runtime/lora.h"
#include "daemon/text/chat_format.h"
#include "daemon/text/tokenizer.h"

namespace ferry::ferryd {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct GenerateFlags {
  fs::path model;
  fs::path adapter;
  std::string prompt;
  fs::path prompts;
  std::optional<int64_t> max_new_tokens;
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<int64_t> top_k;
  uint64_t seed = 0;
  int num = 1;
  bool chat = false;
  bool ignore_eos = false;
  std::vector<std::string> stop;
  int threads = 0;
  int64_t max_batch = 64;
  bool json = false;
};

// One prompt to complete: its token ids and where it came from (for messages).
struct Prompt {
  std::vector<int32_t> ids;
  std::string text;
};

// Sampling defaults from generation_config.json, as transformers' generate reads them:
// do_sample false means greedy; temperature 1, top_p 1, top_k 50 otherwise.
struct GenerationDefaults {
  bool do_sample = false;
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 50;
  std::optional<int64_t> max_new_tokens;
  std::vector<int64_t> eos;
};

Result<GenerationDefaults> ReadGenerationConfig(const fs::path& dir) {
  GenerationDefaults d;
  const fs::path p = dir / "generation_config.json";
  std::error_code ec;
  if (!fs::exists(p, ec)) return d;
  FERRY_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(p, 1u << 20));
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Status::Corruption(p.string() + ": not a JSON object");
  auto num = [&](const char* k, double& out) -> Status {
    if (!j.contains(k) || j[k].is_null()) return Status::OK();
    if (!j[k].is_number()) return Status::Corruption(p.string() + ": field '" + k + "' must be a number");
    out = j[k].get<double>();
    return Status::OK();
  };
  FERRY_RETURN_IF_ERROR(num("temperature", d.temperature));
  FERRY_RETURN_IF_ERROR(num("top_p", d.top_p));
  double top_k = static_cast<double>(d.top_k);
  FERRY_RETURN_IF_ERROR(num("top_k", top_k));
  d.top_k = static_cast<int64_t>(top_k);
  if (j.contains("do_sample") && j["do_sample"].is_boolean()) d.do_sample = j["do_sample"].get<bool>();
  if (j.contains("max_new_tokens") && j["max_new_tokens"].is_number_integer()) {
    d.max_new_tokens = j["max_new_tokens"].get<int64_t>();
  }
  if (j.contains("eos_token_id")) {
    const json& e = j["eos_token_id"];
    for (const json& id : e.is_array() ? e : json::array({e})) {
      if (id.is_number_integer()) d.eos.push_back(id.get<int64_t>());
    }
  }
  return d;
}

Result<std::vector<text::ChatMessage>> ParseMessages(const json& list, const std::string& where) {
  if (!list.is_array() || list.empty()) return Status::InvalidArgument(where + ": messages must be a non-empty list");
  std::vector<text::ChatMessage> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const json& m = list[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
        !m["content"].is_string()) {
      return Status::InvalidArgument(where + ": message " + std::to_string(i) +
                                     " must be an object with string 'role' and 'content'");
    }
    out.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  }
  return out;
}

Result<Prompt> ChatPrompt(const text::Tokenizer& tok, const std::vector<text::ChatMessage>& messages) {
  FERRY_ASSIGN_OR_RETURN(text::ChatFormat format, text::DetectChatFormat(tok));
  Prompt p;
  FERRY_ASSIGN_OR_RETURN(p.text, text::ApplyChatTemplate(format, messages, /*add_generation_prompt=*/true));
  // The template holds the special tokens itself: no post-processor BOS on top.
  FERRY_ASSIGN_OR_RETURN(p.ids, tok.Encode(p.text, {.add_special_tokens = false}));
  return p;
}

Result<Prompt> TextPrompt(const text::Tokenizer& tok, const std::string& text) {
  Prompt p;
  p.text = text;
  // As tokenizer(text) does: with the post-processor's special tokens (a Llama BOS).
  FERRY_ASSIGN_OR_RETURN(p.ids, tok.Encode(text, {.add_special_tokens = true}));
  return p;
}

Result<std::vector<Prompt>> ReadPrompts(const GenerateFlags& f, const text::Tokenizer& tok) {
  std::vector<Prompt> out;
  if (!f.prompt.empty()) {
    if (f.chat) {
      FERRY_ASSIGN_OR_RETURN(Prompt p, ChatPrompt(tok, {{"user", f.prompt}}));
      out.push_back(std::move(p));
    } else {
      FERRY_ASSIGN_OR_RETURN(Prompt p, TextPrompt(tok, f.prompt));
      out.push_back(std::move(p));
    }
    return out;
  }
  std::ifstream in(f.prompts);
  if (!in) return Status::NotFound(f.prompts.string() + ": cannot open");
  std::string line;
  size_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = f.prompts.string() + ":" + std::to_string(line_no);
    if (line.size() > (16u << 20)) return Status::InvalidArgument(where + ": line longer than 16 MiB");
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return Status::InvalidArgument(where + ": not a JSON object");
    Result<Prompt> p = Status::InvalidArgument(where + ": needs a 'prompt' (text or messages) or 'messages' field");
    if (j.contains("messages")) {
      FERRY_ASSIGN_OR_RETURN(auto messages, ParseMessages(j["messages"], where + ": field 'messages'"));
      p = ChatPrompt(tok, messages);
    } else if (j.contains("prompt") && j["prompt"].is_array()) {
      FERRY_ASSIGN_OR_RETURN(auto messages, ParseMessages(j["prompt"], where + ": field 'prompt'"));
      p = ChatPrompt(tok, messages);
    } else if (j.contains("prompt") && j["prompt"].is_string()) {
      p = f.chat ? ChatPrompt(tok, {{"user", j["prompt"].get<std::string>()}})
                 : TextPrompt(tok, j["prompt"].get<std::string>());
    }
    if (!p.ok()) return p.status().WithContext(where);
    out.push_back(std::move(*p));
  }
  if (out.empty()) return Status::InvalidArgument(f.prompts.string() + ": no prompts");
  return out;
}

Status RunGenerate(const GenerateFlags& f) {
  const int threads = SetUpTorch(f.threads);
  FERRY_ASSIGN_OR_RETURN(text::Tokenizer tok, text::Tokenizer::FromDirectory(f.model));
  FERRY_ASSIGN_OR_RETURN(auto model, runtime::CausalLM::Load(f.model, {}));
  std::unique_ptr<runtime::LoraAdapter> adapter;
  if (!f.adapter.empty()) {
    FERRY_ASSIGN_OR_RETURN(adapter, runtime::LoraAdapter::Load(*model, f.adapter));
  }
  FERRY_ASSIGN_OR_RETURN(GenerationDefaults d, ReadGenerationConfig(f.model));
  FERRY_ASSIGN_OR_RETURN(std::vector<Prompt> prompts, ReadPrompts(f, tok));

  runtime::SamplingParams p;
  const bool sample = f.temperature ? *f.temperature > 0 : d.do_sample;
  p.temperature = sample ? f.temperature.value_or(d.temperature) : 0.0;
  p.top_p = f.top_p.value_or(sample ? d.top_p : 1.0);
  p.top_k = f.top_k.value_or(sample ? d.top_k : 0);
  p.max_new_tokens = f.max_new_tokens.value_or(d.max_new_tokens.value_or(64));
  p.seed = f.seed;
  p.stop_strings = f.stop;
  if (!f.ignore_eos) {
    p.eos_token_ids = !d.eos.empty() ? d.eos : model->config().eos_token_ids;
    if (p.eos_token_ids.empty() && tok.eos_id()) p.eos_token_ids.push_back(*tok.eos_id());
  }
  runtime::GeneratorOptions gopts;
  gopts.max_batch = f.max_batch;
  gopts.token_bytes = [&tok](int32_t id) {
    auto b = tok.TokenBytes(id);
    return b.ok() ? std::string(*b) : std::string();
  };
  runtime::Generator gen(*model, gopts);
  std::vector<std::vector<int32_t>> ids;
  for (const auto& pr : prompts) ids.push_back(pr.ids);
  const auto t0 = std::chrono::steady_clock::now();
  FERRY_ASSIGN_OR_RETURN(std::vector<runtime::Completion> out,
                         gen.Generate(ids, f.num, p, adapter ? &adapter->binding() : nullptr));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  int64_t tokens = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const runtime::Completion& c = out[i];
    tokens += static_cast<int64_t>(c.token_ids.size());
    FERRY_ASSIGN_OR_RETURN(std::string text, tok.Decode(c.token_ids, {.skip_special_tokens = true}));
    if (f.json) {
      json j;
      j["prompt_index"] = c.prompt_index;
      if (f.num > 1) j["sample_index"] = i % static_cast<size_t>(f.num);
      j["prompt_token_ids"] = prompts[c.prompt_index].ids;
      j["token_ids"] = c.token_ids;
      j["text"] = text;
      j["logprobs"] = c.logprobs;
      j["finish_reason"] = runtime::FinishName(c.finish);
      std::printf("%s\n", j.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
    } else {
      if (out.size() > 1)
        std::printf("=== prompt %zu%s\n", c.prompt_index,
                    f.num > 1 ? (", sample " + std::to_string(i % static_cast<size_t>(f.num))).c_str() : "");
      std::printf("%s\n", text.c_str());
    }
  }
  std::fflush(stdout);
  std::fprintf(stderr, "ferryd: %zu completion%s, %lld tokens in %.2f s (%.1f tokens/s, %d threads)\n", out.size(),
               out.size() == 1 ? "" : "s", static_cast<long long>(tokens), seconds,
               seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0, threads);
  return Status::OK();
}

}  // namespace

void SetGenerateCommand(CLI::App& app) {
  auto f = std::make_shared<GenerateFlags>();
  CLI::App* cmd = app.add_subcommand("generate", "Sample completions from a model (and a PEFT adapter)");
  cmd->add_option("--model", f->model, "Hugging Face model directory (config.json, safetensors, tokenizer.json)")
      ->required();
  cmd->add_option("--adapter", f->adapter, "PEFT LoRA adapter directory to apply");
  auto* prompt = cmd->add_option("--prompt", f->prompt, "one prompt text");
  auto* prompts = cmd->add_option("--prompts", f->prompts,
                                  "JSONL file: per line {\"prompt\": text or messages} or {\"messages\": [...]}");
  prompt->excludes(prompts);
  cmd->add_option("--max-new-tokens", f->max_new_tokens,
                  "tokens to generate per completion (default: "
                  "generation_config.json's max_new_tokens, else 64)");
  cmd->add_option("--temperature", f->temperature,
                  "0 is greedy; > 0 samples (default: generation_config.json: "
                  "greedy unless do_sample)");
  cmd->add_option("--top-p", f->top_p, "nucleus sampling mass in (0, 1] (default: generation_config.json, else 1)");
  cmd->add_option("--top-k", f->top_k,
                  "keep the k most likely tokens, 0 = off (default: generation_config.json, else 50)");
  cmd->add_option("--seed", f->seed, "sampling seed (default 0)");
  cmd->add_option("-n,--num-return-sequences", f->num, "completions per prompt (default 1)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--stop", f->stop, "stop string (repeatable); the completion ends with the token completing it");
  cmd->add_flag("--chat", f->chat, "format plain-text prompts as one user message in the tokenizer's chat format");
  cmd->add_flag("--ignore-eos", f->ignore_eos, "do not stop at the EOS token");
  cmd->add_option("--threads", f->threads, "LibTorch threads (default: all hardware threads)");
  cmd->add_option("--max-batch", f->max_batch, "sequences decoded together (default 64)")->check(CLI::PositiveNumber);
  cmd->add_flag("--json", f->json,
                "one JSON object per completion and line: prompt_index, prompt_token_ids, token_ids, text, logprobs, "
                "finish_reason");
  cmd->callback([f, prompt, prompts] {
    if (prompt->count() == 0 && prompts->count() == 0) {
      Fail(Status::InvalidArgument("give --prompt TEXT or --prompts FILE.jsonl"));
    }
    Status s = RunGenerate(*f);
    if (!s.ok()) Fail(s);
  });
}

}  // namespace ferry::ferryd
