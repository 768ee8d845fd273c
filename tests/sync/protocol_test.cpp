// Tests of the sync wire protocol (sync/protocol.h), the publisher and the receiver:
// in-process publisher + receivers over ipc:// in a temp dir, CURVE over tcp://127.0.0.1,
// corrupted chunks, mid-transfer skips and malformed frames from a raw socket.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <zmq.hpp>

#include "convert/peft_config.h"
#include "core/checkpoint.h"
#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "store/store.h"
#include "sync/keys.h"
#include "sync/protocol.h"
#include "sync/publisher.h"
#include "sync/receiver.h"
#include "sync/snapshot.h"
#include "tests/sync/sync_test_util.h"
#include "tests/temp_dir.h"

namespace ferry::sync {
namespace {

namespace fs = std::filesystem;

std::span<const std::byte> AsBytes(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

// ---- protocol codec --------------------------------------------------------------------

TEST(ProtocolTest, FetchRoundTripsEveryField) {
  Message m;
  m.type = MsgType::kFetch;
  m.version = {0x0102030405060708ull, 0x1112131415161718ull};
  m.kind = ItemKind::kAux;
  m.index = 7;
  m.offset = 1ull << 40;
  m.length = 4096;
  const std::string h = EncodeHeader(m);
  // magic 4 + type 1 + digest 16 + kind 1 + index 4 + offset 8 + length 4
  ASSERT_EQ(h.size(), 38u);
  EXPECT_EQ(h.substr(0, 4), "FSY2");
  EXPECT_EQ(h[4], 3);
  EXPECT_EQ(static_cast<uint8_t>(h[5]), 0x01);   // digest hi, big-endian
  EXPECT_EQ(static_cast<uint8_t>(h[20]), 0x18);  // digest lo, last byte
  EXPECT_EQ(static_cast<uint8_t>(h[22]), 7);     // index, little-endian
  auto d = Decode(AsBytes(h), nullptr);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->version, m.version);
  EXPECT_EQ(d->kind, ItemKind::kAux);
  EXPECT_EQ(d->index, 7u);
  EXPECT_EQ(d->offset, 1ull << 40);
  EXPECT_EQ(d->length, 4096u);
}

TEST(ProtocolTest, ChunkCarriesPayloadLatestSequenceAndEpoch) {
  Message m;
  m.type = MsgType::kChunk;
  m.sequence = 9;
  m.epoch = 0xfedcba9876543210ull;
  m.offset = 16;
  const std::string h = EncodeHeader(m);
  // magic 4 + type 1 + digest 16 + kind 1 + index 4 + offset 8 + sequence 8 + epoch 8
  ASSERT_EQ(h.size(), 50u);
  EXPECT_EQ(static_cast<uint8_t>(h[42]), 0x10);  // epoch, little-endian
  EXPECT_EQ(static_cast<uint8_t>(h[49]), 0xfe);
  const std::string body = "abc";
  const auto payload = AsBytes(body);
  auto d = Decode(AsBytes(h), &payload);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->sequence, 9u);
  EXPECT_EQ(d->epoch, 0xfedcba9876543210ull);
  EXPECT_EQ(d->offset, 16u);
  EXPECT_EQ(d->bytes.size(), 3u);
}

TEST(ProtocolTest, ManifestAndAnnounceCarryTheEpoch) {
  Message m;
  m.type = MsgType::kAnnounce;
  m.sequence = 3;
  m.version = {7, 8};
  m.epoch = 42;
  auto d = Decode(AsBytes(EncodeHeader(m)), nullptr);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->sequence, 3u);
  EXPECT_EQ(d->version, m.version);
  EXPECT_EQ(d->epoch, 42u);
  m.type = MsgType::kManifest;
  m.epoch = 43;
  const std::string json = "{}";
  const auto payload = AsBytes(json);
  d = Decode(AsBytes(EncodeHeader(m)), &payload);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->sequence, 3u);
  EXPECT_EQ(d->epoch, 43u);
}

TEST(ProtocolTest, AckCarriesTheProvenMergedIdOnlyWhenSet) {
  Message m;
  m.type = MsgType::kAck;
  m.version = {1, 2};
  m.computed = {3, 4};
  const std::string id = "gen-0";
  const auto payload = AsBytes(id);
  auto plain = Decode(AsBytes(EncodeHeader(m)), &payload);
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  EXPECT_FALSE(plain->proven.has_value());
  EXPECT_EQ(plain->computed, m.computed);
  m.proven = store::Digest{5, 6};
  std::string h = EncodeHeader(m);
  auto with = Decode(AsBytes(h), &payload);
  ASSERT_TRUE(with.ok()) << with.status().message();
  ASSERT_TRUE(with->proven.has_value());
  EXPECT_EQ(*with->proven, (store::Digest{5, 6}));
  h[4 + 1 + 32] = 2;  // has_proven must be 0 or 1
  auto bad = Decode(AsBytes(h), &payload);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_NE(bad.status().message().find("ACK: field has_proven"), std::string::npos) << bad.status().message();
}

TEST(ProtocolTest, HelloNamesAVersionOnlyWhenOneIsWanted) {
  Message m;
  m.type = MsgType::kHello;
  const std::string id = "gen-0";
  const auto payload = AsBytes(id);
  const std::string latest = EncodeHeader(m);
  EXPECT_EQ(latest.size(), 5u);
  auto plain = Decode(AsBytes(latest), &payload);
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  EXPECT_FALSE(plain->wanted.has_value());
  EXPECT_EQ(plain->payload, id);
  m.wanted = store::Digest{7, 8};
  const std::string named = EncodeHeader(m);
  EXPECT_EQ(named.size(), 5u + 16u);
  auto with = Decode(AsBytes(named), &payload);
  ASSERT_TRUE(with.ok()) << with.status().message();
  ASSERT_TRUE(with->wanted.has_value());
  EXPECT_EQ(*with->wanted, (store::Digest{7, 8}));
  for (const std::string& bad : {named.substr(0, 5 + 15), named + "x"}) {
    auto d = Decode(AsBytes(bad), &payload);
    ASSERT_FALSE(d.ok()) << bad.size() << " bytes accepted";
    EXPECT_EQ(d.status().code(), StatusCode::kCorruption);
    EXPECT_NE(d.status().message().find("HELLO"), std::string::npos) << d.status().message();
  }
}

TEST(ProtocolTest, RejectsMalformedHeadersWithTypedErrors) {
  auto expect_corrupt = [](std::string_view header, const std::span<const std::byte>* payload, std::string_view what) {
    auto d = Decode(AsBytes(header), payload);
    ASSERT_FALSE(d.ok()) << "accepted: " << what;
    EXPECT_EQ(d.status().code(), StatusCode::kCorruption);
    EXPECT_NE(d.status().message().find(what), std::string::npos) << d.status().message();
  };
  expect_corrupt("", nullptr, "magic");
  expect_corrupt("XXXX\x01", nullptr, "magic");
  expect_corrupt(std::string("FSY1\x01", 5), nullptr, "magic");  // the previous protocol version
  expect_corrupt(std::string("FSY2\x0a", 5), nullptr, "unknown type");
  expect_corrupt(std::string("FSY2\x03\x01\x02", 7), nullptr, "FETCH: header frame truncated");
  Message f;
  f.type = MsgType::kFetch;
  f.length = kMaxChunkBytes + 1;
  expect_corrupt(EncodeHeader(f), nullptr, "field length");
  f.length = 0;
  expect_corrupt(EncodeHeader(f), nullptr, "field length");
  expect_corrupt(std::string("FSY2\x01", 5), nullptr, "HELLO: payload frame missing");
  const std::string bad_id = "a/b";
  const auto p = AsBytes(bad_id);
  expect_corrupt(std::string("FSY2\x01", 5), &p, "receiver id");
  Message old_announce;  // an FSY1-sized ANNOUNCE (no epoch) is truncated
  old_announce.type = MsgType::kAnnounce;
  expect_corrupt(EncodeHeader(old_announce).substr(0, 4 + 1 + 8 + 16), nullptr, "ANNOUNCE: header frame truncated");
  Message ack;
  ack.type = MsgType::kAcked;
  expect_corrupt(EncodeHeader(ack) + "x", nullptr, "trailing bytes");
}

