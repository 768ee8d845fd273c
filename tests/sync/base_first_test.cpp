// A run's base is its first version: a publisher following a checkpoint watcher serves the
// base before the first checkpoint, so a receiver started first holds the base weights
// (verified, activated, acknowledged) and then each checkpoint's merged version. In merged
// and delta mode the base is served whole; in adapter mode too, and a receiver copies what
// its local base holds instead of fetching it, or, without a local base, merges the
// following adapters onto the base it received (kept while adapters refer to it).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "convert/peft_config.h"
#include "core/checkpoint.h"
#include "core/mapped_file.h"
#include "sync/publisher.h"
#include "sync/receiver.h"
#include "sync/snapshot.h"
#include "sync/watch.h"
#include "tests/sync/sync_test_util.h"
#include "tests/temp_dir.h"

namespace ferry::sync {
namespace {

namespace fs = std::filesystem;

const fs::path kCase = fs::path(FERRY_FIXTURES_DIR) / "cases" / "llama_lora_all_linear_f32";

class BaseFirstTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(watched());
    auto s = store::Store::Open(tmp_.path() / "db", {.create_if_missing = true});
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    owned_ = std::move(*s);
    shared_ = owned_.get();  // the watcher and the publisher share it: Store is thread-safe
    WatchOptions o;
    o.dir = watched();
    o.base = (kCase / "base").string();
    o.run = "rl";
    o.threads = 2;
    auto w = CheckpointWatcher::Create(shared_, o);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    watcher_ = std::move(*w);
    auto base = store::HashPath(kCase / "base");
    ASSERT_TRUE(base.ok()) << base.status().ToString();
    base_ = base->id;
  }
  void TearDown() override {
    publisher_.reset();
    watcher_.reset();
    shared_ = nullptr;
    owned_.reset();
  }

  fs::path watched() const { return tmp_.path() / "watch"; }

  void StartPublisher(PublishMode mode) {
    auto ep = PrivateIpcEndpoints(tmp_.path() / "sock");
    ASSERT_TRUE(ep.ok()) << ep.status().ToString();
    endpoints_ = *ep;
    PublisherOptions po;
    po.endpoints = endpoints_;
    po.mode = mode;
    auto p = Publisher::Start(shared_, po);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    publisher_ = std::move(*p);
  }

  ReceiverOptions RecvOptions(const std::string& id) const { return TestReceiverOptions(endpoints_, tmp_.path(), id); }

  // What the CLI serves first: the newest publishable version of the run, which before any
  // checkpoint is the base the watcher recorded in it.
  void PublishFirst(PublishMode mode) {
    auto first = NewestPublishable(*shared_, "rl", mode);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    ASSERT_TRUE(first->has_value()) << "nothing publishable in run rl before the first checkpoint";
    EXPECT_EQ(**first, base_);
    EXPECT_EQ(watcher_->base_version(), base_);
    auto seq = publisher_->Publish(**first);
    ASSERT_TRUE(seq.ok()) << seq.status().ToString();
    EXPECT_EQ(*seq, 1u);
  }

  // Drops the fixture adapter (the last float's lowest byte flipped when `variant`) as
  // checkpoint NAME, lets it settle and returns what the watcher recorded.
  WatchedCheckpoint DropCheckpoint(const std::string& name, bool variant) {
    const fs::path staging = tmp_.path() / ("staging-" + name);
    fs::copy(kCase / "adapter", staging, fs::copy_options::recursive);
    if (variant) {
      std::string w = ReadSmallFile(staging / "adapter_model.safetensors").value();
      w[w.size() - 4] = static_cast<char>(w[w.size() - 4] ^ 1);
      std::ofstream(staging / "adapter_model.safetensors", std::ios::binary | std::ios::trunc) << w;
    }
    fs::rename(staging, watched() / name);
    for (int polls = 0; polls < 3; ++polls) {
      auto got = watcher_->Poll();
      EXPECT_TRUE(got.ok()) << got.status().ToString();
      if (got.ok() && !got->empty()) {
        EXPECT_EQ(got->size(), 1u);
        EXPECT_TRUE((*got)[0].error.ok()) << (*got)[0].error.ToString();
        return (*got)[0];
      }
    }
    ADD_FAILURE() << name << " did not settle";
    return {};
  }

