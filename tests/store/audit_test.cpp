// The post-run audit (store/audit.h): each anomaly rule on stores built from synthetic
// tensors and a clean run reporting none. (Its text, JSON and HTML renderings are the CLI's:
// tests/cli/audit_text_test.cpp, tests/cli/audit_html_test.cpp.)
#include "store/audit.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "store/engine_report.h"

namespace ferry::store {
namespace {

namespace fs = std::filesystem;

// name -> (shape, values), written as F32.
using Tensors = std::map<std::string, std::pair<Shape, std::vector<float>>>;

class AuditTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("ferry_audit_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    StoreOptions o;
    o.create_if_missing = true;
    o.sync_objects = false;
    auto s = Store::Open(dir_ / "db", o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(*s);
  }
  void TearDown() override {
    store_.reset();
    fs::remove_all(dir_);
  }

  // Writes `tensors` into a fresh directory (model.safetensors, or adapter_model.safetensors
  // + adapter_config.json when `adapter`).
  fs::path Write(const Tensors& tensors, bool adapter, const std::string& config = "") {
    const fs::path d = dir_ / ("w" + std::to_string(counter_++));
    fs::create_directories(d);
    std::vector<TensorSpec> specs;
    for (const auto& [name, t] : tensors) specs.push_back({name, DType::kF32, t.first});
    auto w = SafetensorsWriter::CreateFile(d / (adapter ? "adapter_model.safetensors" : "model.safetensors"), specs);
    EXPECT_TRUE(w.ok()) << w.status().ToString();
    for (const auto& [name, t] : tensors) {
      std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(t.second.data()), t.second.size() * 4);
      EXPECT_TRUE((*w)->Append(bytes).ok());
    }
    EXPECT_TRUE((*w)->Finish().ok());
    if (adapter) {
      EXPECT_TRUE(WriteFileAtomic(d / "adapter_config.json",
                                  R"({"peft_type":"LORA","r":1,"lora_alpha":1,"target_modules":["q_proj"]})")
                      .ok());
    }
    if (!config.empty()) {
      EXPECT_TRUE(WriteFileAtomic(d / "config.json", config).ok());
    }
    return d;
  }

  VersionRecord Import(const Tensors& tensors, VersionKind kind, std::optional<int64_t> step = std::nullopt,
                       std::optional<Digest> base = std::nullopt, std::optional<Digest> adapter = std::nullopt,
                       std::map<std::string, double> metrics = {}, const std::string& config = "") {
    ImportOptions o;
    o.run = "r";
    o.kind = kind;
    o.step = step;
    o.base_version = base;
    o.adapter_version = adapter;
    o.metrics = std::move(metrics);
    auto r = store_->Import(Write(tensors, kind == VersionKind::kAdapter, config), o);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? r->record : VersionRecord{};
  }

  // A one-layer adapter: lora_A [1, 2] = {a, 0}, lora_B [2, 1] = {b, 0}.
  static Tensors Adapter(float a, float b) {
    return {{"base_model.model.layers.0.q_proj.lora_A.weight", {{1, 2}, {a, 0}}},
            {"base_model.model.layers.0.q_proj.lora_B.weight", {{2, 1}, {b, 0}}}};
  }
  static Tensors Base(float w = 1) { return {{"layers.0.q_proj.weight", {{2, 2}, {w, 2, 3, 4}}}}; }

  AuditReport Audit(AuditOptions o = {}) {
    auto r = RunAudit(*store_, o);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : AuditReport{};
  }

  Status Record(Event::Type type, const Digest& v, const std::string& receiver, std::optional<Digest> computed,
                int64_t t) {
    store::Event e;
    e.type = type;
    e.version = v;
    e.receiver = receiver;
    e.computed = computed;
    e.time_ns = t;
    return store_->AddEvent(e);
  }

  std::vector<const Anomaly*> Of(const AuditReport& r, AnomalyKind k) {
    std::vector<const Anomaly*> out;
    for (const auto& a : r.anomalies) {
      if (a.kind == k) out.push_back(&a);
    }
    return out;
  }