TEST(ProtocolTest, ManifestValidation) {
  const std::string d = std::string(32, 'a');
  const std::string good_tensor = R"({"name":"w","dtype":"F32","shape":[2,3],"digest":")" + d + R"(","nbytes":24})";
  const std::string plain_fields = R"("epoch":7,"kind":"merged","layout":"hf","mode":"delta",)";
  auto parse_with = [&](const std::string& fields, const std::string& tensors, const std::string& aux) {
    return DecodeManifest(R"({"version":")" + d + R"(","sequence":1,)" + fields + R"("tensors":[)" + tensors +
                          R"(],"aux":[)" + aux + "]}");
  };
  auto parse = [&](const std::string& tensors, const std::string& aux) {
    return parse_with(plain_fields, tensors, aux);
  };
  auto ok = parse(good_tensor, R"({"name":"config.json","digest":")" + d + R"(","size":5})");
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(ok->tensors[0].nbytes, 24u);
  EXPECT_EQ(ok->aux[0].name, "config.json");
  EXPECT_EQ(ok->epoch, 7u);
  EXPECT_EQ(ok->kind, store::VersionKind::kMerged);
  EXPECT_EQ(ok->layout, Layout::kHf);
  EXPECT_EQ(ok->mode, PublishMode::kDelta);
  EXPECT_FALSE(ok->merged_version.has_value());
  const std::string e = std::string(32, 'e'), f = std::string(32, 'f');
  auto adapter = parse_with(R"("epoch":7,"kind":"adapter","layout":"lora","mode":"adapter","base_version":")" + e +
                                R"(","merged_version":")" + f + R"(",)",
                            good_tensor, "");
  ASSERT_TRUE(adapter.ok()) << adapter.status().message();
  EXPECT_EQ(adapter->kind, store::VersionKind::kAdapter);
  EXPECT_EQ(adapter->layout, Layout::kLora);
  EXPECT_EQ(adapter->mode, PublishMode::kAdapter);
  EXPECT_EQ(adapter->base_version->Hex(), e);
  EXPECT_EQ(adapter->merged_version->Hex(), f);

  auto expect = [&](const Result<Manifest>& r, std::string_view what) {
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
    EXPECT_NE(r.status().message().find(what), std::string::npos) << r.status().message();
  };
  expect(DecodeManifest("not json"), "not a JSON object");
  std::string wrong_size = good_tensor;
  wrong_size.replace(wrong_size.find("24"), 2, "25");
  expect(parse(wrong_size, ""), "tensor w: field nbytes does not match");
  expect(parse(good_tensor + "," + good_tensor, ""), "tensor w: names not sorted and unique");
  expect(parse(good_tensor, R"({"name":"../etc/passwd","digest":")" + d + R"(","size":5})"),
         "auxiliary file name '../etc/passwd' is not a plain file name");
  // One rule for auxiliary files (core/aux_files.h): what the store records is all a receiver writes.
  expect(parse(good_tensor, R"({"name":"README.md","digest":")" + d + R"(","size":5})"),
         "auxiliary file name 'README.md' is not one of the auxiliary file names");
  expect(parse(good_tensor, R"({"name":"vocab.safetensors","digest":")" + d + R"(","size":5})"),
         "auxiliary file name 'vocab.safetensors' is not one of the auxiliary file names");
  std::string bad_dtype = good_tensor;
  bad_dtype.replace(bad_dtype.find("F32"), 3, "Q99");
  expect(parse(bad_dtype, ""), "tensor w: field dtype unknown");
  expect(parse_with(R"("kind":"merged","layout":"hf","mode":"delta",)", good_tensor, ""), "field epoch missing");
  expect(parse_with(R"("epoch":7,"kind":"merged","layout":"hf","mode":"sideways",)", good_tensor, ""),
         "field mode has unknown value \"sideways\"");
  expect(parse_with(R"("epoch":7,"kind":"merged","layout":"diagonal","mode":"merged",)", good_tensor, ""),
         "field layout has unknown value");
  expect(parse_with(R"("epoch":7,"kind":"merged","layout":"hf","mode":"adapter","base_version":")" + e +
                        R"(","merged_version":")" + f + R"(",)",
                    good_tensor, ""),
         "field kind is \"merged\" in adapter mode");
  expect(parse_with(R"("epoch":7,"kind":"adapter","layout":"lora","mode":"adapter","base_version":")" + e + R"(",)",
                    good_tensor, ""),
         "field merged_version missing");
  expect(parse_with(R"("epoch":7,"kind":"adapter","layout":"lora","mode":"merged",)", good_tensor, ""),
         "field kind is \"adapter\" outside adapter mode");
  // A nesting bomb is refused before the JSON parser builds it.
  expect(DecodeManifest(R"({"x":)" + std::string(100000, '[') + std::string(100000, ']') + "}"),
         "nests deeper than 8 levels");
}

