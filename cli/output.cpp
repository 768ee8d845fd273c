#include "cli/output.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include <CLI/CLI.hpp>

namespace ferry::cli {

void Fail(const Status& status, int exit_code) { Fail(status.message(), exit_code); }

void FailWithHint(const Status& status, StatusCode when, std::string_view hint, int exit_code) {
  if (status.code() != when) Fail(status, exit_code);
  std::string message = status.message();
  if (message.ends_with('.')) message.pop_back();  // "...instead; use --layout hf", not "instead.; use"
  Fail(message + "; " + std::string(hint), exit_code);
}

void Fail(std::string_view message, int exit_code) {
  std::fprintf(stderr, "ferry: error: %.*s\n", static_cast<int>(message.size()), message.data());
  throw CLI::RuntimeError(exit_code);
}

std::string HumanBytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  }
  return buf;
}

Progress::Progress(std::string label, uint64_t total_bytes, bool enabled)
    : label_(std::move(label)),
      total_(total_bytes),
      enabled_(enabled && ::isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

Progress::~Progress() { Done(); }

void Progress::Add(uint64_t bytes) {
  done_ += bytes;
  if (!enabled_) return;
  auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ > std::chrono::milliseconds(100)) {
    last_draw_ = now;
    Draw(false);
  }
}

void Progress::Done() {
  if (finished_) return;
  finished_ = true;
  if (enabled_) Draw(true);
}

void Progress::Draw(bool final) {
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double frac = total_ == 0 ? 1.0 : std::min(1.0, static_cast<double>(done_) / static_cast<double>(total_));
  const int width = 30;
  const int filled = static_cast<int>(frac * width);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.append(static_cast<size_t>(width - filled), '.');
  const double rate = secs > 0 ? static_cast<double>(done_) / secs : 0.0;
  std::fprintf(stderr, "\r%s [%s] %3.0f%% %s/%s %s/s%s", label_.c_str(), bar.c_str(), frac * 100.0,
               HumanBytes(done_).c_str(), HumanBytes(total_).c_str(), HumanBytes(static_cast<uint64_t>(rate)).c_str(),
               final ? "\n" : "");
  std::fflush(stderr);
}

std::string FerrydPathOrFail() {
  if (const char* env = std::getenv("FERRY_FERRYD"); env != nullptr && *env != '\0') {
    if (::access(env, X_OK) != 0) Fail(std::string("FERRY_FERRYD=") + env + ": not an executable file");
    return env;
  }
  std::error_code ec;
  namespace fs = std::filesystem;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) Fail("cannot find this executable's directory (/proc/self/exe): " + ec.message());
  const fs::path ferryd = self.parent_path() / "ferryd";
  if (::access(ferryd.c_str(), X_OK) != 0) {
    Fail("ferryd not found at " + ferryd.string() +
         " (it is installed next to ferry and needs LibTorch; set FERRY_FERRYD to run another)");
  }
  return ferryd.string();
}

}  // namespace ferry::cli