  fs::path dir_;
  int counter_ = 0;
  std::unique_ptr<Store> store_;
};

TEST_F(AuditTest, CleanRunReportsNoAnomalies) {
  VersionRecord base = Import(Base(), VersionKind::kBase);
  VersionRecord a1 = Import(Adapter(1, 1), VersionKind::kAdapter, 1, base.id, std::nullopt, {{"reward_mean", 0.1}});
  VersionRecord a2 = Import(Adapter(2, 1), VersionKind::kAdapter, 2, base.id, std::nullopt, {{"reward_mean", 0.2}});
  VersionRecord a3 = Import(Adapter(3, 1), VersionKind::kAdapter, 3, base.id, std::nullopt, {{"reward_mean", 0.3}});
  VersionRecord m = Import(Base(2), VersionKind::kMerged, 3, base.id, a3.id);
  for (const auto& v : {base, a1, a2, a3, m})
    ASSERT_TRUE(Record(Event::Type::kPublished, v.id, "", std::nullopt, 10).ok());
  ASSERT_TRUE(Record(Event::Type::kActivated, m.id, "gen-0", m.id, 20).ok());

  AuditReport r = Audit();
  EXPECT_TRUE(r.anomalies.empty()) << r.anomalies.front().message;
  ASSERT_EQ(r.timeline.size(), 5u);
  EXPECT_EQ(r.timeline[0].version.id, base.id);
  EXPECT_EQ(r.timeline[4].version.sequence, 5u);
  // d_k = |a_k - a_{k-1}| (only lora_A[0] changes): 1 and 1.
  ASSERT_TRUE(r.timeline[2].delta_norm.has_value());
  EXPECT_DOUBLE_EQ(*r.timeline[2].delta_norm, 1.0);
  EXPECT_DOUBLE_EQ(*r.timeline[3].delta_norm, 1.0);
  EXPECT_FALSE(r.timeline[1].delta_norm.has_value());
  ASSERT_EQ(r.receivers.size(), 1u);
  EXPECT_EQ(r.receivers[0].receiver, "gen-0");
  EXPECT_TRUE(r.receivers[0].digest_matched);
  EXPECT_EQ(r.timeline[4].activated_by, std::vector<std::string>{"gen-0"});
  EXPECT_TRUE(r.gaps.empty());
  // A receiver exists, so published versions nobody acknowledged are listed: all but the
  // merged one and a3, the adapter it was made from.
  EXPECT_EQ(r.never_acknowledged, (std::vector<Digest>{base.id, a1.id, a2.id}));
  EXPECT_EQ(r.metric_names, std::vector<std::string>{"reward_mean"});
}

TEST_F(AuditTest, MergedEqualToBaseWithNonZeroAdapterIsFlagged) {
  VersionRecord base = Import(Base(), VersionKind::kBase);
  VersionRecord a = Import(Adapter(1, 0.5f), VersionKind::kAdapter, 1, base.id);
  // The flat-reward failure: what was recorded as the merge holds the base's weights (its
  // config.json makes it a version of its own: identical files would be the base's id).
  VersionRecord m = Import(Base(), VersionKind::kMerged, 1, base.id, a.id, {}, R"({"merged": true})");
  ASSERT_NE(m.id, base.id);
  ASSERT_EQ(m.kind, VersionKind::kMerged);
  AuditReport r = Audit();
  auto found = Of(r, AnomalyKind::kMergedEqualsBase);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0]->version, m.id);
  EXPECT_EQ(found[0]->tensor, "base_model.model.layers.0.q_proj.lora_B.weight");
  EXPECT_NE(found[0]->message.find("has the same tensor digests as its base version " + base.id.Hex().substr(0, 12)),
            std::string::npos)
      << found[0]->message;
  EXPECT_NE(found[0]->message.find("adapter version " + a.id.Hex().substr(0, 12) + " is non-zero"), std::string::npos);
  EXPECT_NE(found[0]->message.find("l2_norm 0.5"), std::string::npos) << found[0]->message;
}

TEST_F(AuditTest, MergedEqualToBaseWithZeroAdapterIsNotAMergeFailure) {
  VersionRecord base = Import(Base(), VersionKind::kBase);
  VersionRecord a = Import(Adapter(1, 0), VersionKind::kAdapter, 0, base.id);
  VersionRecord m = Import(Base(), VersionKind::kMerged, 0, base.id, a.id, {}, R"({"merged": true})");
  ASSERT_EQ(m.kind, VersionKind::kMerged);
  AuditReport r = Audit();
  EXPECT_TRUE(Of(r, AnomalyKind::kMergedEqualsBase).empty());
  // Step 0: B is zero by PEFT's initialisation, not flagged either.
  EXPECT_TRUE(Of(r, AnomalyKind::kZeroAdapter).empty());
}

