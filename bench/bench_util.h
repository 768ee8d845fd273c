// What every benchmark here measures with: wall-clock seconds, the median and minimum of a
// set of runs and their list as printed, and a flush of dirty pages between measured steps.
// Header-only.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace ferry::bench {

// Seconds on the steady clock since an arbitrary fixed point (differences are durations).
inline double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Wall-clock seconds `fn` takes.
inline double Seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The median of `v` (the mean of the two middle values for an even count). REQUIRES: v not empty.
inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 == 1 ? v[m] : (v[m - 1] + v[m]) / 2;
}

// The smallest of `v`. REQUIRES: v not empty.
inline double Min(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

// Every run's seconds with three decimals, space-separated: "1.204 1.187 1.199".
inline std::string RunsText(const std::vector<double>& runs) {
  std::string out;
  for (double s : runs) {
    char b[24];
    std::snprintf(b, sizeof b, "%s%.3f", out.empty() ? "" : " ", s);
    out += b;
  }
  return out;
}

// Writes back the dirty pages of the filesystem holding `dir` (syncfs), so that writeback
// left over from one measured step does not land inside the next. 0, or the errno of
// opening `dir`.
inline int SettleFilesystem(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno;
  ::syncfs(fd);
  ::close(fd);
  return 0;
}

}  // namespace ferry::bench
