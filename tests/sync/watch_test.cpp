// CheckpointWatcher (sync/watch.h) against the committed PEFT fixture: an adapter directory
// appearing in the watched directory becomes a merged version equal to PEFT's merged/, a
// directory is handled only once it settled, a broken one is reported once and skipped,
// directories are handled in natural order, full models are imported as full, only the
// newest directory already present at start is handled, and a checkpoint the store refuses
// (an aux file name that is not UTF-8) or whose handling throws is skipped with its error
// while the next one is still imported and published.
#include "sync/watch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "convert/peft_config.h"
#include "core/mapped_file.h"
#include "sync/publisher.h"
#include "tests/temp_dir.h"

namespace ferry::sync {
namespace {

namespace fs = std::filesystem;

const fs::path kCase = fs::path(FERRY_FIXTURES_DIR) / "cases" / "llama_lora_all_linear_f32";

class WatchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(watched());
    auto s = store::Store::Open(tmp_.path() / "db", {.create_if_missing = true});
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(*s);
  }

  fs::path watched() const { return tmp_.path() / "watch"; }

  std::unique_ptr<CheckpointWatcher> Watch(const std::string& base = (kCase / "base").string()) {
    WatchOptions o;
    o.dir = watched();
    o.base = base;
    o.run = "rl";
    o.threads = 2;
    auto w = CheckpointWatcher::Create(store_.get(), o);
    EXPECT_TRUE(w.ok()) << w.status().ToString();
    return w.ok() ? std::move(*w) : nullptr;
  }

  // Copies a fixture directory (adapter/, merged/ ...) into the watched directory as `name`.
  void Drop(const std::string& fixture, const std::string& name) {
    fs::copy(kCase / fixture, watched() / name, fs::copy_options::recursive);
  }

  std::vector<WatchedCheckpoint> PollOk(CheckpointWatcher& w) {
    auto r = w.Poll();
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : std::vector<WatchedCheckpoint>{};
  }

  size_t VersionCount() {
    auto v = store_->ListVersions(std::nullopt);
    EXPECT_TRUE(v.ok());
    return v.ok() ? v->size() : 0;
  }

  testing::ScopedTempDir tmp_{"ferry-watch-test-"};
  std::unique_ptr<store::Store> store_;
};

// The merged snapshot of the fixture, built independently of the watcher (base and adapter
// read straight from the fixture files; aux files as the store collects them beside the base).
store::Digest ExpectedMergedId() {
  SnapshotSource s;
  Checkpoint base = Checkpoint::Open(kCase / "base").value();
  for (const auto& n : base.names()) s.tensors.emplace(n, base.Get(n).value());
  Checkpoint adapter = Checkpoint::Open(kCase / "adapter").value();
  for (const auto& n : adapter.names()) s.adapter_tensors.emplace(n, adapter.Get(n).value());
  s.adapter_config = LoadPeftConfig(kCase / "adapter").value();
  for (const char* n : {"config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
                        "tokenizer_config.json"}) {
    s.aux_files.emplace_back(n, ReadSmallFile(kCase / "base" / n).value());
  }
  SnapshotOptions o;
  o.threads = 2;
  auto snap = BuildSnapshot(s, o);
  EXPECT_TRUE(snap.ok()) << snap.status().ToString();
  return snap.ok() ? (*snap)->manifest_id() : store::Digest{};
}

// Writes the first `bytes` bytes of the fixture adapter's weights to `dst`.
void WritePrefix(const fs::path& dst, size_t bytes) {
  const std::string all = ReadSmallFile(kCase / "adapter" / "adapter_model.safetensors").value();
  std::ofstream f(dst, std::ios::binary | std::ios::trunc);
  f.write(all.data(), static_cast<std::streamsize>(std::min(bytes, all.size())));
}

size_t AdapterWeightsSize() { return fs::file_size(kCase / "adapter" / "adapter_model.safetensors"); }

TEST(NaturalOrderTest, DigitRunsCompareAsNumbers) {
  EXPECT_TRUE(NaturalLess("checkpoint-100", "checkpoint-1000"));
  EXPECT_TRUE(NaturalLess("checkpoint-20", "checkpoint-100"));
  EXPECT_FALSE(NaturalLess("checkpoint-100", "checkpoint-20"));
  EXPECT_TRUE(NaturalLess("a9b", "a10a"));
  EXPECT_FALSE(NaturalLess("step-5", "step-5"));
  EXPECT_TRUE(NaturalLess("step-01", "step-1"));
  EXPECT_FALSE(NaturalLess("step-1", "step-01"));
}