  // The acknowledgement events recorded for `v` by receiver `id` (read once the publisher
  // is stopped).
  std::vector<store::Event> Acks(const store::Digest& v, const std::string& id) {
    std::vector<store::Event> out;
    auto events = owned_->ListEvents(v);
    EXPECT_TRUE(events.ok()) << events.status().ToString();
    if (!events.ok()) return out;
    for (const auto& e : *events) {
      if (e.type == store::Event::Type::kAcknowledged && e.receiver == id) out.push_back(e);
    }
    return out;
  }

  static uint64_t BaseTensorBytes() { return Checkpoint::Open(kCase / "base").value().total_bytes(); }

  testing::ScopedTempDir tmp_{"ferry-basefirst-test-"};
  std::unique_ptr<store::Store> owned_;
  store::Store* shared_ = nullptr;
  std::unique_ptr<CheckpointWatcher> watcher_;
  std::unique_ptr<Publisher> publisher_;
  Endpoints endpoints_;
  store::Digest base_;
};

class BaseFirstModesTest : public BaseFirstTest, public ::testing::WithParamInterface<PublishMode> {};

TEST_P(BaseFirstModesTest, ReceiverStartedFirstHoldsTheBaseThenTheCheckpoint) {
  StartPublisher(GetParam());
  PublishFirst(GetParam());
  auto r = Receiver::Connect(RecvOptions("gen"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto first = (*r)->SyncLatest();
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->version, base_);
  EXPECT_EQ(first->computed, base_);
  EXPECT_EQ(first->active, base_);
  EXPECT_GE(first->bytes_received, BaseTensorBytes());  // served whole
  ExpectActiveVersion(RecvOptions("gen").dir, base_);

  const WatchedCheckpoint c = DropCheckpoint("checkpoint-1", /*variant=*/false);
  ASSERT_TRUE(c.version.has_value());
  auto seq = publisher_->Publish(*c.version);
  ASSERT_TRUE(seq.ok()) << seq.status().ToString();
  EXPECT_EQ(*seq, 2u);
  auto second = (*r)->WaitForNewer(10000);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->version, *c.version);
  EXPECT_EQ(second->active, *c.version);
  if (GetParam() == PublishMode::kDelta) {
    EXPECT_GT(second->bytes_reused, 0u) << "the base's unchanged tensors (embeddings, norms) are copied";
  }
  ExpectActiveVersion(RecvOptions("gen").dir, *c.version);

  publisher_.reset();
  const auto base_acks = Acks(base_, "gen");
  ASSERT_EQ(base_acks.size(), 1u);
  EXPECT_EQ(base_acks[0].computed, std::optional<store::Digest>(base_));
  EXPECT_EQ(Acks(*c.version, "gen").size(), 1u);
}

INSTANTIATE_TEST_SUITE_P(MergedAndDelta, BaseFirstModesTest,
                         ::testing::Values(PublishMode::kMerged, PublishMode::kDelta),
                         [](const auto& p) { return std::string(PublishModeName(p.param)); });

// Adapter mode, a receiver keeping the base locally: the base is activated from its own
// copy (every tensor copied and verified, only the aux files fetched), then each adapter
// is merged onto it and proven.
TEST_F(BaseFirstTest, AdapterModeReceiverWithALocalBaseActivatesItWithoutFetchingTensors) {
  StartPublisher(PublishMode::kAdapter);
  PublishFirst(PublishMode::kAdapter);
  auto o = RecvOptions("lora");
  o.base_dir = kCase / "base";
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto first = (*r)->SyncLatest();
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->version, base_);
  EXPECT_EQ(first->active, base_);
  EXPECT_FALSE(first->proven.has_value());
  EXPECT_EQ(first->bytes_reused, BaseTensorBytes());
  auto base = shared_->GetVersion(base_.Hex());
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  uint64_t aux_bytes = 0;
  for (const auto& a : base->aux) aux_bytes += a.size;
  EXPECT_EQ(first->bytes_received, aux_bytes) << "only the aux files are fetched";
  ExpectActiveVersion(o.dir, base_);

  const WatchedCheckpoint c = DropCheckpoint("checkpoint-1", /*variant=*/false);
  ASSERT_TRUE(c.adapter_version.has_value() && c.version.has_value());
  ASSERT_TRUE(publisher_->Publish(*c.adapter_version).ok());
  auto second = (*r)->WaitForNewer(10000);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->version, *c.adapter_version);
  EXPECT_EQ(second->proven, c.version);
  EXPECT_EQ(second->active, *c.version);
  ExpectActiveVersion(o.dir, *c.version);

  publisher_.reset();
  EXPECT_EQ(Acks(base_, "lora").size(), 1u);
  EXPECT_EQ(Acks(*c.version, "lora").size(), 1u);  // adapter mode records the merged id it proved
}