TEST_F(AuditTest, AllZeroAdapterIsFlaggedAfterStepZero) {
  VersionRecord base = Import(Base(), VersionKind::kBase);
  VersionRecord a = Import(Adapter(1, 0), VersionKind::kAdapter, 7, base.id);
  AuditReport r = Audit();
  auto found = Of(r, AnomalyKind::kZeroAdapter);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0]->version, a.id);
  EXPECT_NE(found[0]->message.find("adapter version " + a.id.Hex().substr(0, 12) +
                                   " (run r, seq 2) is all zero: all 1 "
                                   "lora_B tensors are zero"),
            std::string::npos)
      << found[0]->message;
}

TEST_F(AuditTest, NonFiniteTensorIsNamed) {
  Tensors t = Base();
  t["layers.0.k_proj.weight"] = {{3},
                                 {1, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}};
  VersionRecord v = Import(t, VersionKind::kFull);
  AuditReport r = Audit();
  auto found = Of(r, AnomalyKind::kNonFinite);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0]->tensor, "layers.0.k_proj.weight");
  EXPECT_EQ(found[0]->message, "version " + v.id.Hex().substr(0, 12) +
                                   " (run r, seq 1): tensor layers.0.k_proj.weight has 2 NaN/Inf values");
}

TEST_F(AuditTest, DeltaNormJumpIsFlaggedByTheMedianRule) {
  VersionRecord base = Import(Base(), VersionKind::kBase);
  // lora_A[0] = 0, 1, 2, 3, 23: deltas 1, 1, 1, 20 -> 20x the median 1 > 10x.
  std::vector<VersionRecord> a;
  for (float x : {0.f, 1.f, 2.f, 3.f, 23.f})
    a.push_back(Import(Adapter(x, 1), VersionKind::kAdapter, int64_t(x) + 1, base.id));
  AuditReport r = Audit();
  auto found = Of(r, AnomalyKind::kDeltaJump);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0]->version, a[4].id);
  EXPECT_NE(found[0]->message.find("delta norm 20 from version " + a[3].id.Hex().substr(0, 12) +
                                   " is 20x the median 1 of the 3 previous deltas (rule: > 10x)"),
            std::string::npos)
      << found[0]->message;
  EXPECT_DOUBLE_EQ(*r.timeline.back().delta_norm, 20.0);

  // A looser factor does not flag it; the rule needs min_history previous deltas.
  AuditOptions loose;
  loose.jump_factor = 25;
  EXPECT_TRUE(Of(Audit(loose), AnomalyKind::kDeltaJump).empty());
}

TEST_F(AuditTest, AcknowledgementsOfUnpublishedVersionsAndDigestMismatches) {
  VersionRecord base = Import(Base(), VersionKind::kBase);
  VersionRecord full = Import(Base(3), VersionKind::kFull);
  ASSERT_TRUE(Record(Event::Type::kPublished, full.id, "", std::nullopt, 5).ok());
  // base was imported but never published; `ghost` has no record at all.
  const Digest ghost{0x1234, 0x5678};
  ASSERT_TRUE(Record(Event::Type::kAcknowledged, base.id, "gen-1", base.id, 10).ok());
  ASSERT_TRUE(Record(Event::Type::kActivated, ghost, "gen-2", ghost, 11).ok());
  ASSERT_TRUE(Record(Event::Type::kActivated, full.id, "gen-3", base.id, 12).ok());
  AuditReport r = Audit();
  auto unpublished = Of(r, AnomalyKind::kUnpublishedAck);
  ASSERT_EQ(unpublished.size(), 2u);
  EXPECT_EQ(unpublished[0]->message, "receiver gen-1 acknowledged version " + base.id.Hex().substr(0, 12) +
                                         ", which was never published (no published event)");
  EXPECT_EQ(unpublished[1]->message, "receiver gen-2 activated version " + ghost.Hex().substr(0, 12) +
                                         ", which was never published (no version record)");
  auto mismatch = Of(r, AnomalyKind::kDigestMismatch);
  ASSERT_EQ(mismatch.size(), 1u);
  EXPECT_EQ(mismatch[0]->version, full.id);
  EXPECT_NE(mismatch[0]->message.find("receiver gen-3 activated version " + full.id.Hex().substr(0, 12) +
                                      " but computed digest " + base.id.Hex().substr(0, 12)),
            std::string::npos);
  ASSERT_EQ(r.receivers.size(), 3u);
  EXPECT_FALSE(r.receivers[1].known_version);
  EXPECT_FALSE(r.receivers[2].digest_matched);
  EXPECT_TRUE(r.never_acknowledged.empty());
}

