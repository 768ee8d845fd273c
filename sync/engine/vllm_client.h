// A client of one running vLLM server's HTTP API (vLLM 0.32; ../docs/vllm.md lists the
// endpoints and their traps): the OpenAI completions endpoint with token-id prompts and
// log-probabilities, run-time LoRA adapters, and the dev-mode weight reload. libcurl does the
// HTTP; every answer is parsed as hostile (bounded size, every field checked).
//
// Errors, the same for every call:
//   kUnavailable   the server did not answer within the timeout, refused the connection or
//                  closed it (worth retrying later), naming the URL;
//   kNotFound      404: an unknown model or adapter name, naming it;
//   kFailedPrecondition  any other 4xx/5xx, with the server's own message (cut);
//   kCorruption    the answer is not the JSON the endpoint documents, naming the field.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace ferry::engine {

struct VllmClientOptions {
  // "http://127.0.0.1:8000" (a trailing slash is dropped). REQUIRED
  std::string base_url;
  // Longest wait for one request, connection included. Default: 240 s (TRL's vllm_server_timeout)
  int timeout_ms = 240000;
};

// One completion request of token-id prompts (/v1/completions).
struct CompletionRequest {
  std::string model;  // the served name: the base or a loaded LoRA
  std::vector<std::vector<int32_t>> prompts;
  int n = 1;  // completions per prompt
  int max_tokens = 16;
  double temperature = 1.0;
  double top_p = 1.0;
  int top_k = -1;  // -1: off (vLLM's default)
  double min_p = 0.0;
  double repetition_penalty = 1.0;
  std::optional<uint64_t> seed;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
};

// One completion: its token ids and the sampled tokens' log-probabilities as the server computed
// them (under the request's temperature, vLLM's "processed" log-probs are not asked for: these
// are the raw model's, as vLLM's default logprobs_mode).
struct Completion {
  int prompt_index = 0;
  std::vector<int32_t> token_ids;
  std::vector<double> logprobs;  // one per token id
  std::string finish_reason;     // "stop" or "length"
};

// The name a version's adapter is loaded under: "ferry-<the version's first 12 hex>-<4 hex of
// `instance`>-<n>", unique to the version, the loading process (`instance`: NewInstanceTag()
// once per process) and its n-th load, so that no name is ever loaded twice into a server
// (vLLM refuses it, or with load_inplace serves stale prefix-cache blocks: vllm#42125).
std::string AdapterName(std::string_view version_hex, uint32_t instance, uint64_t n);
// A random tag for AdapterName.
uint32_t NewInstanceTag();

class VllmClient {
 public:
  // kInvalidArgument when base_url is not http(s)://HOST[:PORT][/PATH].
  [[nodiscard]] static Result<std::unique_ptr<VllmClient>> Create(VllmClientOptions options);
  ~VllmClient();
  VllmClient(const VllmClient&) = delete;
  VllmClient& operator=(const VllmClient&) = delete;

  const std::string& base_url() const;

  // A time no request may outlast (each also within the options' timeout): a caller's bound
  // over several requests (an adoption, a retried generation). nullopt: none. A request made
  // after it fails at once as timed out (kUnavailable).
  void SetDeadline(std::optional<std::chrono::steady_clock::time_point> deadline);

  // GET /health: OK when the server answers 200.
  [[nodiscard]] Status Health();
  // GET /v1/models: the served names (the base and every loaded adapter).
  [[nodiscard]] Result<std::vector<std::string>> Models();
  // POST /v1/load_lora_adapter (the server runs with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1): `path`
  // is a PEFT adapter directory the server can read.
  [[nodiscard]] Status LoadLoraAdapter(const std::string& name, const std::string& path);
  // POST /v1/unload_lora_adapter.
  [[nodiscard]] Status UnloadLoraAdapter(const std::string& name);

  // The log-probability of each prompt token after the first, as the model `model` gives it
  // (/v1/completions with prompt_logprobs, max_tokens 1, greedy): result[i][t-1] is
  // log p(prompts[i][t] | prompts[i][<t]). One request per prompt, one after the other: vLLM
  // 0.32's CPU LoRA path crashes its engine on a batch of prompts with prompt_logprobs.
  [[nodiscard]] Result<std::vector<std::vector<double>>> PromptLogProbs(
      const std::string& model, const std::vector<std::vector<int32_t>>& prompts);
  // Samples completions (with per-token log-probabilities and token ids), n per prompt, in
  // prompt order.
  [[nodiscard]] Result<std::vector<Completion>> Complete(const CompletionRequest& request);

  // Dev mode (VLLM_SERVER_DEV_MODE=1): the merged-weights switch.
  [[nodiscard]] Status Pause();
  [[nodiscard]] Status Resume();
  // POST /collective_rpc reload_weights from a directory of safetensors the server can read.
  [[nodiscard]] Status ReloadWeights(const std::string& path);
  [[nodiscard]] Status ResetPrefixCache();
  [[nodiscard]] Status UpdateWeightVersion(const std::string& version);

 private:
  struct Impl;
  explicit VllmClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::engine
