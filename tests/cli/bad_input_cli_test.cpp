// `ferry inspect` over every case of the bad-input corpus: exit code exactly 1 (an error,
// not a signal or an abort), "error" and the file at fault on stderr, and nothing written
// into the checkpoint's directory.
#include <fcntl.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "tests/cli/cli_runner.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "tests/core/bad_input_corpus.h"

extern char** environ;

namespace ferry {
namespace {

namespace fs = std::filesystem;
using corpus::BadInputCase;

std::string Slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Relative path -> contents (directories as "<dir>/" -> "") of everything under `root`.
std::map<std::string, std::string> Snapshot(const fs::path& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    const std::string rel = fs::relative(e.path(), root).string();
    out[e.is_directory() ? rel + "/" : rel] = e.is_directory() ? "" : Slurp(e.path());
  }
  return out;
}

struct RunResult {
  bool exited = false;  // false: killed by a signal
  int code = -1;        // exit status, or the signal number
  std::string out;
  std::string err;
};

// Runs FERRY_CLI_PATH with `args` through the shared runner.
RunResult RunFerry(const std::vector<std::string>& args, const fs::path& /*scratch*/) {
  testing::CliResult c = testing::RunFerry(args);
  RunResult r;
  r.exited = c.signal == 0 && c.exit_code >= 0;
  r.code = r.exited ? c.exit_code : c.signal;
  r.out = std::move(c.out);
  r.err = std::move(c.err);
  return r;
}

class BadInputCli : public ::testing::TestWithParam<BadInputCase> {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::path(::testing::TempDir()) / "ferry_bad_cli_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << tmpl;
    scratch_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(scratch_, ec);
  }
  fs::path scratch_;
};

TEST_P(BadInputCli, InspectFailsWithExitCodeOneAndNamesTheFile) {
  const BadInputCase& c = GetParam();
  // The checkpoint lives in its own directory so that the captured output (in scratch_)
  // does not count as a change to it.
  const fs::path root = scratch_ / c.name;
  ASSERT_TRUE(fs::create_directory(root));
  ASSERT_TRUE(corpus::WriteCase(c, root).ok());
  const auto before = Snapshot(root);

  const RunResult r = RunFerry({"inspect", corpus::OpenPath(c, root).string()}, scratch_);
  ASSERT_TRUE(r.exited) << c.name << ": ferry was killed by signal " << r.code << "\nstderr: " << r.err;
  EXPECT_EQ(r.code, 1) << c.name << "\nstdout: " << r.out << "\nstderr: " << r.err;
  EXPECT_NE(r.err.find("error"), std::string::npos) << r.err;
  const std::string culprit = c.culprit.empty() ? root.filename().string() : c.culprit;
  EXPECT_NE(r.err.find(culprit), std::string::npos) << "stderr does not name " << culprit << ": " << r.err;
  EXPECT_EQ(Snapshot(root), before) << "ferry inspect changed the checkpoint directory";
}

INSTANTIATE_TEST_SUITE_P(Corpus, BadInputCli, ::testing::ValuesIn(corpus::BadInputCases()),
                         [](const ::testing::TestParamInfo<BadInputCase>& p) { return p.param.name; });

}  // namespace
}  // namespace ferry