// Adapter mode without a local base: the receiver fetches the base, activates it, and
// merges each following adapter onto that received base, which pruning keeps.
TEST_F(BaseFirstTest, AdapterModeReceiverWithoutALocalBaseMergesOntoTheBaseItReceived) {
  StartPublisher(PublishMode::kAdapter);
  PublishFirst(PublishMode::kAdapter);
  auto o = RecvOptions("nobase");
  o.keep_versions = 1;
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto first = (*r)->SyncLatest();
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->active, base_);
  EXPECT_GE(first->bytes_received, BaseTensorBytes());

  store::Digest previous_adapter;
  for (int step : {1, 2}) {
    const WatchedCheckpoint c = DropCheckpoint("checkpoint-" + std::to_string(step), /*variant=*/step == 2);
    ASSERT_TRUE(c.adapter_version.has_value() && c.version.has_value());
    ASSERT_TRUE(publisher_->Publish(*c.adapter_version).ok());
    auto s = (*r)->WaitForNewer(10000);
    ASSERT_TRUE(s.ok()) << "step " << step << ": " << s.status().ToString();
    EXPECT_EQ(s->proven, c.version);
    EXPECT_EQ(s->active, *c.version);
    ExpectActiveVersion(o.dir, *c.version);
    // keep_versions 1: the active merge, the adapter it came from and the base it was merged onto.
    EXPECT_TRUE(fs::is_directory(o.dir / "versions" / base_.Hex())) << "step " << step;
    if (step == 2) {
      EXPECT_FALSE(fs::exists(o.dir / "versions" / previous_adapter.Hex()));
    }
    previous_adapter = *c.adapter_version;
  }
}

// Adapter mode, a receiver without a local base that joins after more adapters than the
// publisher keeps served: it fetches the base the newest adapter applies to (still served,
// not activated) and merges onto it, proving the merged id.
TEST_F(BaseFirstTest, AdapterModeReceiverJoiningLateFetchesTheBaseTheAdaptersApplyTo) {
  StartPublisher(PublishMode::kAdapter);
  PublishFirst(PublishMode::kAdapter);
  const WatchedCheckpoint a = DropCheckpoint("checkpoint-1", /*variant=*/false);
  const WatchedCheckpoint b = DropCheckpoint("checkpoint-2", /*variant=*/true);
  ASSERT_TRUE(a.adapter_version && a.version && b.adapter_version && b.version);
  // 10 adapters after the base: more than the 8 versions a publisher keeps serving.
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(publisher_->Publish(*(i % 2 == 0 ? a : b).adapter_version).ok());

  auto o = RecvOptions("late");
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto s = (*r)->SyncLatest();
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->version, *b.adapter_version);
  EXPECT_EQ(s->proven, b.version);
  EXPECT_EQ(s->active, *b.version);
  EXPECT_GE(s->bytes_received, BaseTensorBytes()) << "the base was fetched";
  ExpectActiveVersion(o.dir, *b.version);
  EXPECT_TRUE(fs::is_directory(o.dir / "versions" / base_.Hex()));
  EXPECT_FALSE(fs::exists(o.dir / "manifests" / (base_.Hex() + ".json"))) << "the base was not activated";

  // The next adapter merges onto the same received base without fetching it again.
  ASSERT_TRUE(publisher_->Publish(*a.adapter_version).ok());
  auto next = (*r)->WaitForNewer(10000);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->active, *a.version);
  EXPECT_LT(next->bytes_received, BaseTensorBytes());

  publisher_.reset();
  EXPECT_EQ(Acks(*b.version, "late").size(), 1u);
  EXPECT_TRUE(Acks(base_, "late").empty()) << "a base fetched to merge onto is not acknowledged";
}

}  // namespace
}  // namespace ferry::sync
