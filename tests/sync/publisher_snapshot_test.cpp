// Merged and delta publication of derived versions (store.h, "Derived versions": recorded by
// their digests only, as the daemon records each step) from an offered in-memory snapshot
// (Publisher::Offer): a receiver gets the merged tensors bit-identical and verified, the
// unchanged ones from the store's base objects; bytes that do not match the recorded digest
// are refused with an error naming the tensor; a derived version with no snapshot offered is
// refused naming the version; publish_first publishes the base once (sequence 1).
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "convert/peft_config.h"
#include "core/checkpoint.h"
#include "core/mapped_file.h"
#include "store/store.h"
#include "sync/publisher.h"
#include "sync/receiver.h"
#include "sync/snapshot.h"
#include "tests/sync/sync_test_util.h"
#include "tests/temp_dir.h"

namespace ferry::sync {
namespace {

namespace fs = std::filesystem;

const fs::path kCase = fs::path(FERRY_FIXTURES_DIR) / "cases" / "llama_lora_all_linear_f32";

SnapshotSource FixtureSource() { return FixtureSnapshotSource(kCase); }

std::shared_ptr<const Snapshot> Build(const SnapshotSource& src) {
  SnapshotOptions o;
  o.threads = 2;
  auto snap = BuildSnapshot(src, o);
  EXPECT_TRUE(snap.ok()) << snap.status().ToString();
  return snap.ok() ? *snap : nullptr;
}

class PublisherSnapshotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = store::Store::Open(tmp_.path() / "db", {.create_if_missing = true, .sync_objects = false});
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(*s);
    store::ImportOptions bo;
    bo.kind = store::VersionKind::kBase;
    bo.run = "rl";
    auto base = store_->Import(kCase / "base", bo);
    ASSERT_TRUE(base.ok()) << base.status().ToString();
    base_ = base->record.id;
    store::ImportOptions ao;
    ao.run = "rl";
    ao.base_version = base_;
    auto adapter = store_->Import(kCase / "adapter", ao);
    ASSERT_TRUE(adapter.ok()) << adapter.status().ToString();
    adapter_ = adapter->record.id;
    snapshot_ = Build(FixtureSource());
    ASSERT_NE(snapshot_, nullptr);
  }
  void TearDown() override {
    publisher_.reset();
    store_.reset();
  }

  // Records snapshot_ as the daemon records a step: a derived version (digests only).
  store::Digest RecordDerived() {
    store::ImportOptions mo;
    mo.run = "rl";
    mo.step = 1;
    mo.base_version = base_;
    mo.adapter_version = adapter_;
    auto r = RecordSnapshotDigests(*store_, *snapshot_, mo);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? r->record.id : store::Digest{};
  }

  // As ferryd's publisher runs: following run "rl" in `mode`, `first` published first.
  static PublisherOptions FollowingOptions(PublishMode mode, const store::Digest& first) {
    PublisherOptions po;
    po.mode = mode;
    po.follow_run = "rl";
    po.follow_interval_ms = 20;
    po.publish_first = first;
    return po;
  }

  void StartPublisher(PublisherOptions po) {
    auto ep = PrivateIpcEndpoints(tmp_.path() / "sock");
    ASSERT_TRUE(ep.ok()) << ep.status().ToString();
    endpoints_ = *ep;
    po.endpoints = endpoints_;
    auto p = Publisher::Start(store_.get(), std::move(po));
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    publisher_ = std::move(*p);
  }

  ReceiverOptions RecvOptions(const std::string& id) const { return TestReceiverOptions(endpoints_, tmp_.path(), id); }

  // The names of snapshot_'s tensors whose object the store lacks (the merged ones).
  std::vector<std::string> RowsWithoutObjects(const store::Digest& v) {
    std::vector<std::string> out;
    auto rec = store_->GetVersion(v.Hex());
    EXPECT_TRUE(rec.ok()) << rec.status().ToString();
    if (!rec.ok()) return out;
    EXPECT_TRUE(rec->derived);
    for (const auto& row : rec->tensors) {
      auto t = store_->ReadTensor(row, /*verify=*/false);
      if (!t.ok()) {
        EXPECT_EQ(t.status().code(), StatusCode::kFailedPrecondition) << t.status().ToString();
        out.push_back(row.name);
      }
    }
    return out;
  }

  // Bit-identical: each of `names` in the receiver's active version equals snapshot_'s bytes.
  void ExpectReceivedAsTheSnapshot(const fs::path& receiver_dir, const std::vector<std::string>& names) {
    auto received = Checkpoint::Open(receiver_dir / "current");
    ASSERT_TRUE(received.ok()) << received.status().ToString();
    for (const std::string& name : names) {
      Tensor got = received->Get(name).value();
      Tensor want = snapshot_->checkpoint().Get(name).value();
      ASSERT_EQ(got.nbytes(), want.nbytes()) << name;
      EXPECT_EQ(std::memcmp(got.data(), want.data(), want.nbytes()), 0) << name;
    }
  }

  testing::ScopedTempDir tmp_{"ferry-publisher-snapshot-test-"};
  std::unique_ptr<store::Store> store_;
  std::unique_ptr<Publisher> publisher_;
  std::shared_ptr<const Snapshot> snapshot_;
  Endpoints endpoints_;
  store::Digest base_, adapter_;
};

class PublisherSnapshotModesTest : public PublisherSnapshotTest, public ::testing::WithParamInterface<PublishMode> {};

