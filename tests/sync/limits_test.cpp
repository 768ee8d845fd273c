// Limits the publisher enforces against its peers and the publisher's follow mode
// (sync/publisher.h): a peer that asks and never reads costs references, not copies; an
// oversized frame gets its sender disconnected; an unlisted CURVE key hears no
// announcement; an ipc:// endpoint directory owned by another user is refused; a following
// publisher serves what its mode can publish; a rate cap paces what is sent.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <thread>

#include <zmq.hpp>

#include "core/safetensors.h"
#include "store/store.h"
#include "sync/keys.h"
#include "sync/protocol.h"
#include "sync/publisher.h"
#include "sync/receiver.h"
#include "sync/watch.h"
#include "tests/sync/sync_test_util.h"
#include "tests/temp_dir.h"

namespace ferry::sync {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

class LimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto st = store::Store::Open(tmp_.path() / "db", {.create_if_missing = true});
    ASSERT_TRUE(st.ok()) << st.status().message();
    store_ = std::move(*st);
    auto ep = PrivateIpcEndpoints(tmp_.path() / "sock");
    ASSERT_TRUE(ep.ok()) << ep.status().message();
    endpoints_ = *ep;
  }
  void TearDown() override { publisher_.reset(); }

  store::Digest ImportTiny(const std::string& name, float scale, const store::ImportOptions& o = {}) {
    WriteTinyModel(tmp_.path() / name, scale, {2, 3});
    auto r = store_->Import(tmp_.path() / name, o);
    EXPECT_TRUE(r.ok()) << r.status().message();
    return r.ok() ? r->record.id : store::Digest{};
  }

  void StartPublisher(PublisherOptions o, store::Store* st = nullptr) {
    if (o.endpoints.requests.empty()) o.endpoints = endpoints_;
    auto p = Publisher::Start(st != nullptr ? st : store_.get(), o);
    ASSERT_TRUE(p.ok()) << p.status().message();
    publisher_ = std::move(*p);
  }

  testing::ScopedTempDir tmp_{"ferry-sync-limits-"};
  std::unique_ptr<store::Store> store_;
  std::unique_ptr<Publisher> publisher_;
  Endpoints endpoints_;
};

// max_send_bytes_per_sec paces the chunks: 4 MiB of tensors at 8 MiB/s take at least
// (4 MiB - the 1 MiB of banked credit) / 8 MiB/s = 0.375 s; a negative cap is refused.
TEST_F(LimitsTest, ARateCapPacesTheChunksSent) {
  const fs::path model = tmp_.path() / "four-mib";
  fs::create_directories(model);
  {
    std::vector<TensorSpec> specs;
    for (int i = 0; i < 4; ++i) specs.push_back({"t" + std::to_string(i), DType::kF32, {256 * 1024}});
    auto w = SafetensorsWriter::CreateFile(model / "model.safetensors", specs);
    ASSERT_TRUE(w.ok()) << w.status().message();
    std::vector<float> v(256 * 1024);
    for (int i = 0; i < 4; ++i) {
      std::fill(v.begin(), v.end(), static_cast<float>(i));
      ASSERT_TRUE((*w)->Append(std::as_bytes(std::span(v))).ok());
    }
    ASSERT_TRUE((*w)->Finish().ok());
  }
  auto imported = store_->Import(model, {});
  ASSERT_TRUE(imported.ok()) << imported.status().message();
  PublisherOptions bad;
  bad.endpoints = endpoints_;
  bad.max_send_bytes_per_sec = -1;
  auto refused = Publisher::Start(store_.get(), bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("max_send_bytes_per_sec"), std::string::npos);

  PublisherOptions po;
  po.max_send_bytes_per_sec = 8 << 20;
  StartPublisher(po);
  ASSERT_TRUE(publisher_->Publish(imported->record.id).ok());
  ReceiverOptions ro;
  ro.id = "paced";
  ro.endpoints = endpoints_;
  ro.dir = tmp_.path() / "recv";
  ro.timeout_ms = 10000;
  auto r = Receiver::Connect(ro);
  ASSERT_TRUE(r.ok()) << r.status().message();
  const auto t0 = Clock::now();
  auto s = (*r)->SyncLatest();
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->bytes_received, 4u << 20);
  EXPECT_GE(secs, 0.375);
}

