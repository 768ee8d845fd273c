// Generation batches: prompts -> completions from the co-located generator -> rewards,
// advantages, old/reference log-probabilities and the mismatch correction.
#include <algorithm>
#include <chrono>
#include <map>
#include <numeric>
#include <random>

#include "daemon/grpo/data_parallel.h"
#include "daemon/grpo/grpo_logprobs.h"
#include "daemon/grpo/trainer_internal.h"
#include "daemon/runtime/torch_util.h"
#include "daemon/text/chat_format.h"

namespace ferry::grpo {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

struct PreparedPrompt {
  std::string text;
  std::vector<int32_t> ids;
};

Result<PreparedPrompt> Prepare(const Trainer::State& s, const run::Example& ex) {
  PreparedPrompt p;
  const std::string where = s.dataset->source() + ":" + std::to_string(ex.line);
  if (ex.conversational()) {
    if (!s.chat_format) {
      return Status::InvalidArgument(where + ": a conversational prompt, but chat_template is \"none\"");
    }
    std::vector<text::ChatMessage> messages;
    for (const auto& m : ex.messages) messages.push_back({m.role, m.content});
    auto text = text::ApplyChatTemplate(*s.chat_format, messages, /*add_generation_prompt=*/true);
    if (!text.ok()) return text.status().WithContext(where);
    p.text = std::move(*text);
    // The template holds its special tokens (TRL: apply_chat_template(tokenize=True)).
    auto ids = s.tokenizer->Encode(p.text, {.add_special_tokens = false});
    if (!ids.ok()) return ids.status().WithContext(where);
    p.ids = std::move(*ids);
  } else {
    p.text = ex.prompt;
    // TRL: processing_class(text=prompts), i.e. with the post-processor's special tokens.
    auto ids = s.tokenizer->Encode(p.text, {.add_special_tokens = true});
    if (!ids.ok()) return ids.status().WithContext(where);
    p.ids = std::move(*ids);
  }
  if (s.config.max_prompt_length && static_cast<int64_t>(p.ids.size()) > *s.config.max_prompt_length) {
    // Keep the end of the prompt (the question, the generation prompt), as left truncation does.
    p.ids.erase(p.ids.begin(), p.ids.end() - *s.config.max_prompt_length);
  }
  if (p.ids.empty()) return Status::InvalidArgument(where + ": the prompt tokenizes to nothing");
  return p;
}

// Appends `value` under `name` to the metrics being averaged.
void Add(Metrics& m, const std::string& name, double value) { m[name] = value; }

}  // namespace

uint64_t SamplingSeed(int64_t run_seed, int64_t step, int rank) {
  const uint64_t seed = SplitMix64(SplitMix64(static_cast<uint64_t>(run_seed)) ^ static_cast<uint64_t>(step));
  return rank == 0 ? seed : SplitMix64(seed ^ SplitMix64(static_cast<uint64_t>(rank)));
}

namespace {

// For each row of `pid` / `pmask` ([n, p], on the CPU) the index of its distinct prompt (the
// ids at real positions and where the padding is), and the first row of each distinct prompt.
void GroupRowsByPrompt(const at::Tensor& pid, const at::Tensor& pmask, std::vector<int64_t>& group_of_row,
                       std::vector<int64_t>& first_row) {
  const at::Tensor ids = pid.to(at::kLong).contiguous();
  const at::Tensor real = pmask.to(at::kLong).contiguous();
  const int64_t n = ids.size(0), p = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* ok = real.data_ptr<int64_t>();
  std::map<std::vector<int64_t>, int64_t> seen;
  group_of_row.resize(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    std::vector<int64_t> key(static_cast<size_t>(p));
    for (int64_t t = 0; t < p; ++t) key[static_cast<size_t>(t)] = ok[r * p + t] != 0 ? id[r * p + t] : -1;
    auto [it, added] = seen.emplace(std::move(key), static_cast<int64_t>(first_row.size()));
    if (added) first_row.push_back(r);
    group_of_row[static_cast<size_t>(r)] = it->second;
  }
}

}  // namespace

