// A unique temporary directory for a test, removed with everything in it when destroyed.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace ferry::testing {

class ScopedTempDir {
 public:
  // Creates "<gtest temp dir>/<prefix>XXXXXX".
  explicit ScopedTempDir(const std::string& prefix = "ferry_test_") {
    std::string tmpl = (std::filesystem::path(::testing::TempDir()) / (prefix + "XXXXXX")).string();
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr) << tmpl;
    path_ = tmpl;
  }
  ~ScopedTempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace ferry::testing
