// RunLock: one ferryd per run directory.
//
// DIR/ferryd.lock is held with an exclusive flock(2) for as long as ferryd runs and holds
// its pid as decimal text and a newline. The kernel releases the lock when the holder
// exits, however it exits (SIGKILL included), so a stale file never blocks a restart. The
// file itself stays (unless Remove()); only the lock says whether a ferryd runs. Acquire
// checks, once locked, that the file it locked is still the one named DIR/ferryd.lock.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <utility>

#include "core/status.h"

namespace ferry::control {

class RunLock {
 public:
  // Creates DIR (and missing parents) when absent, opens DIR/ferryd.lock (close-on-exec) and
  // takes the lock without waiting, then writes this process's pid into it.
  // kFailedPrecondition "DIR is in use by ferryd pid N" when another open of the file holds
  // it (another process, or another RunLock in this one); kIOError naming the path when the
  // directory or file cannot be created or written.
  [[nodiscard]] static Result<RunLock> Acquire(const std::filesystem::path& dir);

  // The pid of the process holding DIR's lock; kNotFound "no ferryd is running for DIR" when
  // nobody holds it (or the file does not exist). Takes a shared lock for an instant to tell
  // (an Acquire at that very moment retries instead of failing). kIOError naming the file
  // when it cannot be opened or read; kCorruption when a held file has no pid in it.
  [[nodiscard]] static Result<pid_t> Holder(const std::filesystem::path& dir);

  // DIR/ferryd.lock.
  [[nodiscard]] static std::filesystem::path LockPath(const std::filesystem::path& dir);

  RunLock(RunLock&& other) noexcept;
  RunLock& operator=(RunLock&& other) noexcept;
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  // Releases the lock (the pid is erased from the file first).
  ~RunLock();
  // Removes DIR/ferryd.lock while still holding it, then releases it: for a start that
  // created the file and then failed, so the directory is left as it was. An Acquire that
  // opened the file meanwhile notices it is gone and locks the new one. Idempotent.
  void Remove();

  [[nodiscard]] const std::filesystem::path& path() const { return path_; }

 private:
  RunLock(int fd, std::filesystem::path path) : fd_(fd), path_(std::move(path)) {}
  void Release();
  int fd_ = -1;
  std::filesystem::path path_;
};

}  // namespace ferry::control
