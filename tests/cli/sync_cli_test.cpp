// End-to-end tests of `ferry keys generate` and `ferry sync publish|receive|status`.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <span>

#include "core/safetensors.h"
#include "store/store.h"
#include "tests/cli/cli_runner.h"

extern char** environ;

namespace ferry {
namespace {

namespace fs = std::filesystem;
using ferry::testing::RunFerry;

class SyncCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ferry-synccli-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
  }
  void TearDown() override {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
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

  void SpawnPublisher(const std::vector<std::string>& args) {
    std::vector<std::string> all = {FERRY_CLI_PATH};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    ASSERT_EQ(::posix_spawn(&pid_, FERRY_CLI_PATH, nullptr, nullptr, argv.data(), environ), 0);
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
  pid_t pid_ = -1;
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
  auto r = RunFerry({"sync", "publish", "--db", (root_ / "db").string(), "--requests", "tcp://127.0.0.1:0",
                     "--updates", "tcp://127.0.0.1:0"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("tcp://127.0.0.1:0: tcp:// needs CURVE keys"), std::string::npos) << r.err;
}

TEST_F(SyncCliTest, PublishReceiveStatusEndToEnd) {
  const store::Digest v = MakeStore();
  const std::string sock = (root_ / "sock").string();
  SpawnPublisher({"sync", "publish", "--db", (root_ / "db").string(), "--socket-dir", sock});
  // The receiver's HELLO waits in its queue until the publisher is up (bounded by --timeout-ms).
  auto r = RunFerry({"sync", "receive", "--once", "--dir", (root_ / "gen").string(), "--id", "gen-1", "--socket-dir",
                     sock, "--timeout-ms", "20000"});
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
}

}  // namespace
}  // namespace ferry