// As ferryd runs it: the base published first, once; the run followed; the step's snapshot
// offered before its derived version is recorded.
TEST_P(PublisherSnapshotModesTest, FollowedRunServesTheOfferedSnapshotBitIdentical) {
  StartPublisher(FollowingOptions(GetParam(), base_));
  EXPECT_EQ(publisher_->latest_sequence(), 1u);
  auto r = Receiver::Connect(RecvOptions("gen"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto first = (*r)->SyncLatest();
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->version, base_);
  EXPECT_EQ(first->sequence, 1u) << "the base is published once, not again by the follower";
  EXPECT_EQ(publisher_->latest_sequence(), 1u);

  publisher_->Offer(snapshot_->manifest_id(), snapshot_);
  const store::Digest v = RecordDerived();
  ASSERT_EQ(v, snapshot_->manifest_id());
  const std::vector<std::string> merged = RowsWithoutObjects(v);
  ASSERT_FALSE(merged.empty()) << "the fixture's adapter targets every linear layer";

  auto second = (*r)->WaitForNewer(10000);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->version, v);
  EXPECT_EQ(second->computed, v);
  EXPECT_EQ(second->sequence, 2u);
  if (GetParam() == PublishMode::kDelta) {
    EXPECT_GT(second->bytes_reused, 0u) << "unchanged tensors (embeddings, norms) are copied from the base";
  }
  // Bit-identical: the received files hash to the recorded id, and each merged tensor equals
  // the snapshot's bytes.
  ExpectActiveVersion(RecvOptions("gen").dir, v);
  ExpectReceivedAsTheSnapshot(RecvOptions("gen").dir, merged);
}

INSTANTIATE_TEST_SUITE_P(MergedAndDelta, PublisherSnapshotModesTest,
                         ::testing::Values(PublishMode::kMerged, PublishMode::kDelta),
                         [](const auto& p) { return std::string(PublishModeName(p.param)); });

// As a resumed ferryd starts in merged or delta mode: the version it resumed from (derived)
// is published first, its snapshot offered first, and served bit-identical; the base is not
// published.
TEST_P(PublisherSnapshotModesTest, ADerivedVersionPublishedFirstIsServedFromTheSnapshotOfferedFirst) {
  const store::Digest v = RecordDerived();
  ASSERT_EQ(v, snapshot_->manifest_id());
  PublisherOptions po = FollowingOptions(GetParam(), v);
  po.offer_first = snapshot_;
  StartPublisher(po);
  EXPECT_EQ(publisher_->latest_sequence(), 1u);
  auto r = Receiver::Connect(RecvOptions("gen"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto first = (*r)->SyncLatest();
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->version, v);
  EXPECT_EQ(first->computed, v);
  EXPECT_EQ(first->sequence, 1u);
  ExpectActiveVersion(RecvOptions("gen").dir, v);
  ExpectReceivedAsTheSnapshot(RecvOptions("gen").dir, RowsWithoutObjects(v));
}

TEST_F(PublisherSnapshotTest, DerivedVersionWithoutAnOfferedSnapshotIsRefusedNamingIt) {
  const store::Digest v = RecordDerived();
  StartPublisher({});
  auto seq = publisher_->Publish(v);
  ASSERT_FALSE(seq.ok());
  EXPECT_EQ(seq.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(seq.status().message().find(v.Hex()), std::string::npos) << seq.status().ToString();
  EXPECT_NE(seq.status().message().find("no snapshot"), std::string::npos) << seq.status().ToString();
  EXPECT_EQ(publisher_->latest_sequence(), 0u);
}

TEST_F(PublisherSnapshotTest, OfferedBytesThatDoNotMatchTheRecordedDigestAreRefusedNamingTheTensor) {
  const store::Digest v = RecordDerived();
  // Another step's snapshot (one adapter weight moved) offered as version v.
  SnapshotSource other = FixtureSource();
  for (auto& [name, t] : other.adapter_tensors) {
    if (name.find("lora_B") != std::string::npos) t.mutable_data_as<float>()[0] += 1.0f;
  }
  std::shared_ptr<const Snapshot> wrong = Build(other);
  ASSERT_NE(wrong, nullptr);
  ASSERT_NE(wrong->manifest_id(), v);
  StartPublisher({});
  publisher_->Offer(v, wrong);
  ASSERT_TRUE(publisher_->Publish(v).ok());
  auto r = Receiver::Connect(RecvOptions("gen"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto got = (*r)->SyncLatest();
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kCorruption) << got.status().ToString();
  const std::string msg = got.status().message();
  EXPECT_NE(msg.find("of version " + v.Hex()), std::string::npos) << msg;
  EXPECT_NE(msg.find("not served"), std::string::npos) << msg;
  // The tensor named is one whose offered bytes differ from the recorded row.
  const size_t at = msg.find("tensor '");
  ASSERT_NE(at, std::string::npos) << msg;
  const std::string name = msg.substr(at + 8, msg.find('\'', at + 8) - at - 8);
  auto rec = store_->GetVersion(v.Hex());
  ASSERT_TRUE(rec.ok());
  bool found = false;
  for (const auto& row : rec->tensors) {
    if (row.name != name) continue;
    found = true;
    EXPECT_NE(wrong->digests().at(name), row.digest) << name << " is served from the store, not the snapshot";
  }
  EXPECT_TRUE(found) << "the error names no tensor of the version: " << msg;
  // Nothing activated.
  auto active = ActiveVersion(RecvOptions("gen").dir);
  ASSERT_TRUE(active.ok()) << active.status().ToString();
  EXPECT_FALSE(active->has_value());
}

}  // namespace
}  // namespace ferry::sync