TEST(NaturalOrderTest, TrailingStepIsTheTrailingNumber) {
  EXPECT_EQ(TrailingStep("checkpoint-1500"), 1500);
  EXPECT_EQ(TrailingStep("global_step7"), 7);
  EXPECT_EQ(TrailingStep("final"), std::nullopt);
  EXPECT_EQ(TrailingStep("99999999999999999999999"), std::nullopt);
}

TEST_F(WatchTest, NewAdapterBecomesMergedVersionEqualToPeftMerge) {
  auto w = Watch();
  ASSERT_NE(w, nullptr);
  EXPECT_TRUE(PollOk(*w).empty());
  Drop("adapter", "checkpoint-100");
  EXPECT_TRUE(PollOk(*w).empty());  // seen once: not settled yet
  auto got = PollOk(*w);
  ASSERT_EQ(got.size(), 1u);
  const WatchedCheckpoint& c = got[0];
  ASSERT_TRUE(c.error.ok()) << c.error.ToString();
  EXPECT_EQ(c.dir, watched() / "checkpoint-100");
  EXPECT_EQ(c.step, 100);
  EXPECT_TRUE(c.adapter);
  ASSERT_TRUE(c.version.has_value());
  ASSERT_TRUE(c.adapter_version.has_value());
  EXPECT_EQ(*c.version, ExpectedMergedId());

  auto base = store::HashPath(kCase / "base");
  ASSERT_TRUE(base.ok());
  EXPECT_EQ(w->base_version(), base->id);

  auto merged = store_->GetVersion(c.version->Hex());
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  EXPECT_EQ(merged->kind, store::VersionKind::kMerged);
  EXPECT_EQ(merged->run, "rl");
  EXPECT_EQ(merged->step, 100);
  EXPECT_EQ(merged->adapter_version, c.adapter_version);
  EXPECT_EQ(merged->base_version, base->id);
  EXPECT_EQ(merged->layout, Layout::kHf);

  auto adapter = store_->GetVersion(c.adapter_version->Hex());
  ASSERT_TRUE(adapter.ok()) << adapter.status().ToString();
  EXPECT_EQ(adapter->kind, store::VersionKind::kAdapter);
  EXPECT_EQ(adapter->base_version, base->id);
  EXPECT_EQ(adapter->step, 100);
  auto adapter_hash = store::HashPath(kCase / "adapter");
  ASSERT_TRUE(adapter_hash.ok());
  EXPECT_EQ(adapter->id, adapter_hash->id);

  // The stored merged tensors equal PEFT's merge within 1e-5 of each tensor's scale (the
  // snapshot tests' tolerance).
  Checkpoint want = Checkpoint::Open(kCase / "merged").value();
  ASSERT_EQ(merged->tensors.size(), want.size());
  for (const auto& row : merged->tensors) {
    auto exp = want.Get(row.name);
    ASSERT_TRUE(exp.ok()) << row.name;
    auto t = store_->ReadTensor(row, /*verify=*/true);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ASSERT_EQ(t->shape(), exp->shape()) << row.name;
    std::vector<float> g(static_cast<size_t>(t->numel())), e(static_cast<size_t>(exp->numel()));
    ASSERT_TRUE(ReadAsF32(*t, g).ok());
    ASSERT_TRUE(ReadAsF32(*exp, e).ok());
    float scale = 0;
    for (float x : e) scale = std::max(scale, std::fabs(x));
    for (size_t i = 0; i < e.size(); ++i) ASSERT_NEAR(g[i], e[i], 1e-5f * scale) << row.name << " " << i;
  }
  EXPECT_TRUE(PollOk(*w).empty());  // handled once
}

TEST_F(WatchTest, BaseGivenAsStoredVersionIdGivesTheSameMergedVersion) {
  store::ImportOptions io;
  io.kind = store::VersionKind::kBase;
  auto imported = store_->Import(kCase / "base", io);
  ASSERT_TRUE(imported.ok()) << imported.status().ToString();
  auto w = Watch(imported->record.id.Hex().substr(0, 12));
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->base_version(), imported->record.id);
  Drop("adapter", "checkpoint-3");
  EXPECT_TRUE(PollOk(*w).empty());
  auto got = PollOk(*w);
  ASSERT_EQ(got.size(), 1u);
  ASSERT_TRUE(got[0].error.ok()) << got[0].error.ToString();
  EXPECT_EQ(got[0].version, ExpectedMergedId());
}

