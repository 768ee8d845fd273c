// The reference side of a probe, for programs without LibTorch (`ferry sync receive`): a
// long-lived `ferryd probe --serve` child computes a version's prompt log-probabilities with
// Ferry's runtime (daemon/runtime) and answers one JSON line per request on a pipe. The
// child keeps the last models it loaded, so a small model answers in milliseconds.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "core/status.h"
#include "sync/engine/probe.h"

namespace ferry::engine {

struct ReferenceOptions {
  std::filesystem::path ferryd;  // the ferryd executable. REQUIRED
  int threads = 1;               // the child's compute threads. Default: 1
  int timeout_ms = 120000;       // longest wait for one answer (a cold model load included). Default: 120 s
};

class ReferenceProber {
 public:
  // Starts the child (kIOError naming the executable when it cannot be started).
  [[nodiscard]] static Result<std::unique_ptr<ReferenceProber>> Start(ReferenceOptions options);
  // Closes the child's stdin (it exits at EOF) and reaps it; kills it if it lingers.
  ~ReferenceProber();
  ReferenceProber(const ReferenceProber&) = delete;
  ReferenceProber& operator=(const ReferenceProber&) = delete;

  // The prompt log-probabilities of `sequences` under the model in `model_dir` (an hf
  // directory), with the PEFT adapter in `adapter_dir` applied when given. The child's own
  // errors come back as kFailedPrecondition with its message; kUnavailable when it does not
  // answer in time or has exited (it is then restarted on the next call).
  [[nodiscard]] Result<LogProbs> Compute(const std::filesystem::path& model_dir,
                                         const std::optional<std::filesystem::path>& adapter_dir,
                                         const Sequences& sequences);

 private:
  explicit ReferenceProber(ReferenceOptions options);
  Status Spawn();
  void Stop();
  ReferenceOptions options_;
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string pending_;  // bytes read past the last answer line
};

}  // namespace ferry::engine
