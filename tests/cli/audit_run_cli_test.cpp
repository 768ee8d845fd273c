// `ferry audit --run NAME [--json] [--html FILE]` on a training run recorded in a store the
// way ferryd records one (the base, then per step the adapter's bytes and the merged version
// by its digests, both with the step's metrics; the in-process generator's acknowledgement
// before each step is committed, a remote generator's after): the JSON's steps, generators and
// anomalies, and the HTML page's six per-step plots and step table.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/checkpoint.h"
#include "core/file_util.h"
#include "store/store.h"
#include "tests/cli/cli_runner.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;
using store::Digest;
using store::Event;
using testing::RunFerry;

constexpr int kSteps = 6;

Tensor F32(const Shape& shape, const std::vector<float>& values) {
  auto t = Tensor::Empty(DType::kF32, shape);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  std::memcpy(t->mutable_data(), values.data(), values.size() * sizeof(float));
  return *t;
}

class AuditRunCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("ferry_audit_run_cli_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    db_ = (dir_ / "db").string();
    store::StoreOptions o;
    o.create_if_missing = true;
    o.sync_objects = false;
    auto s = store::Store::Open(db_, o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(*s);
  }
  void TearDown() override {
    store_.reset();
    fs::remove_all(dir_);
  }

  void AddEvent(Event::Type type, const Digest& v, const std::string& receiver, int64_t t) {
    Event e;
    e.type = type;
    e.version = v;
    e.receiver = receiver;
    if (type != Event::Type::kPublished) e.computed = v;
    e.time_ns = t;
    ASSERT_TRUE(store_->AddEvent(e).ok());
  }

  // Records step `n` of run "grpo" as ferryd does: the adapter's bytes (scaled by `scale`),
  // then the merged version by its digests, both with the step's metrics (step 4's loss is
  // NaN). Returns (adapter, merged) and their commit times.
  struct RecordedStep {
    Digest adapter, merged;
    int64_t adapter_time = 0, merged_time = 0;
  };
  RecordedStep RecordStep(int n, float scale = 1.0f) {
    const float x = 0.01f * static_cast<float>(n) * scale;
    std::map<std::string, double> metrics = {{"reward", 0.5 + 0.01 * n},
                                             {"reward_std", 0.3},
                                             {"frac_reward_zero_std", 0.25},
                                             {"kl", 0.001 * n},
                                             {"entropy", 1.5 - 0.01 * n},
                                             {"completions/mean_length", 4 + n},
                                             {"sampling/sampling_logp_difference/mean", 1e-6 * n},
                                             {"learning_rate", 1e-3},
                                             {"loss", n == 4 ? std::numeric_limits<double>::quiet_NaN() : 0.01},
                                             {"grad_norm", 0.5}};
    store::ImportOptions ao;
    ao.run = "grpo";
    ao.kind = store::VersionKind::kAdapter;
    ao.source = store::VersionSource::kDaemon;
    ao.step = n;
    ao.base_version = base_;
    ao.metrics = metrics;
    auto adapter = store_->ImportCheckpoint(
        Checkpoint::FromTensors("adapter", {{"base_model.model.w.lora_A.weight", F32({1, 2}, {x, 0})},
                                            {"base_model.model.w.lora_B.weight", F32({2, 1}, {x, 0})}}),
        {{"adapter_config.json", R"({"peft_type":"LORA","r":1,"lora_alpha":1,"target_modules":["w"]})"}}, ao);
    EXPECT_TRUE(adapter.ok()) << adapter.status().ToString();
    if (!adapter.ok()) return {};
    Tensor merged = F32({2, 2}, {1 + x * x, 2, 3, 4});
    store::TensorRow row;
    row.name = "w";
    row.dtype = DType::kF32;
    row.shape = {2, 2};
    row.digest = store::TensorDigest(merged);
    row.nbytes = 16;
    store::ImportOptions mo = ao;
    mo.kind = store::VersionKind::kMerged;
    mo.adapter_version = adapter->record.id;
    auto m = store_->RecordDerived({row}, {{"config.json", "{}"}}, mo);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (!m.ok()) return {};
    return {adapter->record.id, m->record.id, adapter->record.time_ns, m->record.time_ns};
  }

  // Records run "grpo" as ferryd does (the store stays open when `keep_open`).
  void RecordRun(bool keep_open = false) {
    store::ImportOptions bo;
    bo.run = "grpo";
    bo.kind = store::VersionKind::kBase;
    auto base = store_->ImportCheckpoint(Checkpoint::FromTensors("base", {{"w", F32({2, 2}, {1, 2, 3, 4})}}),
                                         {{"config.json", "{}"}}, bo);
    ASSERT_TRUE(base.ok()) << base.status().ToString();
    base_ = base->record.id;
    std::vector<int64_t> committed;     // commit time of each step's merged version
    std::vector<int64_t> adapter_time;  // and of its adapter (recorded first)
    for (int n = 1; n <= kSteps; ++n) {
      const RecordedStep step = RecordStep(n);
      ASSERT_FALSE(::testing::Test::HasFailure());
      adapters_.push_back(step.adapter);
      merged_.push_back(step.merged);
      committed.push_back(step.merged_time);
      adapter_time.push_back(step.adapter_time);
    }
    // The in-process generator: the base, then each step just before it was committed (ferryd
    // records a step after its generator acknowledged it).
    AddEvent(Event::Type::kPublished, base_, "", base->record.time_ns + 1);
    AddEvent(Event::Type::kAcknowledged, base_, "colocated", base->record.time_ns + 2);
    for (int n = 1; n <= kSteps; ++n) {
      AddEvent(Event::Type::kPublished, merged_[n - 1], "", adapter_time[n - 1] - 2);
      AddEvent(Event::Type::kAcknowledged, merged_[n - 1], "colocated", adapter_time[n - 1] - 1);
    }
    // A remote generator acknowledges step N once step N + 1 is committed (lag 1), up to step 5.
    for (int n = 1; n < kSteps; ++n)
      AddEvent(Event::Type::kAcknowledged, merged_[n - 1], "remote-gen", committed[n] + 1);
    if (!keep_open) store_.reset();
  }

  fs::path dir_;
  std::string db_;
  std::unique_ptr<store::Store> store_;
  Digest base_;
  std::vector<Digest> adapters_, merged_;
};

