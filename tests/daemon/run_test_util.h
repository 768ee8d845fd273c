// Helpers for the daemon/run tests: temporary directories, files, fixture JSON.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/status.h"
#include "tests/temp_dir.h"

namespace ferry::run::testing {

// A fresh directory under ::testing::TempDir(), removed with everything in it.
class TempDir : public ::ferry::testing::ScopedTempDir {
 public:
  TempDir() : ScopedTempDir("ferry-run-test-") {}
};

// Writes `text` to `path` (parents created); `executable` sets mode 0755.
inline void WriteFile(const std::filesystem::path& path, const std::string& text, bool executable = false) {
  std::filesystem::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
  if (executable) ::chmod(path.c_str(), 0755);
}

inline std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A committed fixture under fixtures/run/.
inline nlohmann::json Fixture(const std::string& name) {
  const std::string text = ReadFile(std::filesystem::path(FERRY_FIXTURES_DIR) / "run" / name);
  EXPECT_FALSE(text.empty()) << "fixture " << name << " missing: run fixtures/run/generate.py";
  return nlohmann::json::parse(text);
}

// Expects `status` to be `code` with a message starting with `prefix`; with `needle`, also
// containing it.
inline void ExpectError(const Status& status, StatusCode code, const std::string& prefix,
                        const std::string& needle = "") {
  EXPECT_EQ(status.code(), code) << status.ToString();
  EXPECT_EQ(status.message().rfind(prefix, 0), 0u) << "message: " << status.message() << "\nwanted prefix: " << prefix;
  if (!needle.empty()) {
    EXPECT_NE(status.message().find(needle), std::string::npos) << status.message();
  }
}

}  // namespace ferry::run::testing
