// A unique temporary directory for a test, removed with everything in it when destroyed.
// Every test's temporary directory is one of these (a test file may wrap it to name its
// prefix).
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

namespace ferry::testing {

class ScopedTempDir {
 public:
  // Creates "<gtest temp dir>/<prefix>XXXXXX" (a test failure naming errno when it cannot).
  explicit ScopedTempDir(const std::string& prefix = "ferry_test_") {
    std::string tmpl = (std::filesystem::path(::testing::TempDir()) / (prefix + "XXXXXX")).string();
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr) << "mkdtemp " << tmpl << ": " << std::strerror(errno);
    path_ = std::filesystem::path(tmpl).lexically_normal();
  }
  ~ScopedTempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // path() / name.
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

}  // namespace ferry::testing
