// daemon/dist: torchrun's environment, and a real two-rank Gloo group (two threads of this
// process, each with its own store connection and process group, over loopback TCP), meeting
// through a TCPStore or through a rendezvous file (c10d's FileStore).
#include <gtest/gtest.h>

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "daemon/dist/process_group.h"

namespace ferry::dist {
namespace {

Result<Launch> FromMap(const std::map<std::string, std::string>& env) {
  return LaunchFromEnv([&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

TEST(LaunchFromEnvTest, NoneSetIsOneProcess) {
  auto l = FromMap({});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->world_size, 1);
  EXPECT_EQ(l->rank, 0);
  EXPECT_FALSE(l->distributed());
}

TEST(LaunchFromEnvTest, ReadsTorchrunsVariables) {
  auto l = FromMap({{"RANK", "3"},
                    {"WORLD_SIZE", "4"},
                    {"LOCAL_RANK", "1"},
                    {"LOCAL_WORLD_SIZE", "2"},
                    {"MASTER_ADDR", "10.0.0.7"},
                    {"MASTER_PORT", "29501"}});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->rank, 3);
  EXPECT_EQ(l->world_size, 4);
  EXPECT_EQ(l->local_rank, 1);
  EXPECT_EQ(l->local_world_size, 2);
  EXPECT_EQ(l->master_addr, "10.0.0.7");
  EXPECT_EQ(l->master_port, 29501);
}

TEST(LaunchFromEnvTest, ErrorsNameTheVariable) {
  auto bad_rank = FromMap({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  ASSERT_FALSE(bad_rank.ok());
  EXPECT_EQ(bad_rank.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_rank.status().message().find("RANK=\"2\": not a whole number in 0..1"), std::string::npos)
      << bad_rank.status().message();

  auto no_addr = FromMap({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}});
  ASSERT_FALSE(no_addr.ok());
  EXPECT_NE(no_addr.status().message().find("MASTER_ADDR is not set"), std::string::npos) << no_addr.status().message();

  auto bad_port = FromMap({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}});
  ASSERT_FALSE(bad_port.ok());
  EXPECT_NE(bad_port.status().message().find("MASTER_PORT=\"70000\""), std::string::npos)
      << bad_port.status().message();

  auto not_number = FromMap({{"RANK", "x"}, {"WORLD_SIZE", "2"}});
  ASSERT_FALSE(not_number.ok());
  EXPECT_NE(not_number.status().message().find("RANK=\"x\""), std::string::npos) << not_number.status().message();
}

// FERRY_RENDEZVOUS_FILE stands in for MASTER_ADDR and MASTER_PORT, which are then not read.
TEST(LaunchFromEnvTest, ARendezvousFileTakesThePlaceOfTheMasterAddress) {
  std::map<std::string, std::string> env = {{"RANK", "1"},
                                            {"WORLD_SIZE", "2"},
                                            {"LOCAL_WORLD_SIZE", "2"},
                                            {"FERRY_RENDEZVOUS_FILE", "/run/x/store"},
                                            {"MASTER_PORT", "not a port"}};
  auto l = FromMap(env);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->rank, 1);
  EXPECT_EQ(l->rendezvous_file, "/run/x/store");
  EXPECT_EQ(l->Rendezvous(), "the file /run/x/store");
  // Ranks of one host only.
  env["LOCAL_WORLD_SIZE"] = "1";
  auto hosts = FromMap(env);
  ASSERT_FALSE(hosts.ok());
  EXPECT_NE(hosts.status().message().find(
                "FERRY_RENDEZVOUS_FILE is for ranks of one host, but LOCAL_WORLD_SIZE=1 is not WORLD_SIZE=2"),
            std::string::npos)
      << hosts.status().message();

  auto tcp = FromMap({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "29400"}});
  ASSERT_TRUE(tcp.ok()) << tcp.status().ToString();
  EXPECT_EQ(tcp->rendezvous_file, "");
  EXPECT_EQ(tcp->Rendezvous(), "MASTER_ADDR:MASTER_PORT h:29400");
}

// torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True, compared with Python's
// str(True) as torch does); its restart count names the attempt.
TEST(LaunchFromEnvTest, TorchrunsAgentStoreIsRead) {
  std::map<std::string, std::string> env = {{"RANK", "1"},
                                            {"WORLD_SIZE", "2"},
                                            {"MASTER_ADDR", "localhost"},
                                            {"MASTER_PORT", "29400"},
                                            {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                            {"TORCHELASTIC_RESTART_COUNT", "3"}};
  auto l = FromMap(env);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_TRUE(l->agent_store);
  EXPECT_EQ(l->restart_count, 3);
  EXPECT_EQ(l->Rendezvous(), "MASTER_ADDR:MASTER_PORT localhost:29400 (torchrun's store)");

  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  auto own = FromMap(env);
  ASSERT_TRUE(own.ok()) << own.status().ToString();
  EXPECT_FALSE(own->agent_store);
  EXPECT_EQ(own->restart_count, 0);

  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  env["TORCHELASTIC_RESTART_COUNT"] = "-1";
  auto bad = FromMap(env);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("TORCHELASTIC_RESTART_COUNT=\"-1\""), std::string::npos)
      << bad.status().message();
}

int CudaDevices() {
  const at::CUDAHooksInterface& cuda = at::detail::getCUDAHooks();
  return cuda.hasCUDART() ? cuda.getNumGPUs() : 0;
}

// Whether this LibTorch has NCCL's process group (PyPI's CUDA torch; Debian's has none).
constexpr bool kHaveNccl =
#ifdef USE_C10D_NCCL
    true;
#else
    false;
#endif

// NCCL is refused, saying why: a CPU LibTorch (Debian's) or one without NCCL, no CUDA device,
// or more local ranks than devices (NCCL refuses two ranks on one GPU).
TEST(ProcessGroupTest, NcclIsRefusedSayingWhy) {
  const int devices = CudaDevices();
  if (kHaveNccl && devices >= 2) GTEST_SKIP() << devices << " CUDA devices: 2 local ranks on NCCL can run here";
  Launch l;
  l.world_size = 2;
  l.local_world_size = 2;
  GroupOptions o;
  o.backend = "nccl";
  auto g = ProcessGroup::Join(l, o);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kUnsupported);
  const std::string m = g.status().message();
  if (!at::detail::getCUDAHooks().hasCUDART()) {
    EXPECT_NE(m.find("this LibTorch is a CPU build"), std::string::npos) << m;
    EXPECT_NE(m.find("no NCCL"), std::string::npos) << m;
  } else if (!kHaveNccl) {
    EXPECT_NE(m.find("this LibTorch was built without NCCL"), std::string::npos) << m;
  } else if (devices == 0) {
    EXPECT_NE(m.find("this host has no CUDA device"), std::string::npos) << m;
  } else {
    EXPECT_NE(m.find("2 ranks on this host but 1 CUDA device(s)"), std::string::npos) << m;
    EXPECT_NE(m.find("refuses two ranks on one GPU"), std::string::npos) << m;
  }
  EXPECT_NE(m.find("use \"gloo\""), std::string::npos) << m;
}