// A peer sends 1,000 FETCHes of a 2 MiB aux file and never reads a reply. Replies share
// the publisher's copy of the file (and at most kSendHwm are queued per peer), so the
// process's anonymous memory grows by far less than the 2 GB that copies would take; a
// real receiver is served meanwhile.
TEST_F(LimitsTest, APeerThatNeverReadsCostsReferencesNotCopies) {
  if (RssAnonBytes() == 0) GTEST_SKIP() << "/proc/self/status has no RssAnon";
  const fs::path model = tmp_.path() / "big-aux";
  WriteTinyModel(model, 1.0f, {2, 3});
  {
    std::ofstream tok(model / "tokenizer.json", std::ios::binary);
    tok << "{\"pad\": \"" << std::string(2u << 20, 'x') << "\"}";
  }
  auto imported = store_->Import(model, {});
  ASSERT_TRUE(imported.ok()) << imported.status().message();
  const store::VersionRecord& rec = imported->record;
  uint32_t tok_index = 0;
  while (tok_index < rec.aux.size() && rec.aux[tok_index].name != "tokenizer.json") ++tok_index;
  ASSERT_LT(tok_index, rec.aux.size());
  StartPublisher({});
  ASSERT_TRUE(publisher_->Publish(rec.id).ok());

  zmq::context_t ctx;
  zmq::socket_t flood(ctx, zmq::socket_type::dealer);
  flood.set(zmq::sockopt::linger, 0);
  flood.set(zmq::sockopt::rcvhwm, 1);  // this test's own side buffers (almost) nothing
  flood.set(zmq::sockopt::rcvbuf, 65536);
  flood.set(zmq::sockopt::sndhwm, 0);
  flood.connect(endpoints_.requests);
  Message fetch;
  fetch.type = MsgType::kFetch;
  fetch.version = rec.id;
  fetch.kind = ItemKind::kAux;
  fetch.index = tok_index;
  fetch.offset = 0;
  fetch.length = static_cast<uint32_t>(rec.aux[tok_index].size);
  const std::string header = EncodeHeader(fetch);
  const int64_t before = static_cast<int64_t>(RssAnonBytes());
  for (int i = 0; i < 1000; ++i) flood.send(zmq::buffer(header), zmq::send_flags::none);

  // The publisher still serves others while the flood is queued.
  ReceiverOptions ro;
  ro.id = "bystander";
  ro.endpoints = publisher_->bound_endpoints();
  ro.dir = tmp_.path() / "recv";
  ro.timeout_ms = 10000;
  auto r = Receiver::Connect(ro);
  ASSERT_TRUE(r.ok()) << r.status().message();
  auto s = (*r)->SyncLatest();
  ASSERT_TRUE(s.ok()) << s.status().message();
  ExpectActiveVersion(ro.dir, rec.id);
  // The router serves both connections fairly, so the flood may still be in progress:
  // watch the memory for a while and keep the largest growth.
  int64_t grown = 0;
  for (int i = 0; i < 30; ++i) {
    grown = std::max(grown, static_cast<int64_t>(RssAnonBytes()) - before);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_LT(grown, int64_t{256} << 20) << "anonymous memory grew by " << (grown >> 20) << " MiB";
}

// A frame over ZMQ_MAXMSGSIZE gets its sender disconnected (seen on the sender's socket).
TEST_F(LimitsTest, AnOversizedFrameDisconnectsItsSender) {
  StartPublisher({});
  zmq::context_t ctx;
  zmq::socket_t big(ctx, zmq::socket_type::dealer);
  big.set(zmq::sockopt::linger, 0);
  ASSERT_EQ(zmq_socket_monitor(big.handle(), "inproc://big-monitor", ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED), 0);
  zmq::socket_t mon(ctx, zmq::socket_type::pair);
  mon.connect("inproc://big-monitor");
  big.connect(endpoints_.requests);
  auto next_event = [&]() -> int {
    zmq::pollitem_t item = {mon.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(5000)) == 0) return -1;
    zmq::message_t ev, addr;
    (void)mon.recv(ev);
    (void)mon.recv(addr);
    uint16_t e = 0;
    std::memcpy(&e, ev.data(), 2);
    return e;
  };
  ASSERT_EQ(next_event(), ZMQ_EVENT_CONNECTED);
  const std::string huge(static_cast<size_t>(kMaxFrameBytes) + 1, 'x');
  big.send(zmq::buffer(huge), zmq::send_flags::none);
  EXPECT_EQ(next_event(), ZMQ_EVENT_DISCONNECTED);
  zmq_socket_monitor(big.handle(), nullptr, 0);
}