TEST_F(AuditTest, RunFilterAndUnknownRun) {
  Import(Base(), VersionKind::kBase);
  AuditOptions o;
  o.run = "nope";
  auto r = RunAudit(*store_, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("run 'nope'"), std::string::npos);
  o.run = "r";
  EXPECT_EQ(Audit(o).timeline.size(), 1u);
}

// Gaps are checked on records directly: the store assigns sequences without holes.
TEST(AnalyzeAudit, SequenceGapsAndNeverAcknowledged) {
  std::vector<VersionRecord> v(3);
  for (int i = 0; i < 3; ++i) {
    v[i].id = Digest{1, static_cast<uint64_t>(i)};
    v[i].run = "r";
    v[i].kind = VersionKind::kFull;
  }
  v[0].sequence = 1;
  v[1].sequence = 2;
  v[2].sequence = 5;
  std::vector<Event> events(4);
  for (int i = 0; i < 3; ++i) {
    events[i].type = Event::Type::kPublished;
    events[i].version = v[i].id;
  }
  events[3].type = Event::Type::kActivated;
  events[3].version = v[1].id;
  events[3].receiver = "g";
  events[3].computed = v[1].id;
  auto r = AnalyzeAudit(v, events, {}, {});
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->gaps.size(), 1u);
  EXPECT_EQ(r->gaps[0].first_missing, 3u);
  EXPECT_EQ(r->gaps[0].last_missing, 4u);
  EXPECT_EQ(r->never_acknowledged, (std::vector<Digest>{v[0].id, v[2].id}));
  EXPECT_TRUE(r->anomalies.empty());

  AuditOptions bad;
  bad.jump_factor = 0;
  EXPECT_EQ(AnalyzeAudit(v, events, {}, bad).status().code(), StatusCode::kInvalidArgument);
}

// Merged mode, as ferryd records it: each step's adapter and its merged version, only the
// merged one published. Nothing a receiver could have acknowledged is missing, so nothing is
// listed; a published merged version nobody loaded is.
TEST(AnalyzeAudit, NeverAcknowledgedListsOnlyPublishedVersions) {
  std::vector<VersionRecord> v(4);
  for (int i = 0; i < 4; ++i) {
    v[i].id = Digest{2, static_cast<uint64_t>(i)};
    v[i].run = "r";
    v[i].sequence = static_cast<uint64_t>(i + 1);
  }
  v[0].kind = VersionKind::kAdapter;  // step 1
  v[1].kind = VersionKind::kMerged;
  v[1].adapter_version = v[0].id;
  v[2].kind = VersionKind::kAdapter;  // step 2
  v[3].kind = VersionKind::kMerged;
  v[3].adapter_version = v[2].id;
  std::vector<Event> events(3);
  events[0].type = Event::Type::kPublished;
  events[0].version = v[1].id;
  events[1].type = Event::Type::kPublished;
  events[1].version = v[3].id;
  events[2].type = Event::Type::kAcknowledged;
  events[2].version = v[1].id;
  events[2].receiver = "g";
  events[2].computed = v[1].id;
  auto r = AnalyzeAudit(v, events, {}, {});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->never_acknowledged, std::vector<Digest>{v[3].id})
      << "the unpublished adapters are not listed; step 2's merged version, published, is";
}