TEST(KeysTest, GeneratedKeysRoundTripAndSecretIsPrivate) {
  ferry::testing::ScopedTempDir tmp("ferry-keys-");
  const fs::path dir = tmp.path();
  auto kp = GenerateKeyPair();
  ASSERT_TRUE(kp.ok()) << kp.status().message();
  ASSERT_TRUE(WriteKeyPair(dir / "r", *kp, false).ok());
  struct stat st {};
  ASSERT_EQ(::stat((dir / "r.key").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(*ReadSecretKey(dir / "r.key"), kp->secret_key);
  EXPECT_EQ(*ReadPublicKey(dir / "r.pub"), kp->public_key);
  auto again = WriteKeyPair(dir / "r", *kp, false);
  EXPECT_EQ(again.code(), StatusCode::kAlreadyExists);
  ::chmod((dir / "r.key").c_str(), 0644);
  auto loose = ReadSecretKey(dir / "r.key");
  EXPECT_EQ(loose.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(loose.status().message().find("r.key"), std::string::npos);
  fs::remove_all(dir);
}

TEST(ProtocolTest, PublishModeNamesRoundTripAndUnknownIsRefused) {
  for (PublishMode m : {PublishMode::kMerged, PublishMode::kAdapter, PublishMode::kDelta}) {
    auto parsed = ParsePublishMode(PublishModeName(m));
    ASSERT_TRUE(parsed.ok()) << parsed.status().message();
    EXPECT_EQ(*parsed, m);
  }
  EXPECT_EQ(PublishModeName(PublishMode::kDelta), "delta");
  auto bad = ParsePublishMode("full");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("\"full\""), std::string::npos) << bad.status().message();
}

// ---- end to end ------------------------------------------------------------------------

class SyncTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ferry-sync-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    auto st = store::Store::Open(root_ / "db", {.create_if_missing = true});
    ASSERT_TRUE(st.ok()) << st.status().message();
    store_ = std::move(*st);
    v1_ = ImportModel("m1", 1.0f);
    v2_ = ImportModel("m2", 2.0f);
    auto ep = PrivateIpcEndpoints(root_ / "sock");
    ASSERT_TRUE(ep.ok()) << ep.status().message();
    endpoints_ = *ep;
  }
  void TearDown() override {
    publisher_.reset();
    store_.reset();
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  // A tiny model (two F32 tensors + config.json) whose values depend on `scale`.
  store::Digest ImportModel(const std::string& name, float scale) {
    const fs::path dir = root_ / name;
    WriteTinyModel(dir, scale, {2, 3});
    auto r = store_->Import(dir, {});
    EXPECT_TRUE(r.ok()) << r.status().message();
    return r.ok() ? r->record.id : store::Digest{};
  }

  void StartPublisher(PublisherOptions o = {}) {
    if (o.endpoints.requests.empty()) o.endpoints = endpoints_;
    auto p = Publisher::Start(store_.get(), o);
    ASSERT_TRUE(p.ok()) << p.status().message();
    publisher_ = std::move(*p);
  }

  ReceiverOptions RecvOptions(const std::string& id) {
    ReceiverOptions o = TestReceiverOptions(endpoints_, root_, id);
    o.timeout_ms = 5000;
    return o;
  }

  // The receiver directory's active files hash to `v` and current points at it.
  void ExpectActive(const fs::path& dir, const store::Digest& v) {
    store::VersionRecord rec;
    ExpectActiveVersion(dir, v, &rec);
    EXPECT_EQ(rec.aux.size(), 1u);  // config.json came along
  }

  fs::path root_;
  std::unique_ptr<store::Store> store_;
  std::unique_ptr<Publisher> publisher_;
  store::Digest v1_, v2_;
  Endpoints endpoints_;
};

TEST_F(SyncTest, PrivateEndpointDirectoryIsOwnerOnly) {
  struct stat st {};
  ASSERT_EQ(::stat((root_ / "sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(endpoints_.requests, "ipc://" + (root_ / "sock" / "requests").string());
}

TEST_F(SyncTest, ParseSyncEndpointNamesThePairOrTheValue) {
  auto ipc = ParseSyncEndpoint("ipc://" + (root_ / "pair").string());
  ASSERT_TRUE(ipc.ok()) << ipc.status().message();
  EXPECT_EQ(ipc->requests, "ipc://" + (root_ / "pair" / "requests").string());
  EXPECT_EQ(ipc->updates, "ipc://" + (root_ / "pair" / "updates").string());
  struct stat st {};
  ASSERT_EQ(::stat((root_ / "pair").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  auto tcp = ParseSyncEndpoint("tcp://10.0.0.1:5555");
  ASSERT_TRUE(tcp.ok()) << tcp.status().message();
  EXPECT_EQ(tcp->requests, "tcp://10.0.0.1:5555");
  EXPECT_EQ(tcp->updates, "tcp://10.0.0.1:5556");
  for (const std::string bad :
       {"ipc://", "tcp://h", "tcp://:5", "tcp://h:0", "tcp://h:65535", "tcp://h:5x", "udp://h:5"}) {
    auto r = ParseSyncEndpoint(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(r.status().message().starts_with(bad + ": ")) << r.status().message();
  }
}

TEST_F(SyncTest, ReceiverActivatesLatestAndPublisherRecordsAck) {
  StartPublisher();
  ASSERT_EQ(*publisher_->Publish(v1_), 1u);
  auto r = Receiver::Connect(RecvOptions("gen-0"));
  ASSERT_TRUE(r.ok()) << r.status().message();
  auto s1 = (*r)->SyncLatest();
  ASSERT_TRUE(s1.ok()) << s1.status().message();
  EXPECT_EQ(s1->version, v1_);
  EXPECT_EQ(s1->sequence, 1u);
  EXPECT_EQ(s1->bytes_received, 6 * 4 + 5 * 4 + fs::file_size(root_ / "m1" / "config.json"));
  ExpectActive(root_ / "recv-gen-0", v1_);

  ASSERT_EQ(*publisher_->Publish(v2_), 2u);
  auto s2 = (*r)->WaitForNewer(5000);
  ASSERT_TRUE(s2.ok()) << s2.status().message();
  EXPECT_EQ(s2->version, v2_);
  EXPECT_EQ(s2->computed, v2_);
  ExpectActive(root_ / "recv-gen-0", v2_);
  // Both versions stay on disk; only current moved.
  EXPECT_TRUE(fs::is_directory(root_ / "recv-gen-0" / "versions" / v1_.Hex()));

  auto infos = publisher_->Receivers();
  ASSERT_EQ(infos.size(), 1u);
  EXPECT_EQ(infos[0].id, "gen-0");
  EXPECT_EQ(*infos[0].acknowledged, v2_);
  EXPECT_EQ(infos[0].acknowledged_sequence, 2u);

  publisher_.reset();  // the store is the publisher's while it runs
  auto events = store_->ListEvents(v2_);
  ASSERT_TRUE(events.ok());
  int acks = 0;
  for (const auto& e : *events) {
    if (e.type != store::Event::Type::kAcknowledged) continue;
    ++acks;
    EXPECT_EQ(e.receiver, "gen-0");
    ASSERT_TRUE(e.computed.has_value());
    EXPECT_EQ(*e.computed, v2_);
  }
  EXPECT_EQ(acks, 1);
}

TEST_F(SyncTest, LateJoinerGetsLatestAtOnce) {
  StartPublisher();
  ASSERT_TRUE(publisher_->Publish(v1_).ok());
  ASSERT_TRUE(publisher_->Publish(v2_).ok());
  auto r = Receiver::Connect(RecvOptions("late"));
  ASSERT_TRUE(r.ok());
  auto s = (*r)->SyncLatest();
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->version, v2_);
  EXPECT_EQ(s->sequence, 2u);
  EXPECT_EQ(s->skipped, 0);
  ExpectActive(root_ / "recv-late", v2_);
  EXPECT_FALSE(fs::exists(root_ / "recv-late" / "versions" / v1_.Hex()));
  // Asking again fetches nothing.
  auto again = (*r)->SyncLatest();
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->already_active);
  EXPECT_EQ(again->bytes_received, 0u);
}

// A receiver following a trainer keeps the active and the previous version (keep_versions
// = 2, the default) and deletes older ones with their manifests; 0 keeps everything.
TEST_F(SyncTest, ReceiverKeepsOnlyTheNewestVersionsItActivated) {
  const store::Digest v3 = ImportModel("m3", 3.0f);
  StartPublisher();
  auto follow = [&](const std::string& id, int keep) {
    ReceiverOptions o = RecvOptions(id);
    o.keep_versions = keep;
    auto r = Receiver::Connect(o);
    EXPECT_TRUE(r.ok()) << r.status().message();
    return std::move(*r);
  };
  auto pruning = follow("pruning", 2);
  auto keeping = follow("keeping", 0);
  std::vector<store::Digest> published = {v1_, v2_, v3};
  for (const auto& v : published) {
    ASSERT_TRUE(publisher_->Publish(v).ok());
    for (Receiver* r : {pruning.get(), keeping.get()}) {
      auto s = r->SyncLatest();
      ASSERT_TRUE(s.ok()) << s.status().message();
      EXPECT_EQ(s->active, v);
    }
  }
  auto listing = [](const fs::path& dir) {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
    return names;
  };
  const fs::path p = root_ / "recv-pruning", k = root_ / "recv-keeping";
  ExpectActive(p, v3);
  EXPECT_EQ(listing(p / "versions"), (std::set<std::string>{v2_.Hex(), v3.Hex()}));
  EXPECT_EQ(listing(p / "manifests"), (std::set<std::string>{v2_.Hex() + ".json", v3.Hex() + ".json"}));
  ExpectActive(k, v3);
  EXPECT_EQ(listing(k / "versions"), (std::set<std::string>{v1_.Hex(), v2_.Hex(), v3.Hex()}));

  ReceiverOptions bad = RecvOptions("bad");
  bad.keep_versions = -1;
  auto refused = Receiver::Connect(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("keep_versions"), std::string::npos);
}

TEST_F(SyncTest, CorruptedChunkIsDetectedAndRefetched) {
  StartPublisher();
  ASSERT_TRUE(publisher_->Publish(v1_).ok());
  publisher_->CorruptNextChunksForTesting(1);
  auto r = Receiver::Connect(RecvOptions("c"));
  ASSERT_TRUE(r.ok());
  auto s = (*r)->SyncLatest();
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->refetches, 1);
  ExpectActive(root_ / "recv-c", v1_);
}

TEST_F(SyncTest, PersistentCorruptionFailsWithoutActivating) {
  StartPublisher();
  ASSERT_TRUE(publisher_->Publish(v1_).ok());
  // Every chunk: each tensor fails in the first pass, and a.weight, refetched first, fails
  // both refetches too.
  publisher_->CorruptNextChunksForTesting(1000);
  auto o = RecvOptions("bad");
  o.max_retries = 2;
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok());
  auto s = (*r)->SyncLatest();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kCorruption);
  EXPECT_NE(s.status().message().find("tensor a.weight"), std::string::npos) << s.status().message();
  EXPECT_FALSE(fs::exists(fs::symlink_status(root_ / "recv-bad" / "current")));
  // What arrived is kept only as a partial transfer, never as a version.
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(root_ / "recv-bad" / "versions")) left.push_back(e.path().filename());
  EXPECT_EQ(left, std::vector<std::string>{v1_.Hex() + ".partial"});
  // Sound chunks again: the next sync verifies what the partial holds, fetches the rest.
  publisher_->CorruptNextChunksForTesting(0);
  auto again = (*r)->SyncLatest();
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_EQ(again->version, v1_);
  ExpectActive(root_ / "recv-bad", v1_);
  EXPECT_FALSE(fs::exists(root_ / "recv-bad" / "versions" / (v1_.Hex() + ".partial")));
}

TEST_F(SyncTest, SlowReceiverSkipsToNewerVersionMidTransfer) {
  StartPublisher();
  ASSERT_TRUE(publisher_->Publish(v1_).ok());
  auto o = RecvOptions("slow");
  o.chunk_bytes = 8;
  o.credit = 1;
  bool published = false;
  Publisher* pub = publisher_.get();
  const store::Digest v2 = v2_;
  o.on_chunk_for_testing = [&](uint64_t) {
    if (!published) {
      published = true;
      ASSERT_TRUE(pub->Publish(v2).ok());
    }
  };
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok());
  auto s = (*r)->SyncLatest();
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->version, v2_);
  EXPECT_EQ(s->skipped, 1);
  ExpectActive(root_ / "recv-slow", v2_);
  EXPECT_FALSE(fs::exists(root_ / "recv-slow" / "versions" / v1_.Hex()));
}

