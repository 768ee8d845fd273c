// metrics.jsonl for dashboards and terminals: the Prometheus text format, and following a
// growing file.
//
// Prometheus mapping (text exposition format 0.0.4), from one metrics.jsonl line:
//   every numeric field NAME -> a gauge family  ferry_<NAME'> where NAME' is NAME with each
//                               character outside [A-Za-z0-9_] replaced by '_'
//                               (completions/mean_length -> ferry_completions_mean_length)
//                               # TYPE ferry_<NAME'> gauge
//                               ferry_<NAME'>{run="RUN"} VALUE
//   generator_version (string)  # TYPE ferry_generator_info gauge
//                               ferry_generator_info{run="RUN",version="V"} 1
//   anything else (strings, booleans, null, arrays, objects) is skipped, and so is a field
//   whose mapped name is already taken by an earlier field of the line.
// Fields appear in the line's order. Integers are printed as integers, other numbers in the
// shortest form that reads back to the same double. Label values escape '\' as "\\", '"'
// as "\"" and a newline as "\n"; invalid UTF-8 becomes U+FFFD.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace ferry::control {

// "ferry_" + `field` with characters outside [A-Za-z0-9_] replaced by '_'.
[[nodiscard]] std::string PrometheusMetricName(std::string_view field);
// `value` escaped for use between the quotes of a label value.
[[nodiscard]] std::string EscapeLabelValue(std::string_view value);

// One metrics.jsonl line as a JSON object in the line's order, with nested values (arrays,
// objects: no metric is one) left out, so a hostile line cannot nest deeply. kCorruption
// when the line is not a JSON object.
[[nodiscard]] Result<nlohmann::ordered_json> ParseMetricsLine(std::string_view line);

// The Prometheus text for one metrics.jsonl line (mapping above), every family labelled
// run="`run`". kCorruption when the line is not a JSON object (the caller names file and
// line).
[[nodiscard]] Result<std::string> MetricsToPrometheus(std::string_view line, std::string_view run);

// Follows a text file that grows by whole lines (metrics.jsonl, ferryd.log) and may be
// truncated or replaced (a resumed run cuts metrics.jsonl back to its checkpoint).
// Thread-compatible.
class FileTail {
 public:
  // With `remember_lines` (metrics.jsonl), a rewritten file resumes at the first line that
  // differs from those returned before; without it (a log), at its first line. Remembering
  // costs 8 bytes per line.
  explicit FileTail(std::filesystem::path path, bool remember_lines = true)
      : path_(std::move(path)), remember_(remember_lines) {}

  struct Update {
    std::vector<std::string> lines;  // new complete lines, without their '\n'
    bool rewritten = false;          // the file was truncated, replaced or changed before the end read
  };

  // The complete lines added since the last call (the first call: every complete line). A
  // line still being written (no '\n' yet) waits for the next call, unless it exceeds
  // kMaxPendingBytes, when it is returned as it is. When the file shrank, was replaced (other
  // inode) or the last line read changed, `rewritten` is set and `lines` restarts as the
  // constructor says. At most kMaxPollBytes are read per call (call again for the rest). A
  // missing file has no lines. kIOError naming the file when it exists but cannot be read.
  [[nodiscard]] Result<Update> Poll();

  static constexpr uint64_t kMaxPendingBytes = 1 << 20;
  static constexpr uint64_t kMaxPollBytes = 16 << 20;

 private:
  std::filesystem::path path_;
  uint64_t offset_ = 0;    // end of the last line returned
  uint64_t inode_ = 0;     // the file last read; 0: never read
  std::string last_line_;  // the last line read (ending at offset_), with its newline
  bool remember_;
  std::vector<uint64_t> hashes_;     // a hash of every line read, in order (remember_)
  std::vector<uint64_t> replaying_;  // after a rewrite: the hashes of the lines read before it
  size_t replay_index_ = 0;          // lines of the rewritten file matched against replaying_
};

}  // namespace ferry::control
