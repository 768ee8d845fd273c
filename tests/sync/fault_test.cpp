// Fault tests of the sync protocol (sync/publisher.h, sync/receiver.h): a publisher
// restarted under a live receiver, publishers dying mid-transfer and while idle, receivers
// going away (publisher side liveness), a receiver SIGKILLed mid-transfer and restarted on
// the same directory, and the one-receiver-per-directory lock.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "core/safetensors.h"
#include "store/store.h"
#include "sync/protocol.h"
#include "sync/publisher.h"
#include "sync/receiver.h"
#include "tests/sync/sync_test_util.h"
#include "tests/temp_dir.h"

namespace ferry::sync {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

int64_t MsSince(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

// Entries of DIR/versions that are temporary (".tmp-" in the name).
std::vector<std::string> TempEntries(const fs::path& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir / "versions", ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.find(".tmp-") != std::string::npos) out.push_back(name);
  }
  return out;
}

class FaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto st = store::Store::Open(tmp_.path() / "db", {.create_if_missing = true});
    ASSERT_TRUE(st.ok()) << st.status().message();
    store_ = std::move(*st);
    auto ep = PrivateIpcEndpoints(tmp_.path() / "sock");
    ASSERT_TRUE(ep.ok()) << ep.status().message();
    endpoints_ = *ep;
  }
  void TearDown() override {
    publisher_.reset();
    store_.reset();
  }

  // A model with one F32 tensor of `floats` elements (values depend on `scale`), a small
  // bias and config.json, imported into the store.
  store::Digest ImportModel(const std::string& name, float scale, int floats = 6) {
    const fs::path dir = tmp_.path() / name;
    WriteTinyModel(dir, scale, {floats});
    auto r = store_->Import(dir, {});
    EXPECT_TRUE(r.ok()) << r.status().message();
    return r.ok() ? r->record.id : store::Digest{};
  }

  void StartPublisher(PublisherOptions o = {}) {
    o.endpoints = endpoints_;
    auto p = Publisher::Start(store_.get(), o);
    ASSERT_TRUE(p.ok()) << p.status().message();
    publisher_ = std::move(*p);
  }

  PublisherOptions FastHeartbeats() {
    PublisherOptions o;
    o.heartbeat_ivl_ms = 100;
    o.heartbeat_timeout_ms = 500;
    return o;
  }

  ReceiverOptions RecvOptions(const std::string& id) {
    ReceiverOptions o;
    o.id = id;
    o.endpoints = endpoints_;
    o.dir = tmp_.path() / ("recv-" + id);
    o.timeout_ms = 5000;
    o.heartbeat_ivl_ms = 100;
    return o;
  }

  void ExpectActive(const fs::path& dir, const store::Digest& v) { ExpectActiveVersion(dir, v); }

  // Forks a receiver with options `o` that writes 'k' to the returned pipe after its
  // `chunks`-th chunk and then waits to be killed ('e' if it ended otherwise). Fork before
  // the publisher exists: the child only runs a receiver (its own ZeroMQ context).
  static pid_t ForkReceiverStoppingAfter(const ReceiverOptions& o, int chunks, int* report_fd) {
    int pipe_fds[2];
    if (::pipe(pipe_fds) != 0) return -1;
    const pid_t child = ::fork();
    if (child == 0) {
      ::close(pipe_fds[0]);
      ReceiverOptions co = o;
      int seen = 0;
      co.on_chunk_for_testing = [&](uint64_t) {
        if (++seen == chunks) {
          const char k = 'k';
          (void)!::write(pipe_fds[1], &k, 1);
          for (;;) ::pause();
        }
      };
      auto r = Receiver::Connect(co);
      if (r.ok()) (void)(*r)->SyncLatest();
      const char e = 'e';
      (void)!::write(pipe_fds[1], &e, 1);
      ::_exit(1);
    }
    ::close(pipe_fds[1]);
    *report_fd = pipe_fds[0];
    return child;
  }

  // The child's report ('k', 'e'), or 0 when none came within 20 s. Closes `fd`.
  static char WaitForReport(int fd) {
    pollfd pfd = {fd, POLLIN, 0};
    char got = 0;
    if (::poll(&pfd, 1, 20000) != 1 || ::read(fd, &got, 1) != 1) got = 0;
    ::close(fd);
    return got;
  }

  testing::ScopedTempDir tmp_{"ferry-sync-fault-"};
  std::unique_ptr<store::Store> store_;
  std::unique_ptr<Publisher> publisher_;
  Endpoints endpoints_;
};