TEST_F(SyncTest, TcpWithoutCurveIsRefused) {
  PublisherOptions o;
  o.endpoints = {"tcp://127.0.0.1:*", "tcp://127.0.0.1:*"};
  auto p = Publisher::Start(store_.get(), o);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(p.status().message().find("tcp://127.0.0.1:*"), std::string::npos);
}

TEST_F(SyncTest, CurveAllowListAdmitsListedReceiverOnly) {
  auto server = GenerateKeyPair();
  auto good = GenerateKeyPair();
  auto stranger = GenerateKeyPair();
  ASSERT_TRUE(server.ok() && good.ok() && stranger.ok());
  PublisherOptions po;
  po.endpoints = {"tcp://127.0.0.1:*", "tcp://127.0.0.1:*"};
  po.curve = CurveOptions{server->public_key, server->secret_key, "", {good->public_key}};
  StartPublisher(po);
  ASSERT_TRUE(publisher_->Publish(v1_).ok());
  const Endpoints bound = publisher_->bound_endpoints();
  ASSERT_EQ(bound.requests.rfind("tcp://127.0.0.1:", 0), 0u) << bound.requests;

  auto o = RecvOptions("trusted");
  o.endpoints = bound;
  o.curve = CurveOptions{good->public_key, good->secret_key, server->public_key, {}};
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  auto s = (*r)->SyncLatest();
  ASSERT_TRUE(s.ok()) << s.status().message();
  ExpectActive(root_ / "recv-trusted", v1_);

  auto so = RecvOptions("stranger");
  so.endpoints = bound;
  so.timeout_ms = 700;
  so.curve = CurveOptions{stranger->public_key, stranger->secret_key, server->public_key, {}};
  auto sr = Receiver::Connect(so);
  ASSERT_TRUE(sr.ok());
  auto ss = (*sr)->SyncLatest();
  ASSERT_FALSE(ss.ok());
  EXPECT_EQ(ss.status().code(), StatusCode::kUnavailable) << ss.status().message();
  EXPECT_NE(ss.status().message().find("no reply from " + bound.requests), std::string::npos) << ss.status().message();
  EXPECT_FALSE(fs::exists(fs::symlink_status(root_ / "recv-stranger" / "current")));
  // Without CURVE at all: the handshake never completes either.
  auto no = RecvOptions("plain");
  no.endpoints = bound;
  no.timeout_ms = 300;
  EXPECT_EQ(Receiver::Connect(no).status().code(), StatusCode::kFailedPrecondition);
}

// A receiver whose key the allow-list lacks gets silence, so its message names its key as a
// possible cause; the publisher reports that key once, however often the receiver retries.
// A receiver the publisher has answered before gets no such hint when it later falls silent.
TEST_F(SyncTest, ARefusedCurveKeyIsNamedOnBothSidesOnce) {
  auto server = GenerateKeyPair();
  auto good = GenerateKeyPair();
  auto stranger = GenerateKeyPair();
  ASSERT_TRUE(server.ok() && good.ok() && stranger.ok());
  std::mutex mu;
  std::vector<std::string> rejected;
  PublisherOptions po;
  po.endpoints = {"tcp://127.0.0.1:*", "tcp://127.0.0.1:*"};
  po.curve = CurveOptions{server->public_key, server->secret_key, "", {good->public_key}};
  po.on_rejected_key = [&](const std::string& key) {
    std::lock_guard lock(mu);
    rejected.push_back(key);
  };
  StartPublisher(po);
  ASSERT_TRUE(publisher_->Publish(v1_).ok());
  const Endpoints bound = publisher_->bound_endpoints();

  auto so = RecvOptions("stranger");
  so.endpoints = bound;
  so.timeout_ms = 500;
  so.curve = CurveOptions{stranger->public_key, stranger->secret_key, server->public_key, {}};
  auto sr = Receiver::Connect(so);
  ASSERT_TRUE(sr.ok());
  for (int attempt = 0; attempt < 2; ++attempt) {  // the second one reconnects (a new socket)
    auto ss = (*sr)->SyncLatest();
    ASSERT_FALSE(ss.ok());
    EXPECT_EQ(ss.status().code(), StatusCode::kUnavailable) << ss.status().message();
    EXPECT_EQ(ss.status().message(),
              "sync receiver stranger: no reply from " + bound.requests +
                  " within 500 ms; nothing has come from the publisher yet: it is not running, or it does not allow "
                  "this receiver's CURVE public key " +
                  stranger->public_key + " (not in its allow-list)");
  }
  EXPECT_FALSE((*sr)->heard_from_publisher());
  {
    std::lock_guard lock(mu);
    EXPECT_EQ(rejected, std::vector<std::string>{stranger->public_key});
  }

  auto o = RecvOptions("trusted");
  o.endpoints = bound;
  o.timeout_ms = 500;
  o.curve = CurveOptions{good->public_key, good->secret_key, server->public_key, {}};
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_TRUE((*r)->SyncLatest().ok());
  EXPECT_TRUE((*r)->heard_from_publisher());
  publisher_.reset();
  auto gone = (*r)->SyncLatest();
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code(), StatusCode::kUnavailable) << gone.status().message();
  EXPECT_EQ(gone.status().message(), "sync receiver trusted: no reply from " + bound.requests + " within 500 ms");
  std::lock_guard lock(mu);
  EXPECT_EQ(rejected.size(), 1u);
}

