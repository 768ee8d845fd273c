// Reading a run directory without a daemon (daemon/control/run_dir.h).
#include "daemon/control/run_dir.h"

#include <charconv>
#include <fstream>
#include <system_error>

namespace ferry::control {
namespace {

namespace fs = std::filesystem;

// Metrics lines longer than this are not read (a log line is far shorter).
constexpr std::streamoff kMaxTailBytes = 1 << 20;

}  // namespace

Result<std::optional<CheckpointDir>> NewestCheckpoint(const fs::path& dir) {
  std::optional<CheckpointDir> best;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) {
    if (ec == std::errc::no_such_file_or_directory) return best;
    return Status::IOError(dir.string() + ": cannot list: " + ec.message());
  }
  constexpr std::string_view kPrefix = "checkpoint-";
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) return Status::IOError(dir.string() + ": cannot list: " + ec.message());
    const std::string name = it->path().filename().string();
    if (!name.starts_with(kPrefix) || name.size() == kPrefix.size()) continue;
    const char* first = name.data() + kPrefix.size();
    const char* last = name.data() + name.size();
    uint64_t step = 0;
    auto [ptr, perr] = std::from_chars(first, last, step);
    if (perr != std::errc() || ptr != last) continue;
    std::error_code dir_ec;
    if (!it->is_directory(dir_ec)) continue;
    if (!best || step > best->step) best = CheckpointDir{name, step};
  }
  return best;
}

Result<std::optional<MetricsLine>> LastMetrics(const fs::path& dir) {
  const fs::path path = dir / kMetricsFileName;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::error_code ec;
    if (!fs::exists(path, ec)) return std::optional<MetricsLine>();
    return Status::IOError(path.string() + ": cannot open");
  }
  // Count lines as we go so the error names the line; a run logs a few thousand lines.
  std::string line, last;
  uint64_t number = 0, last_number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (in.eof()) break;  // no newline: still being written
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (static_cast<std::streamoff>(line.size()) > kMaxTailBytes) continue;
    last = std::move(line);
    last_number = number;
  }
  if (in.bad()) return Status::IOError(path.string() + ": cannot read");
  if (last_number == 0) return std::optional<MetricsLine>();
  nlohmann::json j = nlohmann::json::parse(last, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::Corruption(path.string() + " line " + std::to_string(last_number) + ": not a JSON object");
  }
  return std::optional<MetricsLine>(MetricsLine{std::move(last), last_number, std::move(j)});
}

}  // namespace ferry::control
