// daemon/grpo/optimizer.h against LibTorch's own AdamW and clip_grad_norm_ arithmetic.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <vector>

#include "daemon/grpo/optimizer.h"

namespace ferry::grpo {
namespace {

std::vector<at::Tensor> Params() {
  at::manual_seed(21);
  return {at::randn({8, 40}).requires_grad_(true), at::randn({40, 8}).requires_grad_(true),
          at::randn({13}).requires_grad_(true)};
}

double MaxRelError(const at::Tensor& got, const at::Tensor& want) {
  return ((got - want).abs().max() / want.abs().max()).item<double>();
}

TEST(AdamWStepTest, TenStepsEqualLibTorchsAdamWAndKeepItsState) {
  std::vector<at::Tensor> mine = Params(), theirs = Params();
  const auto options = torch::optim::AdamWOptions(3e-2).betas({0.9, 0.99}).eps(1e-6).weight_decay(0.1);
  torch::optim::AdamW a(mine, options), b(theirs, options);
  at::manual_seed(22);
  for (int step = 1; step <= 10; ++step) {
    for (size_t i = 0; i < mine.size(); ++i) {
      if (i == 2 && step % 3 == 0) continue;  // a parameter without a gradient this step is left alone
      const at::Tensor g = at::randn(mine[i].sizes()) * (step % 2 ? 1.0 : 1e-3);
      mine[i].mutable_grad() = g.clone();
      theirs[i].mutable_grad() = g.clone();
    }
    for (auto& group : a.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(3e-2 / step);
    for (auto& group : b.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(3e-2 / step);
    AdamWStep(a);
    b.step();
    for (at::Tensor& p : theirs) p.mutable_grad().reset();  // zero_grad(set_to_none=True), as PyTorch 2 does
    for (size_t i = 0; i < mine.size(); ++i) {
      EXPECT_FALSE(mine[i].grad().defined()) << "the gradients are reset";
      EXPECT_LT(MaxRelError(mine[i].detach(), theirs[i].detach()), 1e-6) << "step " << step << " param " << i;
    }
  }
  // The moments sit where LibTorch's AdamW keeps them (checkpoints save them from there).
  for (size_t i = 0; i < mine.size(); ++i) {
    auto it = a.state().find(StateKey(mine[i]));
    ASSERT_NE(it, a.state().end());
    const auto& sa = static_cast<torch::optim::AdamWParamState&>(*it->second);
    const auto& sb = static_cast<torch::optim::AdamWParamState&>(*b.state().at(StateKey(theirs[i])));
    EXPECT_EQ(sa.step(), i == 2 ? 7 : 10);  // skipped without a gradient
    EXPECT_EQ(sa.step(), sb.step());
    EXPECT_LT(MaxRelError(sa.exp_avg(), sb.exp_avg()), 1e-6);
    EXPECT_LT(MaxRelError(sa.exp_avg_sq(), sb.exp_avg_sq()), 1e-6);
  }
}

TEST(ClipGradNormTest, NormAndClippedGradientsEqualLibTorchs) {
  for (double max_norm : {0.0, 0.5, 1e6}) {
    std::vector<at::Tensor> mine = Params(), theirs = Params();
    at::manual_seed(23);
    for (size_t i = 0; i < mine.size(); ++i) {
      const at::Tensor g = at::randn(mine[i].sizes());
      mine[i].mutable_grad() = g.clone();
      theirs[i].mutable_grad() = g.clone();
    }
    // clip_grad_norm_'s own ops
    std::vector<at::Tensor> norms;
    for (const at::Tensor& p : theirs) norms.push_back(p.grad().norm(2));
    const at::Tensor total = at::stack(norms).norm(2);
    if (max_norm > 0) {
      const at::Tensor coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
      for (const at::Tensor& p : theirs) p.grad().mul_(coef);
    }
    const double norm = ClipGradNorm(mine, max_norm);
    EXPECT_NEAR(norm, total.item<double>(), 1e-6 * norm) << max_norm;
    for (size_t i = 0; i < mine.size(); ++i) {
      EXPECT_LT(MaxRelError(mine[i].grad(), theirs[i].grad()), 1e-6) << max_norm;
    }
    if (max_norm == 0.5) {  // clipped: the norm after is max_norm
      double after = 0;
      for (const at::Tensor& p : mine) after += p.grad().pow(2).sum().item<double>();
      EXPECT_NEAR(std::sqrt(after), 0.5, 1e-5);
    }
  }
}

}  // namespace
}  // namespace ferry::grpo