TEST_F(FaultTest, RestartedPublisherIsFollowedByTheSameReceiver) {
  const store::Digest v1 = ImportModel("m1", 1.0f);
  const store::Digest v2 = ImportModel("m2", 2.0f);
  StartPublisher(FastHeartbeats());
  const uint64_t epoch_a = publisher_->epoch();
  ASSERT_EQ(*publisher_->Publish(v1), 1u);
  auto r = Receiver::Connect(RecvOptions("gen"));
  ASSERT_TRUE(r.ok()) << r.status().message();
  auto s1 = (*r)->SyncLatest();
  ASSERT_TRUE(s1.ok()) << s1.status().message();
  EXPECT_EQ(s1->version, v1);
  EXPECT_EQ(s1->epoch, epoch_a);

  publisher_.reset();  // publisher A goes away; B restarts on the same endpoints and store
  StartPublisher(FastHeartbeats());
  EXPECT_NE(publisher_->epoch(), epoch_a);
  EXPECT_NE(publisher_->epoch(), 0u);
  // B numbers from 1 again: without the epoch the receiver (at sequence 1) would ignore it.
  ASSERT_EQ(*publisher_->Publish(v2), 1u);
  const auto start = Clock::now();
  auto s2 = (*r)->WaitForNewer(15000);
  ASSERT_TRUE(s2.ok()) << s2.status().message();
  EXPECT_LT(MsSince(start), 15000);
  EXPECT_EQ(s2->version, v2);
  EXPECT_EQ(s2->sequence, 1u);
  EXPECT_EQ(s2->epoch, publisher_->epoch());
  EXPECT_EQ((*r)->epoch(), publisher_->epoch());
  ExpectActive(tmp_.path() / "recv-gen", v2);
}

TEST_F(FaultTest, PublisherDyingMidTransferIsAnIOErrorWithinTheTimeout) {
  const store::Digest v1 = ImportModel("big", 1.0f, 16384);  // 64 KiB: 64 chunks of 1 KiB
  StartPublisher();
  ASSERT_TRUE(publisher_->Publish(v1).ok());
  auto o = RecvOptions("mid");
  o.chunk_bytes = 1024;
  o.credit = 1;
  o.timeout_ms = 800;
  int chunks = 0;
  o.on_chunk_for_testing = [&](uint64_t) {
    if (++chunks == 3) publisher_.reset();
  };
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  const auto start = Clock::now();
  auto s = (*r)->SyncLatest();
  const int64_t elapsed = MsSince(start);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kIOError);
  EXPECT_NE(s.status().message().find("no reply from " + endpoints_.requests), std::string::npos)
      << s.status().message();
  EXPECT_EQ(chunks, 3);
  EXPECT_LT(elapsed, 800 + 4000) << "dead publisher not detected within timeout_ms + slack";
  EXPECT_FALSE(fs::exists(fs::symlink_status(o.dir / "current")));
  EXPECT_TRUE(TempEntries(o.dir).empty());
}

TEST_F(FaultTest, PublisherDyingWhileIdleIsAnIOErrorWithinTheTimeout) {
  const store::Digest v1 = ImportModel("m1", 1.0f);
  StartPublisher(FastHeartbeats());
  ASSERT_TRUE(publisher_->Publish(v1).ok());
  auto o = RecvOptions("idle");
  o.timeout_ms = 1000;
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_TRUE((*r)->SyncLatest().ok());
  // Alive but quiet for longer than timeout_ms: the beacons keep it from looking dead.
  auto quiet = (*r)->WaitForNewer(1500);
  ASSERT_FALSE(quiet.ok());
  EXPECT_EQ(quiet.status().code(), StatusCode::kNotFound) << quiet.status().message();

  publisher_.reset();
  const auto start = Clock::now();
  auto s = (*r)->WaitForNewer(60000);
  const int64_t elapsed = MsSince(start);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kIOError);
  EXPECT_NE(s.status().message().find(endpoints_.requests), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find("publisher gone"), std::string::npos) << s.status().message();
  EXPECT_LT(elapsed, 1000 + 4000) << "dead publisher not detected within timeout_ms + slack";
  ExpectActive(o.dir, v1);  // what was active stays active
}