// A fresh directory (mkdtemp), removed with what is in it.
class TempDir {
 public:
  TempDir() {
    std::string t = (std::filesystem::temp_directory_path() / "ferry_dist_test_XXXXXX").string();
    if (::mkdtemp(t.data()) != nullptr) path_ = t;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Two ranks in threads; `body(rank, group)` runs on each. They meet through a TCPStore on a
// free loopback port that rank 0 hosts, or as `adjust` changes their Launch. On NCCL rank r is
// local rank r (device r).
template <typename Fn>
void RunTwoRanks(Fn body, std::chrono::milliseconds timeout = std::chrono::seconds(20),
                 const std::string& backend = "gloo", const std::function<void(Launch&)>& adjust = nullptr) {
  auto free_port = FreeLoopbackPort();
  ASSERT_TRUE(free_port.ok()) << free_port.status().ToString();
  const int port = *free_port;
  auto rank = [&](int r) {
    Launch l;
    l.rank = r;
    l.world_size = 2;
    l.local_rank = r;
    l.local_world_size = 2;
    l.master_addr = "127.0.0.1";
    l.master_port = port;
    if (adjust) adjust(l);
    GroupOptions o;
    o.backend = backend;
    o.timeout = timeout;
    o.prefix = "test";
    auto g = ProcessGroup::Join(l, o);
    EXPECT_TRUE(g.ok()) << g.status().ToString();
    if (g.ok()) body(r, **g);
  };
  std::thread t1(rank, 1);
  rank(0);
  t1.join();
}

// Every collective on rank r of a two-rank group, with its tensors on `device` (on NCCL, host
// tensors travel through the rank's device and come back where they were).
void CheckCollectives(int r, ProcessGroup& g, const at::Device& device) {
  EXPECT_EQ(g.rank(), r);
  EXPECT_EQ(g.size(), 2);
  ASSERT_EQ(g.ranks().size(), 2u);
  EXPECT_EQ(g.ranks()[1].pid, ::getpid());  // both threads of this process

  at::Tensor t = at::full({3}, static_cast<float>(r + 1), at::TensorOptions(device));
  ASSERT_TRUE(g.AllReduceSum(t, "sum").ok());
  EXPECT_EQ(t.device(), device);
  EXPECT_TRUE(t.cpu().equal(at::full({3}, 3.0f))) << t;

  auto all =
      g.AllGather(at::full({2}, static_cast<int64_t>(10 * r), at::TensorOptions(device).dtype(at::kLong)), "gather");
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_EQ(all->device(), device);
  EXPECT_EQ(all->sizes(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ((*all)[1][0].item<int64_t>(), 10);

  at::Tensor b = at::full({4}, static_cast<double>(r == 1 ? 7 : 0), at::TensorOptions(device).dtype(at::kDouble));
  ASSERT_TRUE(g.Broadcast(b, 1, "broadcast").ok());
  EXPECT_EQ(b.device(), device);
  EXPECT_TRUE(b.cpu().equal(at::full({4}, 7.0, at::kDouble)));

  auto bytes = g.AllGatherBytes(std::string(static_cast<size_t>(r * 5 + 1), static_cast<char>('a' + r)), "bytes");
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ((*bytes)[0], "a");
  EXPECT_EQ((*bytes)[1], "bbbbbb");
  auto text = g.BroadcastBytes(r == 0 ? "from rank 0" : "", 0, "text");
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "from rank 0");
}

// A rendezvous file nobody can create: the rank gives up after the timeout, naming the file.
TEST(ProcessGroupTest, ARendezvousFileThatCannotBeOpenedIsNamed) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  Launch l;
  l.world_size = 2;
  l.local_world_size = 2;
  l.rendezvous_file = dir.path() + "/missing/store";
  GroupOptions o;
  o.timeout = std::chrono::seconds(1);
  auto g = ProcessGroup::Join(l, o);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(
      g.status().message().find("rank 0 of 2: the rendezvous at the file " + l.rendezvous_file + " did not complete ("),
      std::string::npos)
      << g.status().message();
}

// The heartbeats of ranks that meet through a file count in files of their own, overwritten in
// place: the rendezvous file does not grow while the ranks run (c10d's FileStore appends every
// write), and the directory holds the store and one heartbeat file per rank.
TEST(ProcessGroupTest, HeartbeatsDoNotGrowTheRendezvousFile) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string file = dir.path() + "/store";
  RunTwoRanks(
      [&](int r, ProcessGroup& g) {
        at::Tensor t = at::ones({2});
        ASSERT_TRUE(g.AllReduceSum(t, "first").ok());
        if (r == 0) {
          auto beats = [&] {  // rank 1's count
            int64_t n = -1;
            std::ifstream in(file + ".hb1", std::ios::binary);
            in.read(reinterpret_cast<char*>(&n), sizeof(n));
            return n;
          };
          const auto size = std::filesystem::file_size(file);
          const int64_t before = beats();
          std::this_thread::sleep_for(ProcessGroup::kHeartbeatInterval * 6);
          EXPECT_GE(beats(), before + 3);
          EXPECT_EQ(std::filesystem::file_size(file + ".hb1"), sizeof(int64_t));
          EXPECT_EQ(std::filesystem::file_size(file), size);
        }
        ASSERT_TRUE(g.AllReduceSum(t, "last").ok());
      },
      std::chrono::seconds(20), "gloo", [&](Launch& l) { l.rendezvous_file = file; });
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"store", "store.hb0", "store.hb1"}));
}