TEST_F(WatchTest, BadBaseAndMissingDirectoryAreRefusedNamingThem) {
  WatchOptions o;
  o.dir = watched();
  o.base = "0123456789abcdef";
  auto w = CheckpointWatcher::Create(store_.get(), o);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kNotFound);
  EXPECT_NE(w.status().message().find("0123456789abcdef"), std::string::npos) << w.status().ToString();

  o.base = (kCase / "adapter").string();
  w = CheckpointWatcher::Create(store_.get(), o);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(w.status().message().find(o.base + " is a PEFT adapter"), std::string::npos) << w.status().ToString();
  EXPECT_EQ(VersionCount(), 0u);  // nothing imported

  o.base = (kCase / "base").string();
  o.dir = tmp_.path() / "nope";
  w = CheckpointWatcher::Create(store_.get(), o);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kNotFound);
  EXPECT_NE(w.status().message().find((tmp_.path() / "nope").string()), std::string::npos) << w.status().ToString();
}

TEST_F(WatchTest, HalfWrittenCheckpointIsImportedOnlyOnceComplete) {
  auto w = Watch();
  ASSERT_NE(w, nullptr);
  const size_t versions_before = VersionCount();  // the base
  const fs::path dir = watched() / "checkpoint-200";
  fs::create_directories(dir);
  fs::copy_file(kCase / "adapter" / "adapter_config.json", dir / "adapter_config.json");
  WritePrefix(dir / "adapter_model.safetensors", AdapterWeightsSize() / 2);
  EXPECT_TRUE(PollOk(*w).empty());
  WritePrefix(dir / "adapter_model.safetensors", AdapterWeightsSize());  // the trainer finishes
  EXPECT_TRUE(PollOk(*w).empty());                                       // changed since the last poll: not settled
  EXPECT_EQ(VersionCount(), versions_before);
  auto got = PollOk(*w);
  ASSERT_EQ(got.size(), 1u);
  ASSERT_TRUE(got[0].error.ok()) << got[0].error.ToString();
  EXPECT_EQ(got[0].version, ExpectedMergedId());
  EXPECT_EQ(VersionCount(), versions_before + 2);  // adapter + merged
}

TEST_F(WatchTest, CheckpointThatSettlesBrokenIsReportedOnceAndSkipped) {
  auto w = Watch();
  ASSERT_NE(w, nullptr);
  const size_t versions_before = VersionCount();
  const fs::path dir = watched() / "checkpoint-300";
  fs::create_directories(dir);
  fs::copy_file(kCase / "adapter" / "adapter_config.json", dir / "adapter_config.json");
  WritePrefix(dir / "adapter_model.safetensors", AdapterWeightsSize() / 2);
  EXPECT_TRUE(PollOk(*w).empty());
  auto got = PollOk(*w);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].step, 300);
  EXPECT_FALSE(got[0].version.has_value());
  EXPECT_EQ(got[0].error.code(), StatusCode::kCorruption) << got[0].error.ToString();
  EXPECT_NE(got[0].error.message().find(dir.string()), std::string::npos) << got[0].error.ToString();
  EXPECT_NE(got[0].error.message().find("adapter_model.safetensors"), std::string::npos) << got[0].error.ToString();
  EXPECT_EQ(VersionCount(), versions_before);  // nothing half-imported
  EXPECT_TRUE(PollOk(*w).empty());             // not retried
  EXPECT_TRUE(PollOk(*w).empty());

  // A good checkpoint after the broken one is still handled.
  Drop("adapter", "checkpoint-400");
  EXPECT_TRUE(PollOk(*w).empty());
  got = PollOk(*w);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(got[0].error.ok()) << got[0].error.ToString();
}

TEST_F(WatchTest, CheckpointsAreHandledInNaturalOrder) {
  auto w = Watch();
  ASSERT_NE(w, nullptr);
  Drop("adapter", "checkpoint-1000");
  Drop("adapter", "checkpoint-100");
  Drop("adapter", "checkpoint-20");
  EXPECT_TRUE(PollOk(*w).empty());
  auto got = PollOk(*w);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].dir.filename(), "checkpoint-20");
  EXPECT_EQ(got[1].dir.filename(), "checkpoint-100");
  EXPECT_EQ(got[2].dir.filename(), "checkpoint-1000");
  EXPECT_EQ(got[0].step, 20);
  EXPECT_EQ(got[1].step, 100);
  EXPECT_EQ(got[2].step, 1000);
  for (const auto& c : got) EXPECT_TRUE(c.error.ok()) << c.error.ToString();
}

