// Batched generation with a KV cache: prefill each prompt once, copy its cache rows to its n
// completions, then decode one token per step for every live sequence.
//
// Sampling (as transformers' generate with do_sample): logits in fp32, divided by the
// temperature, then top-k, then top-p (the smallest set of tokens whose probability reaches
// top_p, at least one kept), then one draw by inverse CDF from a generator seeded with
// `seed` (the same seed, prompts and weights give the same completions on a device).
// temperature 0 is greedy (argmax; ties go to the lowest id, as torch.argmax). Every sampled
// token's log-probability is reported under the temperature-scaled, unfiltered distribution
// (log_softmax(logits / T); T = 1 when greedy): what a GRPO trainer computes for the same
// token, so the two can be compared.
//
// Completion c's s-th token takes the (c * max_new_tokens + s)-th draw of the seeded stream, so
// a completion does not depend on how the requests are batched (max_batch) or when the host
// looks (below), up to the last bits of batched arithmetic.
//
// A sequence finishes at an EOS token (kept), when its decoded text contains a stop string
// (the token completing it is kept), or at max_new_tokens. A decoding step stays on the device:
// it samples, takes the log-probabilities and feeds the tokens to the next step without the
// host reading anything (no synchronisation); the host looks at the tokens every
// finish_check_every steps, ends the rows that finished (a finished row's later tokens are
// dropped) and compacts the cache to the live rows once half of them are done.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/status.h"
#include "daemon/runtime/model.h"

namespace ferry::runtime {

struct SamplingParams {
  double temperature = 1.0;  // 0: greedy. Default: 1
  double top_p = 1.0;        // (0, 1]. Default: 1 (off)
  int64_t top_k = 0;         // 0: off. Default: 0
  int64_t max_new_tokens = 16;
  std::vector<int64_t> eos_token_ids;     // Default: none
  std::vector<std::string> stop_strings;  // needs GeneratorOptions::token_bytes
  uint64_t seed = 0;
};

struct Completion {
  enum class Finish { kEos, kStop, kLength };
  size_t prompt_index = 0;
  std::vector<int32_t> token_ids;
  std::vector<float> logprobs;  // one per token
  Finish finish = Finish::kLength;
};
std::string_view FinishName(Completion::Finish f);  // "eos" | "stop" | "length"

struct GeneratorOptions {
  // Sequences decoded together (prompts x n are split into batches of at most this). Default: 64.
  int64_t max_batch = 64;
  // The bytes a token decodes to (stop strings are matched on them). Default: none.
  std::function<std::string(int32_t)> token_bytes;
  // Decoding steps between the host's looks at the tokens (see the top): the steps in between
  // run without waiting for the device; a row that finished decodes on until the next look.
  // The completions are the same whatever the value. Default: 0 = 1 on the CPU (a look costs
  // nothing there), 16 on CUDA.
  int64_t finish_check_every = 0;
  // Every decoding step with the same shapes: the cache's whole capacity attended (the slots not
  // yet filled masked), the step's slot and positions read from device tensors updated in place
  // (ForwardArgs::cache_slots): what capturing the step as a CUDA graph needs. The same tokens
  // as without, up to rounding. Early steps attend over empty slots too: no slower on the demo's
  // short contexts, more so the longer max_new_tokens is against the prompt. Default: false.
  bool static_shapes = false;
  // Each decoding step replayed from a CUDA graph (cuda_graph.h): the step (the forward, the
  // LM head, the positions and cache slot advanced) is captured after one eager step at each
  // batch size (a new capture after every compaction) and replayed with the sampled tokens
  // copied in; sampling stays outside the graph. Implies static_shapes. The same completions as
  // the eager static-shape steps (the same kernels on the same tensors). Refused (kUnsupported)
  // on a CPU model or a LibTorch without CUDA. Default: false (not yet measured on a GPU:
  // scripts/gpu-check.sh compares it with the eager steps).
  bool cuda_graphs = false;
};

class Generator {
 public:
  // REQUIRES: `model` outlives the generator.
  Generator(const CausalLM& model, GeneratorOptions options);

  // `n` completions of each prompt (completion i*n + j is prompt i's j-th), under `lora` (null:
  // the model's own weights). Errors (kInvalidArgument): an empty prompt, a token id outside
  // the vocabulary, prompt + max_new_tokens beyond max_position_embeddings, bad sampling
  // parameters, stop strings without token_bytes.
  Result<std::vector<Completion>> Generate(const std::vector<std::vector<int32_t>>& prompts, int n,
                                           const SamplingParams& params, const LoraBinding* lora = nullptr) const;

 private:
  const CausalLM& model_;
  GeneratorOptions options_;
};

}  // namespace ferry::runtime