// Under torchrun, its agent hosts the store: no rank hosts one, and the ranks' keys are under
// "/worker/attempt_<restart count>".
TEST(ProcessGroupTest, RanksMeetInTheStoreTorchrunsAgentHosts) {
  auto port = FreeLoopbackPort();
  ASSERT_TRUE(port.ok()) << port.status().ToString();
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(*port);
  so.isServer = true;
  so.waitWorkers = false;
  so.timeout = std::chrono::seconds(20);
  auto agent = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  RunTwoRanks([](int r, ProcessGroup& g) { CheckCollectives(r, g, at::kCPU); }, std::chrono::seconds(20), "gloo",
              [&](Launch& l) {
                l.master_port = *port;
                l.agent_store = true;
                l.restart_count = 3;
              });
  EXPECT_TRUE(agent->check({"/worker/attempt_3/test/ferry/hb/0", "/worker/attempt_3/test/ferry/hb/1"}));
  EXPECT_FALSE(agent->check({"test/ferry/hb/0"}));
}

// How the ranks of a test meet: through a TCPStore, or through a rendezvous file in a fresh
// private directory.
enum class Meet { kTcpStore, kFile };

class ProcessGroupMeetTest : public ::testing::TestWithParam<Meet> {
 protected:
  void SetUp() override { ASSERT_FALSE(dir_.path().empty()); }
  // How the ranks meet: the rendezvous file, or (nothing to change) a TCPStore.
  std::function<void(Launch&)> Meeting() const {
    if (GetParam() == Meet::kTcpStore) return nullptr;
    return [file = dir_.path() + "/store"](Launch& l) { l.rendezvous_file = file; };
  }
  TempDir dir_;
};