// Sends `frames` from a raw DEALER and returns the decoded reply (bounded wait).
Result<Message> RawRequest(zmq::socket_t& s, const std::vector<std::string>& frames, std::string* payload) {
  for (size_t i = 0; i < frames.size(); ++i) {
    s.send(zmq::message_t(frames[i].data(), frames[i].size()),
           i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
  zmq::pollitem_t item = {s.handle(), 0, ZMQ_POLLIN, 0};
  zmq::poll(&item, 1, std::chrono::milliseconds(5000));
  if (!(item.revents & ZMQ_POLLIN)) return Status::Unavailable("no reply within 5 s");
  std::vector<zmq::message_t> parts;
  do {
    parts.emplace_back();
    (void)s.recv(parts.back());
  } while (parts.back().more());
  std::span<const std::byte> p;
  if (parts.size() == 2) {
    *payload = parts[1].to_string();
    p = AsBytes(*payload);
  }
  return Decode({static_cast<const std::byte*>(parts[0].data()), parts[0].size()}, parts.size() == 2 ? &p : nullptr);
}

TEST_F(SyncTest, MalformedFramesAreAnsweredWithErrorsAndPublisherSurvives) {
  StartPublisher();
  ASSERT_TRUE(publisher_->Publish(v1_).ok());
  zmq::context_t ctx;
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  s.connect(endpoints_.requests);
  std::string text;
  auto expect_error = [&](const std::vector<std::string>& frames, std::string_view what) {
    auto m = RawRequest(s, frames, &text);
    ASSERT_TRUE(m.ok()) << m.status().message();
    ASSERT_EQ(m->type, MsgType::kError) << what;
    EXPECT_EQ(m->code, static_cast<uint32_t>(StatusCode::kCorruption)) << text;
    EXPECT_NE(text.find(what), std::string::npos) << text;
  };
  expect_error({"garbage"}, "magic");
  expect_error({std::string("FSY2\x03\x00", 6)}, "FETCH: header frame truncated");
  expect_error({"a", "b", "c"}, "more than 2 frames");
  expect_error({std::string("FSY2\x01", 5), std::string(100, 'x')}, "receiver id");
  Message chunk;
  chunk.type = MsgType::kChunk;
  expect_error({EncodeHeader(chunk), "zz"}, "may not send");

  Message fetch;
  fetch.type = MsgType::kFetch;
  fetch.version = v1_;
  fetch.index = 99;
  fetch.length = 8;
  auto m = RawRequest(s, {EncodeHeader(fetch)}, &text);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->type, MsgType::kError);
  EXPECT_EQ(m->code, static_cast<uint32_t>(StatusCode::kInvalidArgument));
  EXPECT_NE(text.find("tensor index 99"), std::string::npos) << text;

  // An oversized frame gets this peer disconnected (ZMQ_MAXMSGSIZE); others are unaffected.
  zmq::socket_t big(ctx, zmq::socket_type::dealer);
  big.set(zmq::sockopt::linger, 0);
  big.connect(endpoints_.requests);
  std::string huge(static_cast<size_t>(kMaxFrameBytes) + 1, 'x');
  big.send(zmq::message_t(huge.data(), huge.size()), zmq::send_flags::none);

  Message hello;
  hello.type = MsgType::kHello;
  m = RawRequest(s, {EncodeHeader(hello), "raw-client"}, &text);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->type, MsgType::kManifest);
  auto man = DecodeManifest(text);
  ASSERT_TRUE(man.ok());
  EXPECT_EQ(man->version, v1_);
}

// Over CURVE a receiver id belongs to the first public key it came with: another listed
// key claiming it gets nothing, and the acknowledgement event names the key.
TEST_F(SyncTest, CurveReceiverIdIsBoundToItsKeyAndTheAckNamesIt) {
  auto server = GenerateKeyPair();
  auto first = GenerateKeyPair();
  auto second = GenerateKeyPair();
  ASSERT_TRUE(server.ok() && first.ok() && second.ok());
  PublisherOptions po;
  po.endpoints = {"tcp://127.0.0.1:*", "tcp://127.0.0.1:*"};
  po.curve = CurveOptions{server->public_key, server->secret_key, "", {first->public_key, second->public_key}};
  StartPublisher(po);
  ASSERT_TRUE(publisher_->Publish(v1_).ok());
  const Endpoints bound = publisher_->bound_endpoints();

  auto o = RecvOptions("gen0");
  o.endpoints = bound;
  o.curve = CurveOptions{first->public_key, first->secret_key, server->public_key, {}};
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  auto s = (*r)->SyncLatest();
  ASSERT_TRUE(s.ok()) << s.status().message();
  auto events = store_->ListEvents(v1_);
  ASSERT_TRUE(events.ok()) << events.status().message();
  int acks = 0;
  for (const auto& e : *events) {
    if (e.type != store::Event::Type::kAcknowledged) continue;
    ++acks;
    EXPECT_EQ(e.receiver, "gen0");
    EXPECT_NE(e.detail.find("(CURVE key " + first->public_key + ")"), std::string::npos) << e.detail;
  }
  EXPECT_EQ(acks, 1);

  auto impostor = RecvOptions("gen0");
  impostor.dir = root_ / "recv-impostor";
  impostor.endpoints = bound;
  impostor.curve = CurveOptions{second->public_key, second->secret_key, server->public_key, {}};
  auto ir = Receiver::Connect(impostor);
  ASSERT_TRUE(ir.ok()) << ir.status().message();
  auto is = (*ir)->SyncLatest();
  ASSERT_FALSE(is.ok());
  EXPECT_EQ(is.status().code(), StatusCode::kFailedPrecondition) << is.status().message();
  EXPECT_NE(is.status().message().find("receiver id gen0 is bound to another public key than " + second->public_key),
            std::string::npos)
      << is.status().message();
  EXPECT_FALSE(fs::exists(fs::symlink_status(impostor.dir / "current")));
}

// An ACK names a version: one this publisher's store does not hold is answered with
// ERROR and recorded nowhere (a peer cannot fill the audit log with made-up versions).
TEST_F(SyncTest, AckOfAVersionOutsideTheStoreIsRefusedAndNotRecorded) {
  StartPublisher();
  ASSERT_TRUE(publisher_->Publish(v1_).ok());
  zmq::context_t ctx;
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  s.connect(endpoints_.requests);
  Message ack;
  ack.type = MsgType::kAck;
  ack.version = *store::Digest::FromHex(std::string(32, 'd'));
  ack.computed = ack.version;
  std::string text;
  auto m = RawRequest(s, {EncodeHeader(ack), "liar"}, &text);
  ASSERT_TRUE(m.ok()) << m.status().message();
  ASSERT_EQ(m->type, MsgType::kError);
  EXPECT_EQ(m->code, static_cast<uint32_t>(StatusCode::kNotFound)) << text;
  EXPECT_NE(text.find("version dddddddddddddddddddddddddddddddd is not in this publisher's store"), std::string::npos)
      << text;
  // The same peer acknowledging a version the store holds (v2: in the store, not published
  // by this publisher) is recorded.
  ack.version = v2_;
  ack.computed = v2_;
  m = RawRequest(s, {EncodeHeader(ack), "liar"}, &text);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->type, MsgType::kAcked) << text;
  auto events = store_->ListEvents(std::nullopt);
  ASSERT_TRUE(events.ok()) << events.status().message();
  int acks = 0;
  for (const auto& e : *events) {
    if (e.type != store::Event::Type::kAcknowledged) continue;
    ++acks;
    EXPECT_EQ(e.receiver, "liar");
    EXPECT_EQ(e.version, v2_);
  }
  EXPECT_EQ(acks, 1);
}

