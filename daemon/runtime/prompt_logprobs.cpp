#include "daemon/runtime/prompt_logprobs.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>

#include "daemon/runtime/torch_util.h"

namespace ferry::runtime {
namespace {

std::string SequenceName(size_t i) { return "sequence " + std::to_string(i); }

Status CheckSequences(const ModelConfig& config, const std::vector<std::vector<int64_t>>& sequences) {
  if (sequences.empty()) return Status::InvalidArgument("prompt log-probabilities: no sequences");
  for (size_t i = 0; i < sequences.size(); ++i) {
    const auto& s = sequences[i];
    if (s.size() < 2) {
      return Status::InvalidArgument(SequenceName(i) + " has " + std::to_string(s.size()) +
                                     " token(s); prompt log-probabilities need at least 2");
    }
    if (static_cast<int64_t>(s.size()) > config.max_position_embeddings) {
      return Status::InvalidArgument(SequenceName(i) + " has " + std::to_string(s.size()) +
                                     " tokens, more than max_position_embeddings " +
                                     std::to_string(config.max_position_embeddings) + " of " + config.source);
    }
    for (size_t t = 0; t < s.size(); ++t) {
      if (s[t] < 0 || s[t] >= config.vocab_size) {
        return Status::InvalidArgument(SequenceName(i) + ", token " + std::to_string(t) + ": id " +
                                       std::to_string(s[t]) + " is outside the vocabulary [0, " +
                                       std::to_string(config.vocab_size) + ")");
      }
    }
  }
  return Status::OK();
}

// One forward over `rows` (indices into `sequences`), right-padded; writes out[row].
Status RunBatch(const CausalLM& model, const LoraBinding* lora, const std::vector<std::vector<int64_t>>& sequences,
                const std::vector<size_t>& rows, int64_t logits_rows, std::vector<std::vector<float>>& out) {
  const int64_t B = static_cast<int64_t>(rows.size());
  int64_t T = 0;
  for (size_t r : rows) T = std::max<int64_t>(T, static_cast<int64_t>(sequences[r].size()));
  at::Tensor ids = at::zeros({B, T}, at::kLong);
  // Flat indices (b * T + t) of the positions whose next token is scored, and that token.
  std::vector<int64_t> keep, targets;
  {
    auto acc = ids.accessor<int64_t, 2>();
    for (int64_t b = 0; b < B; ++b) {
      const auto& s = sequences[rows[static_cast<size_t>(b)]];
      for (size_t t = 0; t < s.size(); ++t) acc[b][static_cast<int64_t>(t)] = s[t];
      for (size_t t = 0; t + 1 < s.size(); ++t) {
        keep.push_back(b * T + static_cast<int64_t>(t));
        targets.push_back(s[t + 1]);
      }
    }
  }
  ForwardArgs a;
  a.input_ids = ids;
  a.positions = at::arange(T, at::kLong).view({1, T}).expand({B, T}).contiguous();
  a.lora = lora;
  FERRY_ASSIGN_OR_RETURN(at::Tensor hidden, model.Hidden(a));
  return GuardTorch("prompt log-probabilities", [&]() -> Status {
    const at::Device dev = model.device();
    const int64_t n = static_cast<int64_t>(keep.size());
    const at::Tensor flat = hidden.reshape({B * T, hidden.size(-1)});
    const at::Tensor keep_t = at::tensor(keep, at::kLong).to(dev);
    const at::Tensor target_t = at::tensor(targets, at::kLong).to(dev);
    std::vector<float> values(static_cast<size_t>(n));
    for (int64_t lo = 0; lo < n; lo += logits_rows) {
      const int64_t len = std::min(logits_rows, n - lo);
      const at::Tensor h = flat.index_select(0, keep_t.narrow(0, lo, len));
      const at::Tensor logp = at::log_softmax(model.Logits(h, lora).to(at::kFloat), -1);
      const at::Tensor got = logp.gather(1, target_t.narrow(0, lo, len).unsqueeze(1)).squeeze(1).cpu().contiguous();
      std::memcpy(values.data() + lo, got.data_ptr<float>(), static_cast<size_t>(len) * sizeof(float));
    }
    size_t at_value = 0;
    for (size_t r : rows) {
      const size_t m = sequences[r].size() - 1;
      out[r].assign(values.begin() + static_cast<std::ptrdiff_t>(at_value),
                    values.begin() + static_cast<std::ptrdiff_t>(at_value + m));
      at_value += m;
    }
    return Status::OK();
  });
}

}  // namespace

Result<std::vector<std::vector<float>>> PromptLogProbs(const CausalLM& model, const LoraBinding* lora,
                                                       const std::vector<std::vector<int64_t>>& sequences,
                                                       const PromptLogProbsOptions& options) {
  if (options.max_batch_tokens < 1 || options.logits_rows < 1) {
    return Status::InvalidArgument("prompt log-probabilities: max_batch_tokens and logits_rows must be >= 1");
  }
  FERRY_RETURN_IF_ERROR(CheckSequences(model.config(), sequences));
  at::NoGradGuard no_grad;
  // Longest first: each batch's padding is at most the spread of lengths within it.
  std::vector<size_t> order(sequences.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return sequences[x].size() > sequences[y].size(); });
  std::vector<std::vector<float>> out(sequences.size());
  std::vector<size_t> batch;
  for (size_t i = 0; i < order.size();) {
    const int64_t T = static_cast<int64_t>(sequences[order[i]].size());  // the batch's longest
    const int64_t per_batch = std::max<int64_t>(1, options.max_batch_tokens / T);
    batch.clear();
    for (; i < order.size() && static_cast<int64_t>(batch.size()) < per_batch; ++i) batch.push_back(order[i]);
    FERRY_RETURN_IF_ERROR(RunBatch(model, lora, sequences, batch, options.logits_rows, out));
  }
  return out;
}

}  // namespace ferry::runtime