INSTANTIATE_TEST_SUITE_P(Stores, ProcessGroupMeetTest, ::testing::Values(Meet::kTcpStore, Meet::kFile),
                         [](const auto& info) { return info.param == Meet::kFile ? "File" : "TcpStore"; });

TEST_P(ProcessGroupMeetTest, CollectivesOverTwoRanks) {
  RunTwoRanks(
      [](int r, ProcessGroup& g) {
        CheckCollectives(r, g, at::kCPU);

        if (r == 0) {
          // Longer than one Await poll: 1 s on a TCPStore, 2 s on a FileStore (whose wait counts
          // whole seconds).
          std::this_thread::sleep_for(std::chrono::milliseconds(2500));
          ASSERT_TRUE(g.Post("go/0", "1").ok());
        } else {
          auto go = g.Await("go/0", 0, "waiting");
          ASSERT_TRUE(go.ok()) << go.status().ToString();
          EXPECT_EQ(*go, "1");
        }
      },
      std::chrono::seconds(20), "gloo", Meeting());
}

// A one-rank NCCL group (what one GPU allows): every collective runs through NCCL on the
// device, host tensors included, and gives them back where they were.
TEST(ProcessGroupTest, NcclGroupOfOneRunsTheCollectivesOnTheCudaDevice) {
  if (!kHaveNccl || CudaDevices() < 1) GTEST_SKIP() << "needs a LibTorch with NCCL and a CUDA device";
  auto port = FreeLoopbackPort();
  ASSERT_TRUE(port.ok()) << port.status().ToString();
  Launch l;
  l.master_port = *port;
  GroupOptions o;
  o.backend = "nccl";
  o.timeout = std::chrono::seconds(60);
  auto g = ProcessGroup::Join(l, o);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  EXPECT_EQ((*g)->backend(), "nccl");
  for (const at::Device device : {at::Device(at::kCUDA, 0), at::Device(at::kCPU)}) {
    at::Tensor t = at::arange(5, at::TensorOptions(device).dtype(at::kFloat));
    ASSERT_TRUE((*g)->AllReduceSum(t, "sum").ok());
    EXPECT_EQ(t.device(), device);
    EXPECT_TRUE(t.cpu().equal(at::arange(5, at::kFloat))) << t;
    auto all = (*g)->AllGather(at::full({3}, 4.0, at::TensorOptions(device).dtype(at::kDouble)), "gather");
    ASSERT_TRUE(all.ok()) << all.status().ToString();
    EXPECT_EQ(all->device(), device);
    EXPECT_EQ(all->sizes(), (std::vector<int64_t>{1, 3}));
    EXPECT_TRUE(all->cpu().equal(at::full({1, 3}, 4.0, at::kDouble)));
  }
  auto bytes = (*g)->AllGatherBytes("one rank", "bytes");
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  EXPECT_EQ(*bytes, std::vector<std::string>{"one rank"});
  auto text = (*g)->BroadcastBytes("from rank 0", 0, "text");
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_EQ(*text, "from rank 0");
}

