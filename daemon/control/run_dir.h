// A ferryd run directory, as `ferry daemon` reads it without a running daemon.
//
// Layout (ferryd writes it; `ferryd train --dir DIR`):
//   DIR/ferryd.lock        flock + pid of the running ferryd (daemon/control/run_lock.h)
//   DIR/.ferryd/control    the control socket (mode 0700 directory; daemon/control/endpoint.h)
//   DIR/ferryd.log         stdout and stderr of a detached ferryd (`ferry daemon start --detach`)
//   DIR/metrics.jsonl      one JSON object per logged step: step, TRL metric names (reward,
//                          reward_std, kl, entropy, completions/mean_length, learning_rate,
//                          grad_norm, loss, ...) and generator_version (32 hex); a resumed run
//                          truncates it back to its checkpoint's step
//   DIR/checkpoint-N/      complete checkpoints (written under a temporary name, renamed whole)
//   DIR/store/             the run's versions
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace ferry::control {

inline constexpr const char* kMetricsFileName = "metrics.jsonl";
inline constexpr const char* kLogFileName = "ferryd.log";

// A checkpoint directory found in a run directory.
struct CheckpointDir {
  std::string name;   // "checkpoint-N"
  uint64_t step = 0;  // N
};

// The checkpoint-N directory of DIR with the largest N (names that are not "checkpoint-"
// followed by digits only, such as temporary ones, are ignored); nullopt when there is none.
// kIOError naming DIR when it cannot be listed (a missing DIR has no checkpoint).
[[nodiscard]] Result<std::optional<CheckpointDir>> NewestCheckpoint(const std::filesystem::path& dir);

// The last logged step of a run.
struct MetricsLine {
  std::string text;      // the line as written, without its newline
  uint64_t number = 0;   // its line number in the file, from 1
  nlohmann::json value;  // the parsed object
};

// The last complete (newline-terminated), non-blank line of DIR/metrics.jsonl; nullopt when
// the file is absent or has no such line. kCorruption naming the file and line number when
// that line is not a JSON object; kIOError naming the file when it cannot be read.
[[nodiscard]] Result<std::optional<MetricsLine>> LastMetrics(const std::filesystem::path& dir);

}  // namespace ferry::control
