// GRPO maths exactly as TRL 1.16.0's GRPOTrainer computes it: rewards and advantages, the
// generator/trainer mismatch correction and the clipped policy loss, each with the metrics TRL
// logs. Tensors in, tensors and metrics out: nothing here knows models, datasets or the loop.
//
// Shapes: N completions in groups of G consecutive ones (completion i belongs to prompt i / G),
// F reward functions, B sequences of T completion tokens (right-padded; mask 1 = a real token).
// Masks may be bool or any integer/floating type holding 0 and 1 (nonzero counts as 1).
//
// Arithmetic order, dtypes and NaN handling follow TRL's source line by line (grpo_trainer.py
// and trainer/utils.py; docs/daemon.md "## GRPO maths" maps each function to its lines), so
// results equal TRL's within 1e-6 on the fixtures in fixtures/grpo/. Three TRL habits that look
// odd are kept on purpose: reward weights are rounded to fp32 (TRL stores them in an fp32
// tensor), Bessel's correction count/(count-1) is an fp32 number (integer true division), and
// dapo's normaliser is computed in fp32. Everything runs on the tensors' device (CPU or CUDA);
// fp32 and fp64 inputs are computed in their own dtype.
//
// Metrics are keyed by TRL's names. Several ranks: the trainer gathers what TRL gathers
// (rewards, token counts) and passes the global values in.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "daemon/run/config.h"