// Two ranks on two devices, where the host has them.
TEST(ProcessGroupTest, NcclCollectivesOverTwoRanksOnTwoCudaDevices) {
  if (!kHaveNccl || CudaDevices() < 2) GTEST_SKIP() << "needs a LibTorch with NCCL and 2 CUDA devices";
  RunTwoRanks([](int r, ProcessGroup& g) { CheckCollectives(r, g, at::Device(at::kCUDA, r)); },
              std::chrono::seconds(60), "nccl");
  RunTwoRanks([](int r, ProcessGroup& g) { CheckCollectives(r, g, at::kCPU); }, std::chrono::seconds(60), "nccl");
}

TEST(ProcessGroupTest, NcclRankThatStopsAnsweringIsNamed) {
  if (!kHaveNccl || CudaDevices() < 2) GTEST_SKIP() << "needs a LibTorch with NCCL and 2 CUDA devices";
  std::promise<Status> seen;
  RunTwoRanks(
      [&](int r, ProcessGroup& g) {
        at::Tensor t = at::ones({8}, at::TensorOptions(at::Device(at::kCUDA, r)));
        if (r == 1) {
          EXPECT_TRUE(g.AllReduceSum(t, "warm-up").ok());  // the communicator exists on both ranks
          return;                                          // gone without a word
        }
        EXPECT_TRUE(g.AllReduceSum(t, "warm-up").ok());
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        seen.set_value(g.AllReduceSum(t, "step 2: averaging the LoRA gradients"));
      },
      std::chrono::seconds(10), "nccl");
  const Status s = seen.get_future().get();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("step 2: averaging the LoRA gradients: rank 1 (host "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("stopped answering"), std::string::npos) << s.message();
}

TEST_P(ProcessGroupMeetTest, AFailedRankIsNamedWithItsError) {
  std::promise<Status> seen;
  RunTwoRanks(
      [&](int r, ProcessGroup& g) {
        if (r == 1) {
          g.ReportFailure("step 4: reward command 'score.sh' exited with code 3");
          return;  // the group is destroyed: its connections close
        }
        at::Tensor t = at::ones({8});
        seen.set_value(g.AllReduceSum(t, "step 4: averaging the LoRA gradients"));
      },
      std::chrono::seconds(20), "gloo", Meeting());
  const Status s = seen.get_future().get();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("step 4: averaging the LoRA gradients: rank 1 (host "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("failed: step 4: reward command 'score.sh' exited with code 3"), std::string::npos)
      << s.message();
}

