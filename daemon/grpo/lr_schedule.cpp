#include "daemon/grpo/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

namespace ferry::grpo {

double LrMultiplier(LrSchedule schedule, int64_t s, int64_t warmup_steps, int64_t total_steps) {
  if (schedule == LrSchedule::kConstant) return 1.0;
  if (s < warmup_steps) return static_cast<double>(s) / std::max(1.0, static_cast<double>(warmup_steps));
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  switch (schedule) {
    case LrSchedule::kLinear: return std::max(0.0, static_cast<double>(total_steps - s) / span);
    case LrSchedule::kCosine: {
      const double progress = static_cast<double>(s - warmup_steps) / span;
      return std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * 0.5 * 2.0 * progress)));
    }
    case LrSchedule::kConstant:
    case LrSchedule::kConstantWithWarmup: break;
  }
  return 1.0;
}

}  // namespace ferry::grpo
