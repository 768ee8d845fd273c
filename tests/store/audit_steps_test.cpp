// The audit of a training run (store/audit.h, AuditOptions::run): its steps as ferryd records
// them (an adapter and a merged version per step, with the step's metrics), the generators'
// acknowledgements with their lag, and the step rules (generator_behind, reward_collapse,
// nonfinite_loss, grad_norm_spike, digest_mismatch with its step), each on a constructed run
// with exactly one fault, and none on a healthy one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "store/audit.h"
#include "tests/store/audit_test_util.h"

namespace ferry::store {
namespace {

using testing::HealthyMetrics;
using testing::kStepNs;
using testing::kSteps;
using testing::TrainingRun;

std::vector<const Anomaly*> Of(const AuditReport& r, AnomalyKind k) {
  std::vector<const Anomaly*> out;
  for (const auto& a : r.anomalies) {
    if (a.kind == k) out.push_back(&a);
  }
  return out;
}

std::string All(const AuditReport& r) {
  std::string s;
  for (const auto& a : r.anomalies) s += std::string(AnomalyKindName(a.kind)) + ": " + a.message + "\n";
  return s;
}

TEST(AuditSteps, HealthyRunListsEveryStepAndNoAnomaly) {
  TrainingRun run;
  run.Build();
  AuditReport r = run.Audit();
  EXPECT_TRUE(r.anomalies.empty()) << All(r);
  ASSERT_EQ(r.steps.size(), static_cast<size_t>(kSteps + 1));
  // Step 0 is the acknowledged base.
  EXPECT_EQ(r.steps[0].step, 0);
  EXPECT_EQ(r.steps[0].merged_version, TrainingRun::Merged(0));
  EXPECT_FALSE(r.steps[0].adapter_version.has_value());
  const StepEntry& s5 = r.steps[5];
  EXPECT_EQ(s5.step, 5);
  EXPECT_EQ(s5.adapter_version, TrainingRun::Adapter(5));
  EXPECT_EQ(s5.merged_version, TrainingRun::Merged(5));
  EXPECT_EQ(s5.records, 1);  // the adapter and its merged version are one recording of the step
  EXPECT_EQ(s5.time_ns, 5 * kStepNs + 1);
  EXPECT_DOUBLE_EQ(s5.metrics.at("reward"), HealthyMetrics(5).at("reward"));
  ASSERT_EQ(s5.acks.size(), 1u);
  EXPECT_EQ(s5.acks[0].receiver, "colocated");
  EXPECT_EQ(s5.acks[0].version, TrainingRun::Merged(5));
  EXPECT_EQ(s5.acks[0].time_ns, 5 * kStepNs - 1);
  EXPECT_TRUE(s5.acks[0].digest_matched);
  EXPECT_EQ(s5.acks[0].lag, 0);  // acknowledged before the step was committed
  ASSERT_EQ(r.generators.size(), 1u);
  EXPECT_EQ(r.generators[0].receiver, "colocated");
  EXPECT_EQ(r.generators[0].acks, kSteps + 1);
  EXPECT_EQ(r.generators[0].last_step, kSteps);
  EXPECT_EQ(r.generators[0].max_lag, 0);
}

TEST(AuditSteps, NoStepsWithoutARunFilter) {
  TrainingRun run;
  run.Build();
  auto r = AnalyzeAudit(run.versions, run.events, {}, {});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->steps.empty());
  EXPECT_TRUE(r->generators.empty());
}

TEST(AuditSteps, NonFiniteLossNamesItsStep) {
  TrainingRun run;
  run.metrics[7]["loss"] = std::numeric_limits<double>::quiet_NaN();
  run.Build();
  AuditReport r = run.Audit();
  ASSERT_EQ(r.anomalies.size(), 1u) << All(r);
  EXPECT_EQ(r.anomalies[0].kind, AnomalyKind::kNonFiniteLoss);
  EXPECT_EQ(r.anomalies[0].step, 7);
  EXPECT_EQ(r.anomalies[0].version, TrainingRun::Merged(7));
  EXPECT_EQ(r.anomalies[0].message, "step 7 (version " + ShortId(TrainingRun::Merged(7)) + "): loss is NaN or Inf");
}

TEST(AuditSteps, GradNormSpikeOverTheRunningMedian) {
  TrainingRun run;
  run.metrics[20]["grad_norm"] = 50;
  run.Build();
  AuditReport r = run.Audit();
  ASSERT_EQ(r.anomalies.size(), 1u) << All(r);
  EXPECT_EQ(r.anomalies[0].kind, AnomalyKind::kGradNormSpike);
  EXPECT_EQ(r.anomalies[0].step, 20);
  EXPECT_NE(r.anomalies[0].message.find("step 20 (version " + ShortId(TrainingRun::Merged(20)) + "): grad_norm 50 is "),
            std::string::npos)
      << r.anomalies[0].message;
  EXPECT_NE(r.anomalies[0].message.find("of the previous 19 steps (rule: > 10x)"), std::string::npos)
      << r.anomalies[0].message;
  // A looser factor lets it pass.
  AuditOptions loose;
  loose.grad_spike_factor = 1000;
  EXPECT_TRUE(run.Audit(loose).anomalies.empty());
}

TEST(AuditSteps, RewardMovingMeanFallingFromItsBest) {
  TrainingRun run;
  for (int64_t n = 1; n <= kSteps; ++n) run.metrics[n]["reward"] = n <= 15 ? 0.8 : 0.2;
  run.Build();
  AuditReport r = run.Audit();
  // The 10-step moving mean is 0.8 up to step 15, then 0.74, 0.68, 0.62, 0.56 at step 19:
  // the first drop over 0.2. Flagged once.
  ASSERT_EQ(r.anomalies.size(), 1u) << All(r);
  EXPECT_EQ(r.anomalies[0].kind, AnomalyKind::kRewardCollapse);
  EXPECT_EQ(r.anomalies[0].step, 19);
  EXPECT_EQ(r.anomalies[0].message, "step 19 (version " + ShortId(TrainingRun::Merged(19)) +
                                        "): the reward's 10-step moving mean 0.56 is 0.24 below its best 0.8 (at "
                                        "step 10) (rule: a drop > 0.2)");
}

TEST(AuditSteps, RewardStdZeroInEveryGroupForNSteps) {
  TrainingRun run;
  for (int64_t n = 10; n <= 14; ++n) run.metrics[n]["frac_reward_zero_std"] = 1;
  for (int64_t n = 20; n <= 23; ++n) run.metrics[n]["frac_reward_zero_std"] = 1;  // 4 steps: not flagged
  run.Build();
  AuditReport r = run.Audit();
  ASSERT_EQ(r.anomalies.size(), 1u) << All(r);
  EXPECT_EQ(r.anomalies[0].kind, AnomalyKind::kRewardCollapse);
  EXPECT_EQ(r.anomalies[0].step, 14);
  EXPECT_NE(r.anomalies[0].message.find("reward std within every group is zero for 5 consecutive steps, step 10 to "
                                        "step 14"),
            std::string::npos)
      << r.anomalies[0].message;
  AuditOptions longer;
  longer.zero_std_steps = 6;
  EXPECT_TRUE(run.Audit(longer).anomalies.empty());
}

TEST(AuditSteps, RemoteGeneratorsLagAndFallingBehind) {
  TrainingRun run;
  run.Build();
  // remote-a acknowledges step N half a step after N+1 is committed: lag 1; but step 8 only
  // once step 12 is committed: lag 4.
  for (int64_t n = 1; n < kSteps; ++n) {
    const int64_t at = n == 8 ? 12 : n + 1;
    run.Ack("remote-a", TrainingRun::Merged(n), at * kStepNs + 500);
  }
  // remote-b acknowledges steps 1..3 and then nothing.
  for (int64_t n = 1; n <= 3; ++n) run.Ack("remote-b", TrainingRun::Merged(n), n * kStepNs + 600);
  AuditReport r = run.Audit();
  auto behind = Of(r, AnomalyKind::kGeneratorBehind);
  ASSERT_EQ(r.anomalies.size(), 2u) << All(r);
  ASSERT_EQ(behind.size(), 2u);
  EXPECT_EQ(behind[0]->step, 12);
  EXPECT_EQ(behind[0]->version, TrainingRun::Merged(8));
  EXPECT_EQ(behind[0]->message, "receiver remote-a acknowledged step 8 (version " + ShortId(TrainingRun::Merged(8)) +
                                    ") when the trainer was at step 12: 4 steps behind (rule: > 2)");
  // At the end of the run remote-a's last step is 29 (lag 1, fine), remote-b's is 3.
  EXPECT_EQ(behind[1]->step, kSteps);
  EXPECT_EQ(behind[1]->message,
            "receiver remote-b last acknowledged step 3 but the run ended at step 30: 27 steps behind (rule: > 2)");
  std::map<std::string, GeneratorSummary> g;
  for (const auto& x : r.generators) g[x.receiver] = x;
  ASSERT_EQ(g.size(), 3u);
  EXPECT_EQ(g["remote-a"].last_step, 29);
  EXPECT_EQ(g["remote-a"].max_lag, 4);
  EXPECT_EQ(g["remote-b"].last_step, 3);
  EXPECT_EQ(g["remote-b"].max_lag, 0);
  EXPECT_EQ(r.steps[8].acks.back().lag, 4);
  EXPECT_EQ(r.steps[7].acks.back().lag, 1);
  // A threshold of 4 accepts remote-a's worst lag but not remote-b's end.
  AuditOptions loose;
  loose.lag_threshold = 4;
  EXPECT_EQ(run.Audit(loose).anomalies.size(), 1u);
}

// A ferryd run whose generator is a vLLM server records engine proofs, not acknowledgements:
// each step is taken by "ferryd" (type engine, lag 0), nothing is "never acknowledged", and a
// server that stops being proven from step 20 on is behind at the run's end. A record that is
// no proof (its difference above its tolerance) takes nothing.
TEST(AuditSteps, EngineProofsTakeTheirSteps) {
  TrainingRun run;
  run.Build(kSteps, /*engine=*/true);
  AuditReport healthy = run.Audit();
  EXPECT_TRUE(healthy.anomalies.empty()) << All(healthy);
  EXPECT_TRUE(healthy.never_acknowledged.empty());
  ASSERT_EQ(healthy.steps.size(), static_cast<size_t>(kSteps + 1));  // the base proven: step 0
  for (const auto& e : healthy.steps) {
    ASSERT_EQ(e.acks.size(), 1u) << "step " << e.step;
    EXPECT_EQ(e.acks[0].receiver, "ferryd");
    EXPECT_EQ(e.acks[0].type, Event::Type::kEngine);
    EXPECT_EQ(e.acks[0].lag, 0);
  }
  ASSERT_EQ(healthy.generators.size(), 1u);
  EXPECT_EQ(healthy.generators[0].acks, kSteps + 1);

  TrainingRun stalled;
  stalled.Build(kSteps, /*engine=*/false);
  stalled.events.erase(std::remove_if(stalled.events.begin(), stalled.events.end(),
                                      [](const Event& e) { return e.type == Event::Type::kAcknowledged; }),
                       stalled.events.end());
  for (int64_t n = 0; n <= kSteps; ++n) {
    stalled.Prove("ferryd", TrainingRun::Merged(n), n * kStepNs + 100, n < 20 ? 2e-5 : 0.5);
  }
  AuditReport r = stalled.Audit();
  auto behind = Of(r, AnomalyKind::kGeneratorBehind);
  ASSERT_EQ(behind.size(), 1u) << All(r);
  EXPECT_EQ(behind[0]->message,
            "receiver ferryd last acknowledged step 19 but the run ended at step 30: 11 steps behind (rule: > 2)");
  EXPECT_EQ(Of(r, AnomalyKind::kRecorded).size(), 11u);  // the 11 records that are no proofs
  EXPECT_TRUE(r.steps[20].acks.empty());
  EXPECT_EQ(r.never_acknowledged.size(), 11u);  // steps 20..30's merged versions, published
}

TEST(AuditSteps, AResumedRunIsBackAtItsCheckpointsStep) {
  TrainingRun run;
  run.Build(6);
  // Killed after step 6, resumed from checkpoint-3: step 3's snapshot is published and
  // acknowledged again, then steps 4..6 run again to the same versions (recorded once).
  for (int64_t n = 3; n <= 6; ++n) {
    run.Publish(TrainingRun::Merged(n), 10 * kStepNs + n * 100);
    run.Ack("colocated", TrainingRun::Merged(n), 10 * kStepNs + n * 100 + 1);
  }
  AuditReport r = run.Audit();
  EXPECT_TRUE(r.anomalies.empty()) << All(r);
  ASSERT_EQ(r.steps[3].acks.size(), 2u);
  EXPECT_EQ(r.steps[3].acks[1].lag, 0);
  EXPECT_EQ(r.generators[0].max_lag, 0);
}

TEST(AuditSteps, DigestMismatchNamesItsStep) {
  TrainingRun run;
  run.Build();
  run.Ack("remote-a", TrainingRun::Merged(9), 9 * kStepNs + 300, Digest{0xdead, 0xbeef});
  AuditReport r = run.Audit();
  auto mismatch = Of(r, AnomalyKind::kDigestMismatch);
  ASSERT_EQ(mismatch.size(), 1u) << All(r);
  EXPECT_EQ(mismatch[0]->step, 9);
  EXPECT_EQ(mismatch[0]->message, "receiver remote-a acknowledged version " + ShortId(TrainingRun::Merged(9)) +
                                      " but computed digest " + ShortId(Digest{0xdead, 0xbeef}) +
                                      ": it holds other weights (step 9)");
  const StepEntry& s9 = r.steps[9];
  ASSERT_EQ(s9.acks.size(), 2u);
  EXPECT_TRUE(s9.acks[0].digest_matched);
  EXPECT_EQ(s9.acks[1].receiver, "remote-a");
  EXPECT_FALSE(s9.acks[1].digest_matched);
  EXPECT_TRUE(s9.acks[1].digest_reported);
}

TEST(AuditSteps, AResumedRunShowsAStepsNewestRecord) {
  TrainingRun run;
  run.Build(6);
  // Resumed from step 4: steps 5 and 6 recorded again (other bytes, other metrics), each as
  // an adapter and its merged version.
  for (int64_t n = 5; n <= 6; ++n) {
    VersionRecord a = run.versions[static_cast<size_t>(2 * n - 1)];
    a.id = Digest{0xeeee000000000000 + static_cast<uint64_t>(n), 3};
    a.sequence += 100;
    a.time_ns += 100 * kStepNs;
    a.metrics["reward"] = 0.9;
    VersionRecord m = run.versions[static_cast<size_t>(2 * n)];
    m.id = Digest{0xffff000000000000 + static_cast<uint64_t>(n), 4};
    m.sequence = a.sequence + 1;
    m.time_ns = a.time_ns + 1;
    m.adapter_version = a.id;
    m.metrics = a.metrics;
    run.versions.push_back(a);
    run.versions.push_back(m);
  }
  AuditReport r = run.Audit();
  ASSERT_EQ(r.steps.size(), 7u);
  EXPECT_EQ(r.steps[4].records, 1);
  EXPECT_EQ(r.steps[5].records, 2);
  EXPECT_EQ(r.steps[6].records, 2);
  EXPECT_EQ(r.steps[5].adapter_version, (Digest{0xeeee000000000005, 3}));
  EXPECT_EQ(r.steps[5].merged_version, (Digest{0xffff000000000005, 4}));
  EXPECT_DOUBLE_EQ(r.steps[5].metrics.at("reward"), 0.9);
}

// A resume that recorded a step's adapter again but not yet its merged version (killed in
// between) still counts the step twice.
TEST(AuditSteps, AStepWhoseAdapterAloneWasRecordedAgainCountsTwice) {
  TrainingRun run;
  run.Build(6);
  VersionRecord a = run.versions[static_cast<size_t>(2 * 6 - 1)];
  a.id = Digest{0xeeee000000000006, 3};
  a.sequence += 100;
  a.time_ns += 100 * kStepNs;
  run.versions.push_back(a);
  AuditReport r = run.Audit();
  ASSERT_EQ(r.steps.size(), 7u);
  EXPECT_EQ(r.steps[6].records, 2);
  EXPECT_EQ(r.steps[6].adapter_version, (Digest{0xeeee000000000006, 3}));
  EXPECT_EQ(r.steps[6].merged_version, TrainingRun::Merged(6));
}

TEST(AuditSteps, OptionsAreChecked) {
  TrainingRun run;
  run.Build(2);
  for (auto bad : {+[](AuditOptions& o) { o.lag_threshold = -1; }, +[](AuditOptions& o) { o.reward_window = 0; },
                   +[](AuditOptions& o) { o.reward_drop = 0; }, +[](AuditOptions& o) { o.zero_std_steps = 0; },
                   +[](AuditOptions& o) { o.grad_spike_factor = -1; }}) {
    AuditOptions o;
    o.run = "r";
    bad(o);
    auto r = AnalyzeAudit(run.versions, run.events, {}, o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("lag_threshold must be >= 0"), std::string::npos);
  }
}

}  // namespace
}  // namespace ferry::store
