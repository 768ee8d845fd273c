// Fault tests of the sync protocol (sync/publisher.h, sync/receiver.h): a publisher
// restarted under a live receiver, publishers dying mid-transfer and while idle (kUnavailable,
// while a local write failure stays kIOError), a receiver connected before the first
// publication, receivers going away (publisher side liveness), a receiver SIGKILLed
// mid-transfer and restarted on the same directory, and the one-receiver-per-directory lock.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
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
      // The parent starts its publisher and publishes after the fork (a ZeroMQ context must not
      // cross one): until then SyncLatest finds nothing published, or nobody answering.
      for (int tries = 0; r.ok() && tries < 400; ++tries) {
        auto s = (*r)->SyncLatest();
        if (s.ok() || (s.status().code() != StatusCode::kNotFound && s.status().code() != StatusCode::kUnavailable)) {
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(25));
      }
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

TEST_F(FaultTest, PublisherDyingMidTransferIsUnavailableWithinTheTimeout) {
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
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable) << s.status().message();
  EXPECT_NE(s.status().message().find("no reply from " + endpoints_.requests), std::string::npos)
      << s.status().message();
  EXPECT_EQ(chunks, 3);
  EXPECT_LT(elapsed, 800 + 4000) << "dead publisher not detected within timeout_ms + slack";
  EXPECT_FALSE(fs::exists(fs::symlink_status(o.dir / "current")));
  EXPECT_TRUE(TempEntries(o.dir).empty());
}

TEST_F(FaultTest, PublisherDyingWhileIdleIsUnavailableWithinTheTimeout) {
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
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable) << s.status().message();
  EXPECT_NE(s.status().message().find(endpoints_.requests), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find("publisher gone"), std::string::npos) << s.status().message();
  EXPECT_LT(elapsed, 1000 + 4000) << "dead publisher not detected within timeout_ms + slack";
  ExpectActive(o.dir, v1);  // what was active stays active

  // Still gone: a caller retrying in a loop is made to wait its timeout, not spin.
  const auto again_start = Clock::now();
  auto again = (*r)->WaitForNewer(400);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kUnavailable) << again.status().message();
  EXPECT_GE(MsSince(again_start), 350) << "WaitForNewer returned at once during an outage";
}

// A local failure (here DIR/versions replaced by a file, so no transfer directory can be
// made) is kIOError naming the path, never kUnavailable: callers must not wait it out.
TEST_F(FaultTest, LocalWriteFailureIsAnIOErrorNotUnavailable) {
  const store::Digest v1 = ImportModel("m1", 1.0f);
  StartPublisher(FastHeartbeats());
  ASSERT_TRUE(publisher_->Publish(v1).ok());
  auto o = RecvOptions("diskfull");
  auto r = Receiver::Connect(o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  fs::remove_all(o.dir / "versions");
  std::ofstream(o.dir / "versions") << "not a directory";
  auto s = (*r)->SyncLatest();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kIOError) << s.status().message();
  EXPECT_NE(s.status().message().find((o.dir / "versions").string()), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find(std::strerror(ENOTDIR)), std::string::npos) << s.status().message();
  EXPECT_FALSE(fs::exists(fs::symlink_status(o.dir / "current")));
}

// A receiver connected before anything is published: SyncLatest is kNotFound (the publisher
// answers), and WaitForNewer then activates the first version once it is published.
TEST_F(FaultTest, FirstVersionPublishedAfterTheReceiverConnectedIsActivatedByWaitForNewer) {
  const store::Digest v1 = ImportModel("m1", 1.0f);
  StartPublisher(FastHeartbeats());
  auto r = Receiver::Connect(RecvOptions("early"));
  ASSERT_TRUE(r.ok()) << r.status().message();
  auto none = (*r)->SyncLatest();
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound) << none.status().message();
  EXPECT_NE(none.status().message().find("nothing published yet"), std::string::npos) << none.status().message();
  auto quiet = (*r)->WaitForNewer(300);  // beacons only: alive, nothing to sync
  ASSERT_FALSE(quiet.ok());
  EXPECT_EQ(quiet.status().code(), StatusCode::kNotFound) << quiet.status().message();
  ASSERT_TRUE(publisher_->Publish(v1).ok());
  auto s = (*r)->WaitForNewer(15000);
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->version, v1);
  ExpectActive(tmp_.path() / "recv-early", v1);
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