Result<MicroBatchLogps> MicroBatchLogProbs(const Trainer::State& s, const Rollout& r, const std::vector<int64_t>& rows,
                                           bool lora, bool training) {
  const runtime::CausalLM& m = *s.model;
  return runtime::GuardTorch("trainer forward", [&]() -> Result<MicroBatchLogps> {
    MicroBatchLogps out;
    out.rows = at::tensor(rows, at::kLong);
    at::Tensor pid = r.prompt_ids.index_select(0, out.rows);
    at::Tensor pmask = r.prompt_mask.index_select(0, out.rows);
    at::Tensor cid = r.completion_ids.index_select(0, out.rows);
    out.mask = r.completion_mask.index_select(0, out.rows);
    // Drop prompt columns that are padding in every row of this micro-batch.
    const int64_t P = pid.size(1);
    const int64_t first = P - pmask.sum(1).max().item<int64_t>();
    if (first > 0) {
      pid = pid.narrow(1, first, P - first);
      pmask = pmask.narrow(1, first, P - first);
    }
    const int64_t n = pid.size(0), p = pid.size(1), C = cid.size(1);
    // The forward and the log-probs run on the model's device; what they return comes back to
    // the CPU, where the rollout's tensors and the loss live (autograd carries the gradient back).
    const at::Device& dev = m.device();
    at::Tensor attn = at::cat({pmask, out.mask}, 1).to(dev);
    at::Tensor positions = (attn.cumsum(1) - 1).clamp_min(0);
    const at::Tensor mask = out.mask.to(dev);
    runtime::ForwardArgs a;
    a.lora = lora ? &s.adapter->binding() : nullptr;
    a.training = training;
    a.checkpoint_layers = training && s.config.gradient_checkpointing;

    std::vector<int64_t> group_of_row, first_row;
    const bool dropout = training && lora && s.config.lora.lora_dropout > 0;
    if (s.share_prompt_forward && !a.checkpoint_layers && !dropout)
      GroupRowsByPrompt(pid, pmask, group_of_row, first_row);
    at::Tensor h;  // [n, C, hidden]: position p - 1 + t predicts completion token t
    if (!first_row.empty() && static_cast<int64_t>(first_row.size()) < n) {
      // Each distinct prompt once, into a cache with room for the completions ...
      const at::Tensor firsts = at::tensor(first_row, at::kLong).to(dev);
      const at::Tensor group = at::tensor(group_of_row, at::kLong).to(dev);
      out.distinct_prompts = firsts.size(0);
      runtime::KvCache prompts(m.config(), firsts.size(0), p + C - 1, m.dtype(), dev);
      runtime::ForwardArgs pa = a;
      pa.input_ids = pid.to(dev).index_select(0, firsts);
      pa.positions = positions.narrow(1, 0, p).index_select(0, firsts);
      pa.attention_mask = attn.narrow(1, 0, p).index_select(0, firsts).to(at::kBool);
      pa.cache = &prompts;
      FERRY_ASSIGN_OR_RETURN(at::Tensor hp, m.Hidden(pa));
      h = hp.select(1, p - 1).index_select(0, group).unsqueeze(1);
      if (C > 1) {
        // ... then every row's completion (but its last token, which predicts nothing) against
        // its prompt's keys and values.
        runtime::KvCache per_row = prompts.Select(group);
        runtime::ForwardArgs ca = a;
        ca.input_ids = cid.narrow(1, 0, C - 1).to(dev);
        ca.positions = positions.narrow(1, p, C - 1);
        ca.attention_mask = attn.narrow(1, p, C - 1).to(at::kBool);
        ca.cache = &per_row;
        FERRY_ASSIGN_OR_RETURN(at::Tensor hc, m.Hidden(ca));
        h = at::cat({h, hc}, 1);
      }
    } else {
      a.input_ids = at::cat({pid, cid}, 1).to(dev);
      a.positions = positions;
      a.attention_mask = attn.to(at::kBool);
      FERRY_ASSIGN_OR_RETURN(at::Tensor hidden, m.Hidden(a));
      h = hidden.narrow(1, p - 1, C);
    }
    cid = cid.to(dev);
    const runtime::LoraModule* head_lora = lora ? s.adapter->binding().lm_head : nullptr;
    Result<TokenLogProbs> lp = Status::Internal("unset");
    if (head_lora || m.lm_head().quant) {
      lp = TokenLogProbsFromLogits(m.Logits(h, a.lora, training), cid, s.config.temperature, mask);
    } else {
      ChunkedLogProbOptions co;
      co.temperature = s.config.temperature;
      lp = TokenLogProbsFromHidden(h, m.lm_head().weight, at::Tensor(), cid, mask, co);
    }
    if (!lp.ok()) return lp.status();
    out.logps = lp->logps.to(at::kCPU);
    out.entropy = lp->entropy.defined() ? lp->entropy.to(at::kCPU) : lp->entropy;
    return out;
  });
}