TEST_F(FaultTest, PublisherDeclaresAGoneReceiverDeadOnceAndRecordsIt) {
  const store::Digest v1 = ImportModel("m1", 1.0f);
  StartPublisher(FastHeartbeats());
  ASSERT_TRUE(publisher_->Publish(v1).ok());
  auto r = Receiver::Connect(RecvOptions("gone"));
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_TRUE((*r)->SyncLatest().ok());
  auto infos = publisher_->Receivers();
  ASSERT_EQ(infos.size(), 1u);
  EXPECT_EQ(infos[0].id, "gone");
  EXPECT_TRUE(infos[0].alive);

  // Connected but silent for three heartbeat timeouts: ZMTP heartbeats keep it alive.
  const auto watch_until = Clock::now() + std::chrono::milliseconds(1500);
  while (Clock::now() < watch_until) {
    ASSERT_TRUE(publisher_->Receivers().at(0).alive) << "an idle, connected receiver was declared dead";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }

  r->reset();  // the receiver goes away (its connection closes)
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::seconds(10);
  bool dead = false;
  while (!dead && Clock::now() < deadline) {
    dead = !publisher_->Receivers().at(0).alive;
    if (!dead) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(dead) << "receiver not declared dead within 10 s";
  EXPECT_GE(MsSince(start), 400);  // not before heartbeat_timeout_ms (500, minus poll slack)

  publisher_.reset();  // the store is the publisher's while it runs
  auto events = store_->ListEvents(std::nullopt);
  ASSERT_TRUE(events.ok()) << events.status().message();
  int lost = 0;
  for (const auto& e : *events) {
    if (e.type != store::Event::Type::kAnomaly) continue;
    ++lost;
    EXPECT_EQ(e.receiver, "gone");
    EXPECT_EQ(e.version, v1);
    EXPECT_EQ(e.detail.rfind("receiver gone lost: no traffic for ", 0), 0u) << e.detail;
  }
  EXPECT_EQ(lost, 1);
}

TEST_F(FaultTest, ChunkCorruptedMidTensorIsCaughtAtTheTensorEndAndRefetched) {
  const store::Digest v1 = ImportModel("big", 1.0f, 16384);  // a.weight: 64 chunks of 1 KiB
  StartPublisher();
  ASSERT_TRUE(publisher_->Publish(v1).ok());
  auto o = RecvOptions("flip");
  o.chunk_bytes = 1024;
  o.credit = 1;  // the hook runs before the next FETCH: the 11th chunk is the corrupted one
  int chunks = 0;
  o.on_chunk_for_testing = [&](uint64_t) {
    if (++chunks == 10) publisher_->CorruptNextChunksForTesting(1);
  };
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  auto s = (*r)->SyncLatest();
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->refetches, 1);
  // a.weight twice (the whole tensor is refetched), b.bias and config.json once.
  EXPECT_EQ(s->bytes_received, 2 * 16384 * 4 + 5 * 4 + fs::file_size(tmp_.path() / "big" / "config.json"));
  ExpectActive(o.dir, v1);
}

TEST_F(FaultTest, SecondReceiverOnTheSameDirectoryIsRefused) {
  auto first = Receiver::Connect(RecvOptions("one"));
  ASSERT_TRUE(first.ok()) << first.status().message();
  auto second = Receiver::Connect(RecvOptions("one"));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find((tmp_.path() / "recv-one").string()), std::string::npos)
      << second.status().message();
  first->reset();
  auto third = Receiver::Connect(RecvOptions("one"));
  EXPECT_TRUE(third.ok()) << third.status().message();
}