// A model of `tensors` F32 tensors of `elems` elements each (tensor t holds t*1000+i),
// imported into `store`; its id, and the bytes of its aux files in `aux_bytes`.
store::Digest ImportTensors(store::Store& store, const fs::path& model, int tensors, int elems, uint64_t* aux_bytes) {
  fs::create_directories(model);
  std::vector<TensorSpec> specs;
  for (int t = 0; t < tensors; ++t) specs.push_back({"t" + std::to_string(t) + ".weight", DType::kF32, {elems}});
  {
    auto w = SafetensorsWriter::CreateFile(model / "model.safetensors", specs);
    EXPECT_TRUE(w.ok()) << w.status().message();
    if (!w.ok()) return {};
    for (int t = 0; t < tensors; ++t) {
      std::vector<float> v(static_cast<size_t>(elems));
      for (int i = 0; i < elems; ++i) v[static_cast<size_t>(i)] = static_cast<float>(t * 1000 + i);
      EXPECT_TRUE((*w)->Append(std::as_bytes(std::span(v))).ok());
    }
    EXPECT_TRUE((*w)->Finish().ok());
  }
  std::ofstream(model / "config.json") << "{\"model_type\": \"llama\"}\n";
  auto imported = store.Import(model, {});
  EXPECT_TRUE(imported.ok()) << imported.status().message();
  if (!imported.ok()) return {};
  *aux_bytes = 0;
  for (const auto& a : imported->record.aux) *aux_bytes += a.size;
  return imported->record.id;
}

// Whether the file system under `dir` reports never-written ranges as holes (SEEK_HOLE)
// with blocks of at most `block` bytes: what chunk-granular resuming relies on.
bool ReportsHoles(const fs::path& dir, uint64_t block) {
  const fs::path probe = dir / "hole-probe";
  const int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  const char b[1] = {1};
  struct stat st;
  const bool ok = ::ftruncate(fd, 1 << 20) == 0 && ::pwrite(fd, b, 1, 0) == 1 && ::fstat(fd, &st) == 0 &&
                  static_cast<uint64_t>(st.st_blksize) <= block && ::lseek(fd, 0, SEEK_HOLE) < (1 << 20);
  ::close(fd);
  fs::remove(probe);
  return ok;
}

class ResumeTest : public FaultTest {
 protected:
  // Imports `tensors` x `elems` F32, publishes it, and lets a forked receiver with `o` stop
  // after `chunks` chunks and be killed. Returns the version (all-zero on failure).
  store::Digest KillAfter(const ReceiverOptions& o, int tensors, int elems, int chunks, uint64_t* aux_bytes) {
    const store::Digest v = ImportTensors(*store_, tmp_.path() / "model", tensors, elems, aux_bytes);
    int report = -1;
    const pid_t child = ForkReceiverStoppingAfter(o, chunks, &report);
    EXPECT_GE(child, 0);
    if (child < 0) return {};
    StartPublisher();
    EXPECT_TRUE(publisher_->Publish(v).ok());
    const char got = WaitForReport(report);
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    EXPECT_EQ(got, 'k') << "child receiver did not reach chunk " << chunks;
    return got == 'k' ? v : store::Digest{};
  }

  // Options for `id` fetching 4 KiB chunks (a block: chunk-granular resuming applies) one
  // at a time, its directory created so its file system can be probed.
  ReceiverOptions BlockChunks(const std::string& id) {
    ReceiverOptions o = RecvOptions(id);
    o.chunk_bytes = 4096;
    o.credit = 1;
    fs::create_directories(o.dir);
    return o;
  }

