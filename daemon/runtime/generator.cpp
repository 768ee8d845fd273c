#include "daemon/runtime/generator.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <tuple>

#include "daemon/runtime/cuda_graph.h"
#include "daemon/runtime/torch_util.h"

namespace ferry::runtime {
namespace {

// log_softmax(scores, -1) at `next` ([B]), by log_softmax's own formula, (s - max) - log(sum(exp(s -
// max))), without forming the [B, V] result: LibTorch 1.13's CPU log_softmax over a 151,936-entry
// vocabulary ran on one thread (4.5% of a batch-16 decoding step); these are elementwise ops and
// reductions that use every thread. The sum adds up in another order than log_softmax's (last bits).
// `max`: scores.max(-1, keepdim) where the caller has it.
at::Tensor SelectedLogProbs(const at::Tensor& scores, const at::Tensor& next, at::Tensor max = at::Tensor()) {
  if (!max.defined()) max = std::get<0>(scores.max(-1, /*keepdim=*/true));
  const at::Tensor sum = (scores - max).exp_().sum(-1);
  return (scores.gather(-1, next.view({-1, 1})) - max).view({-1}) - sum.log();
}

struct Sampled {
  at::Tensor tokens;    // long [B], on the logits' device
  at::Tensor logprobs;  // float [B]
};

// One token per row of `logits` [B, V] (see the top of generator.h), on the logits' device and
// without waiting for it: `draws` [B] (float, in [0, 1)) are the rows' uniform draws when sampling.
Sampled Sample(const at::Tensor& logits, const SamplingParams& p, const at::Tensor& draws) {
  at::Tensor lf = logits.to(at::kFloat);
  if (p.temperature == 0) {
    // max(-1)'s indices: argmax's (the first of equal maxima, NaN counted the greatest), but
    // LibTorch 1.13's CPU argmax reduces on one thread, 3x slower over a 151,936-entry vocabulary.
    auto [max, index] = lf.max(-1, /*keepdim=*/true);
    at::Tensor next = index.view({-1});
    return {next, SelectedLogProbs(lf, next, max)};
  }
  at::Tensor scaled = lf / p.temperature;
  at::Tensor filtered = scaled;
  const int64_t V = lf.size(-1);
  const double neg_inf = -std::numeric_limits<double>::infinity();
  if (p.top_k > 0 && p.top_k < V) {
    at::Tensor kth = std::get<0>(at::topk(filtered, p.top_k, -1)).narrow(-1, p.top_k - 1, 1);
    filtered = filtered.masked_fill(filtered < kth, neg_inf);
  }
  if (p.top_p < 1.0) {
    auto [sorted, index] = at::sort(filtered, -1, /*descending=*/false);
    at::Tensor cumulative = at::softmax(sorted, -1).cumsum(-1);
    at::Tensor remove = cumulative <= (1.0 - p.top_p);
    remove.narrow(-1, V - 1, 1).fill_(false);
    filtered = filtered.masked_fill(remove.scatter(-1, index, remove), neg_inf);
  }
  at::Tensor cdf = at::softmax(filtered, -1).cumsum(-1);
  at::Tensor next = at::searchsorted(cdf, draws.view({-1, 1}) * cdf.narrow(-1, V - 1, 1), /*out_int32=*/false,
                                     /*right=*/true)
                        .view({-1})
                        .clamp_max(V - 1);
  return {next, SelectedLogProbs(scaled, next)};
}

Status CheckParams(const SamplingParams& p, bool have_token_bytes) {
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature)) {
    return Status::InvalidArgument("temperature must be >= 0, got " + std::to_string(p.temperature));
  }
  if (!(p.top_p > 0 && p.top_p <= 1))
    return Status::InvalidArgument("top_p must be in (0, 1], got " + std::to_string(p.top_p));
  if (p.top_k < 0) return Status::InvalidArgument("top_k must be >= 0, got " + std::to_string(p.top_k));
  if (p.max_new_tokens < 1) return Status::InvalidArgument("max_new_tokens must be >= 1");
  if (!p.stop_strings.empty() && !have_token_bytes) {
    return Status::InvalidArgument("stop strings need a tokenizer to decode the completions");
  }
  for (const auto& s : p.stop_strings) {
    if (s.empty()) return Status::InvalidArgument("a stop string is empty");
  }
  return Status::OK();
}

}  // namespace

