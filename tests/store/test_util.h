// Fixtures shared by the store tests: temp directories, tiny models written to disk, and a
// child process with pipes (the crash and reader tests drive tests/store/crash_helper.cpp).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/safetensors.h"
#include "core/tensor.h"
#include "tests/temp_dir.h"

extern char** environ;

namespace ferry::store::testing {

// A fresh directory under ::testing::TempDir(), removed with everything in it.
class TempDir : public ::ferry::testing::ScopedTempDir {
 public:
  TempDir() : ScopedTempDir("ferry-store-test-") {}
};

// An F32 tensor holding `values`.
inline Tensor F32(Shape shape, const std::vector<float>& values) {
  auto t = Tensor::Empty(DType::kF32, std::move(shape));
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->numel(), static_cast<int64_t>(values.size()));
  std::memcpy(t->mutable_data(), values.data(), values.size() * 4);
  return *t;
}

// A tensor of `dtype` whose bytes are `seed`-derived (not meant as numbers).
inline Tensor Patterned(DType dtype, Shape shape, uint32_t seed) {
  auto t = Tensor::Empty(dtype, std::move(shape));
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < t->nbytes(); ++i) {
    x = x * 1664525u + 1013904223u;
    t->mutable_data()[i] = static_cast<std::byte>(x >> 24);
  }
  return *t;
}

// Writes `tensors` as dir/<file> (declared in the map's order unless `order` is given) and
// each aux file beside it. Creates `dir`.
inline void WriteModel(const std::filesystem::path& dir, const std::map<std::string, Tensor>& tensors,
                       const std::map<std::string, std::string>& aux = {},
                       const std::string& file = "model.safetensors", std::vector<std::string> order = {}) {
  std::filesystem::create_directories(dir);
  if (order.empty()) {
    for (const auto& [name, t] : tensors) order.push_back(name);
  }
  std::vector<TensorSpec> specs;
  for (const auto& name : order) {
    const Tensor& t = tensors.at(name);
    specs.push_back({name, t.dtype(), t.shape()});
  }
  auto w = SafetensorsWriter::CreateFile(dir / file, specs);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  for (const auto& name : order) ASSERT_TRUE((*w)->Write(name, tensors.at(name)).ok());
  ASSERT_TRUE((*w)->Finish().ok());
  for (const auto& [name, contents] : aux) {
    std::ofstream(dir / name, std::ios::binary) << contents;
  }
}

inline std::string ReadFileBytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A child process whose stdin and stdout are pipes to us; stderr goes to a file.
class Child {
 public:
  Child(const std::vector<std::string>& argv, const std::filesystem::path& stderr_path) {
    int in_pipe[2], out_pipe[2];
    EXPECT_EQ(::pipe2(in_pipe, O_CLOEXEC), 0);
    EXPECT_EQ(::pipe2(out_pipe, O_CLOEXEC), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in_pipe[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out_pipe[1], 1);
    posix_spawn_file_actions_addopen(&fa, 2, stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    int rc = ::posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), environ);
    EXPECT_EQ(rc, 0) << "posix_spawn " << argv[0] << ": " << std::strerror(rc);
    posix_spawn_file_actions_destroy(&fa);
    ::close(in_pipe[0]);
    ::close(out_pipe[1]);
    to_child_ = in_pipe[1];
    from_child_ = out_pipe[0];
  }
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      Wait();
    }
    if (to_child_ >= 0) ::close(to_child_);
    if (from_child_ >= 0) ::close(from_child_);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  // The next complete line of output (without '\n'); false on EOF or after `timeout_ms`.
  bool ReadLine(std::string& line, int timeout_ms) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      auto nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return true;
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{from_child_, POLLIN, 0};
      int r = ::poll(&p, 1, static_cast<int>(left.count()));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      char buf[4096];
      ssize_t n = ::read(from_child_, buf, sizeof(buf));
      if (n <= 0) return false;
      buffer_.append(buf, static_cast<size_t>(n));
    }
  }
  // Every complete line still to read, up to EOF (call after the child is gone).
  std::vector<std::string> DrainLines() {
    std::vector<std::string> lines;
    std::string line;
    while (ReadLine(line, 5000)) lines.push_back(line);
    return lines;
  }
  void WriteLine(const std::string& s) {
    std::string data = s + "\n";
    EXPECT_EQ(::write(to_child_, data.data(), data.size()), static_cast<ssize_t>(data.size()));
  }
  void Kill() { ::kill(pid_, SIGKILL); }
  // Waits for the child; returns the raw wait status.
  int Wait() {
    int status = 0;
    if (pid_ > 0) {
      while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
      pid_ = -1;
      status_ = status;
    }
    return status_;
  }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  int status_ = 0;
  std::string buffer_;
};

}  // namespace ferry::store::testing
