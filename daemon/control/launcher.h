// Starting ferryd from another program (`ferry daemon start`): `ferryd train` in the
// foreground (this process becomes ferryd) or detached, then waiting until its control socket
// answers or it exits. LibTorch-free: ferryd is another executable, run by path.
//
// A detached start, in order:
//   1. DIR (the run directory) is created with its parents, DIR/ferryd.log opened for
//      appending (created with mode 0644).
//   2. fork. The child calls setsid (a new session: no controlling terminal, out of the
//      caller's process group, so a terminal's hang-up or Ctrl-C does not reach it), reads
//      /dev/null, appends stdout and stderr to the log and execs ferryd. Until exec it makes
//      only async-signal-safe calls; an exec failure reaches the parent through a
//      close-on-exec pipe, so it is reported as such and not as an early exit.
//   3. The parent asks DIR's control socket (endpoint.h) for `status` every poll interval
//      until it answers, the child exits, or the wait runs out. A ferryd that answers at its
//      run's last step (total_steps > 0 and step >= total_steps) had nothing to do and is
//      about to exit: it is not asked again, its exit is waited for.
// The child is never killed: a start that timed out leaves it running.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace ferry::control {

// `ferryd train --config FILE --dir DIR [--max-steps N] [--publish EP] [--nproc-per-node N]`.
struct FerrydTrainOptions {
  std::filesystem::path ferryd;   // the ferryd executable. REQUIRED
  std::filesystem::path config;   // --config: the run's TOML config. REQUIRED
  std::filesystem::path run_dir;  // --dir: the run directory. REQUIRED
  int64_t max_steps = 0;          // --max-steps N, passed when > 0. Default: 0 (not passed)
  std::string publish;            // --publish EP, passed when not empty. Default: "" (not passed)
  int nproc_per_node = 0;         // --nproc-per-node N, passed when > 1. Default: 0 (not passed)
};

// The command line of `options`, argv[0] being options.ferryd; paths are passed as given.
[[nodiscard]] std::vector<std::string> FerrydTrainArgv(const FerrydTrainOptions& options);

// Replaces this process with ferryd (stdio buffers flushed first): its exit code becomes the
// caller's. Returns only when exec fails: kIOError "cannot run FERRYD: REASON".
[[nodiscard]] Status ExecFerrydTrain(const FerrydTrainOptions& options);

struct DetachOptions {
  // How long to wait for the control socket to answer (or, after an answer at the run's last
  // step, for the exit). Default: 120 s
  std::chrono::milliseconds wait = std::chrono::seconds(120);
  // How often the process and the socket are looked at. Default: 100 ms
  std::chrono::milliseconds poll_interval = std::chrono::milliseconds(100);
  // How long one status request waits for its reply. Default: 500 ms
  std::chrono::milliseconds probe_timeout = std::chrono::milliseconds(500);
};

// How a detached start ended.
enum class DetachedState {
  kAnswering,  // the control socket answered before the run's last step: ferryd runs
  kExited,     // the process exited before answering, or after answering at the last step
  kTimedOut,   // neither within the wait: the process still runs
};

struct DetachedStart {
  DetachedState state = DetachedState::kTimedOut;
  pid_t pid = 0;              // the ferryd process (reaped when kExited)
  std::filesystem::path log;  // DIR/ferryd.log
  nlohmann::json status;      // kAnswering: the status reply's fields (protocol.h)
  // Set when ferryd answered at its run's last step: that step (the reply's total_steps).
  std::optional<int64_t> last_step;
  int exit_code = -1;  // kExited: the exit code; -1 when a signal ended it
  int signal = 0;      // kExited by a signal: its number; 0 otherwise
  // kExited and kTimedOut: kUnavailable naming the pid and the log, e.g. "ferryd pid N exited
  // with code C before its control socket answered; LOG ends with:\n  LINE\n..." (the log's
  // last 10 lines, indented) or "ferryd pid N is running but its control socket did not
  // answer within 120 s (see LOG)". OK when kAnswering.
  Status error;
};

// Starts `ferryd train` detached (steps 1 to 3 above) and reports how the wait ended. The
// Result's own errors mean nothing runs: kIOError naming the run directory or the log when
// they cannot be created or opened, "cannot fork: REASON" / "cannot start ferryd: REASON",
// or "cannot run FERRYD: REASON" when exec failed (that child already reaped).
// REQUIRES: the caller reaps the child if it outlives a kAnswering or kTimedOut result and
// the caller keeps running (waitpid); SIGCHLD is not ignored.
[[nodiscard]] Result<DetachedStart> StartDetached(const FerrydTrainOptions& train, const DetachOptions& options = {});

}  // namespace ferry::control