// Over CURVE, announcements reach listed keys only: an unlisted subscriber hears nothing
// in three announcement periods while a listed one hears the beacon.
TEST_F(LimitsTest, AnUnlistedCurveSubscriberHearsNoAnnouncement) {
  auto server = GenerateKeyPair();
  auto listed = GenerateKeyPair();
  auto stranger = GenerateKeyPair();
  ASSERT_TRUE(server.ok() && listed.ok() && stranger.ok());
  PublisherOptions po;
  po.endpoints = {"tcp://127.0.0.1:*", "tcp://127.0.0.1:*"};
  po.curve = CurveOptions{server->public_key, server->secret_key, "", {listed->public_key}};
  po.heartbeat_ivl_ms = 100;
  StartPublisher(po);
  ASSERT_TRUE(publisher_->Publish(ImportTiny("m", 1.0f)).ok());
  zmq::context_t ctx;
  auto subscriber = [&](const CurveKeyPair& k) {
    zmq::socket_t s(ctx, zmq::socket_type::sub);
    s.set(zmq::sockopt::linger, 0);
    s.set(zmq::sockopt::curve_serverkey, server->public_key);
    s.set(zmq::sockopt::curve_publickey, k.public_key);
    s.set(zmq::sockopt::curve_secretkey, k.secret_key);
    s.set(zmq::sockopt::subscribe, "");
    s.connect(publisher_->bound_endpoints().updates);
    return s;
  };
  zmq::socket_t good = subscriber(*listed);
  zmq::socket_t bad = subscriber(*stranger);
  auto heard = [](zmq::socket_t& s, int ms) {
    zmq::pollitem_t item = {s.handle(), 0, ZMQ_POLLIN, 0};
    return zmq::poll(&item, 1, std::chrono::milliseconds(ms)) > 0;
  };
  EXPECT_TRUE(heard(good, 3000));
  EXPECT_FALSE(heard(bad, 300));
}