TEST_F(AuditRunCli, JsonCarriesStepsAcknowledgementsLagAndAnomalies) {
  RecordRun();
  auto r = RunFerry({"audit", "--db", db_, "--run", "grpo", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["run"], "grpo");
  ASSERT_EQ(j["steps"].size(), static_cast<size_t>(kSteps + 1));
  EXPECT_EQ(j["steps"][0]["step"], 0);
  EXPECT_EQ(j["steps"][0]["merged_version"], base_.Hex());
  const auto& s3 = j["steps"][3];
  EXPECT_EQ(s3["step"], 3);
  EXPECT_EQ(s3["adapter_version"], adapters_[2].Hex());
  EXPECT_EQ(s3["merged_version"], merged_[2].Hex());
  EXPECT_DOUBLE_EQ(s3["metrics"]["reward"].get<double>(), 0.53);
  EXPECT_DOUBLE_EQ(s3["metrics"]["kl"].get<double>(), 0.003);
  ASSERT_EQ(s3["acks"].size(), 2u);
  EXPECT_EQ(s3["acks"][0]["receiver"], "colocated");
  EXPECT_EQ(s3["acks"][0]["lag"], 0);
  EXPECT_EQ(s3["acks"][0]["version"], merged_[2].Hex());
  EXPECT_EQ(s3["acks"][0]["digest_matched"], true);
  EXPECT_EQ(s3["acks"][1]["receiver"], "remote-gen");
  EXPECT_EQ(s3["acks"][1]["lag"], 1);
  EXPECT_TRUE(j["steps"][4]["metrics"]["loss"].is_null());
  EXPECT_EQ(j["steps"][kSteps]["acks"].size(), 1u);  // the remote one never got the last step
  ASSERT_EQ(j["generators"].size(), 2u);
  EXPECT_EQ(j["generators"][0]["receiver"], "colocated");
  EXPECT_EQ(j["generators"][0]["last_step"], kSteps);
  EXPECT_EQ(j["generators"][1]["receiver"], "remote-gen");
  EXPECT_EQ(j["generators"][1]["last_step"], kSteps - 1);
  EXPECT_EQ(j["generators"][1]["max_lag"], 1);
  ASSERT_EQ(j["anomalies"].size(), 1u) << j["anomalies"].dump();
  EXPECT_EQ(j["anomalies"][0]["kind"], "nonfinite_loss");
  EXPECT_EQ(j["anomalies"][0]["step"], 4);
  EXPECT_EQ(j["anomalies"][0]["version"], merged_[3].Hex());

  // A stricter lag threshold flags the remote generator; --strict exits 2.
  auto strict = RunFerry({"audit", "--db", db_, "--run", "grpo", "--json", "--lag-threshold", "0", "--strict"});
  EXPECT_EQ(strict.exit_code, 2) << strict.err;
  auto js = nlohmann::json::parse(strict.out);
  ASSERT_EQ(js["anomalies"].size(), 3u) << js["anomalies"].dump();
  EXPECT_EQ(js["anomalies"][0]["kind"], "generator_behind");
  EXPECT_EQ(js["anomalies"][0]["step"], 2);
  EXPECT_EQ(js["anomalies"][1]["kind"], "generator_behind");
  EXPECT_EQ(js["anomalies"][1]["step"], kSteps);
  EXPECT_EQ(js["anomalies"][1]["message"],
            "receiver remote-gen last acknowledged step 5 but the run ended at step 6: 1 steps behind (rule: > 0)");

  auto bad = RunFerry({"audit", "--db", db_, "--run", "grpo", "--lag-threshold", "-1"});
  EXPECT_EQ(bad.exit_code, 1) << bad.out;
  EXPECT_NE(bad.err.find("--lag-threshold"), std::string::npos) << bad.err;
}

// `records` counts the recordings of a step: 1 for every step of a run (its adapter and the
// merged version made from it are one recording), 2 for a step a resumed run recorded again.
TEST_F(AuditRunCli, RecordsCountsAStepOnceUnlessAResumeRecordedItAgain) {
  RecordRun(/*keep_open=*/true);
  // Resumed from checkpoint 5: step 6 recorded again, with other bytes.
  const RecordedStep again = RecordStep(kSteps, 2.0f);
  ASSERT_FALSE(HasFailure());
  store_.reset();
  auto r = RunFerry({"audit", "--db", db_, "--run", "grpo", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["steps"].size(), static_cast<size_t>(kSteps + 1));
  for (int n = 0; n < kSteps; ++n) EXPECT_EQ(j["steps"][n]["records"], 1) << "step " << n;
  EXPECT_EQ(j["steps"][kSteps]["records"], 2);
  EXPECT_EQ(j["steps"][kSteps]["adapter_version"], again.adapter.Hex());
  EXPECT_EQ(j["steps"][kSteps]["merged_version"], again.merged.Hex());
}

TEST_F(AuditRunCli, HtmlHoldsTheSixStepPlotsAndTheStepTable) {
  RecordRun();
  const fs::path html = dir_ / "report.html";
  auto r = RunFerry({"audit", "--db", db_, "--run", "grpo", "--html", html.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("wrote " + html.string()), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("remote-gen: 5 acknowledgements, last step 5, max lag 1 steps"), std::string::npos) << r.out;
  auto page = ReadSmallFile(html);
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  const std::string& s = *page;
  const size_t steps = s.find("<h2 id=\"steps\">Training steps</h2>");
  ASSERT_NE(steps, std::string::npos);
  const size_t table = s.find("<table class=\"steps\">", steps);
  ASSERT_NE(table, std::string::npos);
  int plots = 0;
  for (size_t p = s.find("<svg class=\"metric\"", steps); p != std::string::npos && p < table;
       p = s.find("<svg class=\"metric\"", p + 1)) {
    ++plots;
  }
  EXPECT_EQ(plots, 6);
  for (const char* title : {">reward</text>", ">kl</text>", ">entropy</text>", ">completions/mean_length</text>",
                            ">sampling/sampling_logp_difference/mean</text>", ">learning_rate</text>"}) {
    const size_t at = s.find(title, steps);
    EXPECT_TRUE(at != std::string::npos && at < table) << title;
  }
  // One row per step (and the header), each step's versions and the remote lag shown.
  size_t rows = 0;
  const size_t table_end = s.find("</table>", table);
  for (size_t p = s.find("<tr>", table); p != std::string::npos && p < table_end; p = s.find("<tr>", p + 1)) ++rows;
  EXPECT_EQ(rows, static_cast<size_t>(kSteps + 2));
  EXPECT_NE(s.find(merged_[2].Hex().substr(0, 12), table), std::string::npos);
  EXPECT_NE(s.find("remote-gen</span> acknowledged", table), std::string::npos);
  EXPECT_NE(s.find("(lag 1)", table), std::string::npos);
  EXPECT_NE(s.find("nonfinite_loss", table), std::string::npos);
  EXPECT_EQ(s.find("<script"), std::string::npos);
}

}  // namespace
}  // namespace ferry