// ENGINE: a receiver tells what its inference engine answered; the publisher records a proof
// as an `engine` event and a mismatch as an `engine_mismatch` anomaly, and refuses a report
// that is not the documented JSON, too large, or about a version its store lacks.
TEST_F(SyncTest, EngineReportsAreRecordedAndMalformedOnesRefused) {
  StartPublisher();
  ASSERT_TRUE(publisher_->Publish(v1_).ok());
  auto r = Receiver::Connect(RecvOptions("gen-e"));
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_TRUE((*r)->SyncLatest().ok());
  const std::string proof =
      R"({"receiver": "gen-e", "engine": "vllm", "url": "http://127.0.0.1:8000", "model": "ferry-abc-1",)"
      R"( "proven": true, "tolerance": 0.0001, "max_diff": 1.5e-05, "previous_diff": null, "tokens": 69, "seconds": 0.05})";
  ASSERT_TRUE((*r)->ReportEngine(v1_, proof).ok());
  std::string mismatch = proof;
  mismatch.replace(mismatch.find("true"), 4, "false");
  mismatch.insert(mismatch.size() - 1, R"(, "why": "differs by 0.5")");
  ASSERT_TRUE((*r)->ReportEngine(v1_, mismatch).ok());
  // A mismatch whose difference was not finite (a NaN in the answer: the receiver's JSON has
  // null) is recorded too; fields the format does not have are not.
  std::string nonfinite = mismatch;
  nonfinite.replace(nonfinite.find("1.5e-05"), 7, "null");
  nonfinite.replace(nonfinite.find("differs by 0.5"), 14, "not finite");
  nonfinite.insert(nonfinite.size() - 1, R"(, "extra": )" + std::string(1000, '[') + std::string(1000, ']'));
  ASSERT_LE(nonfinite.size(), kMaxEngineReportBytes);
  Status recorded = (*r)->ReportEngine(v1_, nonfinite);
  ASSERT_TRUE(recorded.ok()) << recorded.message();
  // v2 is in the store though not published: recorded; a version outside the store is not.
  Status stored = (*r)->ReportEngine(v2_, proof);
  ASSERT_TRUE(stored.ok()) << stored.message();
  Status unknown = (*r)->ReportEngine(*store::Digest::FromHex(std::string(32, 'e')), proof);
  EXPECT_EQ(unknown.code(), StatusCode::kNotFound) << unknown.message();
  for (const auto& [report, what] : std::vector<std::pair<std::string, std::string>>{
           {"[1]", "not a JSON object"},
           {R"({"receiver": "gen-e", "engine": "vllm", "url": "u", "model": "m", "proven": 1})", "'proven'"},
           {R"({"receiver": "bad id!", "engine": "vllm", "url": "u", "model": "m", "proven": true, "tolerance": 1,)"
            R"( "max_diff": 0, "seconds": 0})",
            "'receiver'"},
           {std::string(kMaxEngineReportBytes + 1, ' '), "payload larger than"},
           // A proof must hold its own tolerance; a mismatch must say why in text.
           {std::string(proof).replace(proof.find("1.5e-05"), 7, "0.5"), "exceeds its tolerance"},
           {std::string(mismatch).replace(mismatch.find(R"("differs by 0.5")"), 16, "42"), "'why'"}}) {
    Status s = (*r)->ReportEngine(v1_, report);
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << report;
    EXPECT_NE(s.message().find(what), std::string::npos) << s.message();
  }
  r->reset();
  publisher_.reset();
  auto events = store_->ListEvents(std::nullopt);
  ASSERT_TRUE(events.ok());
  int engine = 0, anomalies = 0;
  for (const auto& e : *events) {
    if (e.type == store::Event::Type::kEngine) {
      ++engine;
      EXPECT_EQ(e.receiver, "gen-e");
      EXPECT_NE(e.detail.find(R"("model":"ferry-abc-1")"), std::string::npos) << e.detail;
      EXPECT_EQ(e.detail.find("proven"), std::string::npos) << e.detail;
    }
    if (e.type == store::Event::Type::kAnomaly && e.anomaly == store::Event::Anomaly::kEngineMismatch) {
      ++anomalies;
      EXPECT_EQ(e.version, v1_);
      const bool first = e.detail.find("differs by 0.5") != std::string::npos;
      EXPECT_NE(e.detail.find(first ? R"("max_diff":1.5e-05)" : R"("max_diff":null,)"), std::string::npos) << e.detail;
      EXPECT_EQ(e.detail.find("extra"), std::string::npos) << e.detail;
    }
  }
  EXPECT_EQ(engine, 2);  // v1 and v2 (a stored version, published or not)
  EXPECT_EQ(anomalies, 2);
}

// The publisher tracks at most kMaxReceivers receiver ids: one more, while all are alive,
// is refused with ERROR; once they are lost (connection closed, heartbeat timeout) a lost
// one is forgotten and the new id is served. The timeout is long enough that a loaded
// machine descheduling this process (its socket then misses ZMTP heartbeats) does not
// drop the connection while the ids register: with 200 ms, CI saw one-too-many admitted.
TEST_F(SyncTest, PublisherTracksBoundedReceiversAndForgetsLostOnesForNewOnes) {
  PublisherOptions po;
  po.heartbeat_ivl_ms = 100;
  po.heartbeat_timeout_ms = 3000;
  StartPublisher(po);
  ASSERT_TRUE(publisher_->Publish(v1_).ok());
  zmq::context_t ctx;
  Message hello;
  hello.type = MsgType::kHello;
  std::string text;
  {
    zmq::socket_t s(ctx, zmq::socket_type::dealer);
    s.set(zmq::sockopt::linger, 0);
    s.connect(endpoints_.requests);
    for (size_t i = 0; i < kMaxReceivers; ++i) {
      auto m = RawRequest(s, {EncodeHeader(hello), "r" + std::to_string(i)}, &text);
      ASSERT_TRUE(m.ok()) << m.status().message();
      ASSERT_EQ(m->type, MsgType::kManifest) << "receiver " << i << ": " << text;
    }
    auto m = RawRequest(s, {EncodeHeader(hello), "one-too-many"}, &text);
    ASSERT_TRUE(m.ok()) << m.status().message();
    ASSERT_EQ(m->type, MsgType::kError);
    EXPECT_EQ(m->code, static_cast<uint32_t>(StatusCode::kFailedPrecondition)) << text;
    EXPECT_NE(text.find("receiver one-too-many refused: this publisher tracks 1024 receivers"), std::string::npos)
        << text;
    EXPECT_EQ(publisher_->Receivers().size(), kMaxReceivers);
  }  // closed: all 1024 ids lose their connection
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (;;) {
    const auto rs = publisher_->Receivers();
    if (std::none_of(rs.begin(), rs.end(), [](const ReceiverInfo& r) { return r.alive; })) break;
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "receivers not declared lost";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  s.connect(endpoints_.requests);
  auto m = RawRequest(s, {EncodeHeader(hello), "newcomer"}, &text);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->type, MsgType::kManifest) << text;
  const auto rs = publisher_->Receivers();
  EXPECT_EQ(rs.size(), kMaxReceivers);
  EXPECT_TRUE(std::any_of(rs.begin(), rs.end(), [](const ReceiverInfo& r) { return r.id == "newcomer" && r.alive; }));
}

// ---- publication modes: delta, adapter, fused layout ------------------------------------

const fs::path kCase = fs::path(FERRY_FIXTURES_DIR) / "cases" / "llama_lora_all_linear_f32";

class ModesTest : public SyncTest {
 protected:
  // Four F32 tensors t0..t3 of 256 elements; tensor i holds scales[i] * (j + 1). Same
  // config.json for every version.
  store::Digest ImportFour(const std::string& name, const std::array<float, 4>& scales) {
    const fs::path dir = root_ / name;
    fs::create_directories(dir);
    std::vector<TensorSpec> specs;
    for (int i = 0; i < 4; ++i) specs.push_back({"t" + std::to_string(i), DType::kF32, {16, 16}});
    auto w = SafetensorsWriter::CreateFile(dir / "model.safetensors", specs);
    EXPECT_TRUE(w.ok());
    for (int i = 0; i < 4; ++i) {
      std::vector<float> v(256);
      for (int j = 0; j < 256; ++j) v[j] = scales[i] * static_cast<float>(j + 1);
      EXPECT_TRUE((*w)->Append(std::as_bytes(std::span(v))).ok());
    }
    EXPECT_TRUE((*w)->Finish().ok());
    std::ofstream(dir / "config.json") << "{\"model_type\": \"four\"}\n";
    auto r = store_->Import(dir, {});
    EXPECT_TRUE(r.ok()) << r.status().message();
    return r->record.id;
  }
  uint64_t ConfigBytes() const { return fs::file_size(root_ / "four1" / "config.json"); }