// An ipc:// endpoint directory that another user owns is refused (a socket there could be
// replaced by that user). Needs root to give the directory away.
TEST_F(LimitsTest, AnEndpointDirectoryOwnedByAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to chown a directory to another user";
  const fs::path dir = tmp_.path() / "theirs";
  fs::create_directories(dir);
  ASSERT_EQ(::chown(dir.c_str(), 65534, 65534), 0);
  auto ep = PrivateIpcEndpoints(dir);
  ASSERT_FALSE(ep.ok());
  EXPECT_EQ(ep.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(ep.status().message().find(dir.string() + ": endpoint directory is owned by another user"),
            std::string::npos)
      << ep.status().message();
}

// A following publisher (follow_run) serves what its mode can publish as it is recorded:
// in merged mode each new merged/full version; in adapter mode the adapter of the newest
// merged version that names one, never a plain merged version it cannot serve.
TEST_F(LimitsTest, FollowingPublisherServesTheNewestVersionItsModeCanPublish) {
  store::Store& shared = *store_;  // imports here, reads and events on the publisher's thread
  const store::Digest v1 = ImportTiny("m1", 1.0f);
  PublisherOptions po;
  po.follow_run = "default";
  po.follow_interval_ms = 20;
  StartPublisher(po, &shared);
  auto wait_for = [&](uint64_t seq) {
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (publisher_->latest_sequence() < seq && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return publisher_->latest_sequence();
  };
  ASSERT_EQ(wait_for(1), 1u);
  WriteTinyModel(tmp_.path() / "m2", 2.0f, {2, 3});
  auto v2 = shared.Import(tmp_.path() / "m2", {});
  ASSERT_TRUE(v2.ok()) << v2.status().message();
  ASSERT_EQ(wait_for(2), 2u);
  ReceiverOptions ro;
  ro.id = "follower";
  ro.endpoints = endpoints_;
  ro.dir = tmp_.path() / "recv";
  ro.timeout_ms = 5000;
  auto r = Receiver::Connect(ro);
  ASSERT_TRUE(r.ok()) << r.status().message();
  auto s = (*r)->SyncLatest();
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->version, v2->record.id);
  EXPECT_FALSE(s->version == v1);

  // Adapter mode over a run whose only servable-looking version is merged without an
  // adapter (its base recorded in another run): nothing to serve (no retry storm, no
  // crash); once a merged version naming an adapter is recorded, its adapter is served.
  publisher_.reset();
  const fs::path adapter_dir = fs::path(FERRY_FIXTURES_DIR) / "cases" / "llama_lora_all_linear_f32";
  store::ImportOptions bo;
  bo.kind = store::VersionKind::kBase;
  bo.run = "bases";
  auto base = shared.Import(adapter_dir / "base", bo);
  ASSERT_TRUE(base.ok()) << base.status().message();
  store::ImportOptions ao;
  ao.base_version = base->record.id;
  ao.run = "lora";
  auto adapter = shared.Import(adapter_dir / "adapter", ao);
  ASSERT_TRUE(adapter.ok()) << adapter.status().message();
  store::ImportOptions plain;
  plain.run = "lora";
  plain.kind = store::VersionKind::kMerged;
  WriteTinyModel(tmp_.path() / "plain", 3.0f, {2, 3});
  ASSERT_TRUE(shared.Import(tmp_.path() / "plain", plain).ok());
  po.follow_run = "lora";
  po.mode = PublishMode::kAdapter;
  StartPublisher(po, &shared);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(publisher_->latest_sequence(), 0u);
  store::ImportOptions mo;
  mo.run = "lora";
  mo.kind = store::VersionKind::kMerged;
  mo.base_version = base->record.id;
  mo.adapter_version = adapter->record.id;
  WriteTinyModel(tmp_.path() / "merged", 4.0f, {2, 3});
  ASSERT_TRUE(shared.Import(tmp_.path() / "merged", mo).ok());
  ASSERT_EQ(wait_for(1), 1u);
  zmq::context_t ctx;
  zmq::socket_t d(ctx, zmq::socket_type::dealer);
  d.set(zmq::sockopt::linger, 0);
  d.connect(endpoints_.requests);
  Message hello;
  hello.type = MsgType::kHello;
  const std::string h = EncodeHeader(hello);
  d.send(zmq::buffer(h), zmq::send_flags::sndmore);
  d.send(zmq::str_buffer("probe"), zmq::send_flags::none);
  zmq::pollitem_t item = {d.handle(), 0, ZMQ_POLLIN, 0};
  ASSERT_EQ(zmq::poll(&item, 1, std::chrono::milliseconds(5000)), 1);
  zmq::message_t head, body;
  (void)d.recv(head);
  ASSERT_TRUE(head.more());
  (void)d.recv(body);
  auto man = DecodeManifest(body.to_string());
  ASSERT_TRUE(man.ok()) << man.status().message();
  EXPECT_EQ(man->version, adapter->record.id);
  EXPECT_EQ(man->mode, PublishMode::kAdapter);
}

}  // namespace
}  // namespace ferry::sync