// An engine's report (store/engine_report.h): the fields' types and ranges, a proof that is
// not within its tolerance, and a mismatch whose difference was not finite (null).
TEST(EngineReportTest, FieldsAreCheckedAndAProofMustHoldItsTolerance) {
  const std::string proof =
      R"({"engine": "vllm", "url": "http://127.0.0.1:8000", "model": "ferry-abc-1", "tolerance": 0.0001,)"
      R"( "max_diff": 1.5e-05, "previous_diff": 0.3, "tokens": 69, "seconds": 0.05})";
  auto ok = ParseEngineReport(proof, true);
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(ok->model, "ferry-abc-1");
  EXPECT_DOUBLE_EQ(*ok->max_diff, 1.5e-05);
  EXPECT_DOUBLE_EQ(*ok->previous_diff, 0.3);
  EXPECT_EQ(ok->tokens, 69);
  // Written back: the same fields, no "why" for a proof.
  auto again = ParseEngineReport(EngineReportJson(*ok), true);
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_EQ(again->url, ok->url);
  EXPECT_EQ(EngineReportJson(*ok).find("why"), std::string::npos);

  auto fails = [](const std::string& text, std::optional<bool> proven, const std::string& what) {
    auto r = ParseEngineReport(text, proven);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
    EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status().message();
  };
  auto with = [&](const std::string& field, const std::string& value) {
    std::string t = proof;
    const size_t at = t.find("\"" + field + "\": ") + field.size() + 4;
    t.replace(at, t.find_first_of(",}", at) - at, value);
    return t;
  };
  fails(with("max_diff", "0.5"), true, "exceeds its tolerance");
  fails(with("max_diff", "null"), true, "not finite");
  fails(with("url", "42"), true, "field 'url' is not a string");
  fails(with("tokens", "-1"), true, "field 'tokens'");
  fails(with("tokens", "1.5"), true, "field 'tokens'");
  fails(with("seconds", "-0.1"), true, "field 'seconds'");
  fails(with("tolerance", "\"small\""), true, "field 'tolerance'");
  fails(with("model", "\"" + std::string(kMaxEngineTextBytes + 1, 'm') + "\""), true, "field 'model' has 4097 bytes");
  fails(proof, std::nullopt, "field 'proven' is not a boolean");
  fails("[1]", true, "not a JSON object");
  // A mismatch: its difference may be null (a NaN or Inf), and it says why.
  std::string mismatch = with("max_diff", "null");
  mismatch.insert(mismatch.size() - 1, R"(, "why": "the answer is not finite", "proven": false)");
  auto m = ParseEngineReport(mismatch, std::nullopt);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_FALSE(m->proven);
  EXPECT_FALSE(m->max_diff.has_value());
  EXPECT_EQ(m->why, "the answer is not finite");
  EXPECT_NE(EngineReportJson(*m).find(R"("max_diff":null)"), std::string::npos) << EngineReportJson(*m);
  std::string why_number = mismatch;
  why_number.replace(why_number.find(R"("the answer is not finite")"), 26, "42");
  fails(why_number, std::nullopt, "field 'why' is not a string");
}

// An engine record that does not hold a proof (hand-edited, or from an older writer) is an
// anomaly naming it, never listed as a proof nor as what served the version.
TEST_F(AuditTest, AnInvalidEngineRecordIsAnAnomalyNotAProof) {
  VersionRecord base = Import(Base(), VersionKind::kBase);
  auto add = [&](const std::string& detail, int64_t t) {
    Event e;
    e.type = Event::Type::kEngine;
    e.version = base.id;
    e.receiver = "gen-e";
    e.time_ns = t;
    e.detail = detail;
    ASSERT_TRUE(store_->AddEvent(e).ok());
  };
  add(R"({"engine": "vllm", "url": "http://h:8000", "model": "ferry-1", "tolerance": 0.0001, "max_diff": 0.5,)"
      R"( "previous_diff": null, "tokens": 69, "seconds": 0.05})",
      1000);
  add(R"({"engine": "vllm", "url": "http://h:8000", "model": "ferry-2", "tolerance": 0.0001, "max_diff": 0.00001,)"
      R"( "previous_diff": null, "tokens": 69, "seconds": 0.05})",
      2000);
  AuditReport r = Audit();
  ASSERT_EQ(r.engines.size(), 1u);
  EXPECT_EQ(r.engines[0].model, "ferry-2");
  ASSERT_EQ(r.timeline.size(), 1u);
  EXPECT_EQ(r.timeline[0].served_by, std::vector<std::string>{"vllm http://h:8000 as ferry-2"});
  auto recorded = Of(r, AnomalyKind::kRecorded);
  ASSERT_EQ(recorded.size(), 1u);
  EXPECT_NE(recorded[0]->message.find("an engine record by gen-e for version " + ShortId(base.id) +
                                      " (recorded at 1000 ns since the epoch) is invalid: engine report: a proof whose "
                                      "largest difference (0.500000) exceeds its tolerance"),
            std::string::npos)
      << recorded[0]->message;
}

}  // namespace
}  // namespace ferry::store
