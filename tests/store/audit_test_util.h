// A training run as ferryd records it, built as version records and events for the audit
// (store/audit.h, AnalyzeAudit with AuditOptions::run): the store's step tests and the CLI's
// rendering tests (tests/cli/audit_text_test.cpp) audit the same run.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "store/audit.h"

namespace ferry::store::testing {

constexpr int64_t kSteps = 30;
constexpr int64_t kStepNs = 1000;  // step N is committed at N * kStepNs

// Healthy metrics: the reward rises slowly, some groups have zero std, finite loss, grad
// norms around 0.5.
inline std::map<std::string, double> HealthyMetrics(int64_t n) {
  return {{"reward", 0.5 + 0.01 * static_cast<double>(n) + (n % 2 ? 0.02 : -0.02)},
          {"reward_std", 0.3},
          {"frac_reward_zero_std", 0.25},
          {"loss", 0.001 * std::sin(static_cast<double>(n))},
          {"grad_norm", 0.5 + 0.2 * std::sin(static_cast<double>(n))},
          {"entropy", 1.2},
          {"completions/mean_length", 4},
          {"sampling/sampling_logp_difference/mean", 1e-6},
          {"learning_rate", 1e-3}};
}

// A run "r" as ferryd records it: its base (sequence 1), then per step N an adapter
// (sequence 2N) and the merged version (2N + 1), both with step N and the step's metrics;
// the in-process generator "colocated" acknowledges the base and each merged version just
// before the step is committed.
struct TrainingRun {
  std::vector<VersionRecord> versions;
  std::vector<Event> events;
  std::map<int64_t, std::map<std::string, double>> metrics;  // step -> overrides

  TrainingRun() {
    for (int64_t n = 1; n <= kSteps; ++n) metrics[n] = HealthyMetrics(n);
  }
  static Digest Adapter(int64_t n) { return Digest{0xaaaa000000000000 + static_cast<uint64_t>(n), 1}; }
  static Digest Merged(int64_t n) { return Digest{0xcccc000000000000 + static_cast<uint64_t>(n), 2}; }

  // `engine`: the generator is a vLLM server (use_vllm): each step's merged version is proven
  // by its answers (a kEngine event of receiver "ferryd") instead of acknowledged.
  void Build(int64_t steps = kSteps, bool engine = false) {
    VersionRecord base;
    base.id = Merged(0);
    base.run = "r";
    base.sequence = 1;
    base.kind = VersionKind::kBase;
    base.time_ns = 10;
    versions.push_back(base);
    Publish(base.id, 15);
    auto take = [&](const Digest& v, int64_t t) { engine ? Prove("ferryd", v, t) : Ack("colocated", v, t); };
    take(Merged(0), 20);
    for (int64_t n = 1; n <= steps; ++n) {
      VersionRecord a;
      a.id = Adapter(n);
      a.run = "r";
      a.sequence = static_cast<uint64_t>(2 * n);
      a.kind = VersionKind::kAdapter;
      a.source = VersionSource::kDaemon;
      a.step = n;
      a.base_version = base.id;
      a.metrics = metrics[n];
      a.time_ns = n * kStepNs;
      VersionRecord m = a;
      m.id = Merged(n);
      m.sequence = a.sequence + 1;
      m.kind = VersionKind::kMerged;
      m.adapter_version = a.id;
      m.derived = true;
      m.time_ns = a.time_ns + 1;
      versions.push_back(a);
      versions.push_back(m);
      Publish(m.id, a.time_ns - 2);
      take(m.id, a.time_ns - 1);
    }
  }
  void Publish(const Digest& v, int64_t t) {
    Event e;
    e.type = Event::Type::kPublished;
    e.version = v;
    e.time_ns = t;
    events.push_back(e);
  }
  void Ack(const std::string& receiver, const Digest& v, int64_t t, std::optional<Digest> computed = std::nullopt) {
    Event e;
    e.type = Event::Type::kAcknowledged;
    e.receiver = receiver;
    e.version = v;
    e.computed = computed ? computed : v;
    e.time_ns = t;
    events.push_back(e);
  }
  // A vLLM proven to serve `v` (`max_diff` above the tolerance 1e-4: a record that is no proof).
  void Prove(const std::string& receiver, const Digest& v, int64_t t, double max_diff = 2e-5) {
    Event e;
    e.type = Event::Type::kEngine;
    e.receiver = receiver;
    e.version = v;
    e.time_ns = t;
    e.detail = R"({"engine": "vllm", "url": "http://127.0.0.1:8000", "model": "ferry-)" + v.Hex().substr(0, 12) +
               R"(", "tolerance": 0.0001, "max_diff": )" + std::to_string(max_diff) +
               R"(, "previous_diff": null, "tokens": 63, "seconds": 0.05})";
    events.push_back(e);
  }
  AuditReport Audit(AuditOptions o = {}) const {
    o.run = "r";
    auto r = AnalyzeAudit(versions, events, {}, o);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : AuditReport{};
  }
};

}  // namespace ferry::store::testing
