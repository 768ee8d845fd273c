// The calibration figure the LibTorch benches print before and after their measurements: these
// machines' speed drifts (a fixed GEMM swung from 170 to 30 GFLOP/s within minutes), so a
// ratio is read beside it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <vector>

#include "bench/bench_util.h"

namespace ferry::bench {

// F32 GEMM GFLOP/s (512 x 1024 x 1024, median of 7) on LibTorch's current thread count.
inline double CalibrationGflops() {
  at::NoGradGuard no_grad;
  const at::Tensor a = at::rand({512, 1024});
  const at::Tensor b = at::rand({1024, 1024});
  at::Tensor c = at::mm(a, b);
  std::vector<double> runs;
  for (int i = 0; i < 7; ++i) runs.push_back(Seconds([&] { c = at::mm(a, b); }));
  return 2.0 * 512 * 1024 * 1024 / Median(runs) / 1e9;
}

}  // namespace ferry::bench
