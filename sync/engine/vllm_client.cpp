#include "sync/engine/vllm_client.h"

#include <curl/curl.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <mutex>
#include <random>
#include <utility>

#include "core/text.h"

namespace ferry::engine {
namespace {

using json = nlohmann::json;

// Answers are small (a probe's prompt log-probs, a step's completions); anything larger is
// refused rather than buffered without end.
constexpr size_t kMaxAnswerBytes = size_t{256} << 20;
constexpr size_t kMaxMessageChars = 300;

void InitCurlOnce() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

size_t Collect(char* data, size_t size, size_t count, void* user) {
  auto* out = static_cast<std::string*>(user);
  const size_t n = size * count;
  if (out->size() + n > kMaxAnswerBytes) return 0;  // makes curl fail with CURLE_WRITE_ERROR
  out->append(data, n);
  return n;
}

// The server's own message from an error answer: FastAPI's {"detail": ...}, vLLM's
// {"error": {"message": ...}} or {"message": ...}, else the body itself; cut and quoted.
std::string ServerMessage(const std::string& body) {
  auto j = json::parse(body, nullptr, false);
  std::string text = body;
  if (j.is_object()) {
    if (j.contains("error") && j["error"].is_object() && j["error"].contains("message") &&
        j["error"]["message"].is_string()) {
      text = j["error"]["message"].get<std::string>();
    } else if (j.contains("message") && j["message"].is_string()) {
      text = j["message"].get<std::string>();
    } else if (j.contains("detail")) {
      // Not dump(): it recurses once per level of a hostile answer's nesting; the body is quoted as it came.
      if (j["detail"].is_string()) text = j["detail"].get<std::string>();
    }
  }
  return QuoteForMessage(text, kMaxMessageChars);
}

Result<double> Number(const json& j, const std::string& where) {
  if (!j.is_number()) return Status(StatusCode::kCorruption, where + " is not a number");
  return j.get<double>();
}

// "token_id:123" (return_tokens_as_token_ids) or a plain id key of a prompt_logprobs entry.
Result<int32_t> TokenIdOf(const std::string& s, const std::string& where) {
  std::string_view v = s;
  if (v.substr(0, 9) == "token_id:") v.remove_prefix(9);
  if (v.empty() || v.size() > 10)
    return Status(StatusCode::kCorruption, where + " is not a token id: " + QuoteForMessage(s, 40));
  int64_t id = 0;
  for (char c : v) {
    if (c < '0' || c > '9')
      return Status(StatusCode::kCorruption, where + " is not a token id: " + QuoteForMessage(s, 40));
    id = id * 10 + (c - '0');
  }
  if (id > INT32_MAX) return Status(StatusCode::kCorruption, where + " is out of range: " + QuoteForMessage(s, 40));
  return static_cast<int32_t>(id);
}

}  // namespace

struct VllmClient::Impl {
  VllmClientOptions options;
  CURL* curl = nullptr;
  std::optional<std::chrono::steady_clock::time_point> deadline;

  ~Impl() {
    if (curl) curl_easy_cleanup(curl);
  }