TEST_F(WatchTest, FullModelCheckpointIsImportedAsFull) {
  auto w = Watch();
  ASSERT_NE(w, nullptr);
  Drop("merged", "checkpoint-7");
  EXPECT_TRUE(PollOk(*w).empty());
  auto got = PollOk(*w);
  ASSERT_EQ(got.size(), 1u);
  ASSERT_TRUE(got[0].error.ok()) << got[0].error.ToString();
  EXPECT_FALSE(got[0].adapter);
  EXPECT_FALSE(got[0].adapter_version.has_value());
  auto hashed = store::HashPath(kCase / "merged");
  ASSERT_TRUE(hashed.ok());
  EXPECT_EQ(got[0].version, hashed->id);
  auto rec = store_->GetVersion(hashed->id.Hex());
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  EXPECT_EQ(rec->kind, store::VersionKind::kFull);
  EXPECT_EQ(rec->step, 7);
  EXPECT_EQ(rec->run, "rl");
}

TEST_F(WatchTest, OnlyTheNewestCheckpointPresentAtStartIsHandled) {
  Drop("adapter", "checkpoint-50");
  Drop("adapter", "checkpoint-500");
  Drop("merged", "checkpoint-60");
  auto w = Watch();
  ASSERT_NE(w, nullptr);
  auto got = PollOk(*w);  // already observed at start: settles on the first poll
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].dir.filename(), "checkpoint-500");
  EXPECT_TRUE(got[0].error.ok()) << got[0].error.ToString();
  EXPECT_TRUE(PollOk(*w).empty());
  auto versions = store_->ListVersions(std::nullopt);
  ASSERT_TRUE(versions.ok());
  for (const auto& v : *versions) EXPECT_NE(v.step, 60) << v.id.Hex();  // the full model was skipped
}

// A store that forwards to `inner` but throws from Import of a directory named `throw_on`
// (standing in for any exception from below the watcher: a library bug, bad_alloc).
class ThrowingStore final : public store::Store {
 public:
  ThrowingStore(store::Store* inner, std::string throw_on) : inner_(inner), throw_on_(std::move(throw_on)) {}
  Result<store::ImportResult> Import(const fs::path& path, const store::ImportOptions& options) override {
    if (path.filename() == throw_on_) throw std::runtime_error("boom in " + path.filename().string());
    return inner_->Import(path, options);
  }
  Result<store::ImportResult> ImportCheckpoint(const Checkpoint& ckpt, const AuxFiles& aux_files,
                                               const store::ImportOptions& options) override {
    return inner_->ImportCheckpoint(ckpt, aux_files, options);
  }
  Result<store::ImportResult> RecordDerived(const std::vector<store::TensorRow>& tensors, const AuxFiles& aux_files,
                                            const store::ImportOptions& options) override {
    return inner_->RecordDerived(tensors, aux_files, options);
  }
  Result<store::VersionRecord> GetVersion(std::string_view id) override { return inner_->GetVersion(id); }
  Result<std::vector<store::VersionRecord>> ListVersions(std::optional<std::string> run) override {
    return inner_->ListVersions(std::move(run));
  }
  Result<std::vector<std::string>> ListRuns() override { return inner_->ListRuns(); }
  Result<std::optional<store::Digest>> Latest(const std::string& run) override { return inner_->Latest(run); }
  Result<Tensor> ReadTensor(const store::TensorRow& row, bool verify) override {
    return inner_->ReadTensor(row, verify);
  }
  Result<std::string> ReadAux(const store::AuxFile& aux) override { return inner_->ReadAux(aux); }
  Result<std::vector<store::VerifyReport>> Verify(std::optional<store::Digest> v) override { return inner_->Verify(v); }
  Status Export(const store::Digest& v, const fs::path& out, bool force) override {
    return inner_->Export(v, out, force);
  }
  using store::Store::AddEvent;
  Status AddEvent(const store::Event& e, bool sync) override { return inner_->AddEvent(e, sync); }
  Result<std::vector<store::Event>> ListEvents(std::optional<store::Digest> v) override {
    return inner_->ListEvents(v);
  }
  Result<int64_t> GarbageCollect(int64_t keep) override { return inner_->GarbageCollect(keep); }
  Status Refresh() override { return inner_->Refresh(); }

 private:
  store::Store* inner_;
  std::string throw_on_;
};

// Writes an extra file named `name` into a checkpoint directory.
void AddFile(const fs::path& dir, const std::string& name) { std::ofstream(dir / name, std::ios::binary) << "x"; }

