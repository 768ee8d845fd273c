// Learning-rate schedules as transformers' get_scheduler computes them (optimization.py): the
// multiplier of the base learning rate for the optimizer step about to be taken.
//   constant                 1
//   constant_with_warmup     s / max(1, W) while s < W, then 1
//   linear                   s / max(1, W) while s < W, then max(0, (N - s) / max(1, N - W))
//   cosine                   s / max(1, W) while s < W, then max(0, 0.5 (1 + cos(pi * 2 * 0.5 * p))),
//                            p = (s - W) / max(1, N - W)
// s is the number of optimizer steps already taken (the first step uses s = 0, so a warmup
// starts at 0), W the warmup steps (run/config.h WarmupSteps), N the total steps.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/status.h"
#include "daemon/run/config.h"

namespace ferry::grpo {

// transformers' lr_scheduler_type, as the run config parsed it (daemon/run/config.h).
using LrSchedule = run::LrSchedule;

double LrMultiplier(LrSchedule schedule, int64_t s, int64_t warmup_steps, int64_t total_steps);

}  // namespace ferry::grpo