namespace {

// Draws the next generation batch's prompts; `seed_step` picks the sampling seed.
Result<DrawnPrompts> DrawPrompts(Trainer::State& s, int64_t seed_step) {
  const run::RunConfig& c = s.config;
  DrawnPrompts d;
  // Every rank draws the whole generation's prompts (the position stays global) and keeps its
  // share of whole groups.
  d.examples = s.sampler->Next(static_cast<size_t>(c.prompts_per_generation()));
  if (s.world > 1) {
    const size_t per_rank = d.examples.size() / static_cast<size_t>(s.world);
    const auto first = d.examples.begin() + static_cast<long>(per_rank * static_cast<size_t>(s.rank));
    d.examples = std::vector<const run::Example*>(first, first + static_cast<long>(per_rank));
  }
  for (const run::Example* ex : d.examples) {
    FERRY_ASSIGN_OR_RETURN(PreparedPrompt p, Prepare(s, *ex));
    d.texts.push_back(std::move(p.text));
    d.ids.push_back(std::move(p.ids));
  }
  d.sampling.temperature = c.temperature;
  d.sampling.top_p = c.top_p;
  d.sampling.top_k = c.top_k;
  d.sampling.max_new_tokens = c.max_completion_length;
  d.sampling.eos_token_ids = s.eos_ids;
  d.sampling.seed = SamplingSeed(c.seed, seed_step, s.rank);
  return d;
}

// Starts sampling the next generation batch on the vLLM server under the version it serves
// now, while this step trains (max_staleness 1). Its own client: the trainer's thread keeps
// adopting versions meanwhile.
Status StartNextGeneration(Trainer::State& s) {
  InFlight f;
  f.from = s.sampler->position();
  FERRY_ASSIGN_OR_RETURN(f.prompts, DrawPrompts(s, s.step + 1));
  f.version_step = s.generator_step;
  f.version = s.generator_version;
  VllmGenerator* vllm = s.vllm.get();
  const int n = static_cast<int>(s.config.num_generations);
  const std::string name = vllm->served_name();
  f.completions = std::async(std::launch::async, [vllm, name, ids = f.prompts.ids, sp = f.prompts.sampling, n] {
    return vllm->GenerateUnder(name, ids, n, sp);
  });
  s.inflight = std::move(f);
  return Status::OK();
}

}  // namespace

