// Tests of the sync wire protocol (sync/protocol.h), the publisher and the receiver:
// in-process publisher + receivers over ipc:// in a temp dir, CURVE over tcp://127.0.0.1,
// corrupted chunks, mid-transfer skips and malformed frames from a raw socket.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <zmq.hpp>

#include "core/safetensors.h"
#include "store/store.h"
#include "sync/keys.h"
#include "sync/protocol.h"
#include "sync/publisher.h"
#include "sync/receiver.h"

namespace ferry::sync {
namespace {

namespace fs = std::filesystem;

std::span<const std::byte> AsBytes(std::string_view s) { return {reinterpret_cast<const std::byte*>(s.data()), s.size()}; }

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
  EXPECT_EQ(h.substr(0, 4), "FSY1");
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

TEST(ProtocolTest, ChunkCarriesPayloadAndLatestSequence) {
  Message m;
  m.type = MsgType::kChunk;
  m.sequence = 9;
  m.offset = 16;
  const std::string h = EncodeHeader(m);
  const std::string body = "abc";
  const auto payload = AsBytes(body);
  auto d = Decode(AsBytes(h), &payload);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->sequence, 9u);
  EXPECT_EQ(d->offset, 16u);
  EXPECT_EQ(d->bytes.size(), 3u);
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
  expect_corrupt(std::string("FSY1\x09", 5), nullptr, "unknown type");
  expect_corrupt(std::string("FSY1\x03\x01\x02", 7), nullptr, "FETCH: header frame truncated");
  Message f;
  f.type = MsgType::kFetch;
  f.length = kMaxChunkBytes + 1;
  expect_corrupt(EncodeHeader(f), nullptr, "field length");
  f.length = 0;
  expect_corrupt(EncodeHeader(f), nullptr, "field length");
  expect_corrupt(std::string("FSY1\x01", 5), nullptr, "HELLO: payload frame missing");
  const std::string bad_id = "a/b";
  const auto p = AsBytes(bad_id);
  expect_corrupt(std::string("FSY1\x01", 5), &p, "receiver id");
  Message ack;
  ack.type = MsgType::kAcked;
  expect_corrupt(EncodeHeader(ack) + "x", nullptr, "trailing bytes");
}

TEST(ProtocolTest, ManifestValidation) {
  const std::string d = std::string(32, 'a');
  const std::string good_tensor = R"({"name":"w","dtype":"F32","shape":[2,3],"digest":")" + d + R"(","nbytes":24})";
  auto parse = [&](const std::string& tensors, const std::string& aux) {
    return DecodeManifest(R"({"version":")" + d + R"(","sequence":1,"tensors":[)" + tensors + R"(],"aux":[)" + aux + "]}");
  };
  auto ok = parse(good_tensor, R"({"name":"config.json","digest":")" + d + R"(","size":5})");
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  EXPECT_EQ(ok->tensors[0].nbytes, 24u);
  EXPECT_EQ(ok->aux[0].name, "config.json");

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
  expect(parse(good_tensor, R"({"name":"../etc/passwd","digest":")" + d + R"(","size":5})"), "not a safe file name");
  std::string bad_dtype = good_tensor;
  bad_dtype.replace(bad_dtype.find("F32"), 3, "Q99");
  expect(parse(bad_dtype, ""), "tensor w: field dtype unknown");
}

TEST(KeysTest, GeneratedKeysRoundTripAndSecretIsPrivate) {
  char tmpl[] = "/tmp/ferry-keys-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const fs::path dir = tmpl;
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
    fs::create_directories(dir);
    std::vector<TensorSpec> specs = {{"a.weight", DType::kF32, {2, 3}}, {"b.bias", DType::kF32, {5}}};
    auto w = SafetensorsWriter::CreateFile(dir / "model.safetensors", specs);
    EXPECT_TRUE(w.ok());
    std::vector<float> a(6), b(5);
    for (int i = 0; i < 6; ++i) a[i] = scale * static_cast<float>(i + 1);
    for (int i = 0; i < 5; ++i) b[i] = -scale * static_cast<float>(i);
    EXPECT_TRUE((*w)->Append(std::as_bytes(std::span(a))).ok());
    EXPECT_TRUE((*w)->Append(std::as_bytes(std::span(b))).ok());
    EXPECT_TRUE((*w)->Finish().ok());
    std::ofstream(dir / "config.json") << "{\"scale\": " << scale << "}\n";
    auto r = store_->Import(dir, {});
    EXPECT_TRUE(r.ok()) << r.status().message();
    return r->record.id;
  }

  void StartPublisher(PublisherOptions o = {}) {
    if (o.endpoints.requests.empty()) o.endpoints = endpoints_;
    auto p = Publisher::Start(store_.get(), o);
    ASSERT_TRUE(p.ok()) << p.status().message();
    publisher_ = std::move(*p);
  }

  ReceiverOptions RecvOptions(const std::string& id) {
    ReceiverOptions o;
    o.id = id;
    o.endpoints = endpoints_;
    o.dir = root_ / ("recv-" + id);
    o.timeout_ms = 5000;
    return o;
  }

  // The receiver directory's active files hash to `v` and current points at it.
  void ExpectActive(const fs::path& dir, const store::Digest& v) {
    auto active = ActiveVersion(dir);
    ASSERT_TRUE(active.ok()) << active.status().message();
    ASSERT_TRUE(active->has_value());
    EXPECT_EQ(**active, v);
    auto rec = store::HashPath(dir / "current");
    ASSERT_TRUE(rec.ok()) << rec.status().message();
    EXPECT_EQ(rec->id, v);
    EXPECT_EQ(rec->aux.size(), 1u);  // config.json came along
    for (const auto& e : fs::directory_iterator(dir / "versions")) {
      EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << "left behind: " << e.path();
    }
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
  EXPECT_TRUE(fs::is_empty(root_ / "recv-bad" / "versions"));
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
  EXPECT_EQ(ss.status().code(), StatusCode::kIOError);
  EXPECT_NE(ss.status().message().find("no reply from " + bound.requests), std::string::npos) << ss.status().message();
  EXPECT_FALSE(fs::exists(fs::symlink_status(root_ / "recv-stranger" / "current")));
  // Without CURVE at all: the handshake never completes either.
  auto no = RecvOptions("plain");
  no.endpoints = bound;
  no.timeout_ms = 300;
  EXPECT_EQ(Receiver::Connect(no).status().code(), StatusCode::kFailedPrecondition);
}

// Sends `frames` from a raw DEALER and returns the decoded reply (bounded wait).
Result<Message> RawRequest(zmq::socket_t& s, const std::vector<std::string>& frames, std::string* payload) {
  for (size_t i = 0; i < frames.size(); ++i) {
    s.send(zmq::message_t(frames[i].data(), frames[i].size()),
           i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
  zmq::pollitem_t item = {s.handle(), 0, ZMQ_POLLIN, 0};
  zmq::poll(&item, 1, std::chrono::milliseconds(5000));
  if (!(item.revents & ZMQ_POLLIN)) return Status::IOError("no reply within 5 s");
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
  expect_error({std::string("FSY1\x03\x00", 6)}, "FETCH: header frame truncated");
  expect_error({"a", "b", "c"}, "more than 2 frames");
  expect_error({std::string("FSY1\x01", 5), std::string(100, 'x')}, "receiver id");
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

}  // namespace
}  // namespace ferry::sync