  // One request; `body` empty means GET. Returns the answer's body when the status is 2xx.
  Result<std::string> Call(const std::string& path, const json* body, const std::string& what) {
    const std::string url = options.base_url + path;
    int timeout_ms = options.timeout_ms;
    if (deadline) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0) {
        return Status(StatusCode::kUnavailable, "vLLM " + url + " (" + what + "): no time left before the deadline");
      }
      timeout_ms = static_cast<int>(std::min<int64_t>(timeout_ms, left));
    }
    curl_easy_reset(curl);
    std::string answer;
    std::string payload;
    curl_slist* headers = nullptr;
    curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, static_cast<long>(timeout_ms));
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(std::min(timeout_ms, 10000)));
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, &Collect);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &answer);
    curl_easy_setopt(curl, CURLOPT_PROTOCOLS_STR, "http,https");
    if (body != nullptr) {
      payload = body->dump();
      headers = curl_slist_append(headers, "Content-Type: application/json");
      curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
      curl_easy_setopt(curl, CURLOPT_POSTFIELDS, payload.data());
      curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(payload.size()));
    }
    const CURLcode rc = curl_easy_perform(curl);
    long http = 0;
    curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &http);
    curl_slist_free_all(headers);
    if (rc == CURLE_WRITE_ERROR && answer.size() >= kMaxAnswerBytes - (1u << 20)) {
      return Status(StatusCode::kCorruption, "vLLM " + url + " (" + what + "): answer larger than " +
                                                 std::to_string(kMaxAnswerBytes >> 20) + " MiB");
    }
    if (rc != CURLE_OK) {
      return Status(StatusCode::kUnavailable,
                    "vLLM " + url + " (" + what + "): " + curl_easy_strerror(rc) +
                        (rc == CURLE_OPERATION_TIMEDOUT ? " after " + std::to_string(timeout_ms) + " ms" : ""));
    }
    if (http == 404) {
      return Status(StatusCode::kNotFound, "vLLM " + url + " (" + what + "): 404 " + ServerMessage(answer));
    }
    if (http < 200 || http >= 300) {
      return Status(http >= 500 && http != 501 ? StatusCode::kUnavailable : StatusCode::kFailedPrecondition,
                    "vLLM " + url + " (" + what + "): HTTP " + std::to_string(http) + " " + ServerMessage(answer));
    }
    return answer;
  }

  Result<json> CallJson(const std::string& path, const json* body, const std::string& what) {
    auto answer = Call(path, body, what);
    if (!answer.ok()) return answer.status();
    auto j = json::parse(*answer, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      return Status(StatusCode::kCorruption,
                    "vLLM " + options.base_url + path + " (" + what +
                        "): the answer is not a JSON object: " + QuoteForMessage(*answer, 120));
    }
    return j;
  }

  Status Post(const std::string& path, const json& body, const std::string& what) {
    auto answer = Call(path, &body, what);
    return answer.ok() ? Status() : answer.status();
  }
};

std::string AdapterName(std::string_view version_hex, uint32_t instance, uint64_t n) {
  char tag[8];
  std::snprintf(tag, sizeof tag, "%04x", instance & 0xffff);
  return "ferry-" + std::string(version_hex.substr(0, 12)) + "-" + tag + "-" + std::to_string(n);
}

uint32_t NewInstanceTag() { return std::random_device()(); }

VllmClient::VllmClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
VllmClient::~VllmClient() = default;

Result<std::unique_ptr<VllmClient>> VllmClient::Create(VllmClientOptions options) {
  std::string url = options.base_url;
  while (!url.empty() && url.back() == '/') url.pop_back();
  const bool http = url.rfind("http://", 0) == 0, https = url.rfind("https://", 0) == 0;
  const size_t host_at = http ? 7 : 8;
  if ((!http && !https) || url.size() <= host_at || url[host_at] == '/' || url[host_at] == ':') {
    return Status(StatusCode::kInvalidArgument,
                  "vLLM server URL " + QuoteForMessage(options.base_url, 200) + " is not http(s)://HOST[:PORT]");
  }
  if (options.timeout_ms <= 0) {
    return Status(StatusCode::kInvalidArgument,
                  "vLLM timeout must be positive, not " + std::to_string(options.timeout_ms));
  }
  InitCurlOnce();
  auto impl = std::make_unique<Impl>();
  impl->curl = curl_easy_init();
  if (impl->curl == nullptr) return Status(StatusCode::kInternal, "curl_easy_init failed");
  options.base_url = url;
  impl->options = std::move(options);
  return std::unique_ptr<VllmClient>(new VllmClient(std::move(impl)));
}

const std::string& VllmClient::base_url() const { return impl_->options.base_url; }

void VllmClient::SetDeadline(std::optional<std::chrono::steady_clock::time_point> deadline) {
  impl_->deadline = deadline;
}

Status VllmClient::Health() {
  auto r = impl_->Call("/health", nullptr, "health");
  return r.ok() ? Status() : r.status();
}

