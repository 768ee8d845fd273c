// Activation checkpointing for the trainer: run a block without keeping its activations and
// recompute it during the backward pass (memory for one block instead of all of them).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

namespace ferry::runtime {

// Returns fn(x). When autograd records (x or a parameter requires grad), the forward runs
// without recording and the backward recomputes fn from the saved `x` to get the gradients
// of `x` and `params` (the trainable tensors fn reads besides x). Randomness (dropout) is
// replayed identically: the default CPU generator's state is saved before the forward and
// restored for the recomputation. REQUIRES: fn reads no trainable tensor outside `params`,
// and everything fn captures stays alive until the backward pass has run.
at::Tensor Checkpointed(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x,
                        const std::vector<at::Tensor>& params);

}  // namespace ferry::runtime
