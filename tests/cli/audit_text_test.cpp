// `ferry audit` and `ferry audit --json`: the report rendered as terminal text and as JSON
// (cli/audit_text.h), over reports the store's analysis builds from constructed records.
#include "cli/audit_text.h"

#include <gtest/gtest.h>

#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/store/audit_test_util.h"

namespace ferry::cli {
namespace {

using store::AnalyzeAudit;
using store::AuditReport;
using store::Digest;
using store::TensorRow;
using store::VersionKind;
using store::VersionRecord;
using store::testing::kSteps;
using store::testing::TrainingRun;

TEST(AuditText, GapsAreListedByRun) {
  AuditReport r;
  r.gaps = {{"r", 3, 4}, {"s", 7, 7}};
  const std::string text = AuditToText(r);
  EXPECT_NE(text.find("run r: missing 3..4"), std::string::npos) << text;
  EXPECT_NE(text.find("run s: missing 7\n"), std::string::npos) << text;
}

// A timeline row holds all of a step's metrics (ferryd records about 30, TRL's names), each
// version on its own line: the row was cut at 511 bytes and ran into the next.
// A ferryd run whose generator is a vLLM server: each step taken by its proof ("ferryd proven"),
// each merged version's row naming the server that served it.
TEST(AuditText, EngineProofsShowInTheStepsAndTheTimeline) {
  TrainingRun run;
  run.Build(3, /*engine=*/true);
  const std::string text = AuditToText(run.Audit());
  EXPECT_NE(text.find("  ferryd proven (0)\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("none acknowledged a step"), std::string::npos) << text;
  EXPECT_EQ(text.find("(no receiver recorded)"), std::string::npos) << text;
  const size_t row = text.find("  r             5        2  ");  // step 2's merged version
  ASSERT_NE(row, std::string::npos) << text;
  EXPECT_NE(text.substr(row, text.find('\n', row) - row)
                .find("  served by vllm http://127.0.0.1:8000 as ferry-" + TrainingRun::Merged(2).Hex().substr(0, 12)),
            std::string::npos)
      << text;
}

TEST(AuditText, ATimelineRowHoldsEveryMetric) {
  AuditReport r;
  for (int i = 0; i < 2; ++i) {
    store::TimelineEntry e;
    e.version.id = Digest{static_cast<uint64_t>(i + 1), 1};
    e.version.run = "a-run-name-longer-than-its-column";
    e.version.sequence = static_cast<uint64_t>(i + 1);
    e.version.step = i + 1;
    e.version.kind = VersionKind::kAdapter;
    for (int k = 0; k < 40; ++k) e.version.metrics["timing/phase_number_" + std::to_string(k)] = 0.125 * k;
    r.timeline.push_back(e);
  }
  const std::string text = AuditToText(r);
  for (int i = 0; i < 2; ++i) {
    const std::string start =
        "  a-run-name-longer-than-its-column    " + std::to_string(i + 1) + "        " + std::to_string(i + 1) + "  ";
    const size_t at = text.find(start);
    ASSERT_NE(at, std::string::npos) << text;
    const std::string row = text.substr(at, text.find('\n', at) - at);
    EXPECT_GT(row.size(), 1000u);
    EXPECT_NE(row.find("timing/phase_number_0=0 "), std::string::npos) << row;
    EXPECT_TRUE(row.ends_with(" timing/phase_number_9=1.125")) << row;  // the last in name order
  }
}

// A base and a step-4 adapter whose lora_B is all zero (a zero_adapter anomaly).
TEST(AuditJson, JsonReport) {
  VersionRecord base;
  base.id = Digest{1, 1};
  base.run = "r";
  base.sequence = 1;
  base.kind = VersionKind::kBase;
  base.tensors = {TensorRow{"layers.0.q_proj.weight", DType::kF32, {2, 2}, Digest{5, 5}, 16, 5.477, 0, false}};
  VersionRecord adapter;
  adapter.id = Digest{2, 2};
  adapter.run = "r";
  adapter.sequence = 2;
  adapter.kind = VersionKind::kAdapter;
  adapter.step = 4;
  adapter.base_version = base.id;
  adapter.metrics = {{"reward_mean", 0.25}};
  adapter.tensors = {
      TensorRow{"base_model.model.layers.0.q_proj.lora_A.weight", DType::kF32, {1, 2}, Digest{6, 6}, 8, 1, 0, false},
      TensorRow{"base_model.model.layers.0.q_proj.lora_B.weight", DType::kF32, {2, 1}, Digest{7, 7}, 8, 0, 0, true}};
  auto r = AnalyzeAudit({base, adapter}, {}, {}, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto j = nlohmann::json::parse(AuditToJson(*r));
  for (const char* k : {"run", "timeline", "receivers", "gaps", "never_acknowledged", "anomalies"}) {
    EXPECT_TRUE(j.contains(k)) << k;
  }
  EXPECT_EQ(j["timeline"].size(), 2u);
  EXPECT_EQ(j["timeline"][1]["metrics"]["reward_mean"], 0.25);
  EXPECT_EQ(j["anomalies"][0]["kind"], "zero_adapter");
}

TEST(AuditJson, JsonCarriesStepsGeneratorsAndAnomalySteps) {
  TrainingRun run;
  run.metrics[7]["loss"] = std::numeric_limits<double>::infinity();
  run.Build();
  auto j = nlohmann::json::parse(AuditToJson(run.Audit()));
  ASSERT_EQ(j["steps"].size(), static_cast<size_t>(kSteps + 1));
  const auto& s7 = j["steps"][7];
  EXPECT_EQ(s7["step"], 7);
  EXPECT_EQ(s7["adapter_version"], TrainingRun::Adapter(7).Hex());
  EXPECT_EQ(s7["merged_version"], TrainingRun::Merged(7).Hex());
  EXPECT_TRUE(s7["metrics"]["loss"].is_null());
  EXPECT_EQ(s7["metrics"]["learning_rate"], 1e-3);
  ASSERT_EQ(s7["acks"].size(), 1u);
  EXPECT_EQ(s7["acks"][0]["receiver"], "colocated");
  EXPECT_EQ(s7["acks"][0]["event"], "acknowledged");
  EXPECT_EQ(s7["acks"][0]["lag"], 0);
  EXPECT_EQ(s7["acks"][0]["digest_matched"], true);
  EXPECT_EQ(j["generators"][0]["receiver"], "colocated");
  EXPECT_EQ(j["generators"][0]["last_step"], kSteps);
  ASSERT_EQ(j["anomalies"].size(), 1u);
  EXPECT_EQ(j["anomalies"][0]["kind"], "nonfinite_loss");
  EXPECT_EQ(j["anomalies"][0]["step"], 7);
}

TEST(AuditJson, AuditJsonOfTextThatIsNotUtf8DoesNotThrow) {
  AuditReport report;
  report.run = "rl-\xff";  // a --run filter as the user typed it
  std::string text;
  ASSERT_NO_THROW(text = AuditToJson(report));
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(j.is_object()) << text;
  EXPECT_EQ(j["run"], "rl-\xef\xbf\xbd");
}

}  // namespace
}  // namespace ferry::cli