Result<std::vector<std::string>> VllmClient::Models() {
  auto j = impl_->CallJson("/v1/models", nullptr, "list models");
  if (!j.ok()) return j.status();
  if (!j->contains("data") || !(*j)["data"].is_array()) {
    return Status(StatusCode::kCorruption, "vLLM " + base_url() + "/v1/models: no \"data\" array");
  }
  std::vector<std::string> names;
  for (const auto& m : (*j)["data"]) {
    if (!m.is_object() || !m.contains("id") || !m["id"].is_string()) {
      return Status(StatusCode::kCorruption, "vLLM " + base_url() + "/v1/models: an entry without a string \"id\"");
    }
    names.push_back(m["id"].get<std::string>());
  }
  return names;
}

Status VllmClient::LoadLoraAdapter(const std::string& name, const std::string& path) {
  return impl_->Post("/v1/load_lora_adapter", json{{"lora_name", name}, {"lora_path", path}},
                     "load adapter " + Quote(name));
}

Status VllmClient::UnloadLoraAdapter(const std::string& name) {
  return impl_->Post("/v1/unload_lora_adapter", json{{"lora_name", name}}, "unload adapter " + Quote(name));
}

Result<std::vector<std::vector<double>>> VllmClient::PromptLogProbs(const std::string& model,
                                                                    const std::vector<std::vector<int32_t>>& prompts) {
  // One prompt per request: vLLM 0.32's CPU LoRA path fails on a batch of prompts with
  // prompt_logprobs (an einsum over mismatched sizes) and its engine process dies with it.
  std::vector<std::vector<double>> out;
  out.reserve(prompts.size());
  const std::string what = "prompt log-probabilities under " + Quote(model);
  const std::string where = "vLLM " + base_url() + "/v1/completions (" + what + "): ";
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto& prompt = prompts[i];
    json body = {{"model", model},     {"prompt", prompt},     {"max_tokens", 1},
                 {"temperature", 0.0}, {"prompt_logprobs", 1}, {"return_tokens_as_token_ids", true}};
    auto j = impl_->CallJson("/v1/completions", &body, what);
    if (!j.ok()) return j.status();
    const std::string seq = "sequence " + std::to_string(i);
    if (!j->contains("choices") || !(*j)["choices"].is_array() || (*j)["choices"].size() != 1 ||
        !(*j)["choices"][0].is_object()) {
      return Status(StatusCode::kCorruption, where + seq + ": \"choices\" is not an array of one object");
    }
    const auto& choice = (*j)["choices"][0];
    const auto& lp = choice.contains("prompt_logprobs") ? choice["prompt_logprobs"] : json();
    if (!lp.is_array() || lp.size() != prompt.size()) {
      return Status(StatusCode::kCorruption,
                    where + seq + ": \"prompt_logprobs\" is not an array of " + std::to_string(prompt.size()));
    }
    std::vector<double> row;
    row.reserve(prompt.size() - 1);
    for (size_t t = 1; t < lp.size(); ++t) {
      const std::string field = seq + " prompt_logprobs[" + std::to_string(t) + "]";
      if (!lp[t].is_object()) return Status(StatusCode::kCorruption, where + field + " is not an object");
      // The entry holds the prompt token itself (and the top-1): find the prompt token's.
      std::optional<double> value;
      for (const auto& [key, entry] : lp[t].items()) {
        auto id = TokenIdOf(key, where + field);
        if (!id.ok()) return id.status();
        if (*id != prompt[t]) continue;
        if (!entry.is_object() || !entry.contains("logprob")) {
          return Status(StatusCode::kCorruption, where + field + ": no \"logprob\"");
        }
        auto v = Number(entry["logprob"], where + field + ".logprob");
        if (!v.ok()) return v.status();
        value = *v;
      }
      if (!value) {
        return Status(StatusCode::kCorruption, where + field + " lacks the prompt token " + std::to_string(prompt[t]));
      }
      row.push_back(*value);
    }
    out.push_back(std::move(row));
  }
  return out;
}