TEST_F(WatchTest, CheckpointWithAnUnrecordableAuxNameIsSkippedAndTheNextIsPublished) {
  // What `ferry sync publish --watch` does: the watcher and a publisher share one store (it
  // is thread-safe); a checkpoint with an error is a warning, the rest published.
  store::Store& shared = *store_;
  auto ep = PrivateIpcEndpoints(tmp_.path() / "sock");
  ASSERT_TRUE(ep.ok()) << ep.status().ToString();
  PublisherOptions po;
  po.endpoints = *ep;
  auto publisher = Publisher::Start(&shared, po);
  ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();
  WatchOptions o;
  o.dir = watched();
  o.base = (kCase / "base").string();
  o.run = "rl";
  o.threads = 2;
  auto w = CheckpointWatcher::Create(&shared, o);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  auto count = [&] {  // while the publisher's thread uses the store too
    auto v = shared.ListVersions(std::nullopt);
    EXPECT_TRUE(v.ok()) << v.status().ToString();
    return v.ok() ? v->size() : 0;
  };
  const size_t versions_before = count();  // the base

  Drop("merged", "checkpoint-10");  // a full model with vocab.<0xFF>
  AddFile(watched() / "checkpoint-10", "vocab.\xff");
  Drop("adapter", "checkpoint-20");  // an adapter with a control character in an aux-list name
  AddFile(watched() / "checkpoint-20", "chat_template.\x01.jinja");
  Drop("adapter", "checkpoint-30");  // a good one
  EXPECT_TRUE(PollOk(**w).empty());
  auto got = (*w)->Poll();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), 3u);

  std::vector<std::string> warnings;
  std::vector<uint64_t> sequences;
  for (const WatchedCheckpoint& c : *got) {
    if (!c.error.ok()) {
      warnings.push_back(c.error.message());
      continue;
    }
    auto seq = (*publisher)->Publish(*c.version);
    ASSERT_TRUE(seq.ok()) << seq.status().ToString();
    sequences.push_back(*seq);
  }
  const fs::path d10 = watched() / "checkpoint-10", d20 = watched() / "checkpoint-20";
  EXPECT_EQ((*got)[0].error.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*got)[1].error.code(), StatusCode::kInvalidArgument);
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_EQ(warnings[0], "checkpoint " + d10.string() + ": " + d10.string() +
                             ": auxiliary file name 'vocab.\\xff' is not valid UTF-8");
  EXPECT_EQ(warnings[1], "checkpoint " + d20.string() + ": " + d20.string() +
                             ": auxiliary file name 'chat_template.\\x01.jinja' contains a control character");
  for (int k : {0, 1}) {
    EXPECT_FALSE((*got)[k].version.has_value());
    EXPECT_FALSE((*got)[k].adapter_version.has_value());  // the adapter was refused before anything was recorded
  }
  ASSERT_TRUE((*got)[2].error.ok()) << (*got)[2].error.ToString();
  EXPECT_EQ((*got)[2].dir.filename(), "checkpoint-30");
  EXPECT_EQ((*got)[2].version, ExpectedMergedId());
  EXPECT_EQ(sequences, std::vector<uint64_t>{1});
  EXPECT_EQ((*publisher)->latest_sequence(), 1u);
  EXPECT_EQ(count(), versions_before + 2);  // adapter + merged of checkpoint-30 only
  EXPECT_TRUE(PollOk(**w).empty());         // the refused ones are not retried
}

TEST_F(WatchTest, ExceptionWhileHandlingACheckpointIsItsErrorAndTheWatcherGoesOn) {
  ThrowingStore throwing(store_.get(), "checkpoint-5");
  WatchOptions o;
  o.dir = watched();
  o.base = (kCase / "base").string();
  o.run = "rl";
  o.threads = 2;
  auto w = CheckpointWatcher::Create(&throwing, o);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const size_t versions_before = VersionCount();
  Drop("merged", "checkpoint-5");
  Drop("adapter", "checkpoint-6");
  EXPECT_TRUE(PollOk(**w).empty());
  std::vector<WatchedCheckpoint> got;
  ASSERT_NO_THROW(got = PollOk(**w));
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].error.code(), StatusCode::kInternal) << got[0].error.ToString();
  EXPECT_EQ(got[0].error.message(),
            "checkpoint " + (watched() / "checkpoint-5").string() + ": unexpected exception: boom in checkpoint-5");
  EXPECT_FALSE(got[0].version.has_value());
  ASSERT_TRUE(got[1].error.ok()) << got[1].error.ToString();
  EXPECT_EQ(got[1].version, ExpectedMergedId());
  EXPECT_EQ(VersionCount(), versions_before + 2);
  EXPECT_TRUE(PollOk(**w).empty());
}

}  // namespace
}  // namespace ferry::sync
