// Shared output helpers for CLI commands: errors, progress, JSON.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace ferry::cli {

// Prints "ferry: error: <message>" to stderr and throws CLI::RuntimeError(exit_code).
[[noreturn]] void Fail(const Status& status, int exit_code = 1);
[[noreturn]] void Fail(std::string_view message, int exit_code = 1);
// As Fail(status), with "; <hint>" after the message when the status has code `when`: the
// CLI's own advice (a flag to pass), keyed on the library's code, never on its text.
[[noreturn]] void FailWithHint(const Status& status, StatusCode when, std::string_view hint, int exit_code = 1);

// The ferryd executable: $FERRY_FERRYD when set, else the one installed next to this one
// (fails naming where it looked).
std::string FerrydPathOrFail();

// "1.50 GiB"
std::string HumanBytes(uint64_t bytes);

// A progress bar with throughput on stderr, drawn only when stderr is a terminal (and
// not with --json); otherwise silent. Thread-compatible, not thread-safe.
class Progress {
 public:
  Progress(std::string label, uint64_t total_bytes, bool enabled);
  ~Progress();
  void Add(uint64_t bytes);
  void Done();

 private:
  void Draw(bool final);
  std::string label_;
  uint64_t total_;
  uint64_t done_ = 0;
  bool enabled_;
  bool finished_ = false;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

// JSON text for stdout (nlohmann::json or ordered_json, `indent` as dump's): bytes that are
// not UTF-8, such as a path the OS allows, become U+FFFD instead of an exception.
template <typename J>
std::string JsonText(const J& j, int indent = -1) {
  return j.dump(indent, ' ', false, J::error_handler_t::replace);
}

}  // namespace ferry::cli
