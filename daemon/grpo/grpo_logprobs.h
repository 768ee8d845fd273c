// Per-token log-probabilities and entropies of completion tokens, as TRL 1.16.0 computes them
// for GRPO, under the sampling temperature (logits / T), so they compare with the generator's.
//
// Two ways to the same numbers:
// - TokenLogProbsFromLogits: full logits [B, T, V] in hand. TRL's
//   selective_log_softmax_and_entropy (its CPU path): logits / temperature, then
//   logit[target] - logsumexp (fp32/fp64; log_softmax + gather for 16-bit types), and the
//   entropy -(exp(logp) * logp).sum over the vocabulary. Computed in the logits' dtype.
// - TokenLogProbsFromHidden: hidden states and the LM head, never materialising [B, T, V].
//   TRL's fused LM head (trainer/utils.py add_fused_lm_head -> kernels/chunked_logprob.py
//   ChunkedLogProbFunction, the path GRPOTrainer 1.16 uses for every log-prob it computes):
//   the projection runs on [token_chunk, vocab_chunk] tiles in the hidden states' dtype, each
//   tile (as fp32) folds into running online-logsumexp statistics in fp32; the backward pass
//   recomputes each tile and turns it into the logits' gradient in place, accumulating the
//   hidden, weight and bias gradients in fp32. Peak extra memory: one tile plus O(B*T) fp32
//   statistics. Outputs are fp32 whatever the input dtype (as TRL's). It equals the logits
//   path within fp32 rounding (tested to 1e-5 in fp32) and TRL's fused head within 1e-6.
//
// Both give 0 (log-prob and entropy) at masked positions, as TRL's masked labels (-100) do, so
// padding never carries NaN or infinities into the loss. Both are differentiable (autograd)
// with respect to the logits / hidden, weight and bias, and run on the inputs' device.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "core/status.h"

namespace ferry::grpo {

struct TokenLogProbs {
  at::Tensor logps;    // [B, T] log p(target) under softmax(logits / temperature); 0 where masked
  at::Tensor entropy;  // [B, T] entropy of that distribution (nats); 0 where masked
};

// `logits` [B, T, V] floating (position t predicts `token_ids`[b, t]), `token_ids` [B, T]
// integer in [0, V), `mask` [B, T] or undefined (every position real). Outputs in the logits'
// dtype. Errors (kInvalidArgument, naming the input): shapes, dtypes, devices, a token id
// outside [0, V) at a real position, temperature <= 0 or not finite.
Result<TokenLogProbs> TokenLogProbsFromLogits(const at::Tensor& logits, const at::Tensor& token_ids, double temperature,
                                              const at::Tensor& mask = {});

struct ChunkedLogProbOptions {
  // The logits are divided by it (TRL multiplies by 1 / temperature). Default: 1.0
  double temperature = 1.0;
  // Tokens per projection tile (TRL TOKEN_CHUNK_SIZE). Default: 4096
  int64_t token_chunk = 4096;
  // Vocabulary columns per tile (TRL _CHUNKED_LOGPROB_CHUNK_SIZE). Default: 32768
  int64_t vocab_chunk = 32768;
};

// `hidden` [B, T, H] floating: hidden[b, t] is the final hidden state (after the last norm)
// that predicts `token_ids`[b, t] (for a prompt of P tokens, the model's positions P-1 ..
// P+T-2). `weight` [V, H] the LM head (tied embeddings included), `bias` [V] or undefined,
// `token_ids` [B, T] integer, `mask` [B, T] or undefined. The projection runs in hidden's
// dtype (weight and bias are cast to it per tile). Outputs fp32 on hidden's device.
// Errors (kInvalidArgument, naming the input): shapes, dtypes, devices, a token id outside
// [0, V) at a real position, chunk sizes < 1, temperature <= 0 or not finite.
Result<TokenLogProbs> TokenLogProbsFromHidden(const at::Tensor& hidden, const at::Tensor& weight,
                                              const at::Tensor& bias, const at::Tensor& token_ids,
                                              const at::Tensor& mask, const ChunkedLogProbOptions& options);

}  // namespace ferry::grpo