  // Flips one byte of tensor `name` in DIR/versions/<v>/model.safetensors.
  void CorruptLocalTensor(const fs::path& dir, const store::Digest& v, const std::string& name) {
    const fs::path file = dir / "versions" / v.Hex() / "model.safetensors";
    uint64_t at = 0;
    {
      auto f = SafetensorsFile::Open(file);
      ASSERT_TRUE(f.ok()) << f.status().message();
      const TensorInfo* info = (*f)->Find(name);
      ASSERT_NE(info, nullptr);
      at = (*f)->RangeOf(*info).offset + 17;
    }
    std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(static_cast<std::streamoff>(at));
    char c = 0;
    io.read(&c, 1);
    c = static_cast<char>(c ^ 0x40);
    io.seekp(static_cast<std::streamoff>(at));
    io.write(&c, 1);
    ASSERT_TRUE(io.good());
  }

  static SnapshotSource FixtureSource() { return FixtureSnapshotSource(kCase); }
  static store::Digest SnapshotId(Layout layout) {
    SnapshotOptions o;
    o.layout = layout;
    o.threads = 2;
    auto snap = BuildSnapshot(FixtureSource(), o);
    EXPECT_TRUE(snap.ok()) << snap.status().ToString();
    return snap.ok() ? (*snap)->manifest_id() : store::Digest{};
  }

  // Imports the fixture's base and adapter; records the merged hf version unless told not to.
  void ImportFixture(bool record_merged) {
    store::ImportOptions bo;
    bo.kind = store::VersionKind::kBase;
    auto base = store_->Import(kCase / "base", bo);
    ASSERT_TRUE(base.ok()) << base.status().message();
    base_ = base->record.id;
    store::ImportOptions ao;
    ao.base_version = base_;
    auto adapter = store_->Import(kCase / "adapter", ao);
    ASSERT_TRUE(adapter.ok()) << adapter.status().message();
    ASSERT_EQ(adapter->record.kind, store::VersionKind::kAdapter);
    adapter_ = adapter->record.id;
    if (record_merged) RecordMerged(Layout::kHf);
  }
  void RecordMerged(Layout layout) {
    SnapshotOptions so;
    so.layout = layout;
    so.threads = 2;
    auto snap = BuildSnapshot(FixtureSource(), so);
    ASSERT_TRUE(snap.ok()) << snap.status().ToString();
    store::ImportOptions mo;
    mo.base_version = base_;
    mo.adapter_version = adapter_;
    auto rec = RecordSnapshot(*store_, **snap, mo);
    ASSERT_TRUE(rec.ok()) << rec.status().ToString();
    (layout == Layout::kHf ? merged_ : merged_fused_) = rec->record.id;
  }

  void ExpectCurrent(const fs::path& dir, const store::Digest& v) { ExpectActiveVersion(dir, v); }

  // adapter_ published in adapter mode, then one SyncLatest of receiver "nobase", which has no
  // local base (RecvOptions("nobase")).
  Result<SyncResult> SyncAdapterWithoutABase() {
    PublisherOptions po;
    po.mode = PublishMode::kAdapter;
    StartPublisher(po);
    if (!publisher_) return Status::Internal("the publisher did not start");
    if (auto seq = publisher_->Publish(adapter_); !seq.ok()) return seq.status();
    auto r = Receiver::Connect(RecvOptions("nobase"));
    if (!r.ok()) return r.status();
    return (*r)->SyncLatest();
  }

  store::Digest base_, adapter_, merged_, merged_fused_;
};

TEST_F(ModesTest, DeltaCopiesHeldTensorsAndFetchesOnlyTheChangedOne) {
  const store::Digest v1 = ImportFour("four1", {1, 2, 3, 4});
  const store::Digest v2 = ImportFour("four2", {1, 2, 5, 4});  // t2 differs
  const store::Digest v3 = ImportFour("four3", {1, 2, 5, 6});  // t3 differs from v2
  PublisherOptions po;
  po.mode = PublishMode::kDelta;
  StartPublisher(po);
  ASSERT_TRUE(publisher_->Publish(v1).ok());
  auto o = RecvOptions("delta");
  o.chunk_bytes = 256;
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  auto s1 = (*r)->SyncLatest();
  ASSERT_TRUE(s1.ok()) << s1.status().message();
  EXPECT_EQ(s1->bytes_received, 4 * 1024 + ConfigBytes());  // nothing held yet
  EXPECT_EQ(s1->bytes_reused, 0u);
  // The received manifest is kept outside the version directory.
  EXPECT_TRUE(fs::exists(o.dir / "manifests" / (v1.Hex() + ".json")));

  ASSERT_TRUE(publisher_->Publish(v2).ok());
  auto s2 = (*r)->WaitForNewer(5000);
  ASSERT_TRUE(s2.ok()) << s2.status().message();
  EXPECT_EQ(s2->version, v2);
  EXPECT_EQ(s2->bytes_received, 1024 + ConfigBytes());
  EXPECT_EQ(s2->bytes_reused, 3 * 1024u);
  EXPECT_EQ(s2->refetches, 0);
  ExpectCurrent(o.dir, v2);

  // A held tensor whose local bytes went bad is fetched instead of copied.
  CorruptLocalTensor(o.dir, v2, "t0");
  ASSERT_TRUE(publisher_->Publish(v3).ok());
  auto s3 = (*r)->WaitForNewer(5000);
  ASSERT_TRUE(s3.ok()) << s3.status().message();
  EXPECT_EQ(s3->version, v3);
  EXPECT_EQ(s3->bytes_received, 2 * 1024 + ConfigBytes());  // t3 (new) and t0 (bad copy)
  EXPECT_EQ(s3->bytes_reused, 2 * 1024u);                   // t1, t2
  ExpectCurrent(o.dir, v3);
}

TEST_F(ModesTest, MergedModeFetchesEverythingAgain) {
  const store::Digest v1 = ImportFour("four1", {1, 2, 3, 4});
  const store::Digest v2 = ImportFour("four2", {1, 2, 5, 4});
  StartPublisher();
  ASSERT_TRUE(publisher_->Publish(v1).ok());
  auto r = Receiver::Connect(RecvOptions("merged"));
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_TRUE((*r)->SyncLatest().ok());
  ASSERT_TRUE(publisher_->Publish(v2).ok());
  auto s2 = (*r)->WaitForNewer(5000);
  ASSERT_TRUE(s2.ok()) << s2.status().message();
  EXPECT_EQ(s2->bytes_received, 4 * 1024 + ConfigBytes());
  EXPECT_EQ(s2->bytes_reused, 0u);
  ExpectCurrent(root_ / "recv-merged", v2);
}

