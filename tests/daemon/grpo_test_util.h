// The GRPO fixture (fixtures/grpo/: TRL 1.16.0's own outputs, see its README) and the
// comparisons the GRPO tests share.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/grpo/grpo_math.h"

namespace ferry::testing {

// |actual - expected| <= kGrpoTolerance * max(1, scale), where scale is |expected| for
// ToleranceScale::kElement (absolute below 1, relative above) and the largest |expected| in the
// tensor for kTensor (normwise: for fp32 sums whose rounding grows with their terms, not their
// result).
inline constexpr double kGrpoTolerance = 1e-6;
enum class ToleranceScale { kElement, kTensor };

struct GrpoCase {
  std::string name;
  std::string kind;   // rewards | mismatch | loss | logprobs_logits | logprobs_fused
  std::string dtype;  // float32 | float64
  nlohmann::json config;
  std::map<std::string, at::Tensor> tensors;                // by the name in index.json, CPU copies
  grpo::Metrics metrics;                                    // null in the JSON (NaN in TRL) -> NaN
  grpo::Metrics mismatch_metrics;                           // loss cases with the mismatch correction
  const at::Tensor& tensor(const std::string& name) const;  // fails the test when absent
  bool has(const std::string& name) const { return tensors.count(name) != 0; }
};

// Every case of `kind`, loaded once from FERRY_FIXTURES_DIR/grpo (fails the test on a load error).
std::vector<const GrpoCase*> GrpoCases(std::string_view kind);

// Expects `actual` to have expected's shape and dtype and every element within
// kGrpoTolerance (NaN only where expected is NaN). `what` names the case and tensor.
void ExpectTensorNear(const at::Tensor& actual, const at::Tensor& expected, const std::string& what,
                      ToleranceScale scale = ToleranceScale::kElement);

// Expects exactly the keys of `expected`, each value within kGrpoTolerance (NaN matches NaN).
void ExpectMetricsNear(const grpo::Metrics& actual, const grpo::Metrics& expected, const std::string& what);

// A JSON number or null as an optional.
std::optional<double> OptionalNumber(const nlohmann::json& j);

}  // namespace ferry::testing