std::string_view FinishName(Completion::Finish f) {
  switch (f) {
    case Completion::Finish::kEos: return "eos";
    case Completion::Finish::kStop: return "stop";
    case Completion::Finish::kLength: return "length";
  }
  return "?";
}

Generator::Generator(const CausalLM& model, GeneratorOptions options) : model_(model), options_(std::move(options)) {
  options_.max_batch = std::max<int64_t>(1, options_.max_batch);
}

Result<std::vector<Completion>> Generator::Generate(const std::vector<std::vector<int32_t>>& prompts, int n,
                                                    const SamplingParams& params, const LoraBinding* lora) const {
  if (n < 1) return Status::InvalidArgument("the number of completions per prompt must be >= 1");
  FERRY_RETURN_IF_ERROR(CheckParams(params, static_cast<bool>(options_.token_bytes)));
  const ModelConfig& cfg = model_.config();
  const bool graphs = options_.cuda_graphs;
  if (graphs && !CudaGraphsAvailable()) {
    return Status::Unsupported(
        "cuda_graphs: this build's LibTorch has no CUDA (build against a CUDA LibTorch: "
        "scripts/build-pytorch.sh)");
  }
  if (graphs && !model_.device().is_cuda()) {
    return Status::Unsupported("cuda_graphs: the model is on " + model_.device().str() + ", not a CUDA device");
  }
  const bool static_shapes = options_.static_shapes || graphs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (prompts[i].empty()) return Status::InvalidArgument("prompt " + std::to_string(i) + " is empty");
    for (int32_t id : prompts[i]) {
      if (id < 0 || id >= cfg.vocab_size) {
        return Status::InvalidArgument("prompt " + std::to_string(i) + ": token id " + std::to_string(id) +
                                       " is outside the vocabulary [0, " + std::to_string(cfg.vocab_size) + ")");
      }
    }
    const int64_t need = static_cast<int64_t>(prompts[i].size()) + params.max_new_tokens;
    if (need > cfg.max_position_embeddings) {
      return Status::InvalidArgument("prompt " + std::to_string(i) + ": " + std::to_string(prompts[i].size()) +
                                     " tokens + max_new_tokens " + std::to_string(params.max_new_tokens) +
                                     " exceed max_position_embeddings " + std::to_string(cfg.max_position_embeddings) +
                                     " of " + cfg.source);
    }
  }
  std::vector<Completion> out(prompts.size() * static_cast<size_t>(n));
  for (size_t i = 0; i < out.size(); ++i) out[i].prompt_index = i / static_cast<size_t>(n);
  std::mt19937_64 rng(params.seed);
  const int64_t per_batch = std::max<int64_t>(1, options_.max_batch / n);
  const at::Device dev = model_.device();
  const int64_t max_new = params.max_new_tokens;
  const int64_t look_every = std::min(
      max_new, options_.finish_check_every > 0 ? options_.finish_check_every : (dev.is_cuda() ? int64_t{16} : 1));
  size_t max_stop = 0;
  for (const auto& stop : params.stop_strings) max_stop = std::max(max_stop, stop.size());

  for (size_t first = 0; first < prompts.size(); first += static_cast<size_t>(per_batch)) {
    const size_t np = std::min(prompts.size() - first, static_cast<size_t>(per_batch));
    FERRY_RETURN_IF_ERROR(GuardTorch("generating", [&]() -> Status {
      at::NoGradGuard no_grad;
      // With graphs, the whole batch runs on a side stream: the capture needs one, and the
      // eager steps before it set cuBLAS and the allocator up on that same stream.
      std::optional<SideStream> side;
      if (graphs) side.emplace(dev);
      int64_t P = 0;
      for (size_t i = 0; i < np; ++i) P = std::max<int64_t>(P, static_cast<int64_t>(prompts[first + i].size()));
      const int64_t B0 = static_cast<int64_t>(np);
      at::Tensor ids = at::zeros({B0, P}, at::kLong);
      at::Tensor mask = at::zeros({B0, P}, at::kBool);
      std::vector<int64_t> next_pos;  // per row: the position of its next token
      for (size_t i = 0; i < np; ++i) {
        const auto& pr = prompts[first + i];
        const int64_t len = static_cast<int64_t>(pr.size());
        auto acc = ids.accessor<int64_t, 2>();
        for (int64_t t = 0; t < len; ++t) acc[static_cast<int64_t>(i)][P - len + t] = pr[static_cast<size_t>(t)];
        mask[static_cast<int64_t>(i)].narrow(0, P - len, len).fill_(true);
        next_pos.push_back(len);
      }
      at::Tensor positions = (mask.to(at::kLong).cumsum(1) - 1).clamp_min(0);
      KvCache cache(cfg, B0, P + max_new, model_.dtype(), dev);
      ForwardArgs a;
      a.input_ids = ids;
      a.positions = positions;
      a.attention_mask = mask;
      a.cache = &cache;
      a.lora = lora;
      FERRY_ASSIGN_OR_RETURN(at::Tensor hidden, model_.Hidden(a));
      at::Tensor logits = model_.Logits(hidden.narrow(1, P - 1, 1).squeeze(1), lora);

      // One row per completion: rows of prompt i are i*n .. i*n+n-1. A finished row keeps riding
      // in the batch (its outputs ignored, row_completion -1) until half the rows are done; then
      // the cache is compacted to the live rows.
      const int64_t rows0 = B0 * n;
      std::vector<int64_t> row_completion, row_pos;
      for (size_t i = 0; i < np; ++i) {
        for (int j = 0; j < n; ++j) {
          row_completion.push_back(static_cast<int64_t>((first + i) * static_cast<size_t>(n) + static_cast<size_t>(j)));
          row_pos.push_back(next_pos[i]);
        }
      }
      if (n > 1) {
        at::Tensor rows = at::arange(B0, at::kLong).repeat_interleave(n).to(dev);
        cache = cache.Select(rows);
        logits = logits.index_select(0, rows);
      }
      // The draws: completion c's step s takes the stream's (c * max_new + s)-th, whatever the
      // batches and looks, moved to the device once. `draw_row`: each row's row of `draws`.
      at::Tensor draws, draw_row;
      if (params.temperature > 0) {
        at::Tensor u = at::empty({rows0, max_new}, at::kDouble);
        double* pu = u.data_ptr<double>();
        for (int64_t i = 0; i < rows0 * max_new; ++i) pu[i] = static_cast<double>(rng() >> 11) * 0x1.0p-53;
        draws = u.to(at::kFloat).t().contiguous().to(dev);  // [max_new, rows]
        draw_row = at::arange(rows0, at::TensorOptions().dtype(at::kLong).device(dev));
      }
      at::Tensor pos = at::tensor(row_pos, at::kLong).view({-1, 1}).to(dev);
      at::Tensor slot;  // static_shapes: the next token's cache slot, on the device
      // The steps since the host's last look, per row, on the device.
      at::Tensor pending_tokens = at::empty({rows0, look_every}, at::TensorOptions().dtype(at::kLong).device(dev));
      at::Tensor pending_logps = at::empty({rows0, look_every}, at::TensorOptions().dtype(at::kFloat).device(dev));
      std::vector<std::string> text(row_completion.size());  // decoded bytes, for stop strings
      int64_t pending = 0;
      // cuda_graphs: the step captured at the current batch size (reset by a compaction, which
      // replaces the cache and positions it was captured on), its input ids and logits (read and
      // written in place by every replay), and the eager steps run since the last compaction.
      std::unique_ptr<CudaGraph> graph;
      at::Tensor graph_ids, graph_logits;
      int64_t eager_steps = 0;
      for (int64_t step = 0; step < max_new; ++step) {
        const Sampled s = Sample(logits, params, draws.defined() ? draws[step].index_select(0, draw_row) : draws);
        const int64_t rows = static_cast<int64_t>(row_completion.size());
        pending_tokens.narrow(0, 0, rows).select(1, pending).copy_(s.tokens);
        pending_logps.narrow(0, 0, rows).select(1, pending).copy_(s.logprobs);
        ++pending;
        const bool last = step + 1 == max_new;
        if (pending == look_every || last) {
          // The host's look: the pending tokens in order, each row to its first EOS or stop.
          const at::Tensor tok_cpu = pending_tokens.narrow(0, 0, rows).narrow(1, 0, pending).to(at::kCPU).contiguous();
          const at::Tensor logp_cpu = pending_logps.narrow(0, 0, rows).narrow(1, 0, pending).to(at::kCPU).contiguous();
          const auto toks = tok_cpu.accessor<int64_t, 2>();
          const auto logps = logp_cpu.accessor<float, 2>();
          size_t live = 0;
          for (size_t r = 0; r < row_completion.size(); ++r) {
            if (row_completion[r] < 0) continue;
            Completion& c = out[static_cast<size_t>(row_completion[r])];
            bool done = false;
            for (int64_t j = 0; j < pending && !done; ++j) {
              const int64_t tok = toks[static_cast<int64_t>(r)][j];
              c.token_ids.push_back(static_cast<int32_t>(tok));
              c.logprobs.push_back(logps[static_cast<int64_t>(r)][j]);
              if (std::find(params.eos_token_ids.begin(), params.eos_token_ids.end(), tok) !=
                  params.eos_token_ids.end()) {
                c.finish = Completion::Finish::kEos;
                done = true;
              } else if (max_stop > 0) {
                const size_t before = text[r].size();
                text[r] += options_.token_bytes(static_cast<int32_t>(tok));
                const size_t from = before >= max_stop ? before - max_stop + 1 : 0;
                for (const auto& stop : params.stop_strings) {
                  if (text[r].find(stop, from) != std::string::npos) {
                    c.finish = Completion::Finish::kStop;
                    done = true;
                    break;
                  }
                }
              }
            }
            if (done) {
              row_completion[r] = -1;
            } else {
              ++live;
            }
          }
          pending = 0;
          if (live == 0 || last) break;
          if (live * 2 <= row_completion.size()) {
            std::vector<int64_t> keep, rc;
            std::vector<std::string> tx;
            for (size_t r = 0; r < row_completion.size(); ++r) {
              if (row_completion[r] < 0) continue;
              keep.push_back(static_cast<int64_t>(r));
              rc.push_back(row_completion[r]);
              tx.push_back(std::move(text[r]));
            }
            const at::Tensor k = at::tensor(keep, at::kLong).to(dev);
            graph.reset();
            eager_steps = 0;
            cache = cache.Select(k);
            pos = pos.index_select(0, k);
            if (draw_row.defined()) draw_row = draw_row.index_select(0, k);
            row_completion = std::move(rc);
            text = std::move(tx);
            a.input_ids = s.tokens.index_select(0, k).view({-1, 1});
          } else {
            a.input_ids = s.tokens.view({-1, 1});
          }
        } else {
          a.input_ids = s.tokens.view({-1, 1});
        }
        a.positions = pos;
        a.attention_mask = at::Tensor();
        a.ids_in_vocab = true;  // sampled from the model's own vocabulary
        if (static_shapes) {
          if (!slot.defined()) slot = at::full({1}, cache.length(), pos.options());
          a.cache_slots = slot;
        }
        if (graphs && !graph && eager_steps > 0) {
          // Capture this step (nothing runs), then replay it below. The capture ran the host's
          // side of the forward, which counted the step's slot as filled: it is not, yet.
          graph_ids = a.input_ids.clone();
          a.input_ids = graph_ids;
          const int64_t filled = cache.length();
          FERRY_ASSIGN_OR_RETURN(graph, CudaGraph::Capture(dev, [&]() -> Status {
                                   FERRY_ASSIGN_OR_RETURN(at::Tensor h, model_.Hidden(a));
                                   graph_logits = model_.Logits(h.squeeze(1), lora);
                                   pos.add_(1);
                                   slot.add_(1);
                                   return Status::OK();
                                 }));
          cache.set_length(filled);
        } else if (graph) {
          graph_ids.copy_(a.input_ids);
        }
        if (graph) {
          graph->Replay();
          cache.set_length(cache.length() + 1);  // the replay filled the step's slot
          logits = graph_logits;
          continue;
        }
        FERRY_ASSIGN_OR_RETURN(hidden, model_.Hidden(a));
        logits = model_.Logits(hidden.squeeze(1), lora);
        // In place, after the forward that read them (in stream order on a device).
        pos.add_(1);
        if (slot.defined()) slot.add_(1);
        ++eager_steps;
      }
      return Status::OK();
    }));
  }
  return out;
}

}  // namespace ferry::runtime