// A rank waiting for a word from a rank that failed cleanly (it posted its error, as rank 0
// does when its control socket cannot be served) names that error, not a silence.
TEST(ProcessGroupTest, AnAwaitedRankThatFailedIsNamedWithItsError) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  std::promise<Result<std::string>> seen;
  RunTwoRanks(
      [&](int r, ProcessGroup& g) {
        if (r == 0) {
          g.ReportFailure("starting: control socket: Address already in use");
          std::this_thread::sleep_for(std::chrono::seconds(3));  // alive, beating, but never posting
          return;
        }
        seen.set_value(g.Await("go/0", 0, "before step 1"));
      },
      std::chrono::seconds(20), "gloo", [&](Launch& l) { l.rendezvous_file = dir.path() + "/store"; });
  const Result<std::string> s = seen.get_future().get();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable);
  const std::string m = s.status().message();
  EXPECT_EQ(m.rfind("before step 1: rank 0 (host ", 0), 0u) << m;
  EXPECT_NE(m.find("failed: starting: control socket: Address already in use"), std::string::npos) << m;
}

// A length a peer sends for its bytes is checked before anything is allocated or copied: a
// negative one (or one past 64 MiB) is a corruption naming the rank, not a string built from
// memory past the buffer.
TEST(ProcessGroupTest, APeersHostileByteLengthIsRefused) {
  std::promise<Result<std::string>> seen;
  RunTwoRanks([&](int r, ProcessGroup& g) {
    if (r == 0) {  // BroadcastBytes' first message, with a length no rank sends
      at::Tensor len = at::full({1}, int64_t{-5}, at::kLong);
      EXPECT_TRUE(g.Broadcast(len, 0, "the start state").ok());
      return;
    }
    seen.set_value(g.BroadcastBytes("", 0, "the start state"));
  });
  const Result<std::string> got = seen.get_future().get();
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kCorruption);
  EXPECT_NE(got.status().message().find("the start state: rank 0 (host "), std::string::npos) << got.status().message();
  EXPECT_NE(got.status().message().find("sent a length of -5 bytes (limit 67108864)"), std::string::npos)
      << got.status().message();
}

// A rank waiting for a word (Await) from a rank that leaves without posting it: named by its
// stopped heartbeat, not a wait without end. (Ranks meeting at a rendezvous file: when the rank
// that hosts LibTorch 1.13's TCPStore leaves, the store's own client thread in the others may
// end their process with "Connection reset by peer", an exception nothing can catch.)
TEST(ProcessGroupTest, AnAwaitedRankThatLeavesIsNamed) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  std::promise<Result<std::string>> seen;
  RunTwoRanks(
      [&](int r, ProcessGroup& g) {
        if (r == 0) return;  // gone without a word
        seen.set_value(g.Await("go/0", 0, "before step 1"));
      },
      std::chrono::seconds(20), "gloo", [&](Launch& l) { l.rendezvous_file = dir.path() + "/store"; });
  const Result<std::string> s = seen.get_future().get();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable);
  const std::string m = s.status().message();
  EXPECT_EQ(m.rfind("before step 1: rank 0 (host ", 0), 0u) << m;
  EXPECT_NE(m.find("stopped answering"), std::string::npos) << m;
}

TEST_P(ProcessGroupMeetTest, ARankThatStopsAnsweringIsNamed) {
  std::promise<Status> seen;
  RunTwoRanks(
      [&](int r, ProcessGroup& g) {
        if (r == 1) return;  // gone without a word (as a killed process)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        at::Tensor t = at::ones({8});
        seen.set_value(g.AllReduceSum(t, "step 2: gathering the rewards"));
      },
      std::chrono::seconds(5), "gloo", Meeting());
  const Status s = seen.get_future().get();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("step 2: gathering the rewards: rank 1 (host "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("stopped answering"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace ferry::dist
