#include "daemon/grpo/optimizer.h"

#include <ATen/core/grad_mode.h>

#include <cmath>
#include <memory>
#include <sstream>

#include "kernels/adamw.h"

namespace ferry::grpo {
namespace {

bool IsPlainF32(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && !t.is_sparse();
}

// A template, so that the branch for the other LibTorch is discarded.
template <typename Key>
Key StateKeyOf(const at::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;  // what 1.13's c10::guts::to_string does
    key << p.unsafeGetTensorImpl();
    return key.str();
  } else {
    return p.unsafeGetTensorImpl();
  }
}

}  // namespace

OptimizerStateKey StateKey(const at::Tensor& p) { return StateKeyOf<OptimizerStateKey>(p); }

double ClipGradNorm(const std::vector<at::Tensor>& params, double max_norm) {
  std::vector<at::Tensor> grads;
  bool plain = true;
  for (const at::Tensor& p : params) {
    if (!p.grad().defined()) continue;
    grads.push_back(p.grad());
    plain = plain && IsPlainF32(grads.back());
  }
  if (grads.empty()) return 0;
  if (!plain) {
    std::vector<at::Tensor> norms;
    for (const at::Tensor& g : grads) norms.push_back(g.detach().norm(2));
    const at::Tensor total = at::stack(norms).norm(2);
    if (max_norm > 0) {
      const at::Tensor coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
      for (const at::Tensor& g : grads) g.detach().mul_(coef);
    }
    return total.item<double>();
  }
  // The sum of squares in double (LibTorch sums each tensor's in float: the norms agree to
  // float rounding).
  double sum = 0;
  for (const at::Tensor& g : grads) sum += kernels::SumOfSquares(g.data_ptr<float>(), g.numel());
  const double total = std::sqrt(sum);
  if (max_norm > 0) {
    const float coef = static_cast<float>(max_norm / (static_cast<double>(static_cast<float>(total)) + 1e-6));
    if (coef < 1.0f) {
      for (const at::Tensor& g : grads) kernels::Scale(g.data_ptr<float>(), g.numel(), coef);
    }
  }
  return total;
}

void AdamWStep(torch::optim::AdamW& optimizer) {
  at::NoGradGuard no_grad;
  bool plain = true;
  for (auto& group : optimizer.param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    plain = plain && !o.amsgrad();
    for (const at::Tensor& p : group.params()) {
      if (p.grad().defined()) plain = plain && IsPlainF32(p) && IsPlainF32(p.grad());
    }
  }
  if (!plain) {
    optimizer.step();
  } else {
    auto& state = optimizer.state();
    for (auto& group : optimizer.param_groups()) {
      const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
      for (at::Tensor& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto it = state.find(StateKey(p));
        if (it == state.end()) {
          // As AdamW::step initialises it.
          auto s = std::make_unique<torch::optim::AdamWParamState>();
          s->step(0);
          s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
          s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
          it = state.emplace(StateKey(p), std::move(s)).first;
        }
        auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
        s.step(s.step() + 1);
        kernels::AdamWScalars k;
        k.lr = o.lr();
        k.beta1 = std::get<0>(o.betas());
        k.beta2 = std::get<1>(o.betas());
        k.eps = o.eps();
        k.weight_decay = o.weight_decay();
        k.step = s.step();
        at::Tensor& m = s.exp_avg();
        at::Tensor& v = s.exp_avg_sq();
        if (!IsPlainF32(m) || !IsPlainF32(v) || m.numel() != p.numel() || v.numel() != p.numel()) {
          m = m.to(at::kFloat).contiguous().clone();  // a state loaded in another layout
          v = v.to(at::kFloat).contiguous().clone();
        }
        kernels::AdamWUpdate(p.data_ptr<float>(), p.grad().data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                             p.numel(), k);
      }
    }
  }
  for (auto& group : optimizer.param_groups()) {
    for (at::Tensor& p : group.params()) p.mutable_grad().reset();
  }
}

}  // namespace ferry::grpo