namespace ferry::grpo {

// TRL's settings, as the run config parsed them once (daemon/run/config.h; their spellings:
// run::NameOf / run::FromName).
using LossType = run::LossType;                                // "grpo" | "bnpo" | "dr_grpo" | "dapo"
using ScaleRewards = run::ScaleRewards;                        // "group" | "batch" | "none"
using ImportanceSamplingLevel = run::ImportanceSamplingLevel;  // "token" | "sequence" (GSPO)
using MismatchMode = run::MismatchMode;  // "token_truncate" | "token_mask" | "sequence_truncate" | "sequence_mask"

// Metric name (TRL's) -> value; NaN where TRL logs NaN (e.g. the std of a single reward).
using Metrics = std::map<std::string, double>;

// ---------------------------------------------------------------------------------------------
// Rewards and advantages (TRL multi_objective_aggregation "sum_then_normalize").

struct AdvantageOptions {
  // G, completions per prompt. Default: 8 (TRL num_generations)
  int64_t num_generations = 8;
  // Default: group
  ScaleRewards scale_rewards = ScaleRewards::kGroup;
  // One per reward function, rounded to fp32 as TRL does; empty: 1.0 each. Default: empty
  std::vector<double> reward_weights;
  // One per reward function: the <name> in rewards/<name>/mean|std. Default: empty (REQUIRED)
  std::vector<std::string> reward_names;
};

struct Advantages {
  at::Tensor rewards;     // [N] weighted nansum per completion; NaN where every function is NaN
  at::Tensor advantages;  // [N] (r - group nanmean) [/ (nanstd + 1e-4)]; NaN -> 0
  // reward, reward_std, rewards/<name>/mean, rewards/<name>/std, frac_reward_zero_std
  Metrics metrics;
};

// `rewards_per_func` [N, F] floating, NaN where a reward function returned None. rewards =
// nansum(rewards_per_func * weights) per row (NaN when the whole row is NaN); advantages =
// (rewards - nanmean of the group) / (std + 1e-4), std = Bessel-corrected nanstd of the group
// ("group"; G = 1: 0) or of the whole batch ("batch"; N = 1: 0); "none" does not divide.
// NaN advantages (unscorable completions, groups without any score) become 0, as do the
// infinities nan_to_num maps. frac_reward_zero_std counts completions whose std isclose to 0.
// Errors (kInvalidArgument): not a 2-D floating tensor, F = 0, N not a positive multiple of
// num_generations, weights or names not one per column.
Result<Advantages> ComputeAdvantages(const at::Tensor& rewards_per_func, const AdvantageOptions& options);

// TRL's trainer/utils.py nanstd: the standard deviation ignoring NaNs with Bessel's correction
// (NaN for fewer than 2 values); `dim` nullopt reduces everything to a 0-dim tensor.
at::Tensor NanStd(const at::Tensor& x, std::optional<int64_t> dim);

// ---------------------------------------------------------------------------------------------
// Generator/trainer mismatch correction (TRL's vLLM importance-sampling correction): the
// generator (here the daemon's KV-cache sampler) reports the log-probability of each token it
// sampled; the trainer recomputes it ("old" log-probs). The loss is multiplied by
// ratio = exp(old - sampling) per token, or exp(sum over the sequence's tokens) per sequence.

struct MismatchOptions {
  // Default: sequence_mask
  MismatchMode mode = MismatchMode::kSequenceMask;
  // Lower bound C_min; none: no lower bound (TRL clip_min None). Default: none
  std::optional<double> clip_min;
  // Upper bound C_max; none: no upper bound. TRL's deprecated vllm_importance_sampling_cap
  // maps here. Default: 3.0
  std::optional<double> clip_max = 3.0;
};

struct MismatchCorrection {
  // [B, T] for token modes, [B, 1] for sequence modes: the factor the per-token loss is
  // multiplied by (LossInputs::importance_sampling_ratio).
  at::Tensor ratio;
  // sampling/sampling_logp_difference/mean|max, sampling/importance_sampling_ratio/min|mean|max
  Metrics metrics;
};

// `old_per_token_logps`, `sampling_per_token_logps`, `completion_mask`: [B, T]. Differences
// are taken on masked tokens only; a NaN sampling log-prob (a token the generator could not
// score) contributes a zero difference. *_truncate clamps the ratio to [clip_min, clip_max];
// *_mask sets ratios outside it to 0. Metrics: |old - sampling| over real, non-NaN tokens
// (0 when none), and the ratio over real tokens (token modes) or over all B sequences
// (sequence modes), 0 when empty.
// Errors (kInvalidArgument): shapes differ or are not 2-D, non-floating log-probs, devices
// differ, a truncate mode with neither bound, clip_min >= clip_max.
Result<MismatchCorrection> ComputeMismatchCorrection(const at::Tensor& old_per_token_logps,
                                                     const at::Tensor& sampling_per_token_logps,
                                                     const at::Tensor& completion_mask, const MismatchOptions& options);

// ---------------------------------------------------------------------------------------------
// The policy loss (TRL GRPOTrainer._compute_loss for the four clipped loss types).

struct LossOptions {
  // Default: dapo
  LossType loss_type = LossType::kDapo;
  // Default: token
  ImportanceSamplingLevel importance_sampling_level = ImportanceSamplingLevel::kToken;
  // Lower clip: coef_2 = clamp(coef_1, 1 - epsilon, 1 + epsilon_high). Default: 0.2
  double epsilon = 0.2;
  // Upper clip; none: epsilon (TRL's rule). Default: none
  std::optional<double> epsilon_high;
  // Two-sided clipping (INTELLECT-2): coef_1 is clamped to at most delta. Default: none
  std::optional<double> delta;
  // KL coefficient; 0: no reference log-probs needed. Default: 0.0
  double beta = 0.0;
  // Multiply the k3 KL term by coef_1 (TRL 1.16's default). Default: true
  bool use_bias_correction_kl = true;
  // dr_grpo's denominator is B * max_completion_length. Default: 512
  int64_t max_completion_length = 512;
  // TRL current_gradient_accumulation_steps: micro-batches in this optimiser step. Default: 1
  int64_t gradient_accumulation_steps = 1;
  // TRL steps_per_generation (dapo: num_items_in_batch spans that many micro-batches).
  // TRL defaults it to gradient_accumulation_steps. Default: 1
  int64_t steps_per_generation = 1;
  // false: TRL's eval normalisers (no accumulation). Default: true
  bool training = true;
  // Data-parallel ranks whose gradients are averaged (TRL's num_processes): dapo divides
  // num_items_in_batch by it, bnpo LossInputs::micro_batch_items. Default: 1
  int64_t num_processes = 1;
};

struct LossInputs {
  // [B, T] the trainer's log-probs under the current policy; the loss is differentiable
  // with respect to it. REQUIRED
  at::Tensor per_token_logps;
  // [B, T] REQUIRED
  at::Tensor completion_mask;
  // [B] (or [B, T]) REQUIRED
  at::Tensor advantages;
  // [B, T] per-token entropies, for the entropy metric only. REQUIRED
  at::Tensor entropies;
  // [B, T] log-probs under the policy that produced the samples; undefined: per_token_logps
  // detached (one optimiser step per generation).
  at::Tensor old_per_token_logps;
  // [B, T] reference-policy log-probs; REQUIRED when beta != 0, ignored otherwise.
  at::Tensor ref_per_token_logps;
  // MismatchCorrection::ratio ([B, T] or [B, 1]); undefined: no mismatch correction.
  at::Tensor importance_sampling_ratio;
  // dapo: real tokens in the whole generation batch (all steps_per_generation micro-batches,
  // every rank's).
  int64_t num_items_in_batch = 0;
  // bnpo with several ranks: real tokens of this micro-batch over every rank; the loss is
  // divided by max(it, 1) / num_processes, so that the ranks' averaged gradients are those of
  // one process over the whole micro-batch (TRL's DDP divides by each rank's own count).
  // Negative: this micro-batch's own count. Default: -1
  int64_t micro_batch_items = -1;
};

struct Loss {
  at::Tensor loss;  // 0-dim, in per_token_logps' dtype, attached to its graph
  // kl (beta != 0), entropy, clip_ratio/low_mean|low_min|high_mean|high_max|region_mean
  Metrics metrics;
};

// coef_1 = exp(logp - old) per token, or exp(masked mean of logp - old) per sequence;
// per-token loss = -min(coef_1 * A, clamp(coef_1, 1 - eps, 1 + eps_high) * A) (coef_1 first
// clamped to delta when set), times the mismatch ratio when given, plus
// beta * (exp(ref - logp) - (ref - logp) - 1) [* coef_1]. Aggregated as
//   grpo:    mean over sequences of sum(l * m) / max(sum m, 1), / gradient_accumulation_steps
//   bnpo:    sum(l * m) / max(sum m, 1), / gradient_accumulation_steps (micro_batch_items:
//            / (max(micro_batch_items, 1) / num_processes) for sum m)
//   dr_grpo: sum(l * m) / (B * max_completion_length), / gradient_accumulation_steps
//   dapo:    sum(l * m) / (max(num_items_in_batch, 1) / num_processes
//            * gradient_accumulation_steps / steps_per_generation)
// (eval, training = false: no accumulation terms). Metrics are computed without gradients.
// Errors (kInvalidArgument, naming the input): a REQUIRED tensor undefined, shapes that do
// not match [B, T] / [B] / [B, 1], non-floating log-probs, tensors on different devices,
// gradient_accumulation_steps, steps_per_generation or max_completion_length < 1,
// num_items_in_batch < 0.
Result<Loss> ComputeLoss(const LossInputs& inputs, const LossOptions& options);

}  // namespace ferry::grpo
