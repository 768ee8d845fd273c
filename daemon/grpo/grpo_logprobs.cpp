#include "daemon/grpo/grpo_logprobs.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "daemon/grpo/grpo_internal.h"
#include "daemon/runtime/torch_util.h"

namespace ferry::grpo {
namespace {

using internal::CheckDefined;
using internal::CheckDevice;
using internal::CheckFloating;
using internal::CheckSizes;
using internal::LongMask;
using internal::SizesString;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// TRL entropy_from_logits: rows per log_softmax call.
constexpr int64_t kEntropyRowChunk = 128;

Status CheckTemperature(std::string_view what, double temperature) {
  if (std::isfinite(temperature) && temperature > 0) return Status::OK();
  return Status::InvalidArgument(std::string(what) + ": temperature must be positive and finite, got " +
                                 std::to_string(temperature));
}

// token_ids [B, T] integer, mask [B, T] or undefined, on `device`; every real position's id in
// [0, vocab).
Status CheckTokens(std::string_view what, const at::Tensor& token_ids, const at::Tensor& mask, int64_t b, int64_t t,
                   int64_t vocab, const at::Device& device) {
  FERRY_RETURN_IF_ERROR(CheckDefined(what, token_ids, "token_ids"));
  FERRY_RETURN_IF_ERROR(CheckSizes(what, token_ids, "token_ids", {b, t}));
  if (!at::isIntegralType(token_ids.scalar_type(), /*includeBool=*/false)) {
    return Status::InvalidArgument(std::string(what) + ": token_ids must be an integer tensor, got " +
                                   std::string(c10::toString(token_ids.scalar_type())));
  }
  FERRY_RETURN_IF_ERROR(CheckDevice(what, token_ids, "token_ids", device));
  if (mask.defined()) {
    FERRY_RETURN_IF_ERROR(CheckSizes(what, mask, "mask", {b, t}));
    FERRY_RETURN_IF_ERROR(CheckDevice(what, mask, "mask", device));
  }
  return runtime::GuardTorch(what, [&]() -> Status {
    at::Tensor bad = at::logical_or(token_ids < 0, token_ids >= vocab);
    if (mask.defined()) bad = at::logical_and(bad, at::ne(mask, 0));
    if (!bad.any().item<bool>()) return Status::OK();
    const at::Tensor first = at::nonzero(bad)[0].cpu();
    const int64_t row = first[0].item<int64_t>();
    const int64_t col = first[1].item<int64_t>();
    return Status::InvalidArgument(std::string(what) + ": token_ids[" + std::to_string(row) + ", " +
                                   std::to_string(col) + "] = " + std::to_string(token_ids[row][col].item<int64_t>()) +
                                   " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  });
}

// Targets as TRL hands them to the kernels: masked positions (label -100) become 0.
at::Tensor Targets(const at::Tensor& token_ids, const at::Tensor& long_mask) {
  at::Tensor ids = token_ids.to(at::kLong);
  return long_mask.defined() ? ids.masked_fill(long_mask == 0, 0) : ids;
}

// TRL kernels/chunked_logprob.py `_forward_tile` (no softcap, logit_scale 1): folds one tile of
// logits into the running online-logsumexp statistics.
void ForwardTile(const at::Tensor& tile, const at::Tensor& targets, at::Tensor running_max, at::Tensor sum_exp,
                 at::Tensor x_sum_exp, at::Tensor target_logit, int64_t vocab_start, int64_t n_cols, double inv_t) {
  const at::Tensor z = tile.to(at::kFloat) * inv_t;
  const at::Tensor local = targets - vocab_start;
  const at::Tensor new_m = at::maximum(running_max, z.amax(-1));
  const at::Tensor rescale = at::exp(running_max - new_m);
  const at::Tensor e = at::exp(z - new_m.unsqueeze(-1));
  sum_exp.mul_(rescale).add_(e.sum(-1));
  x_sum_exp.mul_(rescale).add_((e * z).sum(-1));
  running_max.copy_(new_m);
  const at::Tensor in_tile = at::logical_and(local >= 0, local < n_cols);
  const at::Tensor target_z = z.gather(-1, local.clamp(0, n_cols - 1).unsqueeze(-1)).squeeze(-1);
  target_logit.copy_(at::where(in_tile, target_z, target_logit));
}

// TRL `_backward_tile`: overwrites `tile` (the recomputed logits) with the gradient of the
// loss with respect to them.
void BackwardTile(at::Tensor tile, const at::Tensor& targets, const at::Tensor& log_z, const at::Tensor& entropy,
                  const at::Tensor& grad_logprobs, const at::Tensor& grad_entropy, int64_t vocab_start, int64_t n_cols,
                  double inv_t) {
  const at::Tensor z = tile.to(at::kFloat) * inv_t;
  const at::Tensor log_p = z - log_z.unsqueeze(-1);
  const at::Tensor p = at::exp(log_p);
  at::Tensor grad = at::zeros_like(z);
  if (grad_logprobs.defined()) {
    const at::Tensor is_target =
        at::arange(vocab_start, vocab_start + n_cols, targets.options()) == targets.unsqueeze(-1);
    grad += grad_logprobs.unsqueeze(-1) * (is_target.to(at::kFloat) - p);
  }
  if (grad_entropy.defined()) grad -= grad_entropy.unsqueeze(-1) * p * (log_p + entropy.unsqueeze(-1));
  grad = grad * inv_t;
  tile.copy_(grad);
}

// TRL ChunkedLogProbFunction with the outputs GRPOTrainer asks for (log_probs, entropy).
// Inputs: hidden [N, H], weight [V, H], bias [V] or [0] for none (LibTorch 1.13's
// Function::apply cannot take an undefined tensor; V >= 1 keeps the two apart), targets [N]
// int64 in [0, V).
class ChunkedLogProbFunction : public torch::autograd::Function<ChunkedLogProbFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor& bias, const at::Tensor& targets, double inv_t, int64_t token_chunk,
                               int64_t vocab_chunk) {
    ctx->set_materialize_grads(false);
    const at::ScalarType compute = hidden.scalar_type();
    const int64_t n = hidden.size(0);
    const int64_t vocab = weight.size(0);
    const bool has_bias = bias.numel() > 0;
    const at::TensorOptions f32 = hidden.options().dtype(at::kFloat);
    at::Tensor running_max = at::full({n}, -std::numeric_limits<double>::infinity(), f32);
    at::Tensor sum_exp = at::zeros({n}, f32);
    at::Tensor x_sum_exp = at::zeros({n}, f32);
    at::Tensor target_logit = at::zeros({n}, f32);
    for (int64_t ts = 0; ts < n; ts += token_chunk) {
      const int64_t te = std::min(ts + token_chunk, n);
      const at::Tensor hidden_chunk = hidden.slice(0, ts, te).to(compute);
      for (int64_t vs = 0; vs < vocab; vs += vocab_chunk) {
        const int64_t ve = std::min(vs + vocab_chunk, vocab);
        at::Tensor tile = at::mm(hidden_chunk, weight.slice(0, vs, ve).to(compute).t());
        if (has_bias) tile.add_(bias.slice(0, vs, ve).to(compute));
        ForwardTile(tile, targets.slice(0, ts, te), running_max.slice(0, ts, te), sum_exp.slice(0, ts, te),
                    x_sum_exp.slice(0, ts, te), target_logit.slice(0, ts, te), vs, ve - vs, inv_t);
      }
    }
    const at::Tensor log_z = running_max + at::log(sum_exp);
    at::Tensor logprobs = target_logit - log_z;
    at::Tensor entropy = log_z - x_sum_exp / sum_exp;
    ctx->save_for_backward({hidden, weight, bias, targets, log_z, entropy});
    ctx->saved_data["inv_t"] = inv_t;
    ctx->saved_data["token_chunk"] = token_chunk;
    ctx->saved_data["vocab_chunk"] = vocab_chunk;
    return {logprobs, entropy};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& hidden = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& bias = saved[2];
    const at::Tensor& targets = saved[3];
    const at::Tensor& log_z = saved[4];
    const at::Tensor& entropy = saved[5];
    const double inv_t = ctx->saved_data["inv_t"].toDouble();
    const int64_t token_chunk = ctx->saved_data["token_chunk"].toInt();
    const int64_t vocab_chunk = ctx->saved_data["vocab_chunk"].toInt();
    const at::ScalarType compute = hidden.scalar_type();
    const int64_t n = hidden.size(0);
    const int64_t vocab = weight.size(0);
    const bool has_bias = bias.numel() > 0;
    const at::TensorOptions f32 = hidden.options().dtype(at::kFloat);
    const at::Tensor grad_logprobs = grads[0].defined() ? grads[0].to(at::kFloat).contiguous() : at::Tensor();
    const at::Tensor grad_entropy = grads[1].defined() ? grads[1].to(at::kFloat).contiguous() : at::Tensor();
    at::Tensor grad_hidden = ctx->needs_input_grad(0) ? at::zeros(hidden.sizes(), f32) : at::Tensor();
    at::Tensor grad_weight = ctx->needs_input_grad(1) ? at::zeros(weight.sizes(), f32) : at::Tensor();
    at::Tensor grad_bias = has_bias && ctx->needs_input_grad(2) ? at::zeros(bias.sizes(), f32) : at::Tensor();
    for (int64_t ts = 0; ts < n; ts += token_chunk) {
      const int64_t te = std::min(ts + token_chunk, n);
      const at::Tensor hidden_chunk = hidden.slice(0, ts, te).to(compute);
      const at::Tensor glp = grad_logprobs.defined() ? grad_logprobs.slice(0, ts, te) : at::Tensor();
      const at::Tensor gent = grad_entropy.defined() ? grad_entropy.slice(0, ts, te) : at::Tensor();
      for (int64_t vs = 0; vs < vocab; vs += vocab_chunk) {
        const int64_t ve = std::min(vs + vocab_chunk, vocab);
        const at::Tensor w_chunk = weight.slice(0, vs, ve).to(compute);
        at::Tensor tile = at::mm(hidden_chunk, w_chunk.t());
        if (has_bias) tile.add_(bias.slice(0, vs, ve).to(compute));
        BackwardTile(tile, targets.slice(0, ts, te), log_z.slice(0, ts, te), entropy.slice(0, ts, te), glp, gent, vs,
                     ve - vs, inv_t);
        if (grad_hidden.defined()) {
          grad_hidden.slice(0, ts, te).addmm_(tile.to(at::kFloat), w_chunk.to(at::kFloat));
        }
        if (grad_weight.defined()) {
          grad_weight.slice(0, vs, ve).addmm_(tile.t().to(at::kFloat), hidden_chunk.to(at::kFloat));
        }
        if (grad_bias.defined()) grad_bias.slice(0, vs, ve).add_(tile.sum(0, /*keepdim=*/false, at::kFloat));
      }
    }
    return {grad_hidden.defined() ? grad_hidden.to(hidden.scalar_type()) : at::Tensor(),
            grad_weight.defined() ? grad_weight.to(weight.scalar_type()) : at::Tensor(),
            grad_bias.defined() ? grad_bias.to(bias.scalar_type()) : at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

Result<TokenLogProbs> TokenLogProbsFromLogits(const at::Tensor& logits, const at::Tensor& token_ids, double temperature,
                                              const at::Tensor& mask) {
  constexpr std::string_view kWhat = "token log-probs from logits";
  FERRY_RETURN_IF_ERROR(CheckDefined(kWhat, logits, "logits"));
  if (logits.dim() != 3 || logits.size(2) == 0) {
    return Status::InvalidArgument(std::string(kWhat) + ": logits must be [B, T, V] with V > 0, got " +
                                   SizesString(logits.sizes()));
  }
  FERRY_RETURN_IF_ERROR(CheckFloating(kWhat, logits, "logits"));
  FERRY_RETURN_IF_ERROR(CheckTemperature(kWhat, temperature));
  const int64_t b = logits.size(0);
  const int64_t t = logits.size(1);
  const int64_t vocab = logits.size(2);
  FERRY_RETURN_IF_ERROR(CheckTokens(kWhat, token_ids, mask, b, t, vocab, logits.device()));
  return runtime::GuardTorch(kWhat, [&]() -> Result<TokenLogProbs> {
    // trainer/utils.py selective_log_softmax_and_entropy, then selective_log_softmax and
    // entropy_from_logits (the paths taken without a Triton-capable device).
    const at::Tensor long_mask = mask.defined() ? LongMask(mask) : at::Tensor();
    const at::Tensor x = temperature != 1.0 ? logits / temperature : logits;
    const at::Tensor index = Targets(token_ids, long_mask).unsqueeze(-1);
    at::Tensor logps;
    if (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble) {
      logps = at::gather(x, -1, index) - at::logsumexp(x, {-1}).unsqueeze(-1);
    } else {  // 16-bit: TRL avoids logsumexp there
      std::vector<at::Tensor> rows;
      rows.reserve(static_cast<size_t>(b));
      for (int64_t i = 0; i < b; ++i) rows.push_back(at::log_softmax(x[i], -1).gather(-1, index[i]));
      logps = at::stack(rows);
    }
    logps = logps.squeeze(-1);
    std::vector<at::Tensor> parts;
    for (const at::Tensor& chunk : x.reshape({-1, vocab}).split(kEntropyRowChunk, 0)) {
      const at::Tensor lp = at::log_softmax(chunk, -1);
      parts.push_back(-(at::exp(lp) * lp).sum(-1));
    }
    at::Tensor entropy = at::cat(parts, 0).reshape({b, t});
    if (long_mask.defined()) {
      logps = logps.masked_fill(long_mask == 0, 0.0);
      entropy = entropy.masked_fill(long_mask == 0, 0.0);
    }
    return TokenLogProbs{std::move(logps), std::move(entropy)};
  });
}

Result<TokenLogProbs> TokenLogProbsFromHidden(const at::Tensor& hidden, const at::Tensor& weight,
                                              const at::Tensor& bias, const at::Tensor& token_ids,
                                              const at::Tensor& mask, const ChunkedLogProbOptions& options) {
  constexpr std::string_view kWhat = "token log-probs from hidden states";
  FERRY_RETURN_IF_ERROR(CheckDefined(kWhat, hidden, "hidden"));
  FERRY_RETURN_IF_ERROR(CheckDefined(kWhat, weight, "weight"));
  if (hidden.dim() != 3) {
    return Status::InvalidArgument(std::string(kWhat) + ": hidden must be [B, T, H], got " +
                                   SizesString(hidden.sizes()));
  }
  FERRY_RETURN_IF_ERROR(CheckFloating(kWhat, hidden, "hidden"));
  FERRY_RETURN_IF_ERROR(CheckFloating(kWhat, weight, "weight"));
  const int64_t b = hidden.size(0);
  const int64_t t = hidden.size(1);
  const int64_t h = hidden.size(2);
  if (weight.dim() != 2 || weight.size(1) != h || weight.size(0) == 0) {
    return Status::InvalidArgument(std::string(kWhat) + ": weight must be [V, " + std::to_string(h) +
                                   "] with V > 0, got " + SizesString(weight.sizes()));
  }
  const int64_t vocab = weight.size(0);
  const at::Device device = hidden.device();
  FERRY_RETURN_IF_ERROR(CheckDevice(kWhat, weight, "weight", device));
  if (bias.defined()) {
    FERRY_RETURN_IF_ERROR(CheckFloating(kWhat, bias, "bias"));
    FERRY_RETURN_IF_ERROR(CheckSizes(kWhat, bias, "bias", {vocab}));
    FERRY_RETURN_IF_ERROR(CheckDevice(kWhat, bias, "bias", device));
  }
  FERRY_RETURN_IF_ERROR(CheckTemperature(kWhat, options.temperature));
  if (options.token_chunk < 1 || options.vocab_chunk < 1) {
    return Status::InvalidArgument(std::string(kWhat) + ": token_chunk and vocab_chunk must be at least 1, got " +
                                   std::to_string(options.token_chunk) + " and " + std::to_string(options.vocab_chunk));
  }
  FERRY_RETURN_IF_ERROR(CheckTokens(kWhat, token_ids, mask, b, t, vocab, device));
  return runtime::GuardTorch(kWhat, [&]() -> Result<TokenLogProbs> {
    // trainer/utils.py add_fused_lm_head's forward (the non-compact path) around
    // kernels/chunked_logprob.py ChunkedLogProbFunction.
    const at::Tensor long_mask = mask.defined() ? LongMask(mask) : at::Tensor();
    const at::Tensor targets = Targets(token_ids, long_mask).reshape({-1});
    const at::Tensor bias_or_none = bias.defined() ? bias : at::empty({0}, weight.options());
    variable_list out =
        ChunkedLogProbFunction::apply(hidden.reshape({-1, h}), weight, bias_or_none, targets, 1.0 / options.temperature,
                                      options.token_chunk, options.vocab_chunk);
    at::Tensor logps = out[0].view({b, t});
    at::Tensor entropy = out[1].view({b, t});
    if (long_mask.defined()) {
      logps = logps.masked_fill(long_mask == 0, 0.0);
      entropy = entropy.masked_fill(long_mask == 0, 0.0);
    }
    return TokenLogProbs{std::move(logps), std::move(entropy)};
  });
}

}  // namespace ferry::grpo