TEST_F(FaultTest, ReceiverKilledMidTransferRestartsAndEndsOnTheLatestVerified) {
  const store::Digest v1 = ImportModel("big1", 1.0f, 16384);
  const store::Digest v2 = ImportModel("big2", 3.0f, 16384);
  ReceiverOptions o = RecvOptions("killed");
  o.chunk_bytes = 1024;
  o.credit = 1;
  int report = -1;
  const pid_t child = ForkReceiverStoppingAfter(o, 5, &report);
  ASSERT_GE(child, 0);
  StartPublisher();
  ASSERT_TRUE(publisher_->Publish(v1).ok());
  const char got = WaitForReport(report);
  if (got != 'k') {
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    FAIL() << "child receiver did not reach its fifth chunk (got '" << got << "')";
  }
  // Mid-transfer: the child holds the lock and a temporary directory.
  EXPECT_EQ(TempEntries(o.dir).size(), 1u);
  auto blocked = Receiver::Connect(o);
  ASSERT_FALSE(blocked.ok());
  EXPECT_EQ(blocked.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(blocked.status().message().find(o.dir.string()), std::string::npos) << blocked.status().message();

  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  EXPECT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL);
  EXPECT_FALSE(fs::exists(fs::symlink_status(o.dir / "current")));  // nothing partial activated

  ASSERT_TRUE(publisher_->Publish(v2).ok());
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(TempEntries(o.dir).empty()) << "stale temporary directory of the killed receiver left";
  auto s = (*r)->SyncLatest();
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->version, v2);
  EXPECT_EQ(s->active, v2);
  ExpectActive(o.dir, v2);
  auto rec = store::HashPath(o.dir / "current");
  ASSERT_TRUE(rec.ok());
  EXPECT_EQ(rec->id.Hex(), fs::read_symlink(o.dir / "current").filename().string());
}

// A receiver killed mid-transfer leaves versions/<id>.partial; restarted, it verifies the
// tensors that were complete and fetches only the rest (tensor granularity): 8 tensors of
// 4 KiB in 1 KiB chunks, killed after 10 chunks = t0 and t1 complete, t2 half written.
TEST_F(FaultTest, RestartedReceiverResumesFromTheCompleteTensorsOfThePartialTransfer) {
  const fs::path model = tmp_.path() / "eight";
  fs::create_directories(model);
  std::vector<TensorSpec> specs;
  for (int t = 0; t < 8; ++t) specs.push_back({"t" + std::to_string(t) + ".weight", DType::kF32, {1024}});
  {
    auto w = SafetensorsWriter::CreateFile(model / "model.safetensors", specs);
    ASSERT_TRUE(w.ok()) << w.status().message();
    for (int t = 0; t < 8; ++t) {
      std::vector<float> v(1024);
      for (int i = 0; i < 1024; ++i) v[static_cast<size_t>(i)] = static_cast<float>(t * 1000 + i);
      ASSERT_TRUE((*w)->Append(std::as_bytes(std::span(v))).ok());
    }
    ASSERT_TRUE((*w)->Finish().ok());
  }
  std::ofstream(model / "config.json") << "{\"model_type\": \"llama\"}\n";
  auto imported = store_->Import(model, {});
  ASSERT_TRUE(imported.ok()) << imported.status().message();
  const store::Digest v = imported->record.id;
  uint64_t aux_bytes = 0;
  for (const auto& a : imported->record.aux) aux_bytes += a.size;

  ReceiverOptions o = RecvOptions("resume");
  o.chunk_bytes = 1024;
  o.credit = 1;
  int report = -1;
  const pid_t child = ForkReceiverStoppingAfter(o, 10, &report);
  ASSERT_GE(child, 0);
  StartPublisher();
  ASSERT_TRUE(publisher_->Publish(v).ok());
  const char got = WaitForReport(report);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ASSERT_EQ(got, 'k') << "child receiver did not reach its tenth chunk";

  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(TempEntries(o.dir).empty());
  EXPECT_TRUE(fs::is_directory(o.dir / "versions" / (v.Hex() + ".partial")));
  auto res = (*r)->SyncLatest();
  ASSERT_TRUE(res.ok()) << res.status().message();
  EXPECT_EQ(res->version, v);
  EXPECT_EQ(res->bytes_resumed, 2u * 4096u);
  EXPECT_EQ(res->bytes_received, 6u * 4096u + aux_bytes);
  ExpectActive(o.dir, v);
  auto rec = store::HashPath(o.dir / "current");
  ASSERT_TRUE(rec.ok()) << rec.status().message();
  EXPECT_EQ(rec->id, v);
  EXPECT_FALSE(fs::exists(o.dir / "versions" / (v.Hex() + ".partial")));
}

}  // namespace
}  // namespace ferry::sync