Result<std::vector<Completion>> VllmClient::Complete(const CompletionRequest& request) {
  json body = {{"model", request.model},
               {"prompt", request.prompts},
               {"n", request.n},
               {"max_tokens", request.max_tokens},
               {"temperature", request.temperature},
               {"top_p", request.top_p},
               {"top_k", request.top_k},
               {"min_p", request.min_p},
               {"repetition_penalty", request.repetition_penalty},
               {"logprobs", 0},
               {"return_tokens_as_token_ids", true},
               {"ignore_eos", request.ignore_eos},
               {"skip_special_tokens", false}};
  if (request.seed) body["seed"] = *request.seed;
  if (!request.stop_token_ids.empty()) body["stop_token_ids"] = request.stop_token_ids;
  const std::string what = "completions under " + Quote(request.model);
  auto j = impl_->CallJson("/v1/completions", &body, what);
  if (!j.ok()) return j.status();
  const std::string where = "vLLM " + base_url() + "/v1/completions (" + what + "): ";
  const size_t expected = request.prompts.size() * static_cast<size_t>(request.n);
  if (!j->contains("choices") || !(*j)["choices"].is_array() || (*j)["choices"].size() != expected) {
    return Status(StatusCode::kCorruption, where + "\"choices\" is not an array of " + std::to_string(expected));
  }
  std::vector<Completion> out(expected);
  std::vector<bool> seen(expected, false);
  for (const auto& choice : (*j)["choices"]) {
    if (!choice.is_object() || !choice.contains("index") || !choice["index"].is_number_unsigned() ||
        choice["index"].get<uint64_t>() >= expected || seen[choice["index"].get<size_t>()]) {
      return Status(StatusCode::kCorruption, where + "a choice without a valid, distinct \"index\"");
    }
    const size_t k = choice["index"].get<size_t>();
    seen[k] = true;
    const std::string field = "choice " + std::to_string(k);
    Completion& c = out[k];
    c.prompt_index = static_cast<int>(k / static_cast<size_t>(request.n));
    c.finish_reason = choice.contains("finish_reason") && choice["finish_reason"].is_string()
                          ? choice["finish_reason"].get<std::string>()
                          : "";
    const auto& lp = choice.contains("logprobs") ? choice["logprobs"] : json();
    if (!lp.is_object() || !lp.contains("tokens") || !lp["tokens"].is_array() || !lp.contains("token_logprobs") ||
        !lp["token_logprobs"].is_array() || lp["tokens"].size() != lp["token_logprobs"].size() ||
        lp["tokens"].size() > static_cast<size_t>(request.max_tokens)) {
      return Status(StatusCode::kCorruption,
                    where + field + ": \"logprobs\" lacks matching \"tokens\" and \"token_logprobs\"");
    }
    for (size_t t = 0; t < lp["tokens"].size(); ++t) {
      const std::string at = field + " token " + std::to_string(t);
      if (!lp["tokens"][t].is_string()) return Status(StatusCode::kCorruption, where + at + " is not a string");
      auto id = TokenIdOf(lp["tokens"][t].get<std::string>(), where + at);
      if (!id.ok()) return id.status();
      auto v = Number(lp["token_logprobs"][t], where + at + " log-probability");
      if (!v.ok()) return v.status();
      if (!std::isfinite(*v) && !(std::isinf(*v) && *v < 0)) {
        return Status(StatusCode::kCorruption, where + at + " log-probability is not finite");
      }
      c.token_ids.push_back(*id);
      c.logprobs.push_back(*v);
    }
  }
  return out;
}

Status VllmClient::Pause() { return impl_->Post("/pause", json::object(), "pause"); }
Status VllmClient::Resume() { return impl_->Post("/resume", json::object(), "resume"); }

Status VllmClient::ReloadWeights(const std::string& path) {
  return impl_->Post("/collective_rpc", json{{"method", "reload_weights"}, {"kwargs", {{"weights_path", path}}}},
                     "reload weights from " + Quote(path));
}

Status VllmClient::ResetPrefixCache() {
  return impl_->Post("/reset_prefix_cache", json::object(), "reset prefix cache");
}

Status VllmClient::UpdateWeightVersion(const std::string& version) {
  return impl_->Post("/update_weight_version", json{{"new_version", version}}, "update weight version");
}

}  // namespace ferry::engine