  // Restarts a receiver with `o` (which keeps the killed one's transfer as
  // versions/<id>.partial; `damage` may then alter it), syncs, and checks it activated `v`
  // with exactly the given byte counts, verified by re-hashing what DIR/current holds.
  void ExpectResumed(const ReceiverOptions& o, const store::Digest& v, uint64_t resumed, uint64_t received,
                     int refetches, const std::function<void(const fs::path&)>& damage = {}) {
    auto r = Receiver::Connect(o);
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_TRUE(TempEntries(o.dir).empty());
    const fs::path partial = o.dir / "versions" / (v.Hex() + ".partial");
    ASSERT_TRUE(fs::is_directory(partial));
    if (damage) damage(partial / "model.safetensors");
    auto res = (*r)->SyncLatest();
    ASSERT_TRUE(res.ok()) << res.status().message();
    EXPECT_EQ(res->version, v);
    EXPECT_EQ(res->bytes_resumed, resumed);
    EXPECT_EQ(res->bytes_received, received);
    EXPECT_EQ(res->refetches, refetches);
    ExpectActive(o.dir, v);
    auto rec = store::HashPath(o.dir / "current");
    ASSERT_TRUE(rec.ok()) << rec.status().message();
    EXPECT_EQ(rec->id, v);
    EXPECT_FALSE(fs::exists(o.dir / "versions" / (v.Hex() + ".partial")));
  }
};

// A receiver killed mid-transfer leaves versions/<id>.partial; restarted, it verifies the
// tensors that were complete and fetches only the rest. With chunks smaller than a file
// system block only whole tensors are kept: 8 tensors of 4 KiB in 1 KiB chunks, killed
// after 10 chunks = t0 and t1 complete, t2 half written and fetched again whole.
TEST_F(ResumeTest, ChunksBelowABlockResumeFromTheCompleteTensors) {
  ReceiverOptions o = RecvOptions("resume");
  o.chunk_bytes = 1024;
  o.credit = 1;
  uint64_t aux = 0;
  const store::Digest v = KillAfter(o, 8, 1024, 10, &aux);
  ASSERT_FALSE(v == store::Digest{});
  ExpectResumed(o, v, 2u * 4096u, 6u * 4096u + aux, 0);
}

// With chunks of at least a block, a half-received tensor resumes at its first missing
// chunk: 4 tensors of 16 KiB in 4 KiB chunks, killed after 6 chunks = t0 complete and the
// first 8 KiB of t1 kept; only t1's last 8 KiB, t2 and t3 are fetched.
TEST_F(ResumeTest, AHalfReceivedTensorResumesAtItsFirstMissingChunk) {
  const ReceiverOptions o = BlockChunks("chunks");
  if (!ReportsHoles(o.dir, o.chunk_bytes)) GTEST_SKIP() << o.dir << ": the file system reports no holes (SEEK_HOLE)";
  uint64_t aux = 0;
  const store::Digest v = KillAfter(o, 4, 4096, 6, &aux);
  ASSERT_FALSE(v == store::Digest{});
  ExpectResumed(o, v, 16384u + 8192u, 8192u + 2u * 16384u + aux, 0);
}

// A kept prefix is verified with the bytes fetched after it: damaged on disk after the
// kill, it fails the tensor's digest and the whole tensor is fetched again.
TEST_F(ResumeTest, ADamagedKeptPrefixCostsARefetchOfItsTensor) {
  const ReceiverOptions o = BlockChunks("damaged");
  if (!ReportsHoles(o.dir, o.chunk_bytes)) GTEST_SKIP() << o.dir << ": the file system reports no holes (SEEK_HOLE)";
  uint64_t aux = 0;
  const store::Digest v = KillAfter(o, 4, 4096, 6, &aux);
  ASSERT_FALSE(v == store::Digest{});
  // t0 kept; t1: its last 8 KiB fetched, the digest fails, all 16 KiB fetched; t2, t3.
  // Flip one byte of t1's first chunk: the data starts after the 8-byte length and header.
  ExpectResumed(o, v, 16384u, 8192u + 16384u + 2u * 16384u + aux, 1, [](const fs::path& file) {
    const int fd = ::open(file.c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_GE(fd, 0) << file;
    uint64_t header = 0;
    ASSERT_EQ(::pread(fd, &header, 8, 0), 8);
    const off_t at = static_cast<off_t>(8 + header + 16384 + 100);
    char b = 0;
    ASSERT_EQ(::pread(fd, &b, 1, at), 1);
    b = static_cast<char>(b ^ 0x01);
    ASSERT_EQ(::pwrite(fd, &b, 1, at), 1);
    ::close(fd);
  });
}

}  // namespace
}  // namespace ferry::sync
