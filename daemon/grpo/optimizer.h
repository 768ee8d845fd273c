// The trainer's optimizer step on the adapter's parameters: torch.nn.utils.clip_grad_norm_
// and torch.optim.AdamW (through LibTorch's AdamW object and its state, which checkpoints
// save), run for F32 CPU parameters as one loop per tensor instead of ~10 LibTorch ops each:
// a demo adapter has 56 small tensors, and dispatching ~1,100 ops cost more than their
// arithmetic. Other parameters take LibTorch's own ops.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <string>
#include <type_traits>
#include <vector>

namespace ferry::grpo {

// The key of parameter `p` in an optimizer's state: LibTorch 1.13 keys it by the TensorImpl
// address printed as a string, LibTorch 2.x by the address itself.
using OptimizerStateKey = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;
OptimizerStateKey StateKey(const at::Tensor& p);

// clip_grad_norm_ (as TRL's accelerator calls it): the 2-norm of all gradients together; when
// max_norm > 0, every gradient scaled by min(1, max_norm / (norm + 1e-6)). Returns the norm
// before clipping.
double ClipGradNorm(const std::vector<at::Tensor>& params, double max_norm);

// optimizer.step() then zero_grad() with set_to_none (PyTorch's default since 2.0): the next
// backward writes fresh gradients instead of adding to zeroed ones.
void AdamWStep(torch::optim::AdamW& optimizer);

}  // namespace ferry::grpo