Result<Rollout> MakeRollout(Trainer::State& s) {
  const run::RunConfig& c = s.config;
  const int64_t G = c.num_generations;
  DrawnPrompts drawn;
  std::vector<runtime::Completion> completions;
  int64_t version_step = s.generator_step;
  const auto wait_start = std::chrono::steady_clock::now();
  if (s.inflight) {
    // Sampled while the last step trained, by the version it held then.
    InFlight f = std::move(*s.inflight);
    s.inflight.reset();
    drawn = std::move(f.prompts);
    FERRY_ASSIGN_OR_RETURN(completions, f.completions.get());
    version_step = f.version_step;
  } else {
    FERRY_ASSIGN_OR_RETURN(drawn, DrawPrompts(s, s.step));
    if (s.options.completions_for_testing) {
      completions = s.options.completions_for_testing(drawn.ids, s.step);
      if (completions.size() != drawn.ids.size() * static_cast<size_t>(G)) {
        return Status::Internal("completions_for_testing gave " + std::to_string(completions.size()) +
                                " completions for " + std::to_string(drawn.ids.size()) + " prompts");
      }
    } else {
      PhaseTimer timer(s, "generation");
      FERRY_ASSIGN_OR_RETURN(completions, s.vllm
                                              ? s.vllm->Generate(drawn.ids, static_cast<int>(G), drawn.sampling)
                                              : s.generator->Generate(drawn.ids, static_cast<int>(G), drawn.sampling));
    }
  }
  // Bounded staleness (AsyncGRPO): never train on completions of a version more than
  // max_staleness steps older than the weights being trained.
  const double generation_wait = std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count();
  const int64_t staleness = s.step - version_step;
  if (staleness < 0 || staleness > c.max_staleness) {
    return Status::Internal("completions of a version " + std::to_string(staleness) + " steps old (max_staleness " +
                            std::to_string(c.max_staleness) + ")");
  }
  if (c.max_staleness > 0 && s.vllm) FERRY_RETURN_IF_ERROR(StartNextGeneration(s));
  const std::vector<const run::Example*>& examples = drawn.examples;
  const size_t N = completions.size();

  // Rewards on the decoded texts (special tokens skipped, as TRL decodes completions).
  std::vector<run::RewardInput> inputs(N);
  for (size_t i = 0; i < N; ++i) {
    const size_t pi = i / static_cast<size_t>(G);
    FERRY_ASSIGN_OR_RETURN(inputs[i].completion,
                           s.tokenizer->Decode(completions[i].token_ids, {.skip_special_tokens = true}));
    inputs[i].prompt = drawn.texts[pi];
    inputs[i].completion_tokens = static_cast<int64_t>(completions[i].token_ids.size());
    inputs[i].example = examples[pi];
    inputs[i].prompt_index = static_cast<int64_t>(pi);
  }
  run::RewardMatrix matrix;
  {
    PhaseTimer timer(s, "rewards");
    FERRY_ASSIGN_OR_RETURN(matrix, s.rewards->ScoreAll(inputs));
  }

  Rollout r;
  FERRY_RETURN_IF_ERROR(runtime::GuardTorch("building the generation batch", [&]() -> Status {
    // Per completion, what the statistics over every rank's completions need (TRL gathers
    // them): its rewards (fp32, as TRL keeps them), then its length, whether it was truncated,
    // its prompt's length and its tokens the loss counts. Gathered in one collective.
    at::Tensor rpf = at::tensor(matrix.values, at::kDouble).to(at::kFloat).view({static_cast<int64_t>(N), -1});
    const int64_t F = rpf.size(1);
    at::Tensor stats = at::zeros({static_cast<int64_t>(N), 4}, at::kDouble);
    int64_t P = 0, C = 1;
    for (const auto& p : drawn.ids) P = std::max<int64_t>(P, static_cast<int64_t>(p.size()));
    for (const auto& cm : completions) C = std::max<int64_t>(C, static_cast<int64_t>(cm.token_ids.size()));
    r.prompt_ids = at::full({static_cast<int64_t>(N), P}, s.pad_id, at::kLong);
    r.prompt_mask = at::zeros({static_cast<int64_t>(N), P}, at::kLong);
    r.completion_ids = at::full({static_cast<int64_t>(N), C}, s.pad_id, at::kLong);
    r.completion_mask = at::zeros({static_cast<int64_t>(N), C}, at::kLong);
    r.sampling_logps = at::zeros({static_cast<int64_t>(N), C}, at::kFloat);
    auto pid = r.prompt_ids.accessor<int64_t, 2>();
    auto pm = r.prompt_mask.accessor<int64_t, 2>();
    auto cid = r.completion_ids.accessor<int64_t, 2>();
    auto cm = r.completion_mask.accessor<int64_t, 2>();
    auto sl = r.sampling_logps.accessor<float, 2>();
    auto st = stats.accessor<double, 2>();
    for (size_t i = 0; i < N; ++i) {
      const auto& p = drawn.ids[i / static_cast<size_t>(G)];
      const int64_t lp = static_cast<int64_t>(p.size());
      for (int64_t t = 0; t < lp; ++t) {
        pid[static_cast<int64_t>(i)][P - lp + t] = p[static_cast<size_t>(t)];
        pm[static_cast<int64_t>(i)][P - lp + t] = 1;
      }
      st[static_cast<int64_t>(i)][2] = static_cast<double>(lp);
      const runtime::Completion& comp = completions[i];
      const bool is_truncated = comp.finish != runtime::Completion::Finish::kEos;
      const int64_t lc = static_cast<int64_t>(comp.token_ids.size());
      const bool masked = is_truncated && c.mask_truncated_completions;
      for (int64_t t = 0; t < lc; ++t) {
        cid[static_cast<int64_t>(i)][t] = comp.token_ids[static_cast<size_t>(t)];
        cm[static_cast<int64_t>(i)][t] = masked ? 0 : 1;
        sl[static_cast<int64_t>(i)][t] = comp.logprobs[static_cast<size_t>(t)];
      }
      st[static_cast<int64_t>(i)][0] = static_cast<double>(lc);
      st[static_cast<int64_t>(i)][1] = is_truncated ? 1.0 : 0.0;
      st[static_cast<int64_t>(i)][3] = masked ? 0.0 : static_cast<double>(lc);
    }
    FERRY_ASSIGN_OR_RETURN(at::Tensor all, GatherRows(s, at::cat({rpf.to(at::kDouble), stats}, 1),
                                                      "gathering the rewards and completion lengths"));
    // Advantages and their statistics over the whole batch; this rank keeps its rows.
    FERRY_ASSIGN_OR_RETURN(Advantages adv, ComputeAdvantages(all.narrow(1, 0, F).to(at::kFloat), s.advantage_options));
    r.advantages = adv.advantages.narrow(0, static_cast<int64_t>(N) * s.rank, static_cast<int64_t>(N)).clone();
    r.metrics = adv.metrics;
    const at::Tensor all_stats = all.narrow(1, F, 4).contiguous();
    // dapo's normaliser: the tokens of the whole generation batch, every rank's.
    r.num_items = static_cast<int64_t>(all_stats.select(1, 3).sum().item<double>());
    std::vector<double> lengths, terminated;
    double prompt_tokens = 0;
    int64_t truncated = 0;
    auto all_st = all_stats.accessor<double, 2>();
    for (int64_t i = 0; i < all_stats.size(0); ++i) {
      lengths.push_back(all_st[i][0]);
      prompt_tokens += all_st[i][2];
      if (all_st[i][1] != 0) {
        ++truncated;
      } else {
        terminated.push_back(all_st[i][0]);
      }
    }
    const size_t all_n = lengths.size();
    const double total_completion = std::accumulate(lengths.begin(), lengths.end(), 0.0);
    s.num_tokens += prompt_tokens + total_completion;
    // TRL's completion metrics (grpo_trainer.py _generate_and_score_completions).
    Add(r.metrics, "num_tokens", s.num_tokens);
    if (s.vllm) {
      Add(r.metrics, "sampling/staleness", static_cast<double>(staleness));
      // Seconds the step waited for its completions (0 when sampled while the last step trained).
      Add(r.metrics, "timing/generation_wait", generation_wait);
    }
    Add(r.metrics, "completions/mean_length", total_completion / static_cast<double>(all_n));
    Add(r.metrics, "completions/min_length", *std::min_element(lengths.begin(), lengths.end()));
    Add(r.metrics, "completions/max_length", *std::max_element(lengths.begin(), lengths.end()));
    Add(r.metrics, "completions/clipped_ratio", static_cast<double>(truncated) / static_cast<double>(all_n));
    if (terminated.empty()) terminated.push_back(0.0);
    Add(r.metrics, "completions/mean_terminated_length",
        std::accumulate(terminated.begin(), terminated.end(), 0.0) / static_cast<double>(terminated.size()));
    Add(r.metrics, "completions/min_terminated_length", *std::min_element(terminated.begin(), terminated.end()));
    Add(r.metrics, "completions/max_terminated_length", *std::max_element(terminated.begin(), terminated.end()));
    return Status::OK();
  }));

  // Micro-batches: steps_per_generation slices of per_device_train_batch_size rows, the rows
  // shuffled first when there is more than one slice (as TRL's shuffle_sequence_dict).
  std::vector<int64_t> order(N);
  std::iota(order.begin(), order.end(), 0);
  const int64_t S = c.steps_per_generation;
  if (S > 1) {
    std::mt19937_64 rng(SamplingSeed(c.seed, s.step, s.rank) ^ 0x5bd1e995ULL);
    for (size_t i = N - 1; i > 0; --i) std::swap(order[i], order[rng() % (i + 1)]);
  }
  const size_t per = N / static_cast<size_t>(S);
  for (int64_t k = 0; k < S; ++k) {
    r.rows_of_micro_batch.emplace_back(order.begin() + static_cast<long>(static_cast<size_t>(k) * per),
                                       order.begin() + static_cast<long>(static_cast<size_t>(k + 1) * per));
  }

  // Old and reference log-probs over the whole batch, before any update, without dropout.
  auto whole = [&](bool lora) -> Result<at::Tensor> {
    at::NoGradGuard no_grad;
    at::Tensor out = at::zeros(r.completion_ids.sizes(), at::kFloat);
    for (const auto& rows : r.rows_of_micro_batch) {
      FERRY_ASSIGN_OR_RETURN(MicroBatchLogps mb, MicroBatchLogProbs(s, r, rows, lora, /*training=*/false));
      out.index_copy_(0, mb.rows, mb.logps.to(at::kFloat));
    }
    return out;
  };
  if (!s.fast_old_logps) {
    PhaseTimer timer(s, "old_logps");
    FERRY_ASSIGN_OR_RETURN(r.old_logps, whole(true));
  }
  if (s.loss_options.beta != 0.0) {
    PhaseTimer timer(s, "reference");
    FERRY_ASSIGN_OR_RETURN(r.ref_logps, whole(false));
  }
  if (c.vllm_importance_sampling_correction && r.old_logps.defined()) {
    FERRY_ASSIGN_OR_RETURN(MismatchCorrection mc, ComputeMismatchCorrection(r.old_logps, r.sampling_logps,
                                                                            r.completion_mask, s.mismatch_options));
    r.is_ratio = mc.ratio;
    for (const auto& [k, v] : mc.metrics) r.metrics[k] = v;
  }
  return r;
}

}  // namespace ferry::grpo
