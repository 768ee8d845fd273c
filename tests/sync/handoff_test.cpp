// In-process hand-off (sync/handoff.h): a co-located generator gets the very snapshot the
// trainer built (the same bytes, no copy), keeps it valid whatever is published afterwards,
// is woken by Publish, and proves what it holds by hashing it; acknowledgements are checked
// and recorded in the store as the network publisher records them.
#include "sync/handoff.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/checkpoint.h"
#include "core/mapped_file.h"
#include "tests/temp_dir.h"

namespace ferry::sync {
namespace {

namespace fs = std::filesystem;

const fs::path kBase = fs::path(FERRY_FIXTURES_DIR) / "cases" / "llama_lora_all_linear_f32" / "base";
constexpr const char* kNudged = "model.layers.0.mlp.down_proj.weight";

class TempDir : public testing::ScopedTempDir {
 public:
  TempDir() : ScopedTempDir("ferry-handoff-test-") {}
};

// The trainer's parameters: the fixture base in owned buffers, plus its aux files.
SnapshotSource TrainerSource() {
  SnapshotSource s;
  Checkpoint ckpt = Checkpoint::Open(kBase).value();
  for (const auto& name : ckpt.names()) {
    Tensor t = ckpt.Get(name).value();
    Tensor copy = Tensor::Empty(t.dtype(), t.shape()).value();
    std::memcpy(copy.mutable_data(), t.data(), t.nbytes());
    s.tensors.emplace(name, copy);
  }
  for (const char* n : {"config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
                        "tokenizer_config.json"}) {
    s.aux_files.emplace_back(n, ReadSmallFile(kBase / n).value());
  }
  return s;
}

// A snapshot after `step` optimiser steps: one weight element moved by `step`.
std::shared_ptr<const Snapshot> SnapshotAtStep(SnapshotSource& source, int step) {
  source.tensors.at(kNudged).mutable_data_as<float>()[0] += static_cast<float>(step);
  auto snap = BuildSnapshot(source, SnapshotOptions{});
  EXPECT_TRUE(snap.ok()) << snap.status().ToString();
  return snap.ok() ? *snap : nullptr;
}

std::unique_ptr<store::Store> OpenStore(const fs::path& dir) {
  store::StoreOptions so;
  so.create_if_missing = true;
  so.sync_objects = false;
  auto st = store::Store::Open(dir, so);
  EXPECT_TRUE(st.ok()) << st.status().ToString();
  return st.ok() ? std::move(st).value() : nullptr;
}

// The events of `version` of one type.
std::vector<store::Event> EventsOf(store::Store& st, const store::Digest& version, store::Event::Type type) {
  auto events = st.ListEvents(version);
  EXPECT_TRUE(events.ok()) << events.status().ToString();
  std::vector<store::Event> out;
  if (!events.ok()) return out;
  for (const auto& e : *events) {
    if (e.type == type) out.push_back(e);
  }
  return out;
}

TEST(HandoffTest, GeneratorSeesTheSnapshotsOwnBytesAndProvesTheStoreId) {
  SnapshotSource source = TrainerSource();
  auto snap = SnapshotAtStep(source, 0);
  ASSERT_NE(snap, nullptr);
  SnapshotChannel channel;
  EXPECT_FALSE(channel.Latest().has_value());
  auto seq = channel.Publish(snap);
  ASSERT_TRUE(seq.ok()) << seq.status().ToString();
  EXPECT_EQ(*seq, 1u);

  auto got = channel.Latest();
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->sequence, 1u);
  EXPECT_EQ(got->snapshot.get(), snap.get());
  ASSERT_EQ(got->snapshot->checkpoint().names(), snap->checkpoint().names());
  for (const auto& name : snap->checkpoint().names()) {
    Tensor mine = got->snapshot->checkpoint().Get(name).value();
    Tensor theirs = snap->checkpoint().Get(name).value();
    EXPECT_EQ(mine.data(), theirs.data()) << name << ": the generator must see the snapshot's own buffer";
    EXPECT_NE(mine.data(), source.tensors.at(name).data()) << name << ": the snapshot must not alias the trainer";
  }
  // The generator's proof equals the id the store gives the same weights on disk.
  auto computed = ComputeManifestId(*got->snapshot);
  ASSERT_TRUE(computed.ok()) << computed.status().ToString();
  auto on_disk = store::HashPath(kBase);
  ASSERT_TRUE(on_disk.ok()) << on_disk.status().ToString();
  EXPECT_EQ(*computed, on_disk->id);
  EXPECT_EQ(*computed, snap->manifest_id());
  EXPECT_TRUE(channel.Acknowledge("generator-0", 1, *computed).ok());
}

TEST(HandoffTest, ComputeManifestIdHashesTheBytesNotTheCachedId) {
  SnapshotSource source = TrainerSource();
  auto snap = SnapshotAtStep(source, 0);
  ASSERT_NE(snap, nullptr);
  Tensor t = snap->checkpoint().Get(kNudged).value();
  ASSERT_NE(t.mutable_data(), nullptr);
  const std::byte saved = t.mutable_data()[3];
  t.mutable_data()[3] ^= std::byte{0x40};  // what a stray write into the generator's weights does
  auto computed = ComputeManifestId(*snap);
  t.mutable_data()[3] = saved;
  ASSERT_TRUE(computed.ok()) << computed.status().ToString();
  EXPECT_NE(*computed, snap->manifest_id());
  auto restored = ComputeManifestId(*snap);
  ASSERT_TRUE(restored.ok());
  EXPECT_EQ(*restored, snap->manifest_id());
}

TEST(HandoffTest, NewerSnapshotsAndADroppedPublisherReferenceNeverChangeAHeldSnapshot) {
  SnapshotSource source = TrainerSource();
  SnapshotChannel channel;
  auto first = SnapshotAtStep(source, 0);
  ASSERT_NE(first, nullptr);
  const store::Digest first_id = first->manifest_id();
  Tensor held_tensor = first->checkpoint().Get(kNudged).value();
  const std::vector<std::byte> held_bytes(held_tensor.bytes().begin(), held_tensor.bytes().end());
  std::weak_ptr<const Snapshot> watch = first;
  ASSERT_TRUE(channel.Publish(std::move(first)).ok());

  auto held = channel.Latest();  // the generator takes version 1 ...
  ASSERT_TRUE(held.has_value());
  held_tensor = Tensor();
  // ... and the trainer drops its reference, keeps training and publishes newer versions.
  for (int step = 1; step <= 3; ++step) {
    auto next = SnapshotAtStep(source, step);
    ASSERT_NE(next, nullptr);
    auto seq = channel.Publish(next);
    ASSERT_TRUE(seq.ok());
    EXPECT_EQ(*seq, static_cast<uint64_t>(step + 1));
  }
  ASSERT_FALSE(watch.expired()) << "the generator's reference keeps the snapshot alive";
  EXPECT_EQ(held->sequence, 1u);
  EXPECT_EQ(held->snapshot->manifest_id(), first_id);
  auto computed = ComputeManifestId(*held->snapshot);
  ASSERT_TRUE(computed.ok());
  EXPECT_EQ(*computed, first_id);
  Tensor now = held->snapshot->checkpoint().Get(kNudged).value();
  ASSERT_EQ(now.nbytes(), held_bytes.size());
  EXPECT_EQ(std::memcmp(now.data(), held_bytes.data(), held_bytes.size()), 0);
  EXPECT_NE(channel.Latest()->snapshot->manifest_id(), first_id);
  now = Tensor();

  held.reset();
  EXPECT_TRUE(watch.expired()) << "the channel keeps only the latest snapshot alive";
}

TEST(HandoffTest, WaitForNewerWakesOnPublishFromAnotherThread) {
  SnapshotSource source = TrainerSource();
  auto snap = SnapshotAtStep(source, 0);
  ASSERT_NE(snap, nullptr);
  SnapshotChannel channel;
  const auto start = std::chrono::steady_clock::now();
  auto waiter = std::async(std::launch::async, [&] { return channel.WaitForNewer(0, 60'000); });
  std::thread publisher([&] { ASSERT_TRUE(channel.Publish(snap).ok()); });
  Result<Handoff> got = waiter.get();
  publisher.join();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->sequence, 1u);
  EXPECT_EQ(got->snapshot.get(), snap.get());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << "woken by Publish, not the timeout";

  // Already newer: returns at once.
  auto at_once = channel.WaitForNewer(0, 0);
  ASSERT_TRUE(at_once.ok()) << at_once.status().ToString();
  EXPECT_EQ(at_once->sequence, 1u);
}

TEST(HandoffTest, WaitForNewerTimesOutWithNotFoundNamingTheSequenceAndTimeout) {
  SnapshotSource source = TrainerSource();
  SnapshotChannel channel(nullptr, "run-a");
  auto empty = channel.WaitForNewer(0, 20);
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), StatusCode::kNotFound) << empty.status().ToString();
  ASSERT_TRUE(channel.Publish(SnapshotAtStep(source, 0)).ok());
  const auto start = std::chrono::steady_clock::now();
  auto r = channel.WaitForNewer(1, 50);
  ASSERT_FALSE(r.ok());
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(50));
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status().ToString();
  const std::string msg = r.status().message();
  EXPECT_NE(msg.find("sequence 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("50 ms"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'run-a'"), std::string::npos) << msg;
}

