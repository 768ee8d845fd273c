#include "tests/daemon/grpo_test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>

#include "core/safetensors.h"
#include "daemon/runtime/torch_util.h"

namespace ferry::testing {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct Loaded {
  std::vector<GrpoCase> cases;
  std::string error;
};

grpo::Metrics ParseMetrics(const nlohmann::json& j) {
  grpo::Metrics m;
  for (const auto& [key, value] : j.items()) m[key] = value.is_null() ? kNaN : value.get<double>();
  return m;
}

Loaded Load() {
  Loaded out;
  const std::filesystem::path dir = std::filesystem::path(FERRY_FIXTURES_DIR) / "grpo";
  std::ifstream in(dir / "index.json");
  if (!in) {
    out.error = "cannot open " + (dir / "index.json").string();
    return out;
  }
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    out.error = std::string("index.json: ") + e.what();
    return out;
  }
  auto file = SafetensorsFile::Open(dir / "grpo.safetensors");
  if (!file.ok()) {
    out.error = file.status().ToString();
    return out;
  }
  for (const nlohmann::json& c : index.at("cases")) {
    GrpoCase gc;
    gc.name = c.at("name").get<std::string>();
    gc.kind = c.at("kind").get<std::string>();
    gc.dtype = c.at("dtype").get<std::string>();
    gc.config = c.at("config");
    gc.metrics = ParseMetrics(c.at("metrics"));
    if (c.contains("mismatch_metrics")) gc.mismatch_metrics = ParseMetrics(c.at("mismatch_metrics"));
    for (const auto& [key, value] : c.at("tensors").items()) {
      const std::string stored = gc.name + "." + value.get<std::string>();
      auto t = (*file)->Get(stored);
      if (!t.ok()) {
        out.error = t.status().ToString();
        return out;
      }
      auto torch_t = runtime::ToTorch(*t, at::kCPU);
      if (!torch_t.ok()) {
        out.error = stored + ": " + torch_t.status().ToString();
        return out;
      }
      gc.tensors[key] = torch_t->clone();  // own the bytes: the mapping goes away with `file`
    }
    out.cases.push_back(std::move(gc));
  }
  return out;
}

const Loaded& Fixture() {
  static const Loaded loaded = Load();
  return loaded;
}

}  // namespace

const at::Tensor& GrpoCase::tensor(const std::string& name) const {
  auto it = tensors.find(name);
  if (it == tensors.end()) {
    ADD_FAILURE() << name << ": no tensor " << name;
    static const at::Tensor undefined;
    return undefined;
  }
  return it->second;
}

std::vector<const GrpoCase*> GrpoCases(std::string_view kind) {
  const Loaded& f = Fixture();
  EXPECT_TRUE(f.error.empty()) << f.error;
  std::vector<const GrpoCase*> out;
  for (const GrpoCase& c : f.cases) {
    if (c.kind == kind) out.push_back(&c);
  }
  EXPECT_FALSE(out.empty()) << "no fixture case of kind " << kind;
  return out;
}

void ExpectTensorNear(const at::Tensor& actual, const at::Tensor& expected, const std::string& what,
                      ToleranceScale scale) {
  ASSERT_TRUE(actual.defined()) << what << ": undefined";
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_EQ(actual.scalar_type(), expected.scalar_type()) << what;
  const at::Tensor a = actual.detach().cpu().to(at::kDouble).contiguous().reshape({-1});
  const at::Tensor e = expected.cpu().to(at::kDouble).contiguous().reshape({-1});
  const double* pa = a.data_ptr<double>();
  const double* pe = e.data_ptr<double>();
  double largest = 0;
  for (int64_t i = 0; i < e.numel(); ++i) {
    if (!std::isnan(pe[i])) largest = std::max(largest, std::abs(pe[i]));
  }
  int failures = 0;
  for (int64_t i = 0; i < e.numel() && failures < 5; ++i) {
    const double s = scale == ToleranceScale::kElement ? std::abs(pe[i]) : largest;
    const bool ok =
        std::isnan(pe[i]) ? std::isnan(pa[i]) : std::abs(pa[i] - pe[i]) <= kGrpoTolerance * std::max(1.0, s);
    if (!ok) {
      ++failures;
      ADD_FAILURE() << what << " [flat " << i << "]: got " << pa[i] << ", TRL " << pe[i] << " (diff " << pa[i] - pe[i]
                    << ")";
    }
  }
}

void ExpectMetricsNear(const grpo::Metrics& actual, const grpo::Metrics& expected, const std::string& what) {
  for (const auto& [key, value] : expected) {
    auto it = actual.find(key);
    if (it == actual.end()) {
      ADD_FAILURE() << what << ": metric " << key << " missing";
      continue;
    }
    if (std::isnan(value)) {
      EXPECT_TRUE(std::isnan(it->second)) << what << ": " << key << " = " << it->second << ", TRL NaN";
    } else {
      EXPECT_NEAR(it->second, value, kGrpoTolerance * std::max(1.0, std::abs(value))) << what << ": " << key;
    }
  }
  for (const auto& [key, value] : actual) {
    EXPECT_TRUE(expected.count(key)) << what << ": metric " << key << " = " << value << " is not one TRL logs";
  }
}

std::optional<double> OptionalNumber(const nlohmann::json& j) {
  if (j.is_null()) return std::nullopt;
  return j.get<double>();
}

}  // namespace ferry::testing
