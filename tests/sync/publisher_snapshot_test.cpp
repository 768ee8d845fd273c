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

// Step `step`'s snapshot: the fixture's adapter with one lora_B element moved by `step`.
std::shared_ptr<const Snapshot> StepSnapshot(int step) {
  SnapshotSource src = FixtureSource();
  for (auto& [name, t] : src.adapter_tensors) {
    if (name.find("lora_B") != std::string::npos) t.mutable_data_as<float>()[0] += static_cast<float>(step);
  }
  return Build(src);
}

// Offered snapshots beyond the 2 newest are dropped before they are published: publishing
// the oldest one's version is then refused naming it, the newer ones are served.
TEST_F(PublisherSnapshotTest, AnOfferDroppedForNewerOnesIsRefusedWhenPublished) {
  StartPublisher({});
  std::vector<store::Digest> ids;
  for (int step = 1; step <= 3; ++step) {
    auto snap = StepSnapshot(step);
    ASSERT_NE(snap, nullptr);
    store::ImportOptions mo;
    mo.run = "rl";
    mo.step = step;
    mo.base_version = base_;
    mo.adapter_version = adapter_;
    auto r = RecordSnapshotDigests(*store_, *snap, mo);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ids.push_back(r->record.id);
    publisher_->Offer(r->record.id, snap);
  }
  auto oldest = publisher_->Publish(ids[0]);
  ASSERT_FALSE(oldest.ok());
  EXPECT_EQ(oldest.status().code(), StatusCode::kFailedPrecondition) << oldest.status().ToString();
  EXPECT_NE(oldest.status().message().find(ids[0].Hex()), std::string::npos) << oldest.status().ToString();
  ASSERT_TRUE(publisher_->Publish(ids[1]).ok());
  ASSERT_TRUE(publisher_->Publish(ids[2]).ok());
  auto r = Receiver::Connect(RecvOptions("gen"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto got = (*r)->SyncLatest();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->version, ids[2]);
  ExpectActiveVersion(RecvOptions("gen").dir, ids[2]);
}

// A receiver part-way through a derived version whose snapshot the publisher drops (two
// newer versions published meanwhile: only the 2 newest keep theirs) moves on to the latest
// version, verified, instead of failing on the tensors no longer served. The newer versions
// are published after the first chunk, while the store's tensors are fetched (lm_head, in
// 4 KiB chunks), and once the first merged tensor (layer 0's down_proj, chunk 18) is under way.
// With credit 4 the FETCHes already asked when the run gives way are answered afterwards
// (ERRORs among them), and must not be taken for the answer to the next HELLO.
TEST_F(PublisherSnapshotTest, AVersionWhoseSnapshotIsDroppedMidTransferGivesWayToTheLatest) {
  int round = 0;
  for (const auto& [credit, trigger] : std::vector<std::pair<uint32_t, int>>{{1, 1}, {1, 18}, {1, 19}, {4, 18}}) {
    SCOPED_TRACE("credit " + std::to_string(credit) + ", newer versions published after chunk " +
                 std::to_string(trigger));
    ++round;
    std::vector<store::Digest> ids;
    std::vector<std::shared_ptr<const Snapshot>> snaps;
    for (int k = 1; k <= 3; ++k) {
      const int step = round * 10 + k;
      snaps.push_back(StepSnapshot(step));
      ASSERT_NE(snaps.back(), nullptr);
      store::ImportOptions mo;
      mo.run = "rl";
      mo.step = step;
      mo.base_version = base_;
      mo.adapter_version = adapter_;
      auto r = RecordSnapshotDigests(*store_, *snaps.back(), mo);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      ids.push_back(r->record.id);
    }
    publisher_.reset();
    StartPublisher({});
    publisher_->Offer(ids[0], snaps[0]);
    ASSERT_TRUE(publisher_->Publish(ids[0]).ok());
    ReceiverOptions o = RecvOptions("gen" + std::to_string(round));
    o.chunk_bytes = 4096;  // small pieces: most are asked after the hook
    o.credit = credit;
    int chunks = 0;
    o.on_chunk_for_testing = [&](uint64_t) {
      if (++chunks != trigger) return;
      for (size_t k = 1; k <= 2; ++k) {
        publisher_->Offer(ids[k], snaps[k]);
        ASSERT_TRUE(publisher_->Publish(ids[k]).ok());
      }
    };
    auto r = Receiver::Connect(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    auto got = (*r)->SyncLatest();
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_GE(chunks, trigger);
    EXPECT_EQ(got->version, ids[2]);
    EXPECT_GE(got->skipped, 1);
    ExpectActiveVersion(o.dir, ids[2]);
  }
}

}  // namespace
}  // namespace ferry::sync