TEST_F(ModesTest, PublishRefusesVersionsTheModeCannotServe) {
  ImportFixture(/*record_merged=*/false);
  PublisherOptions po;
  po.mode = PublishMode::kAdapter;
  StartPublisher(po);
  auto no_merged = publisher_->Publish(adapter_);
  ASSERT_FALSE(no_merged.ok());
  EXPECT_EQ(no_merged.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(no_merged.status().message().find(adapter_.Hex()), std::string::npos) << no_merged.status().message();
  EXPECT_NE(no_merged.status().message().find("record the merged version first"), std::string::npos)
      << no_merged.status().message();
  // A merged version is served through its adapter (the base itself is servable: see
  // base_first_test.cpp).
  RecordMerged(Layout::kHf);
  auto merged_in_adapter = publisher_->Publish(merged_);
  ASSERT_FALSE(merged_in_adapter.ok());
  EXPECT_EQ(merged_in_adapter.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(merged_in_adapter.status().message().find(merged_.Hex() + " is of kind merged"), std::string::npos)
      << merged_in_adapter.status().message();
  EXPECT_EQ(publisher_->latest_sequence(), 0u);
  publisher_.reset();

  StartPublisher();  // merged mode
  auto adapter_in_merged = publisher_->Publish(adapter_);
  ASSERT_FALSE(adapter_in_merged.ok());
  EXPECT_EQ(adapter_in_merged.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(adapter_in_merged.status().message().find(adapter_.Hex() + " is an adapter"), std::string::npos)
      << adapter_in_merged.status().message();
}

TEST_F(ModesTest, AdapterModeReceiverMergesOntoItsBaseAndProvesTheMergedId) {
  ImportFixture(/*record_merged=*/true);
  ASSERT_EQ(merged_, SnapshotId(Layout::kHf));
  PublisherOptions po;
  po.mode = PublishMode::kAdapter;
  StartPublisher(po);
  ASSERT_EQ(*publisher_->Publish(adapter_), 1u);

  auto o = RecvOptions("lora");
  o.base_dir = kCase / "base";
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  auto s = (*r)->SyncLatest();
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->version, adapter_);
  EXPECT_EQ(s->computed, adapter_);
  ASSERT_TRUE(s->proven.has_value());
  EXPECT_EQ(*s->proven, merged_);
  EXPECT_EQ(s->active, merged_);
  const uint64_t adapter_bytes = fs::file_size(kCase / "adapter" / "adapter_model.safetensors");
  EXPECT_LT(s->bytes_received, adapter_bytes + 4096) << "adapter mode sent more than the adapter";
  ExpectCurrent(o.dir, merged_);
  // Asking again fetches nothing and still acknowledges the proven id.
  auto again = (*r)->SyncLatest();
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_TRUE(again->already_active);
  EXPECT_EQ(again->proven, std::optional<store::Digest>(merged_));

  // A receiver that wants the fused layout activates the fused merge, still proving the hf id.
  auto fo = RecvOptions("lora-fused");
  fo.base_dir = kCase / "base";
  fo.layout = Layout::kFused;
  auto fr = Receiver::Connect(fo);
  ASSERT_TRUE(fr.ok()) << fr.status().message();
  auto fs_ = (*fr)->SyncLatest();
  ASSERT_TRUE(fs_.ok()) << fs_.status().message();
  EXPECT_EQ(fs_->proven, std::optional<store::Digest>(merged_));
  EXPECT_EQ(fs_->active, SnapshotId(Layout::kFused));
  ExpectCurrent(fo.dir, fs_->active);

  auto infos = publisher_->Receivers();
  ASSERT_EQ(infos.size(), 2u);
  EXPECT_EQ(infos[0].acknowledged, std::optional<store::Digest>(merged_));
  publisher_.reset();
  auto events = store_->ListEvents(merged_);
  ASSERT_TRUE(events.ok()) << events.status().message();
  int acks = 0;
  for (const auto& e : *events) {
    if (e.type != store::Event::Type::kAcknowledged) continue;
    ++acks;
    EXPECT_EQ(e.computed, std::optional<store::Digest>(merged_));
    EXPECT_NE(e.detail.find("adapter " + adapter_.Hex()), std::string::npos) << e.detail;
    EXPECT_EQ(e.detail.find("MISMATCH"), std::string::npos) << e.detail;
  }
  EXPECT_EQ(acks, 3);  // lora twice, lora-fused once
}

// A receiver without a local base, served an adapter whose base was never published: the
// publisher serves that base from its store too (unannounced), and the receiver fetches it
// (not activated) and merges onto it.
TEST_F(ModesTest, AdapterModeReceiverWithoutABaseFetchesTheBaseFromThePublishersStore) {
  ImportFixture(/*record_merged=*/true);
  const ReceiverOptions o = RecvOptions("nobase");
  auto s = SyncAdapterWithoutABase();
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->version, adapter_);
  EXPECT_EQ(s->proven, merged_);
  ExpectCurrent(o.dir, merged_);
  EXPECT_TRUE(fs::is_directory(o.dir / "versions" / base_.Hex()));
  EXPECT_FALSE(fs::exists(o.dir / "manifests" / (base_.Hex() + ".json"))) << "the base was not activated";
}

// An adapter whose base adapter mode cannot serve (a version of kind merged: a LoRA trained
// on a merged model), and no local base: kFailedPrecondition naming both, nothing activated.
TEST_F(ModesTest, AdapterModeWithoutABaseItCanServeActivatesNothing) {
  store::ImportOptions bo;
  bo.kind = store::VersionKind::kMerged;
  auto base = store_->Import(kCase / "base", bo);
  ASSERT_TRUE(base.ok()) << base.status().message();
  store::ImportOptions ao;
  ao.base_version = base->record.id;
  auto adapter = store_->Import(kCase / "adapter", ao);
  ASSERT_TRUE(adapter.ok()) << adapter.status().message();
  base_ = base->record.id;
  adapter_ = adapter->record.id;
  RecordMerged(Layout::kHf);
  const ReceiverOptions o = RecvOptions("nobase");
  auto s = SyncAdapterWithoutABase();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition) << s.status().message();
  EXPECT_NE(s.status().message().find("applies to base " + base_.Hex()), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find("is not served"), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find("base_dir"), std::string::npos) << s.status().message();
  EXPECT_FALSE(fs::exists(fs::symlink_status(o.dir / "current")));
  for (const auto& e : fs::directory_iterator(o.dir / "versions")) {
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << "left behind: " << e.path();
  }
}

// A local base the adapter does not fit (another model's base: it lacks the targeted
// tensors) is a precondition failure naming the base, never kNotFound, which a following
// receiver would take for "nothing published yet" and wait out forever.
TEST_F(ModesTest, AdapterModeOntoABaseLackingTheTargetsIsAPreconditionFailure) {
  ImportFixture(/*record_merged=*/true);
  PublisherOptions po;
  po.mode = PublishMode::kAdapter;
  StartPublisher(po);
  ASSERT_TRUE(publisher_->Publish(adapter_).ok());
  auto o = RecvOptions("wrongbase");
  o.base_dir = fs::path(FERRY_FIXTURES_DIR) / "cases" / "gpt2_conv1d_f32" / "base";
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  auto s = (*r)->SyncLatest();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition) << s.status().message();
  EXPECT_NE(s.status().message().find(o.base_dir->string()), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find("has no tensor"), std::string::npos) << s.status().message();
  EXPECT_FALSE(fs::exists(fs::symlink_status(o.dir / "current")));
}

TEST_F(ModesTest, FusedLayoutReceiverActivatesTheFusedRelayout) {
  ImportFixture(/*record_merged=*/true);
  StartPublisher();
  ASSERT_TRUE(publisher_->Publish(merged_).ok());
  auto o = RecvOptions("fused");
  o.layout = Layout::kFused;
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  auto s = (*r)->SyncLatest();
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->version, merged_);
  EXPECT_EQ(s->computed, merged_);
  EXPECT_FALSE(s->proven.has_value());
  EXPECT_EQ(s->active, SnapshotId(Layout::kFused));
  ExpectCurrent(o.dir, s->active);
  publisher_.reset();
  auto events = store_->ListEvents(merged_);
  ASSERT_TRUE(events.ok());
  int acks = 0;
  for (const auto& e : *events) {
    if (e.type != store::Event::Type::kAcknowledged) continue;
    ++acks;
    EXPECT_EQ(e.computed, std::optional<store::Digest>(merged_));
  }
  EXPECT_EQ(acks, 1);
}

TEST_F(ModesTest, ReceiverRefusesALayoutThatHoldsNoWeights) {
  auto o = RecvOptions("odd");
  o.layout = Layout::kLora;
  auto r = Receiver::Connect(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("layout \"lora\" must be hf or fused"), std::string::npos)
      << r.status().message();
}

}  // namespace
}  // namespace ferry::sync
