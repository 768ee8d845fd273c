// One external reward command: its process and the JSON-lines protocol of rewards.h.
// Used by RewardScorer; separate so the process handling is read (and tested) on its own.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "daemon/run/config.h"

namespace ferry::run {

struct RewardInput;

class RewardCommand {
 public:
  // Starts `spec.command` (see rewards.h for how). `max_reply_bytes` bounds a reply line;
  // `stop_grace_seconds` is how long the process may take to exit once its stdin closes.
  // kNotFound when the program does not exist, kIOError for other failures to start; both
  // name the reward and its argv.
  [[nodiscard]] static Result<std::unique_ptr<RewardCommand>> Start(const RewardSpec& spec, size_t max_reply_bytes,
                                                                    double stop_grace_seconds);
  // Stop().
  ~RewardCommand();
  RewardCommand(const RewardCommand&) = delete;
  RewardCommand& operator=(const RewardCommand&) = delete;

  // One reward per input, NaN for null / NaN replies. Errors as rewards.h describes; after
  // one the process is gone and every later call returns kFailedPrecondition until
  // Restart().
  [[nodiscard]] Result<std::vector<double>> Score(const std::vector<RewardInput>& inputs);

  // Stops the process if it runs and starts a new one.
  [[nodiscard]] Status Restart();

  // Closes the command's stdin, gives it stop_grace_seconds to exit, then kills its
  // process group; reaps it. Idempotent.
  void Stop();

  bool failed() const { return failed_; }
  bool running() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }
  // "reward 'NAME' (ARGV...)": how messages name this command.
  const std::string& label() const { return label_; }

 private:
  RewardCommand(RewardSpec spec, size_t max_reply_bytes, double stop_grace_seconds);
  Status Spawn();
  // Kills the process group, reaps, marks failed, returns `status`.
  Status Fail(Status status);
  // Reaps the exited (or exiting) process within `seconds`, killing it after; the reason
  // it ended ("exited with status 3", "was killed by signal 11 (Segmentation fault)").
  std::string Reap(double seconds);
  Result<std::vector<double>> ScoreBatch(const std::vector<RewardInput>& inputs, size_t begin, size_t end);

  RewardSpec spec_;
  size_t max_reply_bytes_;
  double stop_grace_seconds_;
  std::string label_;
  pid_t pid_ = -1;
  int in_fd_ = -1;   // our end of the command's stdin (a socket: writes never raise SIGPIPE)
  int out_fd_ = -1;  // our end of the command's stdout (a pipe)
  bool failed_ = false;
  std::string pending_;  // reply bytes read but not yet consumed
};

}  // namespace ferry::run
