#include "daemon/grpo/grpo_math.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "daemon/grpo/grpo_internal.h"
#include "daemon/runtime/torch_util.h"

namespace ferry::grpo {

namespace internal {

std::string SizesString(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  return s + "]";
}

Status CheckDefined(std::string_view what, const at::Tensor& t, std::string_view name) {
  if (t.defined()) return Status::OK();
  return Status::InvalidArgument(std::string(what) + ": " + std::string(name) + " is undefined");
}

Status CheckFloating(std::string_view what, const at::Tensor& t, std::string_view name) {
  if (at::isFloatingType(t.scalar_type())) return Status::OK();
  return Status::InvalidArgument(std::string(what) + ": " + std::string(name) + " must be a floating tensor, got " +
                                 std::string(c10::toString(t.scalar_type())));
}

Status CheckSizes(std::string_view what, const at::Tensor& t, std::string_view name, at::IntArrayRef sizes) {
  if (t.sizes() == sizes) return Status::OK();
  return Status::InvalidArgument(std::string(what) + ": " + std::string(name) + " must be " + SizesString(sizes) +
                                 ", got " + SizesString(t.sizes()));
}

Status CheckDevice(std::string_view what, const at::Tensor& t, std::string_view name, const at::Device& device) {
  if (t.device() == device) return Status::OK();
  return Status::InvalidArgument(std::string(what) + ": " + std::string(name) + " is on " + t.device().str() +
                                 ", expected " + device.str());
}

at::Tensor LongMask(const at::Tensor& mask) { return at::ne(mask, 0).to(at::kLong); }

}  // namespace internal

namespace {

using internal::CheckDefined;
using internal::CheckDevice;
using internal::CheckFloating;
using internal::CheckSizes;
using internal::LongMask;
using internal::SizesString;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// TRL utils.nanmin / nanmax: NaN when every value is NaN, else the extreme of the others.
double NanExtreme(const at::Tensor& t, bool want_min) {
  at::Tensor nan = at::isnan(t);
  if (nan.all().item<bool>()) return kNaN;
  at::Tensor kept = t.masked_select(at::logical_not(nan));
  return (want_min ? kept.min() : kept.max()).item<double>();
}

// TRL's `x.clamp(min=1.0)` on an integer count: torch promotes it to the default dtype (fp32).
at::Tensor ClampedCount(const at::Tensor& count) { return count.to(at::kFloat).clamp_min(1.0); }

bool IsSequenceMode(MismatchMode mode) {
  return mode == MismatchMode::kSequenceTruncate || mode == MismatchMode::kSequenceMask;
}

}  // namespace

at::Tensor NanStd(const at::Tensor& x, std::optional<int64_t> dim) {
  if (!dim) return NanStd(x.reshape({-1}), 0);
  const std::vector<int64_t> dims = {*dim};
  at::Tensor mean = at::nanmean(x, dims, /*keepdim=*/true);
  at::Tensor variance = at::nanmean(at::pow(x - mean, 2), dims, /*keepdim=*/true);
  at::Tensor count = at::sum(at::logical_not(at::isnan(x)), dims, /*keepdim=*/true);
  at::Tensor correction = at::div(count, count - 1);  // integer true division: fp32, as in TRL
  correction = at::where(count > 1, correction, at::full_like(correction, kNaN));
  variance.mul_(correction);
  return at::sqrt(variance).squeeze(*dim);
}

Result<Advantages> ComputeAdvantages(const at::Tensor& rewards_per_func, const AdvantageOptions& options) {
  constexpr std::string_view kWhat = "GRPO advantages";
  FERRY_RETURN_IF_ERROR(CheckDefined(kWhat, rewards_per_func, "rewards_per_func"));
  if (rewards_per_func.dim() != 2) {
    return Status::InvalidArgument(std::string(kWhat) + ": rewards_per_func must be [N, F], got " +
                                   SizesString(rewards_per_func.sizes()));
  }
  FERRY_RETURN_IF_ERROR(CheckFloating(kWhat, rewards_per_func, "rewards_per_func"));
  const int64_t n = rewards_per_func.size(0);
  const int64_t f = rewards_per_func.size(1);
  const int64_t g = options.num_generations;
  if (f == 0) return Status::InvalidArgument(std::string(kWhat) + ": rewards_per_func has no reward function column");
  if (g < 1) {
    return Status::InvalidArgument(std::string(kWhat) + ": num_generations must be at least 1, got " +
                                   std::to_string(g));
  }
  if (n == 0 || n % g != 0) {
    return Status::InvalidArgument(std::string(kWhat) + ": " + std::to_string(n) +
                                   " completions are not a positive multiple of num_generations " + std::to_string(g));
  }
  if (!options.reward_weights.empty() && static_cast<int64_t>(options.reward_weights.size()) != f) {
    return Status::InvalidArgument(std::string(kWhat) + ": " + std::to_string(options.reward_weights.size()) +
                                   " reward_weights for " + std::to_string(f) + " reward functions");
  }
  if (static_cast<int64_t>(options.reward_names.size()) != f) {
    return Status::InvalidArgument(std::string(kWhat) + ": " + std::to_string(options.reward_names.size()) +
                                   " reward_names for " + std::to_string(f) + " reward functions");
  }
  return runtime::GuardTorch(kWhat, [&]() -> Result<Advantages> {
    at::NoGradGuard no_grad;
    const at::Tensor& rpf = rewards_per_func;
    std::vector<float> w(static_cast<size_t>(f), 1.0f);
    for (size_t i = 0; i < options.reward_weights.size(); ++i) w[i] = static_cast<float>(options.reward_weights[i]);
    const at::Tensor weights = at::tensor(at::ArrayRef<float>(w), at::kFloat).to(rpf.device());

    // grpo_trainer.py, _generate_and_score_completions, "sum_then_normalize".
    const at::Tensor unscorable = at::isnan(rpf).all(1);
    at::Tensor rewards = (rpf * weights.unsqueeze(0)).nansum(1);
    rewards.masked_fill_(unscorable, kNaN);
    const at::Tensor grouped = rewards.view({-1, g});
    const at::Tensor mean_grouped = at::nanmean(grouped, std::vector<int64_t>{1}).repeat_interleave(g, 0);
    at::Tensor std_rewards;
    if (options.scale_rewards == ScaleRewards::kBatch) {
      std_rewards = n > 1 ? NanStd(rewards, std::nullopt).expand_as(rewards) : at::zeros_like(rewards);
    } else {
      std_rewards = g > 1 ? NanStd(grouped, 1).repeat_interleave(g, 0) : at::zeros_like(rewards);
    }
    at::Tensor advantages = rewards - mean_grouped;
    if (options.scale_rewards != ScaleRewards::kNone) advantages = advantages / (std_rewards + 1e-4);
    const at::Tensor is_std_zero = at::isclose(std_rewards, at::zeros_like(std_rewards));
    advantages = at::nan_to_num(advantages, 0.0);

    Advantages out;
    for (int64_t i = 0; i < f; ++i) {
      const at::Tensor column = rpf.select(1, i);
      const std::string& name = options.reward_names[static_cast<size_t>(i)];
      out.metrics["rewards/" + name + "/mean"] = at::nanmean(column).item<double>();
      out.metrics["rewards/" + name + "/std"] = NanStd(column, std::nullopt).item<double>();
    }
    out.metrics["reward"] = at::nanmean(rewards).item<double>();
    out.metrics["reward_std"] = NanStd(rewards, std::nullopt).item<double>();
    out.metrics["frac_reward_zero_std"] = is_std_zero.to(at::kFloat).mean().item<double>();
    out.rewards = std::move(rewards);
    out.advantages = std::move(advantages);
    return out;
  });
}

Result<MismatchCorrection> ComputeMismatchCorrection(const at::Tensor& old_per_token_logps,
                                                     const at::Tensor& sampling_per_token_logps,
                                                     const at::Tensor& completion_mask,
                                                     const MismatchOptions& options) {
  constexpr std::string_view kWhat = "mismatch correction";
  FERRY_RETURN_IF_ERROR(CheckDefined(kWhat, old_per_token_logps, "old_per_token_logps"));
  FERRY_RETURN_IF_ERROR(CheckDefined(kWhat, sampling_per_token_logps, "sampling_per_token_logps"));
  FERRY_RETURN_IF_ERROR(CheckDefined(kWhat, completion_mask, "completion_mask"));
  if (old_per_token_logps.dim() != 2) {
    return Status::InvalidArgument(std::string(kWhat) + ": old_per_token_logps must be [B, T], got " +
                                   SizesString(old_per_token_logps.sizes()));
  }
  FERRY_RETURN_IF_ERROR(CheckFloating(kWhat, old_per_token_logps, "old_per_token_logps"));
  FERRY_RETURN_IF_ERROR(CheckFloating(kWhat, sampling_per_token_logps, "sampling_per_token_logps"));
  const at::IntArrayRef bt = old_per_token_logps.sizes();
  FERRY_RETURN_IF_ERROR(CheckSizes(kWhat, sampling_per_token_logps, "sampling_per_token_logps", bt));
  FERRY_RETURN_IF_ERROR(CheckSizes(kWhat, completion_mask, "completion_mask", bt));
  const at::Device device = old_per_token_logps.device();
  FERRY_RETURN_IF_ERROR(CheckDevice(kWhat, sampling_per_token_logps, "sampling_per_token_logps", device));
  FERRY_RETURN_IF_ERROR(CheckDevice(kWhat, completion_mask, "completion_mask", device));
  const bool truncate = options.mode == MismatchMode::kTokenTruncate || options.mode == MismatchMode::kSequenceTruncate;
  if (truncate && !options.clip_min && !options.clip_max) {
    return Status::InvalidArgument(std::string(kWhat) + ": mode " + std::string(run::NameOf(options.mode)) +
                                   " needs clip_min or clip_max");
  }
  if (options.clip_min && options.clip_max && *options.clip_min >= *options.clip_max) {
    return Status::InvalidArgument(std::string(kWhat) + ": clip_min (" + std::to_string(*options.clip_min) +
                                   ") must be less than clip_max (" + std::to_string(*options.clip_max) + ")");
  }
  return runtime::GuardTorch(kWhat, [&]() -> Result<MismatchCorrection> {
    at::NoGradGuard no_grad;
    const at::Tensor& old = old_per_token_logps;
    const at::Tensor& sampling = sampling_per_token_logps;
    const at::Tensor mask = LongMask(completion_mask);

    // grpo_trainer.py, _generate_and_score_completions: the vLLM importance-sampling ratio.
    at::Tensor diff = at::nan_to_num((old - sampling) * mask, 0.0);
    const bool sequence_level = IsSequenceMode(options.mode);
    at::Tensor ratio = at::exp(sequence_level ? diff.sum(-1, /*keepdim=*/true) : diff);
    if (truncate) {
      c10::optional<at::Scalar> lo;
      c10::optional<at::Scalar> hi;
      if (options.clip_min) lo = *options.clip_min;
      if (options.clip_max) hi = *options.clip_max;
      ratio = at::clamp(ratio, lo, hi);
    } else {
      const double lo = options.clip_min.value_or(-kInf);
      const double hi = options.clip_max.value_or(kInf);
      ratio = ratio.masked_fill(at::logical_or(ratio<lo, ratio> hi), 0.0);
    }

    // ... and the sampling/* metrics it logs.
    MismatchCorrection out;
    const at::Tensor bool_mask = mask.to(at::kBool);
    const at::Tensor delta_all = at::abs(old - sampling);
    const at::Tensor delta = delta_all.masked_select(at::logical_and(bool_mask, at::logical_not(at::isnan(delta_all))));
    const bool any_delta = delta.numel() > 0;
    out.metrics["sampling/sampling_logp_difference/mean"] = any_delta ? delta.mean().item<double>() : 0.0;
    out.metrics["sampling/sampling_logp_difference/max"] = any_delta ? delta.max().item<double>() : 0.0;
    const at::Tensor flat = sequence_level ? ratio.flatten() : ratio.masked_select(bool_mask);
    const bool any_ratio = flat.numel() > 0;
    out.metrics["sampling/importance_sampling_ratio/min"] = any_ratio ? NanExtreme(flat.min(), true) : 0.0;
    out.metrics["sampling/importance_sampling_ratio/mean"] = any_ratio ? flat.mean().item<double>() : 0.0;
    out.metrics["sampling/importance_sampling_ratio/max"] = any_ratio ? NanExtreme(flat.max(), false) : 0.0;
    out.ratio = std::move(ratio);
    return out;
  });
}

Result<Loss> ComputeLoss(const LossInputs& in, const LossOptions& options) {
  constexpr std::string_view kWhat = "GRPO loss";
  FERRY_RETURN_IF_ERROR(CheckDefined(kWhat, in.per_token_logps, "per_token_logps"));
  FERRY_RETURN_IF_ERROR(CheckDefined(kWhat, in.completion_mask, "completion_mask"));
  FERRY_RETURN_IF_ERROR(CheckDefined(kWhat, in.advantages, "advantages"));
  FERRY_RETURN_IF_ERROR(CheckDefined(kWhat, in.entropies, "entropies"));
  const bool with_kl = options.beta != 0.0;
  if (with_kl) {
    FERRY_RETURN_IF_ERROR(CheckDefined(kWhat, in.ref_per_token_logps, "ref_per_token_logps (beta != 0)"));
  }
  const at::Tensor& logps = in.per_token_logps;
  if (logps.dim() != 2) {
    return Status::InvalidArgument(std::string(kWhat) + ": per_token_logps must be [B, T], got " +
                                   SizesString(logps.sizes()));
  }
  const int64_t b = logps.size(0);
  const int64_t t = logps.size(1);
  const at::Device device = logps.device();
  FERRY_RETURN_IF_ERROR(CheckFloating(kWhat, logps, "per_token_logps"));
  FERRY_RETURN_IF_ERROR(CheckSizes(kWhat, in.completion_mask, "completion_mask", {b, t}));
  FERRY_RETURN_IF_ERROR(CheckDevice(kWhat, in.completion_mask, "completion_mask", device));
  FERRY_RETURN_IF_ERROR(CheckFloating(kWhat, in.advantages, "advantages"));
  if (in.advantages.sizes() != at::IntArrayRef{b} && in.advantages.sizes() != at::IntArrayRef{b, 1} &&
      in.advantages.sizes() != at::IntArrayRef{b, t}) {
    return Status::InvalidArgument(std::string(kWhat) +
                                   ": advantages must be [B], [B, 1] or [B, T] with B = " + std::to_string(b) +
                                   ", T = " + std::to_string(t) + ", got " + SizesString(in.advantages.sizes()));
  }
  FERRY_RETURN_IF_ERROR(CheckDevice(kWhat, in.advantages, "advantages", device));
  const std::pair<const at::Tensor*, std::string_view> per_token[] = {
      {&in.entropies, "entropies"},
      {&in.old_per_token_logps, "old_per_token_logps"},
      {with_kl ? &in.ref_per_token_logps : nullptr, "ref_per_token_logps"},
  };
  for (const auto& [tensor, name] : per_token) {
    if (tensor == nullptr || !tensor->defined()) continue;
    FERRY_RETURN_IF_ERROR(CheckFloating(kWhat, *tensor, name));
    FERRY_RETURN_IF_ERROR(CheckSizes(kWhat, *tensor, name, {b, t}));
    FERRY_RETURN_IF_ERROR(CheckDevice(kWhat, *tensor, name, device));
  }
  if (in.importance_sampling_ratio.defined()) {
    const at::Tensor& r = in.importance_sampling_ratio;
    FERRY_RETURN_IF_ERROR(CheckFloating(kWhat, r, "importance_sampling_ratio"));
    if (r.sizes() != at::IntArrayRef{b, t} && r.sizes() != at::IntArrayRef{b, 1}) {
      return Status::InvalidArgument(std::string(kWhat) + ": importance_sampling_ratio must be " + SizesString({b, t}) +
                                     " or " + SizesString({b, 1}) + ", got " + SizesString(r.sizes()));
    }
    FERRY_RETURN_IF_ERROR(CheckDevice(kWhat, r, "importance_sampling_ratio", device));
  }
  const std::pair<int64_t, std::string_view> at_least_one[] = {
      {options.gradient_accumulation_steps, "gradient_accumulation_steps"},
      {options.steps_per_generation, "steps_per_generation"},
      {options.max_completion_length, "max_completion_length"},
      {options.num_processes, "num_processes"},
  };
  for (const auto& [value, name] : at_least_one) {
    if (value < 1) {
      return Status::InvalidArgument(std::string(kWhat) + ": " + std::string(name) + " must be at least 1, got " +
                                     std::to_string(value));
    }
  }
  if (in.num_items_in_batch < 0) {
    return Status::InvalidArgument(std::string(kWhat) + ": num_items_in_batch must not be negative, got " +
                                   std::to_string(in.num_items_in_batch));
  }

  return runtime::GuardTorch(kWhat, [&]() -> Result<Loss> {
    // grpo_trainer.py, GRPOTrainer._compute_loss.
    const at::Tensor mask = LongMask(in.completion_mask);
    const at::Tensor advantages = in.advantages.dim() == 1 ? in.advantages.unsqueeze(1) : in.advantages;
    const at::Tensor old = in.old_per_token_logps.defined() ? in.old_per_token_logps : logps.detach();
    const at::Tensor log_ratio = logps - old;
    at::Tensor log_importance_weights;
    if (options.importance_sampling_level == ImportanceSamplingLevel::kToken) {
      log_importance_weights = log_ratio;
    } else {
      log_importance_weights = ((log_ratio * mask).sum(-1) / ClampedCount(mask.sum(-1))).unsqueeze(-1);
    }
    at::Tensor coef_1 = at::exp(log_importance_weights);

    at::Tensor per_token_kl;
    if (with_kl) {
      const at::Tensor& ref = in.ref_per_token_logps;
      per_token_kl = at::exp(ref - logps) - (ref - logps) - 1;
      if (options.use_bias_correction_kl) per_token_kl = per_token_kl * coef_1;
    }

    const double epsilon_low = options.epsilon;
    const double epsilon_high = options.epsilon_high.value_or(options.epsilon);
    const at::Tensor coef_2 = at::clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high);
    if (options.delta)
      coef_1 = at::clamp(coef_1, c10::optional<at::Scalar>(), c10::optional<at::Scalar>(*options.delta));
    at::Tensor per_token_loss = -at::minimum(coef_1 * advantages, coef_2 * advantages);
    if (in.importance_sampling_ratio.defined()) per_token_loss = per_token_loss * in.importance_sampling_ratio;
    if (with_kl) per_token_loss = per_token_loss + options.beta * per_token_kl;

    const double normalizer = options.training ? static_cast<double>(options.gradient_accumulation_steps) : 1.0;
    at::Tensor loss;
    switch (options.loss_type) {
      case LossType::kGrpo:
        loss = ((per_token_loss * mask).sum(-1) / ClampedCount(mask.sum(-1))).mean() / normalizer;
        break;
      case LossType::kBnpo:
        if (in.micro_batch_items >= 0) {
          const double items = static_cast<double>(std::max<int64_t>(in.micro_batch_items, 1)) /
                               static_cast<double>(options.num_processes);
          loss = (per_token_loss * mask).sum() / items / normalizer;
        } else {
          loss = (per_token_loss * mask).sum() / ClampedCount(mask.sum()) / normalizer;
        }
        break;
      case LossType::kDrGrpo:
        loss = (per_token_loss * mask).sum() /
               static_cast<double>(per_token_loss.size(0) * options.max_completion_length) / normalizer;
        break;
      case LossType::kDapo: {
        // TRL: num_items_in_batch.clamp(min=1.0) / num_processes [* accumulation / steps_per_generation], in fp32.
        float items = static_cast<float>(std::max<int64_t>(in.num_items_in_batch, 1));
        items = items / static_cast<float>(options.num_processes);
        if (options.training) {
          items = items * static_cast<float>(options.gradient_accumulation_steps);
          items = items / static_cast<float>(options.steps_per_generation);
        }
        loss = (per_token_loss * mask).sum() /
               at::scalar_tensor(items, at::TensorOptions().dtype(at::kFloat).device(device));
        break;
      }
    }

    // The metrics _compute_loss logs after the loss.
    at::NoGradGuard no_grad;
    auto masked_seq_mean = [&](const at::Tensor& x) {
      if (x.size(1) == 1) return x.squeeze(1);
      return (x * mask).sum(-1) / mask.sum(-1);
    };
    auto global_masked_mean = [&](const at::Tensor& x) {
      at::Tensor sum;
      at::Tensor count;
      if (x.size(1) == 1) {
        sum = x.sum();
        count = at::scalar_tensor(static_cast<double>(x.size(0)), at::TensorOptions().dtype(at::kFloat).device(device));
      } else {
        sum = (x * mask).sum();
        count = mask.sum().to(at::kFloat);
      }
      const at::ScalarType type = at::promote_types(sum.scalar_type(), at::kFloat);
      return (sum.to(type) / count.to(type).clamp_min(1.0)).item<double>();
    };
    Loss out;
    if (with_kl) out.metrics["kl"] = global_masked_mean(per_token_kl.detach());
    out.metrics["entropy"] = global_masked_mean(in.entropies.detach());
    const at::Tensor c1 = coef_1.detach();
    const at::Tensor is_low_clipped = at::logical_and(c1 < 1 - epsilon_low, advantages < 0);
    const at::Tensor is_high_clipped = at::logical_and(c1 > 1 + epsilon_high, advantages > 0);
    const at::Tensor is_region_clipped = at::logical_or(is_low_clipped, is_high_clipped);
    out.metrics["clip_ratio/low_mean"] = global_masked_mean(is_low_clipped.to(at::kFloat));
    out.metrics["clip_ratio/high_mean"] = global_masked_mean(is_high_clipped.to(at::kFloat));
    out.metrics["clip_ratio/region_mean"] = global_masked_mean(is_region_clipped.to(at::kFloat));
    out.metrics["clip_ratio/low_min"] = NanExtreme(masked_seq_mean(is_low_clipped.to(at::kFloat)), true);
    out.metrics["clip_ratio/high_max"] = NanExtreme(masked_seq_mean(is_high_clipped.to(at::kFloat)), false);
    out.loss = std::move(loss);
    return out;
  });
}

}  // namespace ferry::grpo
