// One ferryd per run directory (daemon/control/run_lock.h).
#include "daemon/control/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <system_error>
#include <thread>

namespace ferry::control {
namespace {

namespace fs = std::filesystem;

// How long Acquire retries while a Holder() probe holds its instant shared lock.
constexpr auto kProbeGrace = std::chrono::milliseconds(200);
constexpr size_t kMaxPidText = 32;

// The pid written in the file, or nullopt when there is none (yet).
std::optional<pid_t> ReadPid(int fd) {
  char buf[kMaxPidText] = {};
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return std::nullopt;
  long long pid = 0;
  const char* end = buf + n;
  auto [ptr, ec] = std::from_chars(buf, end, pid);
  if (ec != std::errc() || ptr == buf || pid <= 0 || (ptr != end && *ptr != '\n')) return std::nullopt;
  return static_cast<pid_t>(pid);
}

}  // namespace

fs::path RunLock::LockPath(const fs::path& dir) { return dir / "ferryd.lock"; }

Result<RunLock> RunLock::Acquire(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IOError(dir.string() + ": cannot create the run directory: " + ec.message());
  const fs::path path = LockPath(dir);
  const auto give_up = std::chrono::steady_clock::now() + kProbeGrace;
  for (;;) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) return Status::IOError(path.string() + ": cannot open: " + std::strerror(errno));
    while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err == EINTR) continue;
      if (err != EWOULDBLOCK) {
        ::close(fd);
        return Status::IOError(path.string() + ": cannot lock: " + std::strerror(err));
      }
      const std::optional<pid_t> pid = ReadPid(fd);
      // No pid: either the holder has not written it yet or a Holder() probe holds a shared lock.
      if (std::chrono::steady_clock::now() >= give_up) {
        ::close(fd);
        return Status::FailedPrecondition(dir.string() + " is in use by ferryd " +
                                          (pid ? "pid " + std::to_string(*pid) : std::string("(pid not yet written)")) +
                                          " (" + path.string() + ")");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    // The file locked must still be the one at `path`: a holder that removed it (Remove)
    // released a lock nobody else can see; take the new file's instead.
    struct stat held {
    }, named{};
    if (::fstat(fd, &held) == 0 && ::stat(path.c_str(), &named) == 0 && held.st_dev == named.st_dev &&
        held.st_ino == named.st_ino) {
      const std::string text = std::to_string(::getpid()) + "\n";
      if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
        const int err = errno;
        ::close(fd);
        return Status::IOError(path.string() + ": cannot write the pid: " + std::strerror(err));
      }
      return RunLock(fd, path);
    }
    ::close(fd);
  }
}

void RunLock::Remove() {
  if (fd_ < 0) return;
  std::error_code ec;
  fs::remove(path_, ec);  // while held: an Acquire that opened it meanwhile sees it is gone
  Release();
}

Result<pid_t> RunLock::Holder(const fs::path& dir) {
  const fs::path path = LockPath(dir);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ENOENT) return Status::NotFound("no ferryd is running for " + dir.string());
    return Status::IOError(path.string() + ": cannot open: " + std::strerror(errno));
  }
  int rc;
  do {
    rc = ::flock(fd, LOCK_SH | LOCK_NB);
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) {
    ::close(fd);  // releases the shared lock
    return Status::NotFound("no ferryd is running for " + dir.string());
  }
  const int err = errno;
  if (err != EWOULDBLOCK) {
    ::close(fd);
    return Status::IOError(path.string() + ": cannot test the lock: " + std::strerror(err));
  }
  // Held: the holder writes its pid right after locking (and erases it just before releasing).
  for (int i = 0; i < 40; ++i) {
    if (const std::optional<pid_t> pid = ReadPid(fd)) {
      ::close(fd);
      return *pid;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (::flock(fd, LOCK_SH | LOCK_NB) == 0) {
      ::close(fd);
      return Status::NotFound("no ferryd is running for " + dir.string());
    }
  }
  ::close(fd);
  return Status::Corruption(path.string() + ": locked, but holds no pid");
}

RunLock::RunLock(RunLock&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) { other.fd_ = -1; }

RunLock& RunLock::operator=(RunLock&& other) noexcept {
  if (this != &other) {
    Release();
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

RunLock::~RunLock() { Release(); }

void RunLock::Release() {
  if (fd_ < 0) return;
  // Best effort: a stale pid left behind is harmless (the next holder truncates it). A (void)
  // cast does not silence glibc's warn_unused_result under GCC.
  if (::ftruncate(fd_, 0) != 0) {
  }
  ::close(fd_);  // releases the lock
  fd_ = -1;
}

}  // namespace ferry::control
