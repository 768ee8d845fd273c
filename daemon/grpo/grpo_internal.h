// Argument checks shared by the GRPO maths files (not a public API); their LibTorch error edge is
// runtime::GuardTorch (daemon/runtime/torch_util.h).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <string_view>

#include "core/status.h"

namespace ferry::grpo::internal {

// kInvalidArgument "<what>: <name> is undefined" unless `t` is defined.
Status CheckDefined(std::string_view what, const at::Tensor& t, std::string_view name);

// kInvalidArgument unless `t` is a floating tensor (F16, BF16, F32, F64).
Status CheckFloating(std::string_view what, const at::Tensor& t, std::string_view name);

// kInvalidArgument unless `t` has exactly `sizes`.
Status CheckSizes(std::string_view what, const at::Tensor& t, std::string_view name, at::IntArrayRef sizes);

// kInvalidArgument unless `t` lives on `device`.
Status CheckDevice(std::string_view what, const at::Tensor& t, std::string_view name, const at::Device& device);

// "[2, 3]".
std::string SizesString(at::IntArrayRef sizes);

// The mask as TRL holds it: int64 0/1 (any nonzero value counts as 1).
at::Tensor LongMask(const at::Tensor& mask);

}  // namespace ferry::grpo::internal