TEST(HandoffTest, CloseWakesWaitersWithFailedPreconditionAndRefusesPublish) {
  SnapshotSource source = TrainerSource();
  auto snap = SnapshotAtStep(source, 0);
  ASSERT_NE(snap, nullptr);
  SnapshotChannel channel(nullptr, "run-b");
  ASSERT_TRUE(channel.Publish(snap).ok());
  auto waiter = std::async(std::launch::async, [&] { return channel.WaitForNewer(1, 60'000); });
  channel.Close();
  Result<Handoff> r = waiter.get();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find("'run-b'"), std::string::npos) << r.status().message();
  // What was published before closing is still there.
  auto older = channel.WaitForNewer(0, 0);
  ASSERT_TRUE(older.ok()) << older.status().ToString();
  EXPECT_EQ(older->sequence, 1u);
  auto p = channel.Publish(snap);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kFailedPrecondition) << p.status().ToString();
  EXPECT_NE(p.status().message().find("closed"), std::string::npos) << p.status().message();
  auto null = SnapshotChannel().Publish(nullptr);
  ASSERT_FALSE(null.ok());
  EXPECT_EQ(null.status().code(), StatusCode::kInvalidArgument) << null.status().ToString();
}

TEST(HandoffTest, SequencesIncreaseByOneAndOnlyRecentOnesCanBeAcknowledged) {
  SnapshotSource source = TrainerSource();
  auto snap = SnapshotAtStep(source, 0);
  ASSERT_NE(snap, nullptr);
  SnapshotChannel channel;
  const uint64_t n = SnapshotChannel::kAcknowledgeable + 2;
  for (uint64_t i = 1; i <= n; ++i) {
    auto seq = channel.Publish(snap);
    ASSERT_TRUE(seq.ok());
    EXPECT_EQ(*seq, i);
    EXPECT_EQ(channel.Latest()->sequence, i);
  }
  EXPECT_TRUE(channel.Acknowledge("gen", n - SnapshotChannel::kAcknowledgeable + 1, snap->manifest_id()).ok());
  for (uint64_t stale : {uint64_t{0}, n - SnapshotChannel::kAcknowledgeable, n + 1}) {
    Status s = channel.Acknowledge("gen", stale, snap->manifest_id());
    EXPECT_EQ(s.code(), StatusCode::kNotFound) << stale << ": " << s.ToString();
    EXPECT_NE(s.message().find("sequence " + std::to_string(stale)), std::string::npos) << s.message();
  }
  Status bad_id = channel.Acknowledge("no spaces allowed", n, snap->manifest_id());
  EXPECT_EQ(bad_id.code(), StatusCode::kInvalidArgument) << bad_id.ToString();
  EXPECT_NE(bad_id.message().find("no spaces allowed"), std::string::npos) << bad_id.message();
}

TEST(HandoffTest, AcknowledgementsAreRecordedInTheStoreAndAMismatchIsCorruption) {
  TempDir tmp;
  auto st = OpenStore(tmp.path() / "db");
  ASSERT_NE(st, nullptr);
  SnapshotSource source = TrainerSource();
  auto v1 = SnapshotAtStep(source, 0);
  auto v2 = SnapshotAtStep(source, 1);
  ASSERT_NE(v1, nullptr);
  ASSERT_NE(v2, nullptr);
  SnapshotChannel channel(st.get(), "grpo");
  ASSERT_EQ(channel.Publish(v1).value(), 1u);
  ASSERT_EQ(channel.Publish(v2).value(), 2u);

  auto good = ComputeManifestId(*v1);
  ASSERT_TRUE(good.ok());
  EXPECT_TRUE(channel.Acknowledge("gen-a", 1, *good).ok());
  // gen-b claims to hold v2 but computed v1's digest.
  Status bad = channel.Acknowledge("gen-b", 2, *good);
  EXPECT_EQ(bad.code(), StatusCode::kCorruption) << bad.ToString();
  EXPECT_NE(bad.message().find(v1->manifest_id().Hex()), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find(v2->manifest_id().Hex()), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("'gen-b'"), std::string::npos) << bad.message();

  auto acks1 = EventsOf(*st, v1->manifest_id(), store::Event::Type::kAcknowledged);
  ASSERT_EQ(acks1.size(), 1u);
  EXPECT_EQ(acks1[0].receiver, "gen-a");
  EXPECT_EQ(acks1[0].version, v1->manifest_id());
  ASSERT_TRUE(acks1[0].computed.has_value());
  EXPECT_EQ(*acks1[0].computed, v1->manifest_id());
  EXPECT_EQ(acks1[0].detail.find("MISMATCH"), std::string::npos) << acks1[0].detail;

  auto acks2 = EventsOf(*st, v2->manifest_id(), store::Event::Type::kAcknowledged);
  ASSERT_EQ(acks2.size(), 1u);
  EXPECT_EQ(acks2[0].receiver, "gen-b");
  ASSERT_TRUE(acks2[0].computed.has_value());
  EXPECT_EQ(*acks2[0].computed, v1->manifest_id());
  EXPECT_EQ(acks2[0].detail, "MISMATCH: receiver computed " + v1->manifest_id().Hex());

  auto pub = EventsOf(*st, v2->manifest_id(), store::Event::Type::kPublished);
  ASSERT_EQ(pub.size(), 1u);
  EXPECT_NE(pub[0].detail.find("sequence 2"), std::string::npos) << pub[0].detail;
  EXPECT_NE(pub[0].detail.find("'grpo'"), std::string::npos) << pub[0].detail;
}

TEST(HandoffTest, ConcurrentGeneratorsSeeIncreasingSequencesUpToTheLast) {
  SnapshotSource source = TrainerSource();
  std::vector<std::shared_ptr<const Snapshot>> versions;
  for (int step = 0; step < 6; ++step) versions.push_back(SnapshotAtStep(source, step));
  SnapshotChannel channel;
  const uint64_t last = versions.size();
  auto generator = [&]() -> Status {
    uint64_t seen = 0;
    while (seen < last) {
      auto h = channel.WaitForNewer(seen, 60'000);
      if (!h.ok()) return h.status();
      if (h->sequence <= seen)
        return Status::Internal("sequence went from " + std::to_string(seen) + " to " + std::to_string(h->sequence));
      if (h->snapshot != versions[h->sequence - 1]) return Status::Internal("wrong snapshot for a sequence");
      auto id = ComputeManifestId(*h->snapshot);
      if (!id.ok()) return id.status();
      FERRY_RETURN_IF_ERROR(channel.Acknowledge("gen", h->sequence, *id));
      seen = h->sequence;
    }
    return Status::OK();
  };
  std::vector<std::future<Status>> gens;
  for (int i = 0; i < 3; ++i) gens.push_back(std::async(std::launch::async, generator));
  for (const auto& v : versions) ASSERT_TRUE(channel.Publish(v).ok());
  for (auto& g : gens) {
    Status s = g.get();
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
}

// The daemon's loop: the trainer thread records every snapshot in the store and publishes
// it; generator threads acknowledge into the same store meanwhile (no lock around it). Every
// version is recorded once, in sequence, and every acknowledgement and publication is there.
TEST(HandoffTest, RecordingPublishingAndAcknowledgingShareOneStore) {
  TempDir tmp;
  auto st = OpenStore(tmp.path() / "db");
  ASSERT_NE(st, nullptr);
  SnapshotSource source = TrainerSource();
  std::vector<std::shared_ptr<const Snapshot>> versions;
  for (int step = 0; step < 4; ++step) versions.push_back(SnapshotAtStep(source, step + 1));
  SnapshotChannel channel(st.get(), "grpo");
  const uint64_t last = versions.size();
  auto generator = [&](const std::string& id) -> Status {
    uint64_t seen = 0;
    while (seen < last) {
      auto h = channel.WaitForNewer(seen, 60'000);
      if (!h.ok()) return h.status();
      auto computed = ComputeManifestId(*h->snapshot);
      if (!computed.ok()) return computed.status();
      FERRY_RETURN_IF_ERROR(channel.Acknowledge(id, h->sequence, *computed));
      auto listed = st->ListVersions(std::string("grpo"));  // reads while the trainer records
      if (!listed.ok()) return listed.status();
      seen = h->sequence;
    }
    return Status::OK();
  };
  std::vector<std::future<Status>> gens;
  for (const char* id : {"gen-a", "gen-b"}) gens.push_back(std::async(std::launch::async, generator, id));
  for (size_t i = 0; i < versions.size(); ++i) {
    store::ImportOptions o;
    o.run = "grpo";
    o.step = static_cast<int64_t>(i + 1);
    auto recorded = RecordSnapshot(*st, *versions[i], o);
    ASSERT_TRUE(recorded.ok()) << recorded.status().ToString();
    ASSERT_EQ(recorded->record.id, versions[i]->manifest_id());
    ASSERT_TRUE(channel.Publish(versions[i]).ok());
  }
  for (auto& g : gens) {
    Status s = g.get();
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  auto listed = st->ListVersions(std::string("grpo"));
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  ASSERT_EQ(listed->size(), versions.size());
  for (size_t i = 0; i < versions.size(); ++i) {
    EXPECT_EQ((*listed)[i].id, versions[i]->manifest_id());
    EXPECT_EQ((*listed)[i].sequence, i + 1);
    EXPECT_EQ(EventsOf(*st, versions[i]->manifest_id(), store::Event::Type::kPublished).size(), 1u);
  }
  // The last version is acknowledged by both generators (earlier ones by whoever saw them).
  auto acks = EventsOf(*st, versions.back()->manifest_id(), store::Event::Type::kAcknowledged);
  std::set<std::string> receivers;
  for (const auto& e : acks) receivers.insert(e.receiver);
  EXPECT_EQ(receivers, (std::set<std::string>{"gen-a", "gen-b"}));
}

}  // namespace
}  // namespace ferry::sync
