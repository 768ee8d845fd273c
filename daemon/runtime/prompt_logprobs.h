// Prompt log-probabilities: what vLLM's `prompt_logprobs` reports for a prompt's tokens, as this
// runtime computes them, so a server can be checked to run a given weight version.
//
// For a sequence x_0 .. x_{n-1} (n >= 2), the result holds n - 1 values, one per position
// t = 1 .. n-1:
//   logp[t - 1] = log_softmax(logits(x_0 .. x_{t-1}))[x_t]
// with the logits of the model (and its LoRA binding, if any) at position t - 1, at temperature 1
// and with no processing (vLLM's default logprobs_mode, raw_logprobs). Position 0 has none (vLLM
// reports None there). The forward runs in the model's compute dtype (CausalLM::dtype(): load
// the model with ModelOptions::dtype = float32 for an F32 reference); the logits are cast to F32
// before log_softmax, as vLLM's sampler does.
//
// Batching: sequences are sorted by length and packed into batches of at most
// `max_batch_tokens` padded tokens, each right-padded with id 0 at positions 0 .. T-1. No
// attention mask is needed: attention is causal, so a real token never sees the padding after
// it, and the padding's outputs are dropped. The LM head runs over the kept positions only,
// `logits_rows` rows at a time, so memory is bounded by the batch and one [rows, vocab] tile.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "daemon/runtime/model.h"

namespace ferry::runtime {

struct PromptLogProbsOptions {
  // Padded tokens (batch rows x longest sequence) per forward; a longer sequence runs alone.
  // Default: 8192.
  int64_t max_batch_tokens = 8192;
  // Positions projected by the LM head at a time (the logits tile is [rows, vocab] in F32).
  // Default: 1024.
  int64_t logits_rows = 1024;
};

// For each of `sequences`, the F32 log-probability of token t given tokens < t, t = 1 .. n-1 (see
// the top of this file); out[i].size() == sequences[i].size() - 1. `lora`: null for the base
// model, else a binding made for `model` (LoraAdapter::binding()).
// Errors (kInvalidArgument, naming the sequence index and the token position): no sequences, a
// sequence of fewer than 2 tokens, one longer than the config's max_position_embeddings, an id
// outside [0, vocab_size); options < 1. LibTorch failures are kInternal.
// Thread-safety: as CausalLM::Forward (concurrent calls on one model are safe).
Result<std::vector<std::vector<float>>> PromptLogProbs(const CausalLM& model, const LoraBinding* lora,
                                                       const std::vector<std::vector<int64_t>>& sequences,
                                                       const PromptLogProbsOptions& options = {});

}  // namespace ferry::runtime
