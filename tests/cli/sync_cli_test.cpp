// End-to-end tests of `ferry keys generate` and `ferry sync publish|receive|status`,
// including `publish --watch` over the committed PEFT fixture, a following receiver started
// before the publisher or before the first checkpoint (it holds the base first, in merged and
// adapter mode), the hint to give --base DIR to a receiver of adapters without one, a local
// write failure ending `receive`, `status` reporting a receiver the publisher declared lost, and
// a receiver key missing from the publisher's allow-list named on both sides (tcp:// with CURVE).
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/checkpoint.h"
#include "core/safetensors.h"
#include "store/store.h"
#include "tests/cli/cli_runner.h"

extern char** environ;

namespace ferry {
namespace {

namespace fs = std::filesystem;
using ferry::testing::RunFerry;

const fs::path kCase = fs::path(FERRY_FIXTURES_DIR) / "cases" / "llama_lora_all_linear_f32";

std::string Slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class SyncCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ferry-synccli-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
  }
  void TearDown() override {
    for (pid_t* p : {&pid_, &recv_pid_}) {
      if (*p > 0) {
        ::kill(*p, SIGKILL);
        ::waitpid(*p, nullptr, 0);
      }
    }
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  // A store with one tiny version; returns its id.
  store::Digest MakeStore() {
    const fs::path m = root_ / "m";
    fs::create_directories(m);
    auto w = SafetensorsWriter::CreateFile(m / "model.safetensors", {{"w", DType::kF32, {3}}});
    EXPECT_TRUE(w.ok());
    const float v[3] = {1.5f, -2.0f, 0.25f};
    EXPECT_TRUE((*w)->Append(std::as_bytes(std::span(v))).ok());
    EXPECT_TRUE((*w)->Finish().ok());
    auto s = store::Store::Open(root_ / "db", {.create_if_missing = true});
    EXPECT_TRUE(s.ok());
    auto r = (*s)->Import(m, {});
    EXPECT_TRUE(r.ok());
    return r->record.id;
  }

  // Starts `program ARGS` in the background, stdout and stderr going to NAME.out / NAME.err
  // under the test directory; returns its pid (-1 after a test failure).
  pid_t Spawn(const std::string& program, const std::vector<std::string>& args, const std::string& name) {
    std::vector<std::string> all = {program};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string out = (root_ / (name + ".out")).string(), err = (root_ / (name + ".err")).string();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    pid_t pid = -1;
    const int rc = ::posix_spawn(&pid, program.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) {
      ADD_FAILURE() << "posix_spawn " << program << ": " << std::strerror(rc);
      return -1;
    }
    return pid;
  }

  // Starts `ferry ARGS` in the background, stdout and stderr going to pub.out / pub.err.
  void SpawnPublisher(const std::vector<std::string>& args) {
    pid_ = Spawn(FERRY_CLI_PATH, args, "pub");
    ASSERT_GT(pid_, 0);
  }

  // Starts `ferry sync receive ARGS` in the background (recv.out / recv.err). With
  // `file_blocks` > 0 it runs under `ulimit -f file_blocks` (1 KiB blocks) with SIGXFSZ
  // ignored, so writing past that size fails with EFBIG.
  void SpawnReceiver(const std::vector<std::string>& args, int file_blocks = 0) {
    std::vector<std::string> all = {"sync", "receive"};
    all.insert(all.end(), args.begin(), args.end());
    if (file_blocks <= 0) {
      recv_pid_ = Spawn(FERRY_CLI_PATH, all, "recv");
    } else {
      std::vector<std::string> sh = {
          "-c", "trap '' XFSZ; ulimit -f " + std::to_string(file_blocks) + "; exec \"$0\" \"$@\"", FERRY_CLI_PATH};
      sh.insert(sh.end(), all.begin(), all.end());
      recv_pid_ = Spawn("/bin/bash", sh, "recv");
    }
    ASSERT_GT(recv_pid_, 0);
  }

  // Polls the receiver's `file` ("recv.out" / "recv.err") until it holds `needle`, the
  // receiver exits, or 60 s pass; returns the file's contents.
  std::string WaitForReceiver(const std::string& file, const std::string& needle) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    std::string text;
    while (recv_pid_ > 0 && std::chrono::steady_clock::now() < deadline) {
      text = Slurp(root_ / file);
      if (text.find(needle) != std::string::npos) return text;
      int status = 0;
      if (::waitpid(recv_pid_, &status, WNOHANG) == recv_pid_) {
        recv_pid_ = -1;
        ADD_FAILURE() << "receiver exited (status " << status << ") before '" << needle << "' in " << file
                      << "; stderr: " << Slurp(root_ / "recv.err");
        return text;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << "no '" << needle << "' in " << file << " within 60 s; stderr: " << Slurp(root_ / "recv.err");
    return text;
  }

  // Waits up to `limit` for the receiver to exit; its exit code, -1 when killed by a signal,
  // or nullopt (and the receiver is killed) when it was still running.
  std::optional<int> WaitForReceiverExit(std::chrono::seconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(recv_pid_, &status, WNOHANG) == recv_pid_) {
        recv_pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(recv_pid_, SIGKILL);
    ::waitpid(recv_pid_, nullptr, 0);
    recv_pid_ = -1;
    return std::nullopt;
  }

  // Stops the receiver with SIGTERM and returns its exit code.
  int StopReceiver() {
    ::kill(recv_pid_, SIGTERM);
    int status = 0;
    ::waitpid(recv_pid_, &status, 0);
    recv_pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  // Puts a checkpoint into the watched directory `watched` as NAME atomically: a full model
  // (the fixture base's config.json and one F32 tensor of `floats` elements, scaled by
  // `scale`) or, when `floats` is 0, the fixture's PEFT adapter.
  void DropCheckpoint(const fs::path& watched, const std::string& name, int floats, float scale = 1.0f) {
    const fs::path staging = root_ / ("staging-" + name);
    if (floats == 0) {
      fs::copy(kCase / "adapter", staging, fs::copy_options::recursive);
    } else {
      fs::create_directories(staging);
      fs::copy_file(kCase / "base" / "config.json", staging / "config.json");
      auto w = SafetensorsWriter::CreateFile(staging / "model.safetensors", {{"w", DType::kF32, {floats}}});
      ASSERT_TRUE(w.ok()) << w.status().message();
      std::vector<float> v(static_cast<size_t>(floats));
      for (int i = 0; i < floats; ++i) v[static_cast<size_t>(i)] = scale * static_cast<float>(i);
      ASSERT_TRUE((*w)->Append(std::as_bytes(std::span(v))).ok());
      ASSERT_TRUE((*w)->Finish().ok());
    }
    fs::rename(staging, watched / name);
  }

  // The "version" of the JSON line of `out` that names checkpoint `name` (publish --json).
  static std::string PublishedVersion(const std::string& out, const std::string& name) {
    std::istringstream lines(out);
    for (std::string line; std::getline(lines, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.contains("dir") && j["dir"].get<std::string>().ends_with("/" + name)) {
        return j["published"].get<std::string>();
      }
    }
    ADD_FAILURE() << "no published line for " << name << " in " << out;
    return "";
  }

  // Polls the publisher's `file` ("pub.out" / "pub.err") until it holds `needle`, the
  // publisher exits, or 60 s pass; returns the file's contents.
  std::string WaitForOutput(const std::string& file, const std::string& needle) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    std::string text;
    while (pid_ > 0 && std::chrono::steady_clock::now() < deadline) {
      text = Slurp(root_ / file);
      if (text.find(needle) != std::string::npos) return text;
      if (pid_ > 0 && ::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        ADD_FAILURE() << "publisher exited; stderr: " << Slurp(root_ / "pub.err");
        return text;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << "no '" << needle << "' in " << file << " within 60 s; stderr: " << Slurp(root_ / "pub.err");
    return text;
  }

  // Stops the publisher with SIGTERM and returns its exit code.
  int StopPublisher() {
    ::kill(pid_, SIGTERM);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  fs::path root_;
  pid_t pid_ = -1;       // the publisher
  pid_t recv_pid_ = -1;  // a receiver started with SpawnReceiver
};

TEST_F(SyncCliTest, KeysGenerateWritesPrivateSecretAndPrintsPublicKey) {
  auto r = RunFerry({"keys", "generate", "--out", (root_ / "k").string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  struct stat st {};
  ASSERT_EQ(::stat((root_ / "k.key").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  std::ifstream pub(root_ / "k.pub");
  std::string key;
  pub >> key;
  EXPECT_EQ(key.size(), 40u);
  EXPECT_EQ(r.out, key + "\n");
  auto again = RunFerry({"keys", "generate", "--out", (root_ / "k").string()});
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_NE(again.err.find("k.key"), std::string::npos) << again.err;
}

TEST_F(SyncCliTest, TcpWithoutKeysIsRefused) {
  MakeStore();
  auto r = RunFerry({"sync", "publish", "--db", (root_ / "db").string(), "--bind", "tcp://127.0.0.1:5555"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--bind tcp://127.0.0.1:5555"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("tcp:// needs CURVE keys"), std::string::npos) << r.err;
  // The library names no flag; the CLI adds the ones that give each side its keys.
  EXPECT_NE(r.err.find("; give --key and --allow"), std::string::npos) << r.err;
  auto rc = RunFerry({"sync", "receive", "--once", "--connect", "tcp://127.0.0.1:5555", "--out",
                      (root_ / "gen").string(), "--id", "gen-1"});
  EXPECT_EQ(rc.exit_code, 1);
  EXPECT_NE(rc.err.find("--connect tcp://127.0.0.1:5555"), std::string::npos) << rc.err;
  EXPECT_NE(rc.err.find("tcp:// needs CURVE keys"), std::string::npos) << rc.err;
  EXPECT_NE(rc.err.find("; give --key and --server-key"), std::string::npos) << rc.err;
  EXPECT_FALSE(fs::exists(root_ / "gen"));
}

// Key flags are checked in pairs, and a key file that cannot be used is named
// (sync::LoadServerCurve / LoadClientCurve).
TEST_F(SyncCliTest, KeyFlagsComeInPairsAndABadKeyFileIsNamed) {
  MakeStore();
  ASSERT_EQ(RunFerry({"keys", "generate", "--out", (root_ / "k").string()}).exit_code, 0);
  const std::string db = (root_ / "db").string(), key = (root_ / "k").string();
  const std::string pub_ep = "ipc://" + (root_ / "pub").string();
  auto publish = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {"sync", "publish", "--db", db, "--bind", pub_ep};
    args.insert(args.end(), extra.begin(), extra.end());
    return RunFerry(args);
  };
  auto receive = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {
        "sync", "receive", "--once", "--connect", pub_ep, "--out", (root_ / "gen").string(), "--id", "gen-1"};
    args.insert(args.end(), extra.begin(), extra.end());
    return RunFerry(args);
  };
  auto r = publish({"--key", key});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--key needs --allow FILE"), std::string::npos) << r.err;
  r = publish({"--allow", (root_ / "k.pub").string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--allow needs --key"), std::string::npos) << r.err;
  r = receive({"--key", key});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--key needs --server-key FILE"), std::string::npos) << r.err;

  std::ofstream(root_ / "allow") << "# receivers\nnot-a-key\n";
  r = publish({"--key", key, "--allow", (root_ / "allow").string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find((root_ / "allow").string() + ":2: not a 40-character Z85 public key"), std::string::npos)
      << r.err;
  r = receive({"--key", key, "--server-key", (root_ / "absent.pub").string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find((root_ / "absent.pub").string()), std::string::npos) << r.err;
  fs::permissions(root_ / "k.key", fs::perms::group_read, fs::perm_options::add);
  r = receive({"--key", key, "--server-key", (root_ / "k.pub").string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find((root_ / "k.key").string() + ": secret key file is readable by group or others"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(root_ / "gen"));
}

// Whether 127.0.0.1:`port` can be bound now (TCP).
bool PortFree(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// A port P of 127.0.0.1 with P and P + 1 free (a tcp:// publisher binds both); 0 if none found.
uint16_t FreePortPair() {
  for (int tries = 0; tries < 100; ++tries) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    uint16_t port = 0;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      port = ntohs(a.sin_port);
    }
    ::close(fd);
    if (port != 0 && port < 65534 && PortFree(port) && PortFree(static_cast<uint16_t>(port + 1))) return port;
  }
  return 0;
}

// A receiver whose key the publisher's allow-list lacks only sees silence: its error names
// its key and key file; the publisher prints the refused key, once however often it retries.
TEST_F(SyncCliTest, ARefusedReceiverKeyIsNamedByReceiverAndPublisher) {
  MakeStore();
  for (const char* name : {"server", "trusted", "stranger"}) {
    auto k = RunFerry({"keys", "generate", "--out", (root_ / name).string()});
    ASSERT_EQ(k.exit_code, 0) << k.err;
  }
  fs::copy_file(root_ / "trusted.pub", root_ / "allow");
  std::string stranger;
  std::ifstream(root_ / "stranger.pub") >> stranger;
  ASSERT_EQ(stranger.size(), 40u);
  const uint16_t port = FreePortPair();
  ASSERT_NE(port, 0);
  const std::string ep = "tcp://127.0.0.1:" + std::to_string(port);
  SpawnPublisher({"sync", "publish", "--db", (root_ / "db").string(), "--bind", ep, "--key",
                  (root_ / "server").string(), "--allow", (root_ / "allow").string()});
  WaitForOutput("pub.err", "serving ");
  ASSERT_FALSE(HasFailure());
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto r = RunFerry({"sync", "receive", "--once", "--connect", ep, "--key", (root_ / "stranger").string(),
                       "--server-key", (root_ / "server.pub").string(), "--out", (root_ / "gen").string(), "--id",
                       "gen-x", "--timeout-ms", "500"});
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_NE(r.err.find("ferry: error: sync receiver gen-x: no reply from " + ep +
                         " within 500 ms; nothing has come "
                         "from the publisher yet: it is not running, or it does not allow this receiver's CURVE public "
                         "key " +
                         stranger + " (not in its allow-list); this receiver's public key is " +
                         (root_ / "stranger").string() + ".pub: the publisher's --allow file must list it"),
              std::string::npos)
        << r.err;
  }
  const std::string refused = "ferry: warning: refused a receiver with CURVE public key " + stranger +
                              ": not in --allow " + (root_ / "allow").string() + "\n";
  const std::string err = WaitForOutput("pub.err", refused);
  EXPECT_EQ(err.find(refused, err.find(refused) + 1), std::string::npos) << "reported more than once:\n" << err;
  // The listed key is served, and not reported.
  auto ok = RunFerry({"sync", "receive", "--once", "--connect", ep, "--key", (root_ / "trusted").string(),
                      "--server-key", (root_ / "server.pub").string(), "--out", (root_ / "gen").string(), "--id",
                      "gen-t", "--timeout-ms", "20000"});
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_EQ(StopPublisher(), 0);
  const std::string final_err = Slurp(root_ / "pub.err");
  EXPECT_EQ(final_err.find("refused a receiver", final_err.find(refused) + refused.size()), std::string::npos)
      << final_err;
}

TEST_F(SyncCliTest, BadEndpointsAreRefusedNamingThem) {
  MakeStore();
  auto r = RunFerry({"sync", "publish", "--db", (root_ / "db").string(), "--bind", "udp://127.0.0.1:5555"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--bind udp://127.0.0.1:5555: unsupported endpoint"), std::string::npos) << r.err;
  r = RunFerry({"sync", "publish", "--db", (root_ / "db").string(), "--bind", "tcp://127.0.0.1:http"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--bind tcp://127.0.0.1:http: PORT must be"), std::string::npos) << r.err;
  r = RunFerry({"sync", "receive", "--connect", "ipc://", "--out", (root_ / "gen").string(), "--id", "g"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--connect ipc://: ipc:// needs a directory"), std::string::npos) << r.err;
}

TEST_F(SyncCliTest, BogusModeIsRefusedNamingTheValue) {
  MakeStore();
  auto r = RunFerry({"sync", "publish", "--db", (root_ / "db").string(), "--bind", "ipc://" + (root_ / "sock").string(),
                     "--mode", "bogus"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--mode"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("bogus"), std::string::npos) << r.err;
}

TEST_F(SyncCliTest, WatchWithoutBaseIsRefusedNamingTheFlag) {
  MakeStore();
  fs::create_directories(root_ / "w");
  auto r = RunFerry({"sync", "publish", "--db", (root_ / "db").string(), "--bind", "ipc://" + (root_ / "sock").string(),
                     "--watch", (root_ / "w").string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--watch needs --base"), std::string::npos) << r.err;
  r = RunFerry({"sync", "publish", "--db", (root_ / "db").string(), "--bind", "ipc://" + (root_ / "sock").string(),
                "--watch", (root_ / "w").string(), "--base", (root_ / "missing").string()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find((root_ / "missing").string()), std::string::npos) << r.err;
}

// A receiver asked to drive vLLM in adapter mode by a publisher that serves merged versions is
// refused at its first version, saying what to use (each version was served as the base,
// never proven, an anomaly every 30 s for good).
TEST_F(SyncCliTest, EngineAdapterModeAgainstAMergedPublisherIsRefused) {
  MakeStore();
  const std::string ep = "ipc://" + (root_ / "sock").string();
  SpawnPublisher({"sync", "publish", "--db", (root_ / "db").string(), "--bind", ep});
  WaitForOutput("pub.err", "publishing run default");
  auto r = RunFerry({"sync", "receive", "--once", "--out", (root_ / "gen").string(), "--id", "gen-1", "--connect", ep,
                     "--timeout-ms", "20000", "--engine", "vllm", "--engine-url", "http://127.0.0.1:9", "--engine-mode",
                     "adapter"});
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("--engine-mode adapter: the publisher serves merged versions"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("use --engine-mode merged (or auto)"), std::string::npos) << r.err;
  EXPECT_EQ(StopPublisher(), 0);
}

TEST_F(SyncCliTest, PublishReceiveStatusEndToEnd) {
  const store::Digest v = MakeStore();
  const std::string ep = "ipc://" + (root_ / "sock").string();
  SpawnPublisher({"sync", "publish", "--db", (root_ / "db").string(), "--bind", ep});
  WaitForOutput("pub.err", "publishing run default");
  // The receiver's HELLO waits in its queue until the publisher is up (bounded by --timeout-ms).
  auto r = RunFerry({"sync", "receive", "--once", "--json", "--out", (root_ / "gen").string(), "--id", "gen-1",
                     "--connect", ep, "--timeout-ms", "20000"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\"version\":\"" + v.Hex() + "\""), std::string::npos) << r.out;
  EXPECT_EQ(fs::read_symlink(root_ / "gen" / "current"), fs::path("versions") / v.Hex());
  auto hashed = store::HashPath(root_ / "gen" / "current");
  ASSERT_TRUE(hashed.ok());
  EXPECT_EQ(hashed->id, v);
  EXPECT_EQ(StopPublisher(), 0);

  auto s = RunFerry({"sync", "status", "--db", (root_ / "db").string(), "--json"});
  ASSERT_EQ(s.exit_code, 0) << s.err;
  EXPECT_NE(s.out.find("\"receiver\": \"gen-1\""), std::string::npos) << s.out;
  EXPECT_NE(s.out.find("\"verified\": true"), std::string::npos) << s.out;
  EXPECT_NE(s.out.find("\"lag\": 0"), std::string::npos) << s.out;
  EXPECT_NE(s.out.find("\"lost\": false"), std::string::npos) << s.out;
  EXPECT_EQ(s.out.find("\"last_seen\": null"), std::string::npos) << s.out;
}

// A trainer drops a broken checkpoint, then a PEFT adapter checkpoint, into the watched
// directory: the broken one is reported and skipped, the adapter is merged onto the base and
// published, and a receiver activates exactly the merged version the publisher printed.
TEST_F(SyncCliTest, WatchPublishesEachNewAdapterCheckpointMerged) {
  const fs::path watched = root_ / "trainer";
  fs::create_directories(watched);
  const std::string ep = "ipc://" + (root_ / "sock").string();
  SpawnPublisher({"sync", "publish", "--db", (root_ / "db").string(), "--bind", ep, "--run", "rl", "--watch",
                  watched.string(), "--base", (kCase / "base").string(), "--poll-ms", "100", "--json"});
  WaitForOutput("pub.err", "publishing run rl");
  ASSERT_FALSE(HasFailure());
  EXPECT_TRUE(fs::is_directory(root_ / "db" / "rocksdb"));  // --watch creates the store

  // Broken: complete config, truncated weights (prepared outside, then renamed in).
  const fs::path broken = root_ / "staging-broken";
  fs::create_directories(broken);
  fs::copy_file(kCase / "adapter" / "adapter_config.json", broken / "adapter_config.json");
  const std::string weights = Slurp(kCase / "adapter" / "adapter_model.safetensors");
  std::ofstream(broken / "adapter_model.safetensors", std::ios::binary) << weights.substr(0, weights.size() / 2);
  fs::rename(broken, watched / "checkpoint-5");
  const std::string err = WaitForOutput("pub.err", "checkpoint-5");
  ASSERT_FALSE(HasFailure());
  EXPECT_NE(err.find((watched / "checkpoint-5").string()), std::string::npos) << err;
  EXPECT_NE(err.find("adapter_model.safetensors"), std::string::npos) << err;

  fs::copy(kCase / "adapter", watched / "checkpoint-10", fs::copy_options::recursive);
  const std::string out = WaitForOutput("pub.out", "checkpoint-10");
  ASSERT_FALSE(HasFailure());
  ASSERT_NE(out.find('\n'), std::string::npos) << out;
  const auto line = nlohmann::json::parse(out.substr(0, out.find('\n')), nullptr, false);
  ASSERT_TRUE(line.is_object()) << out;
  EXPECT_EQ(line["step"], 10);
  const std::string merged = line["version"].get<std::string>();
  EXPECT_EQ(line["published"], merged);  // --mode merged publishes the merged version
  auto adapter_hash = store::HashPath(kCase / "adapter");
  ASSERT_TRUE(adapter_hash.ok());
  EXPECT_EQ(line["adapter"], adapter_hash->id.Hex());

  auto r = RunFerry({"sync", "receive", "--once", "--json", "--connect", ep, "--out", (root_ / "gen").string(), "--id",
                     "gen-1", "--timeout-ms", "20000"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto hashed = store::HashPath(root_ / "gen" / "current");
  ASSERT_TRUE(hashed.ok()) << hashed.status().ToString();
  EXPECT_EQ(hashed->id.Hex(), merged);
  EXPECT_TRUE(fs::exists(root_ / "gen" / "current" / "config.json"));
  EXPECT_TRUE(fs::exists(root_ / "gen" / "current" / "tokenizer.json"));

  // A second, different adapter (lowest mantissa byte of its last float changed): recorded
  // and published as sequence 2; gen-1 is then one servable version behind (the adapter
  // version recorded along the way does not count).
  std::string weights2 = weights;
  weights2[weights2.size() - 4] = static_cast<char>(weights2[weights2.size() - 4] ^ 1);
  const fs::path second = root_ / "staging-second";
  fs::copy(kCase / "adapter", second, fs::copy_options::recursive);
  std::ofstream(second / "adapter_model.safetensors", std::ios::binary | std::ios::trunc) << weights2;
  fs::rename(second, watched / "checkpoint-20");
  const std::string out2 = WaitForOutput("pub.out", "checkpoint-20");
  ASSERT_FALSE(HasFailure());
  EXPECT_NE(out2.find("\"sequence\":2"), std::string::npos) << out2;
  EXPECT_EQ(StopPublisher(), 0);
  auto st = RunFerry({"sync", "status", "--db", (root_ / "db").string(), "--run", "rl", "--json"});
  ASSERT_EQ(st.exit_code, 0) << st.err;
  const auto rows = nlohmann::json::parse(st.out, nullptr, false);
  ASSERT_TRUE(rows.is_array() && rows.size() == 1u) << st.out;
  EXPECT_EQ(rows[0]["receiver"], "gen-1");
  EXPECT_EQ(rows[0]["version"], merged);
  EXPECT_EQ(rows[0]["verified"], true);
  EXPECT_EQ(rows[0]["lag"], 1);
  EXPECT_EQ(rows[0]["lost"], false);

  // The store holds the base and each checkpoint's adapter and merged versions of run rl;
  // the first merged one names its adapter and the base.
  auto s = store::Store::Open(root_ / "db", {.read_only = true});
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto rec = (*s)->GetVersion(merged);
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  EXPECT_EQ(rec->kind, store::VersionKind::kMerged);
  EXPECT_EQ(rec->step, 10);
  EXPECT_EQ(rec->adapter_version, adapter_hash->id);
  auto base_hash = store::HashPath(kCase / "base");
  ASSERT_TRUE(base_hash.ok());
  EXPECT_EQ(rec->base_version, base_hash->id);
  auto all = (*s)->ListVersions("rl");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 5u);  // base + 2 x (adapter, merged); nothing from the broken checkpoint
}

// A following receiver started before the trainer saved any checkpoint: the publisher
// serves the run's base at once, so the receiver activates the base id and acknowledges it,
// then activates checkpoint-10's merged id. In adapter mode, a receiver keeping the base
// (--base) copies the base from its own files instead of fetching it, then merges and
// proves the adapter.
class SyncCliBaseFirstTest : public SyncCliTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(SyncCliBaseFirstTest, ReceiveStartedBeforeTheFirstCheckpointHoldsTheBaseThenTheCheckpoint) {
  const std::string mode = GetParam();
  const fs::path watched = root_ / "trainer";
  fs::create_directories(watched);
  const std::string ep = "ipc://" + (root_ / "sock").string();
  auto base = store::HashPath(kCase / "base");
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  const std::string base_id = base->id.Hex();
  SpawnPublisher({"sync", "publish", "--db", (root_ / "db").string(), "--bind", ep, "--mode", mode, "--watch",
                  watched.string(), "--base", (kCase / "base").string(), "--poll-ms", "100", "--json"});
  WaitForOutput("pub.err", "publishing run default");
  ASSERT_FALSE(HasFailure());
  std::vector<std::string> recv = {"--json", "--connect",    ep,     "--out", (root_ / "gen").string(), "--id",
                                   "gen-1",  "--timeout-ms", "20000"};
  if (mode == "adapter") recv.insert(recv.end(), {"--base", (kCase / "base").string()});
  SpawnReceiver(recv);
  const std::string first = WaitForReceiver("recv.out", "\"version\":\"" + base_id + "\"");
  ASSERT_FALSE(HasFailure());
  const auto line = nlohmann::json::parse(first.substr(0, first.find('\n')), nullptr, false);
  ASSERT_TRUE(line.is_object()) << first;
  EXPECT_EQ(line["active"], base_id);
  EXPECT_EQ(line["sequence"], 1);
  // Merged mode fetches the base's tensors; adapter mode copies them from --base.
  const uint64_t tensor_bytes = Checkpoint::Open(kCase / "base").value().total_bytes();
  EXPECT_EQ(line["bytes_reused"].get<uint64_t>(), mode == "adapter" ? tensor_bytes : 0u) << first;
  EXPECT_EQ(line["bytes_received"].get<uint64_t>() >= tensor_bytes, mode != "adapter") << first;
  auto hashed = store::HashPath(root_ / "gen" / "current");
  ASSERT_TRUE(hashed.ok()) << hashed.status().ToString();
  EXPECT_EQ(hashed->id.Hex(), base_id);
  EXPECT_NE(Slurp(root_ / "pub.err").find("ferry: serving " + base_id + " (sequence 1)"), std::string::npos);

  DropCheckpoint(watched, "checkpoint-10", /*floats=*/0);
  const std::string published = WaitForOutput("pub.out", "checkpoint-10");
  ASSERT_FALSE(HasFailure());
  const auto pub_line = nlohmann::json::parse(published.substr(0, published.find('\n')), nullptr, false);
  ASSERT_TRUE(pub_line.is_object()) << published;
  const std::string merged = pub_line["version"].get<std::string>();
  WaitForReceiver("recv.out", "\"active\":\"" + merged + "\"");
  ASSERT_FALSE(HasFailure());
  hashed = store::HashPath(root_ / "gen" / "current");
  ASSERT_TRUE(hashed.ok()) << hashed.status().ToString();
  EXPECT_EQ(hashed->id.Hex(), merged);
  EXPECT_EQ(StopReceiver(), 0);
  EXPECT_EQ(StopPublisher(), 0);

  // The publisher recorded gen-1's acknowledgement of the base, then of the merged version.
  auto s = store::Store::Open(root_ / "db", {.read_only = true});
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  for (const std::string& id : {base_id, merged}) {
    auto events = (*s)->ListEvents(store::Digest::FromHex(id).value());
    ASSERT_TRUE(events.ok()) << events.status().ToString();
    int acks = 0;
    for (const auto& e : *events) {
      if (e.type != store::Event::Type::kAcknowledged || e.receiver != "gen-1") continue;
      ++acks;
      EXPECT_EQ(e.computed, std::optional<store::Digest>(store::Digest::FromHex(id).value())) << e.detail;
    }
    EXPECT_EQ(acks, 1) << id;
  }
}

INSTANTIATE_TEST_SUITE_P(MergedAndAdapter, SyncCliBaseFirstTest, ::testing::Values("merged", "adapter"));

// A receiver without --base, connecting to a publisher in adapter mode after the first adapter
// was published, fetches the base that adapter applies to (not activated) and activates the
// adapter merged onto it, proving the publisher's merged id.
TEST_F(SyncCliTest, ReceiveOfAnAdapterWithoutBaseFetchesTheBaseFirst) {
  const fs::path watched = root_ / "trainer";
  fs::create_directories(watched);
  const std::string ep = "ipc://" + (root_ / "sock").string();
  SpawnPublisher({"sync", "publish", "--db", (root_ / "db").string(), "--bind", ep, "--mode", "adapter", "--watch",
                  watched.string(), "--base", (kCase / "base").string(), "--poll-ms", "100", "--json"});
  WaitForOutput("pub.err", "publishing run default");
  ASSERT_FALSE(HasFailure());
  DropCheckpoint(watched, "checkpoint-10", /*floats=*/0);
  const std::string adapter = PublishedVersion(WaitForOutput("pub.out", "checkpoint-10"), "checkpoint-10");
  ASSERT_FALSE(HasFailure());
  auto adapter_hash = store::HashPath(kCase / "adapter");
  ASSERT_TRUE(adapter_hash.ok()) << adapter_hash.status().ToString();
  ASSERT_EQ(adapter, adapter_hash->id.Hex());  // adapter mode publishes the adapter itself
  auto base = store::HashPath(kCase / "base");
  ASSERT_TRUE(base.ok()) << base.status().ToString();

  auto r = RunFerry({"sync", "receive", "--once", "--connect", ep, "--out", (root_ / "gen").string(), "--id", "gen-1",
                     "--timeout-ms", "20000", "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_NE(r.out.find("\"version\":\"" + adapter + "\""), std::string::npos) << r.out;
  EXPECT_TRUE(fs::is_directory(root_ / "gen" / "versions" / base->id.Hex()));
  auto current = store::HashPath(root_ / "gen" / "current");
  ASSERT_TRUE(current.ok()) << current.status().ToString();
  EXPECT_NE(r.out.find("\"proven\":\"" + current->id.Hex() + "\""), std::string::npos) << r.out;
  EXPECT_EQ(StopPublisher(), 0);
}

// When the publisher cannot serve the base its adapters apply to (here a version of kind
// merged: a LoRA trained on a merged model), `receive` without --base exits 1 and tells the
// user to give --base DIR, and nothing is activated.
TEST_F(SyncCliTest, ReceiveOfAnAdapterWhoseBaseIsNotServedTellsTheUserToGiveBase) {
  const std::string db = (root_ / "db").string();
  auto base = RunFerry({"store", "import", "--db", db, "--kind", "merged", (kCase / "base").string()});
  ASSERT_EQ(base.exit_code, 0) << base.err;
  const std::string base_id = base.out.substr(0, 32);
  auto adapter = RunFerry({"store", "import", "--db", db, "--base-version", base_id, (kCase / "adapter").string()});
  ASSERT_EQ(adapter.exit_code, 0) << adapter.err;
  const std::string adapter_id = adapter.out.substr(0, 32);
  auto merge = RunFerry({"convert", "--base", (kCase / "base").string(), "--adapter", (kCase / "adapter").string(),
                         "--out", (root_ / "merged").string()});
  ASSERT_EQ(merge.exit_code, 0) << merge.err;
  auto merged = RunFerry({"store", "import", "--db", db, "--kind", "merged", "--base-version", base_id,
                          "--adapter-version", adapter_id, (root_ / "merged").string()});
  ASSERT_EQ(merged.exit_code, 0) << merged.err;
  const std::string ep = "ipc://" + (root_ / "sock").string();
  SpawnPublisher({"sync", "publish", "--db", db, "--bind", ep, "--mode", "adapter"});
  WaitForOutput("pub.err", "serving " + adapter_id);
  ASSERT_FALSE(HasFailure());

  auto r = RunFerry({"sync", "receive", "--once", "--connect", ep, "--out", (root_ / "gen").string(), "--id", "gen-1",
                     "--timeout-ms", "20000"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.rfind("ferry: error: the publisher serves adapters: give --base DIR (the local base model): "
                        "sync receiver gen-1: adapter " +
                            adapter_id + " applies to base " + base_id,
                        0),
            0u)
      << r.err;
  EXPECT_NE(r.err.find("is not served"), std::string::npos) << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_FALSE(fs::exists(fs::symlink_status(root_ / "gen" / "current")));
  EXPECT_EQ(StopPublisher(), 0);
}

// A following receiver started before its publisher warns once that nothing answers, keeps
// waiting, and activates the publisher's version once it comes up.
TEST_F(SyncCliTest, ReceiveStartedBeforeThePublisherWaitsForIt) {
  const store::Digest v = MakeStore();
  const std::string ep = "ipc://" + (root_ / "sock").string();
  SpawnReceiver({"--json", "--connect", ep, "--out", (root_ / "gen").string(), "--id", "gen-1", "--timeout-ms", "500"});
  WaitForReceiver("recv.err", "no reply from");
  ASSERT_FALSE(HasFailure());
  SpawnPublisher({"sync", "publish", "--db", (root_ / "db").string(), "--bind", ep});
  WaitForReceiver("recv.out", "\"version\":\"" + v.Hex() + "\"");
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(fs::read_symlink(root_ / "gen" / "current"), fs::path("versions") / v.Hex());
  EXPECT_EQ(StopReceiver(), 0);
  EXPECT_EQ(StopPublisher(), 0);
  const std::string err = Slurp(root_ / "recv.err");
  const size_t first = err.find("no reply from");
  EXPECT_EQ(err.find("no reply from", first + 1), std::string::npos) << "warned more than once per outage:\n" << err;
}

// --once still fails fast (exit 1) when nobody answers; a watching publisher answers at once
// with its base.
TEST_F(SyncCliTest, ReceiveOnceFailsFastWithoutAVersion) {
  const std::string ep = "ipc://" + (root_ / "sock").string();
  auto silent = RunFerry({"sync", "receive", "--once", "--connect", ep, "--out", (root_ / "gen").string(), "--id",
                          "gen-1", "--timeout-ms", "300"});
  EXPECT_EQ(silent.exit_code, 1);
  EXPECT_NE(silent.err.find("ferry: error: sync receiver gen-1: no reply from"), std::string::npos) << silent.err;

  const fs::path watched = root_ / "trainer";
  fs::create_directories(watched);
  SpawnPublisher({"sync", "publish", "--db", (root_ / "db").string(), "--bind", ep, "--watch", watched.string(),
                  "--base", (kCase / "base").string(), "--poll-ms", "100"});
  WaitForOutput("pub.err", "publishing run default");
  ASSERT_FALSE(HasFailure());
  // Before any checkpoint the publisher serves the base (a publisher with nothing at all to
  // serve, kNotFound "nothing published yet", is covered by sync_fault_test).
  auto base = store::HashPath(kCase / "base");
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  auto first = RunFerry({"sync", "receive", "--once", "--json", "--connect", ep, "--out", (root_ / "gen").string(),
                         "--id", "gen-1", "--timeout-ms", "20000"});
  EXPECT_EQ(first.exit_code, 0) << first.err;
  EXPECT_NE(first.out.find("\"active\":\"" + base->id.Hex() + "\""), std::string::npos) << first.out;
  EXPECT_EQ(fs::read_symlink(root_ / "gen" / "current"), fs::path("versions") / base->id.Hex());
}

// A local write failure (the receiver may write files of at most 64 KiB; the second version
// is larger) ends a following receiver with exit code 1 and a message naming the file and
// the OS error, instead of being retried forever as if the publisher were gone. What was
// active stays active.
TEST_F(SyncCliTest, ReceiveExitsNonZeroOnALocalWriteFailure) {
  const fs::path watched = root_ / "trainer";
  fs::create_directories(watched);
  const std::string ep = "ipc://" + (root_ / "sock").string();
  SpawnPublisher({"sync", "publish", "--db", (root_ / "db").string(), "--bind", ep, "--watch", watched.string(),
                  "--base", (kCase / "base").string(), "--poll-ms", "100", "--json"});
  WaitForOutput("pub.err", "publishing run default");
  ASSERT_FALSE(HasFailure());
  DropCheckpoint(watched, "checkpoint-1", /*floats=*/64);  // 256 bytes of weights
  const std::string small = PublishedVersion(WaitForOutput("pub.out", "checkpoint-1"), "checkpoint-1");
  ASSERT_FALSE(HasFailure());
  SpawnReceiver(
      {"--json", "--connect", ep, "--out", (root_ / "gen").string(), "--id", "gen-1", "--timeout-ms", "20000"},
      /*file_blocks=*/64);
  WaitForReceiver("recv.out", "\"version\":\"" + small + "\"");
  ASSERT_FALSE(HasFailure());

  DropCheckpoint(watched, "checkpoint-2", /*floats=*/0);  // merged onto the base: ~360 KiB
  WaitForOutput("pub.out", "checkpoint-2");
  ASSERT_FALSE(HasFailure());
  const std::optional<int> code = WaitForReceiverExit(std::chrono::seconds(60));
  const std::string err = Slurp(root_ / "recv.err");
  ASSERT_TRUE(code.has_value()) << "receiver still running 60 s after the write failure; stderr:\n" << err;
  EXPECT_EQ(*code, 1) << err;
  EXPECT_NE(err.find("ferry: error: " + (root_ / "gen" / "versions").string()), std::string::npos) << err;
  EXPECT_NE(err.find("model.safetensors"), std::string::npos) << err;
  EXPECT_NE(err.find(std::strerror(EFBIG)), std::string::npos) << err;
  EXPECT_EQ(err.find("warning"), std::string::npos) << err;
  EXPECT_EQ(fs::read_symlink(root_ / "gen" / "current"), fs::path("versions") / small);
  EXPECT_EQ(StopPublisher(), 0);
}

// A receiver killed while the publisher runs is declared lost after the publisher's
// heartbeat timeout (5 s by default; not a flag), and `sync status --json` (a reader beside
// the running publisher) says so.
TEST_F(SyncCliTest, StatusReportsAReceiverThePublisherDeclaredLost) {
  const store::Digest v = MakeStore();
  const std::string ep = "ipc://" + (root_ / "sock").string();
  SpawnPublisher({"sync", "publish", "--db", (root_ / "db").string(), "--bind", ep});
  WaitForOutput("pub.err", "publishing run default");
  ASSERT_FALSE(HasFailure());
  SpawnReceiver(
      {"--json", "--connect", ep, "--out", (root_ / "gen").string(), "--id", "gen-1", "--timeout-ms", "20000"});
  WaitForReceiver("recv.out", "\"version\":\"" + v.Hex() + "\"");
  ASSERT_FALSE(HasFailure());
  ::kill(recv_pid_, SIGKILL);
  ::waitpid(recv_pid_, nullptr, 0);
  recv_pid_ = -1;

  nlohmann::json rows;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    auto st = RunFerry({"sync", "status", "--db", (root_ / "db").string(), "--json"});
    ASSERT_EQ(st.exit_code, 0) << st.err;
    rows = nlohmann::json::parse(st.out, nullptr, false);
    ASSERT_TRUE(rows.is_array() && rows.size() == 1u) << st.out;
    if (rows[0]["lost"] == true) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  ASSERT_TRUE(rows.is_array() && rows.size() == 1u) << rows.dump();
  EXPECT_EQ(rows[0]["receiver"], "gen-1");
  EXPECT_EQ(rows[0]["lost"], true) << rows.dump(2);
  EXPECT_EQ(rows[0]["version"], v.Hex());
  EXPECT_NE(rows[0].value("lost_detail", "").find("receiver gen-1 lost: no traffic for"), std::string::npos)
      << rows.dump(2);
  EXPECT_EQ(StopPublisher(), 0);
}

}  // namespace
}  // namespace ferry
